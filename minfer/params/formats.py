"""Weight formats of the linear slots: how a matrix is stored, multiplied and looked up.

A family's weight table marks which matrices are *linear slots* (`spec.Linear`): every layer
matrix, the output heads and the embedding tables. Only those take a format other than the
compute dtype, and every format stores a slot the same way round: (out, in), one row per output
channel, as Hugging Face stores it and as a dot-product kernel reads it fastest (one contiguous
row per output). The math multiplies with `ops.linear` (y = x @ w.T) and looks rows up with
`ops.embed` (a tied embedding is its head's rows).

Formats: "float32" and "float16" (on CUDA float16 is also the compute dtype), "bfloat16" (the
top half of a float32, stored as its uint16 bits: NumPy has no bfloat16), "int8" (symmetric, one
float32 scale per output channel, as BMInf and CTranslate2 quantise) and "int4" (symmetric, one
float32 scale per group of `int4_group(in)` input channels, two values a byte: see `quantize_int4`
for the layout). A quantised matrix `w` is stored as `w` plus its scales `w` + SCALE_SUFFIX, in
packed layers and in files.

What the products compute in is the backend's `compute` (backend.py): float32 by default (the
weights are widened, the activations stay float32) or, on the CPU with int8 or int4 weights,
"int8": each input row is rounded to int8 steps of its own (absmax / 127) and the products are
integer dot products (`kernels/quantised_products.py`, on the CPU's VNNI instructions where it has them);
without the compiled kernels the same rounding is applied and the product is taken in float32
(`quantise_rows`), so every path computes the same function.

A slot whose stored dtype is not the compute dtype becomes a `PackedWeight`: on the CPU its
small-M products (decoding: one row per sequence) run in the compiled kernels (minfer/kernels/), which
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

SCALE_SUFFIX = "_scale"         # a quantised matrix `w` travels with its float32 scales `w_scale`
# int4: input channels per scale. 128, as GPTQ and AWQ default to: on weights/tiny-t5-dates 64,
# 128 and 256 keep every held-out output and give the same logit error (8.4e-2 / 8.6e-2 /
# 8.3e-2 of the largest logit, benchmarks/accuracy_modes.py: its weights are near-Gaussian; real
# checkpoints with outlier channels favour smaller groups), while the compute="int8" products do
# per group 3 vector instructions for each input row and weight row (the offset, a conversion,
# a scaled add) beside one vpdpbusd per 64 columns: 3 per vpdpbusd at 64, 1.5 at 128 (benchmark
# them with benchmarks/bench_step_overhead.py). Inner sizes that are not a multiple of it take
# the largest multiple of 64 that divides them (one group per row when none does).
INT4_GROUP = 128
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


def int4_group(K: int) -> int:
    """Input channels per scale of an int4 matrix with inner size K (K is even)."""
    g = INT4_GROUP
    while g >= 64:
        if K % g == 0:
            return g
        g //= 2
    return K


def quantize_int4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(out, in) float -> packed int4 (out, in / 2) uint8 and float32 scales (out, in / G).

    Per group of G = `int4_group(in)` input channels: scale d = m / -8 where m is the group's
    value of largest magnitude, q = clip(round(w / d), -8, 7) (so m itself is exact: -8), stored
    as the unsigned nibble q + 8 (llama.cpp's q4_0 uses the same rule). Layout: columns in blocks
    of 64, block b being 32 bytes, byte i holding column 64b + i in its low nibble and column
    64b + 32 + i in its high one (what the kernels unpack with one mask and one shift); a last
    partial block of r columns pairs column i with column i + r / 2. A zero group gets scale 1."""
    w = np.asarray(w, dtype=np.float32)
    N, K = w.shape
    if K % 2:
        raise ConfigError(f"int4 needs an even number of input channels, got a matrix of {K}")
    G = int4_group(K) if K else 2
    groups = w.reshape(N, K // G, G)
    at = np.abs(groups).argmax(axis=2)[..., None]
    scale = (np.take_along_axis(groups, at, axis=2)[..., 0] / -8.0).astype(np.float32)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(groups / scale[..., None]), -8, 7).astype(np.int16).reshape(N, K) + 8
    packed = np.empty((N, K // 2), np.uint8)
    full = K // 64 * 64
    blocks = q[:, :full].reshape(N, -1, 2, 32)
    packed[:, :full // 2] = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(N, -1)
    half = (K - full) // 2
    packed[:, full // 2:] = q[:, full:full + half] | (q[:, full + half:] << 4)
    return packed, scale


def _widen_int4(src: Any, dst: Any) -> None:
    """Packed int4 rows (R, K / 2) -> their values q (R, K) as floats, unscaled (any array
    namespace; see `quantize_int4` for the layout)."""
    R, K = dst.shape
    full = K // 64 * 64
    if full:
        blocks = src[:, :full // 2].reshape(R, -1, 32)
        out = dst[:, :full].reshape(R, -1, 2, 32)
        out[:, :, 0] = blocks & 15
        out[:, :, 1] = blocks >> 4
    half = (K - full) // 2
    if half:
        tail = src[:, full // 2:]
        dst[:, full:full + half] = tail & 15
        dst[:, full + half:] = tail >> 4
    dst -= 8


def apply_scale(w: Any, scale: Any) -> Any:
    """Rows of widened values w (R, K) times their scales: one per row (R,), or one per group of
    input channels (R, K / G)."""
    if scale.ndim == 1:
        w *= scale[:, None]
    else:
        R, groups = scale.shape
        w.reshape(R, groups, -1)[...] *= scale[:, :, None]
    return w


def quantise_rows(xp: Any, x: Any) -> Any:
    """x (M, K) with each row rounded to int8 steps of its own, absmax / 127 (to nearest even):
    what `compute="int8"` multiplies, for the products the integer kernels do not take. A row
    holding inf or NaN comes out NaN (as from the kernels), a zero row zero."""
    amax = xp.abs(x).max(axis=1, keepdims=True)
    ok = xp.isfinite(amax) & (amax > 0)
    inv = xp.where(ok, np.float32(127.0) / xp.where(ok, amax, np.float32(1.0)), np.float32(0.0))
    q = xp.rint(xp.where(ok, x, np.float32(0.0)) * inv.astype(np.float32))
    step = xp.where(ok | (amax == 0), amax / np.float32(127.0), np.float32(np.nan))
    return (q * step.astype(np.float32)).astype(np.float32, copy=False)


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

    stored: the format's stored matrix (out, in), or (out, in / 2) bytes for int4; shape: the
    logical (out, in); scale: (out,) or (out, groups) float32, or None; widen(src, dst): rows of
    `bits` -> float rows (unscaled); kernel(x, bits, [scale,] out): the compiled small-M product,
    or None (off, or not on the CPU); qkernel(x, bits, scale, out, work): the compiled int8 x
    int8 product of `compute="int8"`, or None; quantise_inputs: compute="int8" (activations
    rounded to int8 steps before every product); bits: what the kernels read (the stored array,
    or float16 viewed as its uint16 bits for the compiled code); scratch: the runtime's shared
    flat float buffer (one product at a time; also where the int8 products quantise their
    inputs), None for a slot already stored in the compute dtype (float32 on the CPU with the
    kernels on: nothing to widen, BLAS reads it directly)."""

    def __init__(self, stored: Any, scale: Any, widen: Callable[[Any, Any], None],
                 kernel: Callable | None, scratch: Any, bits: Any = None,
                 shape: tuple[int, int] | None = None, qkernel: Callable | None = None,
                 quantise_inputs: bool = False):
        self.stored, self.scale, self.widen, self.kernel = stored, scale, widen, kernel
        self.bits = stored if bits is None else bits
        self.scratch = scratch
        self.shape = tuple(stored.shape) if shape is None else tuple(shape)
        self.plain = scratch is None      # stored in the compute dtype: no widening, no scale
        self.qkernel, self.quantise_inputs = qkernel, quantise_inputs
        self._work = None                 # the scratch as bytes (the int8 products' inputs)
        self._groups = 1 if scale is None or scale.ndim == 1 else scale.shape[1]

    def matmul(self, xp: Any, x: Any, out: Any) -> Any:
        """x (M, K) @ self.T -> out (M, N), float."""
        # (asked at every call: a process forked after the kernels' threads started must not
        # run them, minfer/kernels/)
        fast = self.kernel is not None and kernels.active() is not None
        if self.quantise_inputs:
            if fast and self.qkernel is not None and self.shape[1] >= KERNEL_MIN_INNER:
                return self._int8_product(x, out)
            x = quantise_rows(xp, x)      # the same rounding, multiplied in float32 below
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
                kernels.on_pool(lambda: xp.matmul(x, self.stored.T, out=out)) if xp is np \
                    else xp.matmul(x, self.stored.T, out=out)
                return out
            if xp is np:   # (BLAS only from the pool's threads: kernels.split's `blas`)
                kernels.on_pool(lambda: self._widened_product(xp, x, out, 0, N, self.scratch))
            else:
                self._widened_product(xp, x, out, 0, N, self.scratch)
            return out
        count = kernels.parts(N, MIN_PART_COLUMNS)   # each part widens into its own scratch
        if self.plain:   # BLAS at one thread per part of the output columns
            kernels.split(N, lambda i, a, b: xp.matmul(x, self.stored[a:b].T, out=out[:, a:b]),
                          count, blas=True)
            return out
        size = self.scratch.size // count
        kernels.split(N, lambda i, a, b: self._widened_product(
            xp, x, out, a, b, self.scratch[i * size:(i + 1) * size]), count, blas=True)
        return out

    def _int8_product(self, x: Any, out: Any) -> Any:
        """The compiled int8 x int8 product, over as many input rows at a time as the scratch
        holds quantised (all of a decoding step's; an encoder pass's in parts)."""
        x = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        if self._work is None:
            self._work = self.scratch.view(np.uint8)
        M, K = x.shape
        if kernels.quantised_bytes(M, K, self._groups) <= self._work.size:   # (decoding)
            self.qkernel(x, self.bits, self.scale, out, self._work)
            return out
        step = M
        while step > 1 and kernels.quantised_bytes(step, K, self._groups) > self._work.size:
            step = (step + 1) // 2
        for a in range(0, M, step):
            b = min(M, a + step)
            self.qkernel(x[a:b], self.bits, self.scale, out[a:b], self._work)
        return out

    def _widened_product(self, xp: Any, x: Any, out: Any, start: int, stop: int,
                         scratch: Any) -> None:
        """Output columns start:stop of x @ self.T: widen blocks of stored rows into `scratch`,
        apply their scales, and multiply each with BLAS. The scales go on the weights before
        the product: the unscaled product (the output / scale, up to 127x the output) overflows
        float16 (CUDA)."""
        K = self.shape[1]
        block = max(1, scratch.size // max(K, 1))
        for j in range(start, stop, block):
            e = min(stop, j + block)
            w = scratch[:(e - j) * K].reshape(e - j, K)
            self.widen(self.bits[j:e], w)
            if self.scale is not None:
                apply_scale(w, self.scale[j:e])
            xp.matmul(x, w.T, out=out[:, j:e])

    def rows(self, xp: Any, ids: Any, out: Any) -> Any:
        """Rows `ids` (n,) as floats into out (n, K): embedding lookups. Off NumPy the stored
        rows (and scales) are gathered through the scratch's bytes, so nothing is allocated."""
        if self.plain:
            return xp.take(self.stored, ids, axis=0, out=out)
        if xp is np:
            self.widen(self.bits[ids], out)
            if self.scale is not None:
                apply_scale(out, self.scale[ids])
            return out
        raw = self.scratch.view(np.uint8)
        cols = self.bits.shape[1]
        width = cols * self.bits.dtype.itemsize
        scale_cols = 0 if self.scale is None else int(np.prod(self.scale.shape[1:], dtype=np.int64))
        step = max(1, (raw.size - 2 * ALIGNMENT) // (width + 4 * max(scale_cols, 1)))
        for a in range(0, ids.shape[0], step):   # rows at a time, and their scales
            n = min(step, ids.shape[0] - a)
            got = raw[:n * width].view(self.bits.dtype).reshape(n, cols)
            xp.take(self.bits, ids[a:a + n], axis=0, out=got)
            self.widen(got, out[a:a + n])
            if self.scale is not None:
                at = align_up(n * width)
                scale = raw[at:at + 4 * n * max(scale_cols, 1)].view(np.float32)
                scale = scale.reshape(n, scale_cols) if self.scale.ndim == 2 else scale
                xp.take(self.scale, ids[a:a + n], axis=0, out=scale)
                apply_scale(out[a:a + n], scale)
        return out


# =====================================================================================================
# The formats
# =====================================================================================================
@dataclass(frozen=True)
class WeightFormat:
    """How a linear slot (out, in) is stored: as a plain array of `storage` dtype, or quantised
    (`scaled`: with float32 scales per output channel, or per group of input channels when
    `grouped`; `packed`: two values a byte)."""
    name: str
    storage: Any                               # numpy dtype of the stored array
    file_code: str                             # its safetensors dtype (the matrix's, if scaled)
    scaled: bool = False                       # int8 / int4: scales beside the matrix
    grouped: bool = False                      # int4: a scale per group of input channels
    packed: bool = False                       # int4: two values a byte, (out, in / 2)
    widen: Callable[[Any, Any], None] = _widen_cast   # the NumPy widening of its rows
    quantization: str = ""                     # how a file written in it says so (metadata)
    # (its compiled kernels: kernels.registry.BY_FORMAT[name])

    def array_names(self, name: str) -> tuple[str, ...]:
        """The names of the arrays a matrix `name` is stored as."""
        return (name, name + SCALE_SUFFIX) if self.scaled else (name,)

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored matrix's shape for a logical (out, in)."""
        return (shape[0], shape[1] // 2) if self.packed else tuple(shape)

    def logical_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """The logical (out, in) of a stored matrix's shape."""
        return (stored[0], stored[1] * 2) if self.packed else tuple(stored)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scales' shape for a logical (out, in) matrix."""
        return (shape[0], shape[1] // int4_group(shape[1])) if self.grouped else (shape[0],)

    def stored(self, name: str, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], Any]]:
        """The arrays a matrix `name` of logical `shape` (out, in) is stored as:
        {array name: (shape, dtype)}."""
        if self.packed and shape[1] % 2:
            raise ConfigError(f"{self.name} needs an even number of input channels: '{name}' "
                              f"has {shape[1]}")
        out = {name: (self.stored_shape(shape), np.dtype(self.storage))}
        if self.scaled:
            out[name + SCALE_SUFFIX] = (self.scale_shape(shape), np.dtype(np.float32))
        return out

    def encode(self, name: str, w: np.ndarray) -> dict[str, np.ndarray]:
        """A float32 (out, in) matrix (or a block of its rows) -> its stored arrays (host)."""
        if self.scaled:
            q, scale = quantize_int4(w) if self.grouped else quantize_int8(w)
            return {name: q, name + SCALE_SUFFIX: scale}
        if self.name == "bfloat16":
            return {name: to_bfloat16_bits(w)}
        return {name: w.astype(self.storage, copy=False)}

    def decode(self, q: np.ndarray, scale: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """A stored quantised matrix (or rows of it) and its scales -> float32 of `shape` (host)."""
        out = np.empty(shape, np.float32)
        self.widen(q, out)
        return apply_scale(out, scale)

    def wrap(self, name: str, arrays: dict[str, Any], compute_dtype: Any, scratch: Any,
             kernels: Any, int8_inputs: bool = False) -> Any:
        """The stored arrays (on the device) -> what `ops.linear` multiplies by: the array itself
        when it is already in the compute dtype (and no kernel runs it), else a PackedWeight.
        `kernels` is the compiled kernels on the CPU (`kernels.registry`), or None; `int8_inputs`:
        compute="int8" (only quantised formats take it: the backend checks)."""
        w = arrays[name]
        own = kernels.BY_FORMAT[self.name] if kernels is not None else None
        if np.dtype(self.storage) == np.dtype(compute_dtype) and not self.scaled:
            return w if own is None else PackedWeight(w, None, _widen_cast, own.product, None)
        scale = arrays.get(name + SCALE_SUFFIX)
        shape = self.logical_shape(w.shape)
        if kernels is None:
            return PackedWeight(w, scale, self.widen, None, scratch, shape=shape,
                                quantise_inputs=int8_inputs)
        bits = w.view(np.uint16) if w.dtype == np.float16 else w   # numba has no float16
        # the int4 kernels take whole blocks of 64 columns per group; other sizes widen
        compiled = not self.grouped or int4_group(shape[1]) % 64 == 0
        kernel = own.product if compiled else None
        qkernel = own.int8_product if compiled and int8_inputs else None
        return PackedWeight(w, scale, own.widen, kernel, scratch, bits, shape, qkernel, int8_inputs)

    def slot(self, float32: bool, compute_dtype: Any) -> tuple["WeightFormat", np.dtype]:
        """(the format a slot is stored in, the dtype its product computes in): a slot marked
        float32 (`spec.Linear.float32`) computes in float32 when the compute dtype is half, and
        is stored float32 unless the format is quantised (which widens into float32 instead)."""
        if float32 and np.dtype(compute_dtype).itemsize < 4:
            return (self if self.scaled else FORMATS["float32"]), np.dtype(np.float32)
        return self, np.dtype(compute_dtype)

    def scratch_bytes(self, shape: tuple[int, int], compute_dtype: Any) -> int:
        """Float scratch a block-widened product with this matrix needs (0 for plain arrays)."""
        if np.dtype(self.storage) == np.dtype(compute_dtype) and not self.scaled:
            return 0
        return align_up(min(WIDEN_SCRATCH_BYTES, int(np.prod(shape)) * np.dtype(compute_dtype).itemsize))


FORMATS: dict[str, WeightFormat] = {
    "float32": WeightFormat("float32", np.float32, "F32"),
    "float16": WeightFormat("float16", np.float16, "F16"),
    "bfloat16": WeightFormat("bfloat16", np.uint16, "BF16", widen=_widen_bfloat16),
    "int8": WeightFormat("int8", np.int8, "I8", scaled=True,
                         quantization="int8 per output channel"),
    "int4": WeightFormat("int4", np.uint8, "U8", scaled=True, grouped=True, packed=True,
                         widen=_widen_int4,
                         quantization=f"int4 per group of {INT4_GROUP} input channels"),
}
QUANTIZED = {f.file_code: f for f in FORMATS.values() if f.scaled}   # by the matrix's file dtype


def weight_format(name: str) -> WeightFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"weight format {name!r} is not supported "
                          f"(supported: {', '.join(FORMATS)})") from None
