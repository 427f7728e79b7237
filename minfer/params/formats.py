"""Weight formats of the linear slots: how a matrix is stored, multiplied and looked up.

A family's weight table marks which matrices are *linear slots* (`spec.Linear`): every layer
matrix, the output heads and the embedding tables. Only those take a format other than the
compute dtype, and every format stores a slot the same way round: (out, in), one row per output
channel, as Hugging Face stores it and as a dot-product kernel reads it fastest (one contiguous
row per output). The math multiplies with `ops.linear` (y = x @ w.T) and looks rows up with
`ops.embed` (a tied embedding is its head's rows).

Formats: "float32" and "float16" (on CUDA float16 is also the compute dtype), "bfloat16" (the
top half of a float32, stored as its uint16 bits: NumPy has no bfloat16) and "int8" (weight-only,
symmetric, one float32 scale per output channel, as BMInf and CTranslate2 quantise). A matrix
`w` in int8 is stored as `w` plus its scales `w` + SCALE_SUFFIX, in packed layers and in files.

A slot whose stored dtype is not the compute dtype becomes a `PackedWeight`: on the CPU its
small-M products (decoding: one row per sequence) run in the compiled kernels (kernels.py), which
read the stored bytes and widen them in registers; larger products (the encoder, a prompt) widen
blocks of rows into a float scratch that stays in cache and call BLAS, so no float copy of a
whole matrix is ever written. On the CPU a large product is cut into one part of output columns
per thread (`kernels.split`), each widening into its own share of the scratch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import kernels
from ..arena import ALIGNMENT, align_up
from ..errors import ConfigError

SCALE_SUFFIX = "_scale"         # an int8 matrix `w` travels with its float32 scales `w_scale`
# Blocks of packed rows are widened here for products of more rows than the kernels take: BLAS
# repacks the whole input for every block, so blocks must be large for large inputs (a 1 MiB
# scratch made a 2048-row encoder pass 2.4x slower than float32); at most one matrix's worth.
WIDEN_SCRATCH_BYTES = 16 << 20
KERNEL_MAX_ROWS = 64            # products of up to this many rows go to the compiled kernels
                                # (they beat OpenBLAS's small-M GEMM, which packs the whole weight
                                # at every call, up to ~64 rows on 2 cores; BLAS wins beyond)
KERNEL_MIN_INNER = 64           # ... and an inner dimension of at least this: with short weight
                                # rows the kernel's scattered output writes dominate (the adaptive
                                # softmax's tail clusters, K = 8 or 32: 2-6x slower than BLAS)
MIN_PART_COLUMNS = 64           # a large product is split over the threads in parts of at least
                                # this many output columns (kernels.split)


# =====================================================================================================
# int8 quantisation (per output channel) and the widening of stored bits
# =====================================================================================================
def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(out, in) float -> int8 (out, in) and float32 scales (out,): w ~= q * scale[:, None].

    Symmetric, one scale per output channel (absmax / 127), round to nearest. A zero channel gets
    scale 1 (its q is all zero anyway)."""
    w = np.asarray(w, dtype=np.float32)
    scale = np.abs(w).max(axis=1) / 127.0 if w.shape[1] else np.ones(w.shape[0], np.float32)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def dequantize_int8(xp: Any, q: Any, scale: Any, out: Any) -> Any:
    """int8 q (out, in) * scale (out,) per row, into the float buffer `out` of q's shape."""
    # Two simple passes (widen, then scale in place) run several times faster in NumPy than one
    # mixed-type multiply, whose int8 * float32 loop casts element by element.
    out[...] = q
    out *= scale[:, None]
    return out


