"""An encoder pass's self-attention in float32: softmax(q k^T + bias) v for every (batch row,
head), the position bias read by distance (as kernels/pass_softmax.py), both products on the
float32 panel tile (float_tiles.py), and no (B, H, T, T) score tensor: a thread holds one block
of query rows' scores at a time. What compute="float32" runs on the CPU with the compiled
kernels (ops.float_distance_attention); pass_attention.py is its bfloat16 sibling.

Per (batch row, head), on one thread: the keys transposed into (D, S), padded with zeros to
whole vectors of 16 (the tile then reads whole vectors, and the zeros add nothing), the values
read where they are (copied and padded likewise where D is not whole vectors); per block of up to QUERY_BLOCK queries, their scores
against every key (the queries read where the q|k|v product left them), each row's softmax with
the bias and key mask added (`_softmax_row`: the float32 path's own), then the weights times
the values into the output rows. Sums in float32 in k order, as a BLAS product's may differ in
their last bits.
"""

from __future__ import annotations

import numba
from numba import njit, prange

from .attention_layout import QUERY_BLOCK, AttentionShape
from .float_tiles import LANES, PANEL, panel
from .pass_softmax import _softmax_row
from .vector_math import NON_FINITE_SAFE


@njit(inline="always")
def _tile(P, C, x, m, K, w, n0, valid, out, om, oc):
    if P == 4:
        panel(4, C, x, m, K, w, n0, valid, out, om, oc)
    elif P == 3:
        panel(3, C, x, m, K, w, n0, valid, out, om, oc)
    elif P == 2:
        panel(2, C, x, m, K, w, n0, valid, out, om, oc)
    else:
        panel(1, C, x, m, K, w, n0, valid, out, om, oc)


@njit(inline="always")
def _product(x, m0, rows, K, w, N, out, om0):
    """out[om0 + r, :N] = x[m0 + r, :K] @ w[:K, :N] for r < rows: panels of PANEL columns, 4
    rows a tile and the last rows % 4 alone (w's rows readable to N rounded up to 16)."""
    for n0 in range(0, N, PANEL):
        nb = min(PANEL, N - n0)
        P = (nb + LANES - 1) // LANES
        r = 0
        while r + 4 <= rows:
            _tile(P, 4, x, m0 + r, K, w, n0, nb, out, om0 + r, n0)
            r += 4
        while r < rows:
            _tile(P, 1, x, m0 + r, K, w, n0, nb, out, om0 + r, n0)
            r += 1


@njit(inline="always")
def _stage_keys(qkv, b, h, kt, block):
    """Head h of batch row b's keys transposed into kt (D, Sp), zero past S: LANES keys at a
    time copied into `block` (LANES, D), then written out a column of them at a time, LANES
    contiguous words (a column of every key gathered at a time ran 2x slower:
    benchmarks/README.md, "Measurements behind constants in the code")."""
    S, D = qkv.shape[1], qkv.shape[4]
    for s0 in range(0, kt.shape[1], LANES):
        n = min(LANES, S - s0)
        for r in range(n):
            src = qkv[b, s0 + r, 1, h]
            dst = block[r]
            for d in range(D):
                dst[d] = src[d]
        for r in range(n, LANES):
            block[r, :] = 0
        for d in range(D):
            row = kt[d, s0:s0 + LANES]
            for r in range(LANES):
                row[r] = block[r, d]


@njit(inline="always")
def _stage_values(qkv, b, h, vp):
    """Head h of batch row b's values into vp (S, Dp), zero past D: only for a D that is not
    whole vectors (the tile reads them in place otherwise)."""
    S, D = qkv.shape[1], qkv.shape[4]
    for s in range(S):
        src = qkv[b, s, 2, h]
        dst = vp[s]
        for d in range(D):
            dst[d] = src[d]
        for d in range(D, vp.shape[1]):
            dst[d] = 0


@njit(parallel=True, cache=True, **NON_FINITE_SAFE)
def _attend(qkv, table, key_mask, ctx, keys, values, staging, scores):
    B, T, _, H, D = qkv.shape
    S = T
    threads = scores.shape[0]
    shared = table.shape[0] == 1
    whole = D % LANES == 0                            # the values read where they are
    for t in prange(threads):
        kt, sc = keys[t], scores[t]
        for task in range(t, B * H, threads):
            b, h = task // H, task % H
            tb = table[0 if shared else h]
            _stage_keys(qkv, b, h, kt, staging[t])
            q = qkv[b, :, 0, h]                       # (T, D), rows 3 H D apart
            out = ctx[b, :, h]                        # (T, D), rows H D apart
            vp = qkv[b, :, 2, h]                      # (S, D), rows 3 H D apart ...
            if not whole:                             # ... or copied, zero past D
                _stage_values(qkv, b, h, values[t])
                vp = values[t]
            for t0 in range(0, T, QUERY_BLOCK):
                rows = min(T - t0, QUERY_BLOCK)
                _product(q, t0, rows, D, kt, S, sc, 0)
                for r in range(rows):
                    i = t0 + r
                    _softmax_row(sc[r], tb[T - 1 - i:T - 1 - i + S], key_mask[b], S)
                _product(sc, 0, rows, S, vp, D, out, t0)


def attend_f32(qkv, table, key_mask, ctx, work) -> None:
    """ctx (B, T, H, D) = softmax(q k^T + bias) v in float32, the self-attention of T positions:
    qkv (B, T, 3, H, D) float32 (the q|k|v product's output, contiguous), the bias table[h, j -
    i + T - 1] (H, 2T - 1) (or (1, ...) for every head) plus key_mask[b, j] (B, T); work a
    contiguous buffer of at least AttentionShape(B, H, T, T, D, threads, "float32").nbytes()
    bytes for numba's current thread count."""
    shape = AttentionShape.of_call("float32", qkv, table, key_mask, ctx, numba.get_num_threads())
    p = shape.carve(work)
    _attend(qkv, table, key_mask, ctx, p["keys"], p["values"], p["staging"], p["scores"])

