"""Products computed in float32 for every storage format: out (M, N) = x (M, K) @ w (N, K).T
[* scale]. Decoding multiplies one row per sequence by every weight matrix, a product that only
streams the weights from memory: these read each weight row once, in its stored format, widen
it in registers (`widening.widen`) and take the dot products with every input row while the
weight row is in L1. Blocks of output rows are spread over the threads (`prange`).

Conventions: activations are float32; weights are (out, in) row-major in their stored dtype
(float32, float16 or bfloat16 as uint16 bits, int8 or fp8 codes with float32 scales per row,
int4 two a byte with scales per group); outputs are written in place. `fastmath` lets LLVM reorder the dot
products' sums so it can vectorise them (the order of a float32 sum differs from BLAS's by
rounding, as BLAS's own does between machines). Loops index slices from 0 (`range(n)` over a
slice rather than `range(a, b)` over the whole array), which spares the negative-index checks
that stop LLVM vectorising. One body serves every format: `_matmul` takes the format as a
compile-time constant (each public wrapper passes a module constant, so numba specialises the
body); the wrappers cost nothing at run time and cache like any function.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .widening import BF16, E4M3, E5M2, F16, F32, I8, unit_factor, widen_unit

BLOCK = 32                      # output rows per parallel task
# Up to this many input rows a product streams each weight row once and dots it with every input
# row (4 input rows per pass over it); above it, 4 x 4 tiles over widened weight rows do fewer
# loads per multiply-add. Where they cross was measured on a t5-small decoder step
# (benchmarks/README.md, "Measurements behind constants in the code").
STREAM_MAX_ROWS = 8
# ... and only while those input rows stay in L1 beside the streaming weight row: four rows of
# K = 3072 (the FF's output product) are 48 KiB, more than Zen 4's 32 KiB L1, and re-read from
# L2 for every weight row they ran at ~0.6x the stream of K = 768. Past this many bytes of input
# rows the 4 x 4 tiles take them: float32 weights sooner (the tiles read their rows as stored)
# than the others (the tiles widen 4 rows into a copy first). Measured: benchmarks/README.md,
# "Measurements behind constants in the code".
STREAM_MAX_INPUT_BYTES = 16 << 10        # float32 weights
STREAM_MAX_WIDENED_INPUT_BYTES = 32 << 10  # weights widened from another format
NO_SCALE = np.ones(0, np.float32)



# -- small-M products: out (M, N) = x (M, K) @ w (N, K).T [* scale (N,)] -----------------------------------
@njit(inline="always", fastmath=True)
def _fma4(a0, a1, a2, a3, v, w0, w1, w2, w3):
    """One input element times four weights, added to four accumulators (inlined: scalars stay
    in registers, as if written out)."""
    return a0 + v * w0, a1 + v * w1, a2 + v * w2, a3 + v * w3


@njit(inline="always", fastmath=True)
def _tile4x4(x0, x1, x2, x3, r0, r1, r2, r3, K):
    """Dot products of 4 input rows with 4 weight rows: 16 accumulators, so each loaded element
    feeds 4 multiply-adds (LLVM vectorises the k loop: 16 vector accumulators, 8 loads)."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
    for k in range(K):
        w0, w1, w2, w3 = r0[k], r1[k], r2[k], r3[k]
        a00, a01, a02, a03 = _fma4(a00, a01, a02, a03, x0[k], w0, w1, w2, w3)
        a10, a11, a12, a13 = _fma4(a10, a11, a12, a13, x1[k], w0, w1, w2, w3)
        a20, a21, a22, a23 = _fma4(a20, a21, a22, a23, x2[k], w0, w1, w2, w3)
        a30, a31, a32, a33 = _fma4(a30, a31, a32, a33, x3[k], w0, w1, w2, w3)
    return (a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33)


@njit(inline="always", fastmath=True)
def _tile1x4(x0, r0, r1, r2, r3, K):
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for k in range(K):
        v = x0[k]
        a0 += v * r0[k]
        a1 += v * r1[k]
        a2 += v * r2[k]
        a3 += v * r3[k]
    return (a0, a1, a2, a3)