def to_bfloat16_bits(w: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(w)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def _widen_cast(src: Any, dst: Any) -> None:     # float16 / int8 / float32 -> float
    dst[...] = src


def _widen_bfloat16(src: Any, dst: Any) -> None:  # the bits are the high half of a float32
    bits = dst.view(np.uint32)
    bits[...] = src
    bits <<= 16


def takes_kernel(M: int, K: int) -> bool:
    """Whether an (M, K) @ (K, N) product goes to the compiled kernels (else to BLAS)."""
    return M <= KERNEL_MAX_ROWS and K >= KERNEL_MIN_INNER


# =====================================================================================================
# What the math multiplies by
# =====================================================================================================
class PackedWeight:
    """A linear slot stored in a form `xp.matmul` cannot take as it is. `ops.linear` calls its
    `matmul(xp, x, out)` and `ops.embed` its `rows(xp, ids, out)`.

    stored: (out, in) array of the format's storage dtype; scale: (out,) float32 or None;
    widen(src, dst): rows of `bits` -> float rows; kernel(x, bits, [scale,] out): the compiled
    small-M product, or None (off, or not on the CPU); bits: what both read (the stored array,
    or float16 viewed as its uint16 bits for the compiled code); scratch: the runtime's shared
    flat float buffer (one product at a time), None for a slot already stored in the compute
    dtype (float32 on the CPU with the kernels on: nothing to widen, BLAS reads it directly)."""

    def __init__(self, stored: Any, scale: Any, widen: Callable[[Any, Any], None],
                 kernel: Callable | None, scratch: Any, bits: Any = None):
        self.stored, self.scale, self.widen, self.kernel = stored, scale, widen, kernel
        self.bits = stored if bits is None else bits
        self.scratch = scratch
        self.shape = stored.shape
        self.plain = scratch is None      # stored in the compute dtype: no widening, no scale

    def matmul(self, xp: Any, x: Any, out: Any) -> Any:
        """x (M, K) @ self.T -> out (M, N), float."""
        # (asked at every call: a process forked after the kernels' threads started must not
        # run them, kernels.py)
        fast = self.kernel is not None and kernels.active() is not None
        if fast and takes_kernel(x.shape[0], self.shape[1]):
            x = x if x.flags.c_contiguous else np.ascontiguousarray(x)
            if self.scale is None:
                self.kernel(x, self.bits, out)
            else:
                self.kernel(x, self.bits, self.scale, out)
            return out
        N = self.shape[0]
        if not fast:   # NumPy mode or CUDA: one pass of blocks; BLAS has its threads
            if self.plain:
                return xp.matmul(x, self.stored.T, out=out)
            self._widened_product(xp, x, out, 0, N, self.scratch)
            return out
        count = kernels.parts(N, MIN_PART_COLUMNS)   # each part widens into its own scratch
        if self.plain:   # BLAS at one thread per part of the output columns
            kernels.split(N, lambda i, a, b: xp.matmul(x, self.stored[a:b].T, out=out[:, a:b]),
                          count)
            return out
        size = self.scratch.size // count
        kernels.split(N, lambda i, a, b: self._widened_product(
            xp, x, out, a, b, self.scratch[i * size:(i + 1) * size]), count)
        return out

    def _widened_product(self, xp: Any, x: Any, out: Any, start: int, stop: int,
                         scratch: Any) -> None:
        """Output columns start:stop of x @ self.T: widen blocks of stored rows into `scratch`,
        apply their int8 scales, and multiply each with BLAS. The scales go on the weights before
        the product: the unscaled product (the output / scale, up to 127x the output) overflows
        float16 (CUDA)."""
        K = self.shape[1]
        block = max(1, scratch.size // max(K, 1))
        for j in range(start, stop, block):
            e = min(stop, j + block)
            w = scratch[:(e - j) * K].reshape(e - j, K)
            self.widen(self.bits[j:e], w)
            if self.scale is not None:
                w *= self.scale[j:e, None]
            xp.matmul(x, w.T, out=out[:, j:e])

    def rows(self, xp: Any, ids: Any, out: Any) -> Any:
        """Rows `ids` (n,) as floats into out (n, K): embedding lookups. Off NumPy the stored
        rows (and scales) are gathered through the scratch's bytes, so nothing is allocated."""
        if self.plain:
            return xp.take(self.stored, ids, axis=0, out=out)
        if xp is np:
            self.widen(self.bits[ids], out)
            if self.scale is not None:
                out *= self.scale[ids][:, None]
            return out
        raw = self.scratch.view(np.uint8)
        width = self.shape[1] * self.bits.dtype.itemsize
        step = max(1, (raw.size - 2 * ALIGNMENT) // (width + 4))   # rows at a time, and scales
        for a in range(0, ids.shape[0], step):
            n = min(step, ids.shape[0] - a)
            got = raw[:n * width].view(self.bits.dtype).reshape(n, self.shape[1])
            xp.take(self.bits, ids[a:a + n], axis=0, out=got)
            self.widen(got, out[a:a + n])
            if self.scale is not None:
                at = align_up(n * width)
                scale = raw[at:at + 4 * n].view(np.float32)
                xp.take(self.scale, ids[a:a + n], axis=0, out=scale)
                out[a:a + n] *= scale[:, None]
        return out


# =====================================================================================================
# The formats
# =====================================================================================================
@dataclass(frozen=True)
class WeightFormat:
    """How a linear slot (out, in) is stored: as a plain array of `storage` dtype (plus, for
    int8, its per-output-channel scales)."""
    name: str
    storage: Any                               # numpy dtype of the stored array
    file_code: str                             # its safetensors dtype (the matrix's, for int8)
    scaled: bool = False                       # int8: scales beside the matrix
    widen: Callable[[Any, Any], None] = _widen_cast
    kernel_name: str = ""                      # the compiled product for this storage
    widen_name: str = ""                       # the compiled widening of its rows

    def array_names(self, name: str) -> tuple[str, ...]:
        """The names of the arrays a matrix `name` is stored as."""
        return (name, name + SCALE_SUFFIX) if self.scaled else (name,)

    def stored(self, name: str, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], Any]]:
        """The arrays a matrix `name` of logical `shape` (out, in) is stored as:
        {array name: (shape, dtype)}."""
        out = {name: (tuple(shape), np.dtype(self.storage))}
        if self.scaled:
            out[name + SCALE_SUFFIX] = ((shape[0],), np.dtype(np.float32))
        return out

    def encode(self, name: str, w: np.ndarray) -> dict[str, np.ndarray]:
        """A float32 (out, in) matrix (or a block of its rows) -> its stored arrays (host)."""
        if self.scaled:
            q, scale = quantize_int8(w)
            return {name: q, name + SCALE_SUFFIX: scale}
        if self.name == "bfloat16":
            return {name: to_bfloat16_bits(w)}
        return {name: w.astype(self.storage, copy=False)}

    def wrap(self, name: str, arrays: dict[str, Any], compute_dtype: Any, scratch: Any,
             kernels: Any) -> Any:
        """The stored arrays (on the device) -> what `ops.linear` multiplies by: the array itself
        when it is already in the compute dtype (and no kernel runs it), else a PackedWeight.
        `kernels` is the compiled-kernel module on the CPU, or None."""
        w = arrays[name]
        if np.dtype(self.storage) == np.dtype(compute_dtype) and not self.scaled:
            return w if kernels is None else PackedWeight(w, None, _widen_cast,
                                                          getattr(kernels, self.kernel_name), None)
        scale = arrays.get(name + SCALE_SUFFIX)
        if kernels is None:
            return PackedWeight(w, scale, self.widen, None, scratch)
        bits = w.view(np.uint16) if w.dtype == np.float16 else w   # numba has no float16
        return PackedWeight(w, scale, getattr(kernels, self.widen_name),
                            getattr(kernels, self.kernel_name), scratch, bits)

    def slot(self, float32: bool, compute_dtype: Any) -> tuple["WeightFormat", np.dtype]:
        """(the format a slot is stored in, the dtype its product computes in): a slot marked
        float32 (`spec.Linear.float32`) computes in float32 when the compute dtype is half, and
        is stored float32 unless the format is int8 (which widens into float32 instead)."""
        if float32 and np.dtype(compute_dtype).itemsize < 4:
            return (self if self.scaled else FORMATS["float32"]), np.dtype(np.float32)
        return self, np.dtype(compute_dtype)

    def scratch_bytes(self, shape: tuple[int, int], compute_dtype: Any) -> int:
        """Float scratch a block-widened product with this matrix needs (0 for plain arrays)."""
        if np.dtype(self.storage) == np.dtype(compute_dtype) and not self.scaled:
            return 0
        return align_up(min(WIDEN_SCRATCH_BYTES, int(np.prod(shape)) * np.dtype(compute_dtype).itemsize))


FORMATS: dict[str, WeightFormat] = {
    "float32": WeightFormat("float32", np.float32, "F32", kernel_name="matmul_f32"),
    "float16": WeightFormat("float16", np.float16, "F16", kernel_name="matmul_f16",
                            widen_name="widen_f16"),
    "bfloat16": WeightFormat("bfloat16", np.uint16, "BF16", widen=_widen_bfloat16,
                             kernel_name="matmul_bf16", widen_name="widen_bf16"),
    "int8": WeightFormat("int8", np.int8, "I8", scaled=True, kernel_name="matmul_i8",
                         widen_name="widen_i8"),
}


def weight_format(name: str) -> WeightFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"weight format {name!r} is not supported "
                          f"(supported: {', '.join(FORMATS)})") from None
