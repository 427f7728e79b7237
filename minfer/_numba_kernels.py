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

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

# A fast threading layer first: GNU OpenMP (libgomp) or TBB; "workqueue" is the slow fallback.
numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]

BLOCK = 32                      # output rows per parallel task
F32, F16, BF16, I8 = 0, 1, 2, 3  # storage formats (compile-time constants)
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
        row_f = np.empty(K, np.float32)  # a weight row widened once, then used by every x row
        for i in range(n1 - n0):
            row = wb[i]
            for k in range(K):
                row_f[k] = _widen(row[k], fmt)
            s = scale[n0 + i] if scaled else np.float32(1.0)
            m = 0
            while m + 4 <= M:            # four x rows share each load of the weight row
                x0, x1, x2, x3 = x[m], x[m + 1], x[m + 2], x[m + 3]
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for k in range(K):
                    t = row_f[k]
                    a0 += x0[k] * t
                    a1 += x1[k] * t
                    a2 += x2[k] * t
                    a3 += x3[k] * t
                ob[m, i], ob[m + 1, i], ob[m + 2, i], ob[m + 3, i] = a0 * s, a1 * s, a2 * s, a3 * s
                m += 4
            while m < M:
                xm = x[m]
                acc = np.float32(0.0)
                for k in range(K):
                    acc += xm[k] * row_f[k]
                ob[m, i] = acc * s
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


# -- fused step functions ---------------------------------------------------------------------------------
@njit(fastmath=True, cache=True)
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


@njit(fastmath=True, cache=True)
def _attend_one(q, k, v, bias, ctx, b, h):
    """One (row, head): softmax(q . k_j + bias_j) over keys j, then the weighted sum of v."""
    S, D = k.shape[2], k.shape[3]
    qv = q[b, h]
    kb, vb = k[b, h], v[b, h]
    brow = bias[b if bias.shape[0] > 1 else 0, h if bias.shape[1] > 1 else 0]
    scores = np.empty(S, np.float32)
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
    for j in range(S):
        p = scores[j] / total
        vj = vb[j]
        for d in range(D):
            out[d] += p * vj[d]


@njit(fastmath=True, cache=True)
def attend_query(q, k, v, bias, ctx):
    """One query position per (row, head): q (B, H, D), keys/values (B, H, S, D) (views of a KV
    cache), additive bias (Bb, Hb, S) broadcast over rows / heads when Bb / Hb is 1, -> ctx
    (B, H, D). Softmax is max-subtracted: a fully masked row gives uniform weights, not NaN."""
    B, H = q.shape[0], q.shape[1]
    for b in range(B):
        for h in range(H):
            _attend_one(q, k, v, bias, ctx, b, h)


@njit(parallel=True, fastmath=True, cache=True)
def attend_query_parallel(q, k, v, bias, ctx):
    """`attend_query` with the (row, head) pairs spread over the threads (large batches)."""
    B, H = q.shape[0], q.shape[1]
    for bh in prange(B * H):
        _attend_one(q, k, v, bias, ctx, bh // H, bh % H)


_RELU, _GELU_TANH, _GELU_ERF, _SILU = 0, 1, 2, 3
ACTIVATION_IDS = {"relu": _RELU, "gelu_new": _GELU_TANH, "gelu_pytorch_tanh": _GELU_TANH,
                  "gelu_fast": _GELU_TANH, "gelu": _GELU_ERF, "silu": _SILU, "swish": _SILU}
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@njit(inline="always")
def _activate(a, kind):
    if kind == _RELU:
        return max(a, np.float32(0.0))
    if kind == _GELU_TANH:
        return 0.5 * a * (1.0 + math.tanh(_SQRT_2_OVER_PI * (a + 0.044715 * a * a * a)))
    if kind == _GELU_ERF:
        return 0.5 * a * (1.0 + math.erf(a * 0.7071067811865476))
    return a / (1.0 + math.exp(-a))


@njit(fastmath=True, cache=True)
def activate(hidden, F, kind, gated):
    """In place over hidden (R, F | 2F): act(h) for the first F columns, times the second F
    columns when `gated` (T5 v1.1's act(x W_0) * (x W_1))."""
    R = hidden.shape[0]
    for r in range(R):
        row = hidden[r]
        for c in range(F):
            a = _activate(row[c], kind)
            row[c] = a * row[F + c] if gated else a


def warm_up() -> None:
    """Compile (or load from the cache) every kernel for the array types the models use."""
    x, out = np.zeros((1, 4), np.float32), np.zeros((1, 2), np.float32)
    matmul_f32(x, np.zeros((2, 4), np.float32), out)
    matmul_f16(x, np.zeros((2, 4), np.uint16), out)
    matmul_bf16(x, np.zeros((2, 4), np.uint16), out)
    matmul_i8(x, np.zeros((2, 4), np.int8), np.ones(2, np.float32), out)
    add_rms_norm(np.ones((1, 4), np.float32), np.ones((1, 4), np.float32),
                 np.ones(4, np.float32), 1e-6, np.empty((1, 4), np.float32))
    for kind in set(ACTIVATION_IDS.values()):
        activate(np.ones((1, 4), np.float32), 2, kind, True)


# -- threads ---------------------------------------------------------------------------------------------
def set_threads(n: int) -> None:
    numba.set_num_threads(n)


def max_threads() -> int:
    return numba.config.NUMBA_NUM_THREADS
