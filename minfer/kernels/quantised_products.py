"""int8 x int8 products (compute="int8"): input rows quantised to int8 on the fly, integer dot
products on the CPU's dot-product instructions (`tiles`), int32 sums scaled back to float32.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from . import tiles
from .float_products import BLOCK
from .widening import I8



# -- int8 x int8 products (compute="int8") ----------------------------------------------------------------
# Each input row is quantised on the fly, symmetric, one scale per row (absmax / 127, round to
# nearest even), the integer products run on the dot-product instructions (`tiles`: 4-row x
# 4-column tiles of vpdpbusd, int32 sums) and each output is sum * row scale * weight scale. The
# quantised rows, their sums and scales go to `work`, the runtime's widening scratch (the caller
# passes as many rows at a time as fit: `kernels.quantised_bytes`). `best` False runs the tiles
# built for `tiles.FALLBACK` instead (what a CPU without VNNI runs; the tests compare both).
_tile = tiles.make_tile({True: tiles.ISA, False: tiles.FALLBACK})
OFFSET_BEST, OFFSET_FALLBACK = tiles.offset(tiles.ISA), tiles.offset(tiles.FALLBACK)
WIDTH_BEST, WIDTH_FALLBACK = tiles.width(tiles.ISA), tiles.width(tiles.FALLBACK)
I4 = tiles.INT4               # the tiles' kinds: I8 (the int8 storage format) and I4
assert tiles.INT8 == I8
QUANTISE_PARALLEL = 1 << 16             # elements of input above which rows quantise in parallel


@intrinsic
def _abs_bits(typingctx, v):
    """|v| as the int32 of its bits: they order as |v| does, inf above every finite value and NaN
    above inf, so one integer max (which vectorises; a float max with NaN semantics does not)
    gives the row's absmax and whether it is finite."""
    def codegen(context, builder, signature, args):
        bits = builder.bitcast(args[0], ir.IntType(32))
        return builder.and_(bits, ir.Constant(ir.IntType(32), 0x7FFFFFFF))
    return types.int32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, v):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@njit(cache=True)
def _quantise_row(xr, qr, sums, G):
    """qr = round(xr * 127 / absmax) (int8), sums[g] = sum of group g (G columns each) of qr;
    returns the row's scale absmax / 127 (NaN when the row holds inf or NaN: its outputs are NaN,
    which generation names; 0 for a zero row)."""
    K = xr.shape[0]
    top = np.int32(0)
    for k in range(K):
        top = max(top, _abs_bits(xr[k]))
    if top >= np.int32(0x7F800000) or top == 0:
        qr[:] = 0
        sums[:] = 0
        return np.float32(np.nan) if top else np.float32(0.0)
    amax = _bits_f32(top)
    inv = np.float32(127.0) / amax
    for k in range(K):
        qr[k] = np.int8(np.rint(xr[k] * inv))
    for g in range(sums.shape[0]):
        part = qr[g * G:(g + 1) * G]
        s = 0
        for k in range(G):
            s += np.int32(part[k])
        sums[g] = s
    return amax / np.float32(127.0)


@njit(cache=True)
def _carve(work, M, K, groups):
    """The quantised rows (M, K) int8, their group sums (M, groups) int32 and scales (M,) float32
    in the byte buffer `work` (64-byte aligned parts; kernels.quantised_bytes sizes it: keep the
    two layouts the same)."""
    a = (M * K + 63) // 64 * 64
    b = a + (M * groups * 4 + 63) // 64 * 64
    xq = work[:M * K].view(np.int8).reshape((M, K))
    sums = work[a:a + M * groups * 4].view(np.int32).reshape((M, groups))
    sx = work[b:b + M * 4].view(np.float32)
    return xq, sums, sx


@njit(parallel=True, cache=True)
def _quantise(x, work, groups, G):
    M, K = x.shape
    xq, sums, sx = _carve(work, M, K, groups)
    if M * K >= QUANTISE_PARALLEL:
        for m in prange(M):
            sx[m] = _quantise_row(x[m], xq[m], sums[m], G)
    else:
        for m in range(M):
            sx[m] = _quantise_row(x[m], xq[m], sums[m], G)
    return xq, sums, sx


