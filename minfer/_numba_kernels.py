"""The compiled kernels themselves (imported through kernels.py, which says what they are for).

Conventions: activations are float32; weights are (out, in) row-major in their stored dtype
(float32, float16 or bfloat16 as uint16 bits, int8 with float32 scales per row); outputs are
written in place. `fastmath` lets LLVM reorder the dot products' sums so it can vectorise them
(the order of a float32 sum differs from BLAS's by rounding, as BLAS's own does between
machines). Loops index slices from 0 (`range(n)` over a slice rather than `range(a, b)` over the
whole array), which spares the negative-index checks that stop LLVM vectorising.

One body serves every storage format: `_matmul` takes the format as a compile-time constant
(each public wrapper passes a module constant, so numba specialises the body and folds the
`widen` branch away); the wrappers cost nothing at run time and cache like any function.
"""

from __future__ import annotations

import math
import os

# GNU OpenMP's idle threads spin 300,000 times before they sleep. On a machine whose cores other
# processes also use, the spinning thread takes the core the working one needs: with one busy
# process beside a 2-thread run on 2 cores, t5-small decoding fell from 163 to 64 tok/s
# (batch 16: 809 -> 271). 1,000 spins cost nothing measurable on a quiet machine (168 / 800 tok/s)
# and under that load gave 101 / 408 (benchmarks/README.md, "Threads on a busy machine"). Read
# once, when numba loads libgomp at the first parallel call; the user's own setting wins.
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "1000"


def _prefer_512_bit_vectors() -> None:
    """LLVM tunes Intel's AVX-512 server cores (skylake-avx512, icelake-server, sapphirerapids)
    to prefer 256-bit vectors, so the loops here would be vectorised at half the width the CPU
    has (AMD's znver4 already gets 512 bits). numba takes the target's features from
    NUMBA_CPU_FEATURES when set: the host's own plus "-prefer-256-bit" lifts the preference.
    Only when the user set neither NUMBA_CPU_NAME nor NUMBA_CPU_FEATURES, and before numba's first
    compilation in the process (numba builds its target machine once)."""
    if "NUMBA_CPU_FEATURES" in os.environ or "NUMBA_CPU_NAME" in os.environ:
        return
    import llvmlite.binding as ll
    features = ll.get_host_cpu_features()
    if features.get("avx512f"):
        os.environ["NUMBA_CPU_FEATURES"] = features.flatten() + ",-prefer-256-bit"


_prefer_512_bit_vectors()

import numba  # noqa: E402  (after the CPU features are chosen)
import numpy as np  # noqa: E402
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from . import _dot_ir

# A fast threading layer first: GNU OpenMP (libgomp) or TBB; "workqueue" is the slow fallback.
numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]

BLOCK = 32                      # output rows per parallel task
# Up to this many input rows a product streams each weight row once and dots it with every input
# row (4 input rows per pass over it); above it, 4 x 4 tiles over widened weight rows do fewer
# loads per multiply-add. On a t5-small decoder step with its weights streamed from memory (2 threads,
# AVX-512): float32 M=2 / 4 / 8: 5.6 / 6.8 / 12.0 ms against 8.0 / 8.0 / 12.7 with the tiles;
# int8 2.5 / 2.9 / 6.2 against 4.1 / 4.8 / 7.3; at M=16 the tiles win (17.1 against 20.7).
STREAM_MAX_ROWS = 8
F32, F16, BF16, I8 = 0, 1, 2, 3  # storage formats (compile-time constants)
# The fused step functions take fastmath's reassociation (which vectorises their sums) but not its
# "no NaN / no inf" assumptions, and NumPy's error model (x / 0 is inf, not ZeroDivisionError):
# an overflowed score must come out as NaN logits, which generation names in a one-line error,
# never as a raw exception from inside a kernel or a finite value LLVM made up.
NON_FINITE_SAFE = dict(fastmath={"reassoc", "contract", "arcp", "nsz", "afn"}, error_model="numpy")
NO_SCALE = np.ones(0, np.float32)