@njit(inline="always")
def _widen_rows(wb, i, nr, rf, fmt):
    """Weight rows i .. i + nr - 1 of wb widened into rf (4, K), zeros past them (their results
    are dropped)."""
    K = rf.shape[1]
    for j in range(nr):
        row = wb[i + j]
        dst = rf[j]
        for k in range(K):
            dst[k] = widen_unit(row[k], fmt)
    for j in range(nr, 4):
        rf[j, :] = 0.0
    return rf[0], rf[1], rf[2], rf[3]


def _four_rows(wb, i, nr, rf, fmt):
    """The 4 float32 weight rows from row i of wb that a 4 x 4 tile takes: float32 rows as
    stored when all 4 are there (typed per weight dtype: the stored rows are float32 arrays
    only for float32 weights), else `_widen_rows`."""


@overload(_four_rows, inline="always")
def _four_rows_typed(wb, i, nr, rf, fmt):
    if wb.dtype == types.float32:
        def stored(wb, i, nr, rf, fmt):
            if nr == 4:
                return wb[i], wb[i + 1], wb[i + 2], wb[i + 3]
            return _widen_rows(wb, i, nr, rf, fmt)
        return stored
    return lambda wb, i, nr, rf, fmt: _widen_rows(wb, i, nr, rf, fmt)


