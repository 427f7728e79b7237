"""The scratch of the encoder's compiled attention (kernels/pass_attention.py in bfloat16,
kernels/pass_attention_int8.py in int8, kernels/pass_attention_float.py in float32), in plain NumPy so that the run's planning
(models/t5/buffers.py, through ops.distance_scratch) sizes it without loading numba: one
declaration of the parts, their shapes and their order.

float32: per thread, one (batch row, head)'s keys transposed (D, S), padded with zeros to whole
vectors of FLOAT_LANES, through a staging block of FLOAT_LANES keys; its values (S, D) padded
likewise where D is not whole vectors (else none: they are read in place); one block of
QUERY_BLOCK queries' scores.

bfloat16, per thread, for the (batch row, head) it runs: the queries as the bfloat16 tiles'
interleaved input rows (groups of GROUP rows, each row padded to whole steps of STEP columns),
the keys as panels of PANEL keys (Dp / 2 words of column pairs per key), the values as panels of
PANEL value columns over the keys (Sp / 2 words of key pairs per column); LANE_ROWS positions'
rows rounded (the packing's staging), one block of QUERY_BLOCK queries' float32 scores and their
bfloat16 weights (interleaved rows again, the value product's input).

int8, per thread: the queries quantised as the int8 products' input rows (INT8_STEP columns
at a time, each row padded to Dp, a multiple of INT8_STEP) with their sums and scales; the keys
quantised into rows of Dp, then as panels of PANEL keys, with their scales; the values as
panels of PANEL value columns over Sp positions, with their column scales (and the columns'
absmax and inverse while they are found); one block's float32 scores, its weights quantised as
input rows, their sums and scales. No kind grows with the batch or the heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PANEL = 64                 # keys (or value columns) of one packed panel: 4 vectors of 16 lanes
GROUP = 4                  # input rows interleaved step by step
STEP = 32                  # bfloat16 columns of one tile step: rows padded to a multiple
INT8_STEP = 64             # int8 columns of one tile step (tiles.STEP)
WEIGHT_LEVELS = 127        # int8: a softmax weight's code is round(127 w / the row's largest w)
                           # (the tiles' signed operand: 7 bits)
QUERY_BLOCK = 64           # query rows whose scores a thread holds at once
LANE_ROWS = 16             # positions one packing task takes: a vector of key lanes (even:
                           # value words pair two positions)
ALIGN = 64                 # each part from a cache line
FLOAT_LANES = 16           # float32 lanes of the float32 tile's vectors (float_tiles.LANES)


def up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(frozen=True)
class AttentionShape:
    """One call's scratch: B batch rows, H heads, T queries over S keys of D columns, `threads`
    parallel tasks."""
    B: int
    H: int
    T: int
    S: int
    D: int
    threads: int
    kind: str = "bfloat16"     # or "int8", "float32"

    def parts(self) -> dict[str, tuple[tuple[int, ...], type]]:
        """name -> (shape, dtype) of each part, in order."""
        T, S, D = self.T, self.S, self.D             # (B and H: the call's, not the parts')
        if self.kind == "float32":
            Sf, Df = up(S, FLOAT_LANES), up(D, FLOAT_LANES)
            return {"keys": ((self.threads, D, Sf), np.float32),
                    "values": ((self.threads, S if D % FLOAT_LANES else 0, Df), np.float32),
                    "staging": ((self.threads, FLOAT_LANES, D), np.float32),
                    "scores": ((self.threads, min(T, QUERY_BLOCK), Sf), np.float32)}
        rows = up(min(T, QUERY_BLOCK), GROUP)
        if self.kind == "int8":
            Dp, Sp, Dv = up(D, INT8_STEP), up(S, INT8_STEP), up(D, PANEL)
            return {"queries": ((self.threads, T * Dp), np.int8),
                    "query_sums": ((self.threads, T, 1), np.int32),
                    "query_scales": ((self.threads, T), np.float32),
                    "key_rows": ((self.threads, Sp, Dp), np.int8),
                    "keys": ((self.threads, Sp * Dp), np.uint8),
                    "key_scales": ((self.threads, Sp), np.float32),
                    "values": ((self.threads, Dv * Sp), np.uint8),
                    "value_scales": ((self.threads, Dv), np.float32),
                    "column_top": ((self.threads, D), np.int32),
                    "column_inv": ((self.threads, D), np.float32),
                    "scores": ((self.threads, rows, S), np.float32),
                    "weights": ((self.threads, rows * Sp), np.int8),
                    "weight_sums": ((self.threads, rows, 1), np.int32),
                    "weight_scales": ((self.threads, rows), np.float32)}
        Dp, Sp = up(D, STEP), up(S, STEP)
        return {"queries": ((self.threads, up(T, GROUP) // GROUP, GROUP * Dp), np.uint16),
                "keys": ((self.threads, up(S, PANEL) * Dp), np.uint16),
                "values": ((self.threads, up(D, PANEL) * Sp), np.uint16),
                "rounded": ((self.threads, LANE_ROWS, Dp // 2), np.uint32),
                "scores": ((self.threads, rows, S), np.float32),
                "weights": ((self.threads, rows // GROUP, GROUP * Sp), np.uint16)}

    @classmethod
    def of_call(cls, kind: str, qkv, table, key_mask, ctx, threads: int) -> AttentionShape:
        """The shape of an attention kernel's call (`kind`: bfloat16, int8 or float32) over qkv
        (B, T, 3, H, D), or a ValueError naming what does not fit: qkv contiguous, ctx (B, T,
        H, D) with contiguous rows of D, table (H | 1, 2T - 1), key_mask (B, T)."""
        name = {"bfloat16": "attend_bf16", "int8": "attend_i8"}.get(kind, "attend_f32")
        B, T, three, H, D = qkv.shape
        if three != 3 or not qkv.flags.c_contiguous or ctx.shape != (B, T, H, D):
            raise ValueError(f"{name}: qkv (B, T, 3, H, D) contiguous, ctx (B, T, H, D)")
        if table.shape[1] != 2 * T - 1 or table.shape[0] not in (1, H) or key_mask.shape != (B, T):
            raise ValueError(f"{name}: table (H | 1, 2T - 1), key_mask (B, T)")
        if ctx.strides[3] != 4:
            raise ValueError(f"{name}: ctx needs contiguous rows of D")
        return cls(B, H, T, T, D, threads, kind)

    def nbytes(self) -> int:
        """Bytes `carve` needs: every part from an ALIGN boundary, and the buffer's own start."""
        return sum(up(int(np.prod(shape)) * np.dtype(dt).itemsize, ALIGN)
                   for shape, dt in self.parts().values()) + ALIGN

    def carve(self, work: np.ndarray) -> dict[str, np.ndarray]:
        """The parts as arrays over the contiguous buffer `work` (at least `nbytes()` bytes)."""
        flat = work.reshape(-1).view(np.uint8)
        if flat.nbytes < self.nbytes():
            raise ValueError(f"{self.kind} attention: the scratch holds {flat.nbytes} bytes, "
                             f"{self.nbytes()} needed")
        at = -flat.ctypes.data % ALIGN
        out = {}
        for name, (shape, dt) in self.parts().items():
            n = int(np.prod(shape)) * np.dtype(dt).itemsize
            out[name] = flat[at:at + n].view(dt).reshape(shape)
            at = up(at + n, ALIGN)
        return out
