"""The compiled kernels themselves (imported through kernels.py, which says what they are for).

Conventions: inputs are float32, C-contiguous; weights are (out, in) row-major in their stored
dtype (float32, float16 or bfloat16 as uint16 bits, int8 with float32 scales per row); outputs
are written in place. `fastmath` lets LLVM reorder the dot products' sums so it can vectorise
them (the order of a float32 sum differs from BLAS's by rounding, as BLAS's own does between
machines). Loops index slices from 0 (`range(n)` over a slice rather than `range(a, b)` over the
whole array), which spares the negative-index checks that stop LLVM vectorising.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

# A fast threading layer first: GNU OpenMP (libgomp) or TBB; "workqueue" is the slow fallback.
numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]

BLOCK = 32  # output rows per parallel task


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


# -- small-M products: out (M, N) = x (M, K) @ w (N, K).T ----------------------------------------------
@njit(parallel=True, fastmath=True, cache=True)
def matmul_f32(x, w, out):
    M, K = x.shape
    N = w.shape[0]
    for b in prange((N + BLOCK - 1) // BLOCK):
        n0 = b * BLOCK
        n1 = min(N, n0 + BLOCK)
        wb, ob = w[n0:n1], out[:, n0:n1]
        for i in range(n1 - n0):
            row = wb[i]
            for m in range(M):
                xm = x[m]
                acc = np.float32(0.0)
                for k in range(K):
                    acc += xm[k] * row[k]
                ob[m, i] = acc


@njit(parallel=True, fastmath=True, cache=True)
def matmul_f16(x, w, out):
    M, K = x.shape
    N = w.shape[0]
    for b in prange((N + BLOCK - 1) // BLOCK):
        n0 = b * BLOCK
        n1 = min(N, n0 + BLOCK)
        wb, ob = w[n0:n1], out[:, n0:n1]
        for i in range(n1 - n0):
            row = wb[i]
            for m in range(M):
                xm = x[m]
                acc = np.float32(0.0)
                for k in range(K):
                    acc += xm[k] * _f16(row[k])
                ob[m, i] = acc


@njit(parallel=True, fastmath=True, cache=True)
def matmul_bf16(x, w, out):
    M, K = x.shape
    N = w.shape[0]
    for b in prange((N + BLOCK - 1) // BLOCK):
        n0 = b * BLOCK
        n1 = min(N, n0 + BLOCK)
        wb, ob = w[n0:n1], out[:, n0:n1]
        for i in range(n1 - n0):
            row = wb[i]
            for m in range(M):
                xm = x[m]
                acc = np.float32(0.0)
                for k in range(K):
                    acc += xm[k] * _bf16(row[k])
                ob[m, i] = acc


@njit(parallel=True, fastmath=True, cache=True)
def matmul_i8(x, w, scale, out):
    M, K = x.shape
    N = w.shape[0]
    for b in prange((N + BLOCK - 1) // BLOCK):
        n0 = b * BLOCK
        n1 = min(N, n0 + BLOCK)
        wb, sb, ob = w[n0:n1], scale[n0:n1], out[:, n0:n1]
        for i in range(n1 - n0):
            row = wb[i]
            s = sb[i]
            for m in range(M):
                xm = x[m]
                acc = np.float32(0.0)
                for k in range(K):
                    acc += xm[k] * np.float32(row[k])
                ob[m, i] = acc * s


def warm_up() -> None:
    x, out = np.zeros((1, 4), np.float32), np.zeros((1, 2), np.float32)
    matmul_f32(x, np.zeros((2, 4), np.float32), out)
    matmul_f16(x, np.zeros((2, 4), np.uint16), out)
    matmul_bf16(x, np.zeros((2, 4), np.uint16), out)
    matmul_i8(x, np.zeros((2, 4), np.int8), np.ones(2, np.float32), out)


# -- threads ---------------------------------------------------------------------------------------------
def set_threads(n: int) -> None:
    numba.set_num_threads(n)


def max_threads() -> int:
    return numba.config.NUMBA_NUM_THREADS