@njit(parallel=True, fastmath=True, cache=True)
def _matmul(x, w, scale, out, fmt, scaled):
    M, K = x.shape
    N = w.shape[0]
    f = unit_factor(fmt)                 # (the weights are widened up to it: widen_unit)
    for b in prange((N + BLOCK - 1) // BLOCK):
        n0 = b * BLOCK
        n1 = min(N, n0 + BLOCK)
        wb, ob = w[n0:n1], out[:, n0:n1]
        if M == 1:                       # decoding one sequence: widen in registers, one pass
            x0 = x[0]
            for i in range(n1 - n0):
                row = wb[i]
                acc = np.float32(0.0)
                for k in range(K):
                    acc += x0[k] * widen_unit(row[k], fmt)
                ob[0, i] = acc * (scale[n0 + i] * f) if scaled else acc
            continue
        budget = STREAM_MAX_INPUT_BYTES if fmt == F32 else STREAM_MAX_WIDENED_INPUT_BYTES
        if M <= STREAM_MAX_ROWS and M * K * 4 <= budget:
            # beams, small batches: each weight row read once
            for i in range(n1 - n0):     # (widened in registers), dotted with every input row
                row = wb[i]              # while it sits in L1; the inputs stay in L1 too
                s = scale[n0 + i] * f if scaled else np.float32(1.0)
                m = 0
                while m + 4 <= M:
                    x0, x1, x2, x3 = x[m], x[m + 1], x[m + 2], x[m + 3]
                    a0 = a1 = a2 = a3 = np.float32(0.0)
                    for k in range(K):
                        v = widen_unit(row[k], fmt)
                        a0 += x0[k] * v
                        a1 += x1[k] * v
                        a2 += x2[k] * v
                        a3 += x3[k] * v
                    ob[m, i], ob[m + 1, i], ob[m + 2, i], ob[m + 3, i] = a0 * s, a1 * s, a2 * s, a3 * s
                    m += 4
                while m < M:
                    x0 = x[m]
                    a0 = np.float32(0.0)
                    for k in range(K):
                        a0 += x0[k] * widen_unit(row[k], fmt)
                    ob[m, i] = a0 * s
                    m += 1
            continue
        # more input rows: 4 weight rows at a time, widened once into float rows that stay in
        # L1, each multiplied by every input row in 4x4 tiles (1x4 for the last M % 4 rows);
        # float32 weight rows are taken as they are stored (4 of them whole: no copy)
        rf = np.zeros((4, K), np.float32)
        for i in range(0, n1 - n0, 4):
            nr = min(4, n1 - n0 - i)
            r0, r1, r2, r3 = _four_rows(wb, i, nr, rf, fmt)
            s = np.ones(4, np.float32)
            if scaled:
                for j in range(nr):
                    s[j] = scale[n0 + i + j] * f
            m = 0
            while m + 4 <= M:
                t = _tile4x4(x[m], x[m + 1], x[m + 2], x[m + 3], r0, r1, r2, r3, K)
                for a in range(4):
                    for j in range(nr):
                        ob[m + a, i + j] = t[a * 4 + j] * s[j]
                m += 4
            while m < M:
                t = _tile1x4(x[m], r0, r1, r2, r3, K)
                for j in range(nr):
                    ob[m, i + j] = t[j] * s[j]
                m += 1


@njit(cache=True)
def matmul_f32(x, w, out):
    _matmul(x, w, NO_SCALE, out, F32, False)


@njit(cache=True)
def matmul_f16(x, w, out):
    _matmul(x, w, NO_SCALE, out, F16, False)


@njit(cache=True)
def matmul_bf16(x, w, out):
    _matmul(x, w, NO_SCALE, out, BF16, False)


@njit(cache=True)
def matmul_i8(x, w, scale, out):
    _matmul(x, w, scale, out, I8, True)


# fp8 codes with a float32 scale per output row: (x . codes) * scale, the codes widened in
# registers (widening._e4m3 / _e5m2), the scale applied once per output
@njit(cache=True)
def matmul_e4m3(x, w, scale, out):
    _matmul(x, w, scale, out, E4M3, True)


@njit(cache=True)
def matmul_e5m2(x, w, scale, out):
    _matmul(x, w, scale, out, E5M2, True)


# -- 4-bit weights, computed in float32 ------------------------------------------------------------------
# A row of an int4 matrix (io/formats.py) is K/2 bytes: each block of 64 columns is 32 bytes,
# byte i holding column i in its low nibble and column 32 + i in its high one, as q + 8 (q in
# -8..7); one float32 scale per group of G columns (G a multiple of 64 here). Up to
# STREAM_MAX_ROWS input rows, each weight row is widened in registers and dotted with every input
# row, the nibbles taken as they are (q + 8) and 8 x the group's input sum taken off once per
# group; more rows widen 4 weight rows into float rows in L1 (scaled) for the 4x4 tiles.
@njit(inline="always")
def _widen_i4_row(row, srow, dst):
    K = dst.shape[0]
    G = K // srow.shape[0]
    for g in range(srow.shape[0]):
        s = srow[g]
        for blk in range(G // 64):
            c = g * G + blk * 64
            src, out = row[c // 2:c // 2 + 32], dst[c:c + 64]
            for i in range(32):
                b = np.int32(src[i])
                out[i] = np.float32((b & 15) - 8) * s
                out[32 + i] = np.float32((b >> 4) - 8) * s


@intrinsic
def _nib_lo(typingctx, b):
    """The low nibble of a byte as a float (a zero extension LLVM vectorises; numba's own
    integer arithmetic widens to int64 first)."""
    def codegen(context, builder, signature, args):
        return builder.uitofp(builder.and_(args[0], ir.Constant(ir.IntType(8), 15)), ir.FloatType())
    return types.float32(types.uint8), codegen


@intrinsic
def _nib_hi(typingctx, b):
    def codegen(context, builder, signature, args):
        return builder.uitofp(builder.lshr(args[0], ir.Constant(ir.IntType(8), 4)), ir.FloatType())
    return types.float32(types.uint8), codegen


@njit(parallel=True, fastmath=True, cache=True)
def matmul_i4(x, w, scale, out):
    M, K = x.shape
    N = w.shape[0]
    groups = scale.shape[1]
    G = K // groups
    if M <= STREAM_MAX_ROWS:
        # (unsigned offsets: a signed index makes numba test for negative ones, which stops
        # LLVM vectorising; slicing per block instead costs a reference count each)
        xsum = np.empty((M, groups), np.float32)     # 8 x each is what the nibbles' + 8 adds
        for m in range(M):
            for g in range(groups):
                t = np.float32(0.0)
                for k in range(g * G, (g + 1) * G):
                    t += x[m, k]
                xsum[m, g] = np.float32(8.0) * t
        for b in prange((N + BLOCK - 1) // BLOCK):
            for n in range(b * BLOCK, min(N, (b + 1) * BLOCK)):
                row, srow = w[n], scale[n]
                m = 0
                while m < M:
                    rows = min(4, M - m)
                    x0, x1, x2, x3 = x[m], x[m + 1 if rows > 1 else m], x[m + 2 if rows > 2 else m], \
                        x[m + 3 if rows > 3 else m]
                    a0 = a1 = a2 = a3 = np.float32(0.0)
                    for g in range(groups):
                        p0 = p1 = p2 = p3 = np.float32(0.0)
                        for blk in range(G // 64):
                            o = np.uint64(g * G + blk * 64)
                            h = o // np.uint64(2)
                            for i in range(32):
                                bb = row[h + np.uint64(i)]
                                lo, hi = _nib_lo(bb), _nib_hi(bb)
                                k0, k1 = o + np.uint64(i), o + np.uint64(32 + i)
                                p0 += x0[k0] * lo + x0[k1] * hi
                                if rows > 1:
                                    p1 += x1[k0] * lo + x1[k1] * hi
                                    p2 += x2[k0] * lo + x2[k1] * hi
                                    p3 += x3[k0] * lo + x3[k1] * hi
                        s = srow[g]
                        a0 += (p0 - xsum[m, g]) * s
                        if rows > 1:
                            a1 += (p1 - xsum[m + 1, g]) * s
                            a2 += (p2 - xsum[m + 2 if rows > 2 else m, g]) * s
                            a3 += (p3 - xsum[m + 3 if rows > 3 else m, g]) * s
                    out[m, n] = a0
                    if rows > 1:
                        out[m + 1, n] = a1
                    if rows > 2:
                        out[m + 2, n] = a2
                    if rows > 3:
                        out[m + 3, n] = a3
                    m += rows
        return
    _grouped_product(x, w, scale, out, _widen_i4_row)


# -- grouped int8 weights (GGUF's blocks), computed in float32 -----------------------------------------
# A row of a grouped int8 matrix (io/formats.py: "int8g32", "int8g16") is K int8 values q and, per
# group of G columns, a float32 scale s and offset o (params (N, K / G, 2)): the weight is q * s + o.
# Four weight rows at a time are widened into float rows in L1, each value q * s + o rounded once
# (q * s is exact, so a fused multiply-add gives the same float as GGUF's own float32
# dequantisation), then dotted with every input row in 4x4 tiles (1x4 for the last M % 4 rows).
# One path for every M: a decoding step's one row pays the widening per weight row, which the
# dot products' loads dominate anyway.
@njit(inline="always")
def _widen_i8g_row(row, prow, dst):
    groups = prow.shape[0]
    G = row.shape[0] // groups
    for g in range(groups):
        s, o = prow[g, 0], prow[g, 1]
        src, out = row[g * G:(g + 1) * G], dst[g * G:(g + 1) * G]
        for i in range(G):
            out[i] = np.float32(src[i]) * s + o


@njit(inline="always")
def _dot_widened(x, rf, ob, i, nr):
    """Input rows x (M, K) dotted with the widened weight rows rf (4, K): outputs ob[:, i:i+nr]."""
    M, K = x.shape
    m = 0
    while m + 4 <= M:
        t = _tile4x4(x[m], x[m + 1], x[m + 2], x[m + 3], rf[0], rf[1], rf[2], rf[3], K)
        for a in range(4):
            for j in range(nr):
                ob[m + a, i + j] = t[a * 4 + j]
        m += 4
    while m < M:
        t = _tile1x4(x[m], rf[0], rf[1], rf[2], rf[3], K)
        for j in range(nr):
            ob[m, i + j] = t[j]
        m += 1


@njit(inline="always")
def _grouped_product(x, w, params, out, widen_row):
    """out = x @ (the rows widened by widen_row(row, the row's group scales (and offsets),
    dst)).T: blocks of weight rows over the threads, 4 rows widened at a time into L1, then the
    4x4 tiles (int4, and GGUF's grouped int8 / int4)."""
    K = x.shape[1]
    N = w.shape[0]
    for b in prange((N + BLOCK - 1) // BLOCK):
        n0 = b * BLOCK
        n1 = min(N, n0 + BLOCK)
        ob = out[:, n0:n1]
        rf = np.zeros((4, K), np.float32)
        for i in range(0, n1 - n0, 4):
            nr = min(4, n1 - n0 - i)
            for j in range(nr):
                widen_row(w[n0 + i + j], params[n0 + i + j], rf[j])
            for j in range(nr, 4):       # past the last weight row: zeros, results dropped
                rf[j, :] = 0.0
            _dot_widened(x, rf, ob, i, nr)


@njit(parallel=True, fastmath=True, cache=True)
def matmul_i8g(x, w, params, out):
    _grouped_product(x, w, params, out, _widen_i8g_row)


# -- grouped int4 weights (GGUF's 4-bit blocks), computed in float32 -----------------------------------
# A row of a grouped int4 matrix (io/formats.py: "int4g32", "int4g16") is K / 2 bytes in int4's
# layout (blocks of 64 columns, byte i holding column i low and 32 + i high; a last block of 32
# columns pairs column i with 16 + i), the codes unsigned (0..15), and per group of G columns a
# float32 scale s and offset o (params (N, K / G, 2)): the weight is q * s + o. K is a multiple
# of 32 (the products.wrap condition), so G is 16 or a multiple of 32: each block's 32 bytes
# widen in one loop of constant length that LLVM vectorises, with one (s, o) for its low
# nibbles and one for its high ones, or for G = 16 a select between two (two loops of 16 per
# half were 2-3x slower on one core, so were per-column indices). Four weight rows at a time are
# widened into float rows in L1 (q * s exact, so each value rounds once, as GGUF's own float32
# dequantisation: the same floats as matmul_i8g's), then dotted with every input row in 4x4 tiles.
@njit(inline="always")
def _widen_i4g_run(src, dl, dh, sl, ol, sh, oh, n):
    """n bytes -> their low nibbles' values into dl, their high nibbles' into dh."""
    for i in range(n):
        b = src[i]
        dl[i] = _nib_lo(b) * sl + ol
        dh[i] = _nib_hi(b) * sh + oh


@njit(inline="always")
def _widen_i4g_row(row, prow, dst):
    K = dst.shape[0]
    G = K // prow.shape[0]
    for blk in range(K // 64):           # low nibbles: columns c.., high: c + 32..
        c = blk * 64
        if G % 32 == 0:                  # (constant trip counts: each loop vectorised whole)
            gl, gh = c // G, (c + 32) // G
            _widen_i4g_run(row[c // 2:c // 2 + 32], dst[c:c + 32], dst[c + 32:c + 64],
                           prow[gl, 0], prow[gl, 1], prow[gh, 0], prow[gh, 1], 32)
            continue
        g = c // 16                      # G = 16: bytes 0..15 and 16..31 differ in group
        s0, o0, s1, o1 = prow[g, 0], prow[g, 1], prow[g + 1, 0], prow[g + 1, 1]
        s2, o2, s3, o3 = prow[g + 2, 0], prow[g + 2, 1], prow[g + 3, 0], prow[g + 3, 1]
        src, dl, dh = row[c // 2:c // 2 + 32], dst[c:c + 32], dst[c + 32:c + 64]
        for i in range(32):
            b = src[i]
            first = i < 16
            dl[i] = _nib_lo(b) * (s0 if first else s1) + (o0 if first else o1)
            dh[i] = _nib_hi(b) * (s2 if first else s3) + (o2 if first else o3)
    if K % 64:                           # a last block of 32 columns: i and 16 + i
        c = K - 32
        gl, gh = c // G, (c + 16) // G
        _widen_i4g_run(row[c // 2:c // 2 + 16], dst[c:c + 16], dst[c + 16:c + 32],
                       prow[gl, 0], prow[gl, 1], prow[gh, 0], prow[gh, 1], 16)


@njit(parallel=True, fastmath=True, cache=True)
def matmul_i4g(x, w, params, out):
    _grouped_product(x, w, params, out, _widen_i4g_row)