# -- widening stored bits to float32 (numba has no CPU float16 type) -----------------------------------
@intrinsic
def _f16(typingctx, bits):
    """float16 bits (uint16) -> float32: reinterpret as LLVM half, extend (F16C on x86)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _bf16(typingctx, bits):
    """bfloat16 bits (uint16) -> float32: they are the high half of the float32."""
    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())
    return types.float32(types.uint16), codegen


@njit(inline="always")
def _widen(v, fmt):
    if fmt == F16:
        return _f16(v)
    if fmt == BF16:
        return _bf16(v)
    return np.float32(v)


# -- small-M products: out (M, N) = x (M, K) @ w (N, K).T [* scale (N,)] -----------------------------------
@njit(inline="always", fastmath=True)
def _tile4x4(x0, x1, x2, x3, r0, r1, r2, r3, K):
    """Dot products of 4 input rows with 4 weight rows: 16 accumulators, so each loaded element
    feeds 4 multiply-adds (LLVM vectorises the k loop: 16 vector accumulators, 8 loads)."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
    for k in range(K):
        w0, w1, w2, w3 = r0[k], r1[k], r2[k], r3[k]
        v = x0[k]
        a00 += v * w0
        a01 += v * w1
        a02 += v * w2
        a03 += v * w3
        v = x1[k]
        a10 += v * w0
        a11 += v * w1
        a12 += v * w2
        a13 += v * w3
        v = x2[k]
        a20 += v * w0
        a21 += v * w1
        a22 += v * w2
        a23 += v * w3
        v = x3[k]
        a30 += v * w0
        a31 += v * w1
        a32 += v * w2
        a33 += v * w3
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


@njit(parallel=True, fastmath=True, cache=True)
def _matmul(x, w, scale, out, fmt, scaled):
    M, K = x.shape
    N = w.shape[0]
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
                    acc += x0[k] * _widen(row[k], fmt)
                ob[0, i] = acc * scale[n0 + i] if scaled else acc
            continue
        if M <= STREAM_MAX_ROWS:         # beams, small batches: each weight row read once
            for i in range(n1 - n0):     # (widened in registers), dotted with every input row
                row = wb[i]              # while it sits in L1; the inputs stay in L1 too
                s = scale[n0 + i] if scaled else np.float32(1.0)
                m = 0
                while m + 4 <= M:
                    x0, x1, x2, x3 = x[m], x[m + 1], x[m + 2], x[m + 3]
                    a0 = a1 = a2 = a3 = np.float32(0.0)
                    for k in range(K):
                        v = _widen(row[k], fmt)
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
                        a0 += x0[k] * _widen(row[k], fmt)
                    ob[m, i] = a0 * s
                    m += 1
            continue
        # more input rows: 4 weight rows at a time, widened once into float rows that stay in
        # L1, each multiplied by every input row in 4x4 tiles (1x4 for the last M % 4 rows)
        rf = np.zeros((4, K), np.float32)
        for i in range(0, n1 - n0, 4):
            nr = min(4, n1 - n0 - i)
            for j in range(nr):
                row = wb[i + j]
                dst = rf[j]
                for k in range(K):
                    dst[k] = _widen(row[k], fmt)
            for j in range(nr, 4):       # past the last weight row: zeros, results dropped
                rf[j, :] = 0.0
            s = np.ones(4, np.float32)
            if scaled:
                for j in range(nr):
                    s[j] = scale[n0 + i + j]
            m = 0
            while m + 4 <= M:
                t = _tile4x4(x[m], x[m + 1], x[m + 2], x[m + 3], rf[0], rf[1], rf[2], rf[3], K)
                for a in range(4):
                    for j in range(nr):
                        ob[m + a, i + j] = t[a * 4 + j] * s[j]
                m += 4
            while m < M:
                t = _tile1x4(x[m], rf[0], rf[1], rf[2], rf[3], K)
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