def _row_scale(scale, j):
    """Weight row j's scale (int8: scale[j]); typed for int4's 2-D scales too, which the int8
    tail below never reads (both kinds share one kernel body, typed whole)."""


@overload(_row_scale)
def _row_scale_typed(scale, j):
    if scale.ndim == 1:
        return lambda scale, j: scale[j]
    return lambda scale, j: scale[j, 0]


@njit(inline="always")
def _tail_fix(rows, cols, ob, i, m, wb, sb, xq, sx, main, K):
    """The exact products of the columns past the last whole vector (K not a multiple of it)."""
    for r in range(rows):
        for c in range(cols):
            s = 0
            for k in range(main, K):
                s += np.int32(wb[i + r, k]) * np.int32(xq[m + c, k])
            ob[m + c, i + r] += np.float32(s) * (sx[m + c] * _row_scale(sb, i + r))


@njit(parallel=True, cache=True)
def _qmatmul(x, w, scale, out, work, kind, best):
    """out = quantised(x) @ w.T with int8 (kind I8: scale per row) or int4 (I4: scale per group)
    weights, on the `best` tiles or the fallback's."""
    numba.literally(kind)                # one build per kind and instruction set: the others'
    numba.literally(best)                # tiles are not compiled
    M, K = x.shape
    N = w.shape[0]
    # (both kinds' code is typed whatever the kind, so it reads only what both arrays have)
    if kind == I8:
        W = WIDTH_BEST if best else WIDTH_FALLBACK
        off = OFFSET_BEST if best else OFFSET_FALLBACK
        n = K // W                       # whole vectors per row; the tail is summed exactly
        main, groups, G, per = n * W, 1, n * W, 0
    else:
        groups = scale.shape[-1]
        n, G, off, main = groups, K // groups, 0, K
        per = G // 64                    # 64-column blocks per group
    xq, sums, sx = _quantise(x, work, groups, G)
    for b in prange((N + BLOCK - 1) // BLOCK):
        n0 = b * BLOCK
        nb = min(N, n0 + BLOCK) - n0
        wb, ob, sb = w[n0:n0 + nb], out[:, n0:n0 + nb], scale[n0:n0 + nb]
        # 4 input rows x 4 weight rows at a time (then x 1; 1 row at the ends): the block's
        # weight rows and the 4 input rows stay in L1 while the input rows are used
        m = 0
        while m < M:
            cols = 4 if m + 4 <= M else 1
            i = 0
            while i < nb:
                rows = 4 if i + 4 <= nb else 1
                if rows == 4 and cols == 4:
                    _tile(kind, 4, 4, best, wb, sb, i, xq, sums, m, n, per, sx, ob, off)
                elif rows == 4:
                    _tile(kind, 4, 1, best, wb, sb, i, xq, sums, m, n, per, sx, ob, off)
                elif cols == 4:
                    _tile(kind, 1, 4, best, wb, sb, i, xq, sums, m, n, per, sx, ob, off)
                else:
                    _tile(kind, 1, 1, best, wb, sb, i, xq, sums, m, n, per, sx, ob, off)
                if main < K:
                    _tail_fix(rows, cols, ob, i, m, wb, sb, xq, sx, main, K)
                i += rows
            m += cols


@njit(cache=True)
def qmatmul_i8(x, w, scale, out, work):
    _qmatmul(x, w, scale, out, work, I8, True)


@njit(cache=True)
def qmatmul_i8_fallback(x, w, scale, out, work):
    _qmatmul(x, w, scale, out, work, I8, False)


@njit(cache=True)
def qmatmul_i4(x, w, scale, out, work):
    _qmatmul(x, w, scale, out, work, I4, True)


@njit(cache=True)
def qmatmul_i4_fallback(x, w, scale, out, work):
    _qmatmul(x, w, scale, out, work, I4, False)

