"""The CPU and CUDA product dispatch of the linear slots: what the math multiplies by (`wrap`:
the stored array itself, or a `PackedWeight` that multiplies itself), and how.

What the products compute in is the backend's `compute` (backend.py): float32 by default (the
weights are widened, the activations stay float32); on the CPU with int8 or int4 weights,
"int8": each input row is rounded to int8 steps of its own (absmax / 127) and the products are
integer dot products (`kernels/quantised_products.py`, on the CPU's VNNI instructions where it
has them); on the CPU with bfloat16 weights, "bfloat16": each input is rounded to bfloat16 (to
nearest even) and the products of bfloat16 pairs are summed in float32
(`kernels/bfloat16_products.py`, on AVX512_BF16's vdpbf16ps where the CPU has it). Without the
compiled kernels the same rounding is applied (`ROUNDINGS`) and the product is taken in float32,
so every path computes the same function (bfloat16 x bfloat16 products are exact in float32;
only the order of the sums differs).

A slot whose stored dtype is not the compute dtype becomes a `PackedWeight`: on the CPU its
small-M products (decoding: one row per sequence) run in the compiled kernels (minfer/kernels/),
which read the stored bytes and widen them in registers; larger products (the encoder, a prompt)
widen blocks of rows into a float scratch that stays in cache and call BLAS, so no float copy of
a whole matrix is ever written. On the CPU a large product is cut into one part of output
columns per thread (`kernels.split`), each widening into its own share of the scratch. The
storage formats themselves (layouts, encoding) are `io/formats.py`'s.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import kernels
from .arena import ALIGNMENT, align_up
from .io.formats import (SCALE_SUFFIX, WeightFormat, apply_scale, int4_group, to_bfloat16_bits,
                         widen_cast)

# Blocks of packed rows are widened into a scratch for products of more rows than the kernels
# take: BLAS repacks the whole input for every block, so blocks must be large for large inputs
# (a 1 MiB scratch made a 2048-row encoder pass far slower than float32); at most one matrix's worth.
WIDEN_SCRATCH_BYTES = 16 << 20
KERNEL_MAX_ROWS = 64            # products of up to this many rows go to the compiled kernels
                                # (they beat OpenBLAS's small-M GEMM, which packs the whole weight
                                # at every call, up to ~64 rows on 2 cores; BLAS wins beyond)
KERNEL_MIN_INNER = 64           # ... and an inner dimension of at least this: with short weight
                                # rows the kernel's scattered output writes dominate (the adaptive
                                # softmax's tail clusters, K = 8 or 32: slower than BLAS)
MIN_PART_COLUMNS = 64           # a large product is split over the threads in parts of at least
                                # this many output columns (kernels.split)
MIN_PART_ROWS = 64              # elementwise work (a ReLU after a product, ops' activations)
                                # is split over the threads in parts of at least this many rows
                                # (fewer: the hand-off costs more)


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


def round_to_bfloat16(xp: Any, x: Any) -> Any:
    """x (M, K) float32 with every value rounded to the nearest bfloat16 (ties to even), as
    float32: what `compute="bfloat16"` multiplies (a CPU mode: x is a NumPy array), for the
    products the compiled kernels do not take. NaN stays NaN; values past bfloat16's largest
    round to infinity, as in the kernels."""
    return (to_bfloat16_bits(x).astype(np.uint32) << np.uint32(16)).view(np.float32)


# compute mode -> how the products' input rows are rounded (float32: not at all)
ROUNDINGS: dict[str, Callable[[Any, Any], Any]] = {"int8": quantise_rows,
                                                   "bfloat16": round_to_bfloat16}


def takes_kernel(M: int, K: int) -> bool:
    """Whether an (M, K) @ (K, N) product goes to the compiled kernels (else to BLAS)."""
    return M <= KERNEL_MAX_ROWS and K >= KERNEL_MIN_INNER


# =====================================================================================================
# What the math multiplies by
# =====================================================================================================
class QuantisedRows:
    """What an RMS norm hands the int8 x int8 product after it when it quantised its rows
    straight into that product's scratch (`ops.add_rms_norm(..., into=)`): `rows`, the norm's
    float buffer (..., K), gives the shape only; it was not written. Only `ops.linear` with the
    same slot takes it; any other use fails (it is no array)."""

    def __init__(self, rows: Any):
        self.rows = rows

    @property
    def shape(self) -> tuple[int, ...]:
        return self.rows.shape


class PackedWeight:
    """A linear slot stored in a form `xp.matmul` cannot take as it is. `ops.linear` calls its
    `matmul(xp, x, out)` and `ops.embed` its `rows(xp, ids, out)`.

    stored: the format's stored matrix (out, in), or (out, in / 2) bytes for int4; shape: the
    logical (out, in); scale: (out,) or (out, groups) float32, (out, groups, 2) for the grouped
    int8 formats (a scale and an offset per group: `formats.apply_scale`), or None; widen(src, dst): rows of
    `bits` -> float rows (unscaled); kernel(x, bits, [scale,] out): the compiled small-M product,
    or None (off, or not on the CPU); compute: "float32", or the rounding of the inputs before
    every product ("int8", "bfloat16": `ROUNDINGS`); rounded_kernel: the compiled product of that
    compute mode, or None (`(x, bits, scale, out, work)`, or `(x, bits, out, work)` for a format
    without scales: bfloat16)
    and work_bytes(M, K, groups) the scratch bytes it rounds M input rows into; floors: whether
    that product takes a floor for its outputs (the int8 products' epilogue: a ReLU); ready_rows:
    whether it also takes rows already quantised in the scratch (`norm_work`); bits: what the
    kernels read (the stored array, or float16 viewed as its uint16 bits for the compiled code);
    scratch: the runtime's shared flat float buffer (one product at a time; also where the
    rounded products put their rounded inputs), None for a slot already stored in the compute
    dtype (float32 on the CPU with the kernels on: nothing to widen, BLAS reads it directly)."""

    def __init__(self, stored: Any, scale: Any, widen: Callable[[Any, Any], None],
                 kernel: Callable | None, scratch: Any, bits: Any = None,
                 shape: tuple[int, int] | None = None, compute: str = "float32",
                 rounded_kernel: Callable | None = None,
                 work_bytes: Callable[[int, int, int], int] | None = None,
                 floors: bool = False, ready_rows: bool = False):
        self.stored, self.scale, self.widen, self.kernel = stored, scale, widen, kernel
        self.bits = stored if bits is None else bits
        self.scratch = scratch
        self.shape = tuple(stored.shape) if shape is None else tuple(shape)
        self.plain = scratch is None      # stored in the compute dtype: no widening, no scale
        self.rounding = ROUNDINGS.get(compute)
        self.rounded_kernel, self.work_bytes = rounded_kernel, work_bytes
        self.floors = floors and rounded_kernel is not None
        self.ready_rows = ready_rows and rounded_kernel is not None
        self._work = None                 # the scratch as bytes (the rounded products' inputs)
        self._steps: dict[int, int] = {}  # rows rounded at a time, by M (decoding's few M)
        self.groups = 1 if scale is None or scale.ndim == 1 else scale.shape[1]

    def _rounds_compiled(self) -> bool:
        """Whether the products run in the compiled product of the compute mode now (asked at
        every call: a process forked after the kernels' threads started must not run them,
        minfer/kernels/)."""
        return (self.kernel is not None and self.rounded_kernel is not None
                and self.shape[1] >= KERNEL_MIN_INNER and kernels.active() is not None)

    def norm_work(self, M: int) -> Any:
        """The scratch (bytes) an RMS norm in front of this product may quantise its M input
        rows into (`kernels.add_rms_norm_quantised`, with `groups` sums a row), or None where
        this product does not take them so: not compute="int8" in the compiled kernels, a
        format whose kernel quantises only for itself (GGUF's blocks), or more rows than the
        scratch holds at once (the product then takes them in parts, quantising each)."""
        if not (self.ready_rows and self._rounds_compiled()):
            return None
        return self._work_bytes() if self._rows_at_once(M) == M else None

    def _rows_at_once(self, M: int) -> int:
        """How many of M input rows the scratch holds rounded at once: all, or parts of whole
        4-row tiles. Remembered for the small M of decoding steps (asked ~100 times a step)."""
        step = self._steps.get(M)
        if step is not None:
            return step
        step, size = M, self._work_bytes().size
        while step > 1 and self.work_bytes(step, self.shape[1], self.groups) > size:
            step = (step + 1) // 2
        if 4 < step < M:
            step -= step % 4
        if M <= KERNEL_MAX_ROWS:
            self._steps[M] = step
        return step

    def matmul(self, xp: Any, x: Any, out: Any, relu: bool = False, ready: bool = False) -> Any:
        """x (M, K) @ self.T -> out (M, N), float; with `relu`, max(that, 0) (in the int8
        products' epilogue where they run it). `ready`: x's rows are already quantised in the
        scratch (`norm_work`; x gives the shape only)."""
        if ready:   # (only ever after norm_work said yes, in the same state)
            return self._rounded_product(x, out, relu, ready)
        fast = self.kernel is not None and kernels.active() is not None
        if self.rounding is not None:
            if self._rounds_compiled():
                return self._rounded_product(x, out, relu)
            x = self.rounding(xp, x)      # the same rounding, multiplied in float32 below
        if not self._product(xp, x, out, fast, relu) and relu:
            xp.maximum(out, 0, out=out)
        return out

    def _product(self, xp: Any, x: Any, out: Any, fast: bool, relu: bool = False) -> bool:
        """out = x @ self.T in float32: the small-M kernels, or blocks widened for BLAS. Returns
        whether it took the ReLU too (`relu`: the parts over the threads floor their own
        columns as they finish them)."""
        if fast and takes_kernel(x.shape[0], self.shape[1]):
            x = x if x.flags.c_contiguous else np.ascontiguousarray(x)
            if self.scale is None:
                self.kernel(x, self.bits, out)
            else:
                self.kernel(x, self.bits, self.scale, out)
            return False
        N = self.shape[0]
        if not fast:   # NumPy mode or CUDA: one pass of blocks; BLAS has its threads
            # (BLAS only from the pool's threads: kernels.split's `blas`)
            kernels.on_pool(lambda: xp.matmul(x, self.stored.T, out=out) if self.plain else
                            self._widened_product(xp, x, out, 0, N, self.scratch), xp)
            return False
        count = kernels.parts(N, MIN_PART_COLUMNS)   # each part widens into its own scratch
        size = 0 if self.plain else self.scratch.size // count

        def part(i: int, a: int, b: int) -> None:     # output columns a:b on one thread
            if self.plain:   # BLAS at one thread per part
                xp.matmul(x, self.stored[a:b].T, out=out[:, a:b])
            else:
                self._widened_product(xp, x, out, a, b, self.scratch[i * size:(i + 1) * size])
            if relu:
                np.maximum(out[:, a:b], 0, out=out[:, a:b])

        kernels.split(N, part, count, blas=True)
        return True

    def _work_bytes(self) -> Any:
        if self._work is None:
            self._work = self.scratch.view(np.uint8)
        return self._work

    def _rounded_product(self, x: Any, out: Any, relu: bool = False, ready: bool = False) -> Any:
        """The compiled product of the compute mode, over as many input rows at a time as the
        scratch holds rounded (all of a decoding step's; an encoder pass's in parts); `ready`:
        all of x's rows are there already, quantised."""
        x = x if x.flags.c_contiguous or ready else np.ascontiguousarray(x)
        work = self._work_bytes()
        M = x.shape[0]
        step = self._rows_at_once(M)
        if ready and step < M:
            raise AssertionError("quantised rows handed to a product whose scratch is short")
        extra = ((kernels.RELU_FLOOR if relu else kernels.NO_FLOOR,) if self.floors else ()) + \
            ((ready,) if self.ready_rows else ())
        for a in range(0, M, step):
            b = min(M, a + step)
            if self.scale is None:
                self.rounded_kernel(x[a:b], self.bits, out[a:b], work, *extra)
            else:
                self.rounded_kernel(x[a:b], self.bits, self.scale, out[a:b], work, *extra)
        if relu and not self.floors:    # (bfloat16's products: the ReLU after, rows over the threads)
            kernels.split(M, lambda i, a, b: np.maximum(out[a:b], 0, out=out[a:b]),
                          kernels.parts(M, MIN_PART_ROWS))
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
                scale = scale.reshape((n, *self.scale.shape[1:]))
                xp.take(self.scale, ids[a:a + n], axis=0, out=scale)
                apply_scale(out[a:a + n], scale)
        return out


def wrap(fmt: WeightFormat, name: str, arrays: dict[str, Any], compute_dtype: Any, scratch: Any,
         compiled: Any, compute: str = "float32") -> Any:
    """The stored arrays (on the device) of a slot in format `fmt` -> what `ops.linear`
    multiplies by: the array itself when it is already in the compute dtype (and no kernel runs
    it), else a PackedWeight. `compiled` is the compiled kernels on the CPU (`kernels.compiled()`:
    the registry), or None; `compute`: the backend's compute mode ("int8" only for quantised
    formats and GGUF's int8 blocks, "bfloat16" only for bfloat16 and fp8 weights: the backend
    checks)."""
    w = arrays[name]
    own = compiled.BY_FORMAT[fmt.name] if compiled is not None else None
    if np.dtype(fmt.storage) == np.dtype(compute_dtype) and not fmt.scaled:
        return w if own is None else PackedWeight(w, None, widen_cast, own.product, None)
    scale = arrays.get(name + SCALE_SUFFIX)
    shape = fmt.logical_shape(w.shape)
    if own is None:
        return PackedWeight(w, scale, fmt.widen, None, scratch, shape=shape, compute=compute)
    bits = w.view(np.uint16) if w.dtype == np.float16 else w   # numba has no float16
    # the int4 kernels take whole blocks of 64 columns per group, the grouped ones (GGUF's int8
    # and int4 blocks) rows of whole 32 columns (so groups of 16 or a multiple of 32); other
    # sizes widen
    blocks = (not fmt.packed or int4_group(shape[1]) % 64 == 0 if not fmt.group else
              shape[1] % 32 == 0)
    kernel = own.product if blocks else None
    rounded = own.rounded.get(compute) if blocks else None
    return PackedWeight(w, scale, own.widen, kernel, scratch, bits, shape, compute,
                        *(rounded or (None, None)), floors=own.floors,
                        ready_rows=own.ready_rows)


def scratch_bytes(fmt: WeightFormat, shape: tuple[int, int], compute_dtype: Any) -> int:
    """Float scratch a block-widened product with this matrix needs (0 for plain arrays)."""
    if np.dtype(fmt.storage) == np.dtype(compute_dtype) and not fmt.scaled:
        return 0
    return align_up(min(WIDEN_SCRATCH_BYTES, int(np.prod(shape)) * np.dtype(compute_dtype).itemsize))