# -- 4-bit weights, computed in float32 ------------------------------------------------------------------
# A row of an int4 matrix (params/formats.py) is K/2 bytes: each block of 64 columns is 32 bytes,
# byte i holding column i in its low nibble and column 32 + i in its high one, as q + 8 (q in
# -8..7); one float32 scale per group of G columns (G a multiple of 64 here). Up to
# STREAM_MAX_ROWS input rows, each weight row is widened in registers and dotted with every input
# row, the nibbles taken as they are (q + 8) and 8 x the group's input sum taken off once per
# group; more rows widen 4 weight rows into float rows in L1 (scaled) for the 4x4 tiles.
@njit(inline="always")
def _widen_i4_row(row, srow, dst, K):
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
    for b in prange((N + BLOCK - 1) // BLOCK):
        n0 = b * BLOCK
        n1 = min(N, n0 + BLOCK)
        ob = out[:, n0:n1]
        rf = np.zeros((4, K), np.float32)
        for i in range(0, n1 - n0, 4):
            nr = min(4, n1 - n0 - i)
            for j in range(nr):
                _widen_i4_row(w[n0 + i + j], scale[n0 + i + j], rf[j], K)
            for j in range(nr, 4):       # past the last weight row: zeros, results dropped
                rf[j, :] = 0.0
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


@njit(nogil=True, cache=True)
def widen_i4(src, dst):
    """Rows of an int4 matrix -> their values q (float, unscaled): the block-widened products
    apply the group scales after, as they apply int8's row scales."""
    R, K = dst.shape
    for r in range(R):
        srow, drow = src[r], dst[r]
        for blk in range(K // 64):
            s, d = srow[blk * 32:blk * 32 + 32], drow[blk * 64:blk * 64 + 64]
            for i in range(32):
                b = np.int32(s[i])
                d[i] = np.float32((b & 15) - 8)
                d[32 + i] = np.float32((b >> 4) - 8)
        tail = K % 64                    # a last partial block pairs column c with c + tail / 2
        if tail:
            half, c0 = tail // 2, K - tail
            for i in range(half):
                b = np.int32(srow[c0 // 2 + i])
                drow[c0 + i] = np.float32((b & 15) - 8)
                drow[c0 + half + i] = np.float32((b >> 4) - 8)


# -- int8 x int8 products (compute="int8") ----------------------------------------------------------------
# Each input row is quantised on the fly, symmetric, one scale per row (absmax / 127, round to
# nearest even), the integer products run on the dot-product instructions (`_dot_ir`: 4-row x
# 4-column tiles of vpdpbusd, int32 sums) and each output is sum * row scale * weight scale. The
# quantised rows, their sums and scales go to `work`, the runtime's widening scratch (the caller
# passes as many rows at a time as fit: `kernels.quantised_bytes`). `best` False runs the tiles
# built for `_dot_ir.FALLBACK` instead (what a CPU without VNNI runs; the tests compare both).
_tile = _dot_ir.make_tile({True: _dot_ir.ISA, False: _dot_ir.FALLBACK})
OFFSET_BEST, OFFSET_FALLBACK = _dot_ir.offset(_dot_ir.ISA), _dot_ir.offset(_dot_ir.FALLBACK)
WIDTH_BEST, WIDTH_FALLBACK = _dot_ir.width(_dot_ir.ISA), _dot_ir.width(_dot_ir.FALLBACK)
I4 = _dot_ir.INT4               # the tiles' kinds: I8 (the int8 storage format) and I4
assert _dot_ir.INT8 == I8
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


# -- fused step functions ---------------------------------------------------------------------------------
@njit(cache=True, **NON_FINITE_SAFE)
def add_rms_norm(x, delta, weight, eps, h):
    """x (R, C) += delta (R, C) (skipped when delta has no rows), then h = weight * x /
    sqrt(mean(x^2) + eps) per row: a residual add and the RMS norm after it, in one pass."""
    R, C = x.shape
    add = delta.shape[0] == R
    for r in range(R):
        xr, hr = x[r], h[r]
        if add:
            dr = delta[r]
            for c in range(C):
                xr[c] += dr[c]
        ss = np.float32(0.0)
        for c in range(C):
            ss += xr[c] * xr[c]
        inv = np.float32(1.0) / math.sqrt(ss / C + eps)
        for c in range(C):
            hr[c] = xr[c] * inv * weight[c]


@njit(cache=True, **NON_FINITE_SAFE)
def _attend_one(q, k, v, S, bias, ctx, b, h, scores):
    """One (row, head): softmax(q . k_j + bias_j) over keys j < S, then the weighted sum of v.
    k[b, h] and v[b, h] are C-contiguous (N, D) cache rows: numba then knows each key is
    contiguous and vectorises the dot products (on strided views it did not: 2.5x slower)."""
    D = k.shape[3]
    qv = q[b, h]
    kb, vb = k[b, h], v[b, h]
    brow = bias[b if bias.shape[0] > 1 else 0, h if bias.shape[1] > 1 else 0]
    top = -np.inf
    for j in range(S):
        kj = kb[j]
        acc = np.float32(0.0)
        for d in range(D):
            acc += qv[d] * kj[d]
        acc += brow[j]
        scores[j] = acc
        top = max(top, acc)
    total = np.float32(0.0)
    for j in range(S):
        e = np.exp(scores[j] - top)
        scores[j] = e
        total += e
    out = ctx[b, h]
    out[:] = 0.0
    inv = np.float32(1.0) / total
    for j in range(S):
        p = scores[j] * inv
        vj = vb[j]
        for d in range(D):
            out[d] += p * vj[d]


@njit(cache=True, **NON_FINITE_SAFE)
def attend_query(q, k, v, S, bias, ctx):
    """One query position per (row, head): q (B, H, D), the first S keys/values of C-contiguous
    caches (B, H, N, D), additive bias (Bb, Hb, >=S) broadcast over rows / heads when Bb / Hb is
    1, -> ctx (B, H, D). Softmax is max-subtracted: a fully masked row gives uniform weights,
    not NaN."""
    B, H = q.shape[0], q.shape[1]
    scores = np.empty(S, np.float32)
    for b in range(B):
        for h in range(H):
            _attend_one(q, k, v, S, bias, ctx, b, h, scores)


@njit(parallel=True, cache=True, **NON_FINITE_SAFE)
def attend_query_parallel(q, k, v, S, bias, ctx):
    """`attend_query` with the (row, head) pairs spread over the threads (large batches)."""
    B, H = q.shape[0], q.shape[1]
    for bh in prange(B * H):
        _attend_one(q, k, v, S, bias, ctx, bh // H, bh % H, np.empty(S, np.float32))


# Only ReLU is compiled: numba's exp / tanh / erf are scalar calls (no vector math library), so
# GELU and SiLU over a row ran 2-20x slower here than in NumPy's vectorised loops.
@njit(fastmath=True, cache=True)
def relu(hidden, F, gated):
    """In place over hidden (R, F | 2F): max(h, 0) for the first F columns, times the second F
    columns when `gated` (T5 v1.1's act(x W_0) * (x W_1))."""
    R = hidden.shape[0]
    for r in range(R):
        row = hidden[r]
        for c in range(F):
            a = max(row[c], np.float32(0.0))
            row[c] = a * row[F + c] if gated else a


# -- widening blocks of stored rows (the large-M products: BLAS multiplies the float copy) ----------------
# Serial and without the GIL: each part of a split product (kernels.split) widens its own rows on
# its own thread, then multiplies them with BLAS.
@njit(nogil=True, cache=True)
def _widen_rows(src, dst, fmt):
    R, K = src.shape
    for r in range(R):
        srow, drow = src[r], dst[r]
        for k in range(K):
            drow[k] = _widen(srow[k], fmt)


@njit(nogil=True, cache=True)
def widen_f16(src, dst):
    _widen_rows(src, dst, F16)


@njit(nogil=True, cache=True)
def widen_bf16(src, dst):
    _widen_rows(src, dst, BF16)


@njit(nogil=True, cache=True)
def widen_i8(src, dst):
    _widen_rows(src, dst, I8)


# -- decoding's host-side work ------------------------------------------------------------------------
@njit(cache=True)
def top_k(a, k, idx, val):
    """The k largest of each row of a (R, N), best first, ties in index order (what a stable
    descending sort gives): indices into idx (R, k), values into val (R, k). One pass per row,
    inserting into a sorted list only what beats its last entry."""
    R, N = a.shape
    for r in range(R):
        row, ir, vr = a[r], idx[r], val[r]
        filled = 0
        for n in range(N):
            v = row[n]
            if filled == k and not v > vr[k - 1]:
                continue
            j = filled if filled < k else k - 1
            while j > 0 and v > vr[j - 1]:   # strictly greater: equal values keep index order
                vr[j] = vr[j - 1]
                ir[j] = ir[j - 1]
                j -= 1
            vr[j] = v
            ir[j] = n
            if filled < k:
                filled += 1


@njit(parallel=True, cache=True)
def gather_rows(cache, rows, length):
    """cache (L, B, H, N, D): row b of every layer becomes old row rows[b] (b < len(rows)), for
    the first `length` positions; rows may repeat (beams following their parents)."""
    L, B, H, D = cache.shape[0], cache.shape[1], cache.shape[2], cache.shape[4]
    n = rows.shape[0]
    # only rows that change move (a beam that keeps its parent stays), and only the sources
    # they read are saved first (a source may itself be overwritten)
    slot = np.full(B, -1, np.int64)
    count = 0
    for b in range(n):
        if rows[b] != b and slot[rows[b]] < 0:
            slot[rows[b]] = count
            count += 1
    for l in prange(L):
        tmp = np.empty((count, H, length, D), cache.dtype)
        for r in range(B):
            if slot[r] >= 0:
                tmp[slot[r]] = cache[l, r, :, :length]
        for b in range(n):
            if rows[b] != b:
                cache[l, b, :, :length] = tmp[slot[rows[b]]]


def warm_up() -> None:
    """Compile (or load from the cache) every kernel for the array types the models use."""
    x, out = np.zeros((1, 4), np.float32), np.zeros((1, 2), np.float32)
    matmul_f32(x, np.zeros((2, 4), np.float32), out)
    matmul_f16(x, np.zeros((2, 4), np.uint16), out)
    matmul_bf16(x, np.zeros((2, 4), np.uint16), out)
    matmul_i8(x, np.zeros((2, 4), np.int8), np.ones(2, np.float32), out)
    add_rms_norm(np.ones((1, 4), np.float32), np.ones((1, 4), np.float32),
                 np.ones(4, np.float32), 1e-6, np.empty((1, 4), np.float32))
    relu(np.ones((1, 4), np.float32), 2, True)
    for widen in (widen_f16, widen_bf16):
        widen(np.zeros((1, 4), np.uint16), np.empty((1, 4), np.float32))
    widen_i8(np.zeros((1, 4), np.int8), np.empty((1, 4), np.float32))
    x64, out64 = np.zeros((1, 64), np.float32), np.zeros((1, 2), np.float32)  # (a 64-column block)
    nibbles, scales = np.zeros((2, 32), np.uint8), np.ones((2, 1), np.float32)
    matmul_i4(x64, nibbles, scales, out64)
    widen_i4(nibbles, np.empty((2, 64), np.float32))
    work = np.empty(4096, np.uint8)
    qmatmul_i8(x64, np.zeros((2, 64), np.int8), np.ones(2, np.float32), out64, work)
    qmatmul_i4(x64, nibbles, scales, out64, work)
    top_k(np.zeros((1, 4), np.float32), 2, np.empty((1, 2), np.int64), np.empty((1, 2), np.float32))
    cache = np.zeros((1, 1, 2, 2, 4), np.float32)        # (L, B, H, N, D)
    q, ctx = np.zeros((1, 2, 4), np.float32), np.empty((1, 2, 4), np.float32)
    # (Bb, Hb, S) bias: contiguous, or a strided view (the window of a longer causal table)
    biases = (np.zeros((1, 2, 2), np.float32), np.zeros((1, 2, 4), np.float32)[:, :, 2:])
    for attend in (attend_query, attend_query_parallel):
        for bias in biases:
            attend(q, cache[0], cache[0], 2, bias, ctx)
    gather_rows(cache, np.zeros(1, np.int64), 1)


# -- threads ---------------------------------------------------------------------------------------------
def set_threads(n: int) -> None:
    numba.set_num_threads(n)


def max_threads() -> int:
    return numba.config.NUMBA_NUM_THREADS
