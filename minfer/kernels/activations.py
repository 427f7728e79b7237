"""The feed-forward's activation over the rows of its hidden state, compiled: act(h) for the
first F columns, times the second F when the FF is gated (T5 v1.1, flan, mT5, UMT5: act(x W_0) *
(x W_1)), in place; or, in front of an int8 x int8 product, quantised straight into that
product's scratch (`activate_quantised`), as the fused norm does (quantised_products.py), so
the activated float rows are never written.

GELU (tanh or erf) and SiLU are written in `vector_math`'s vectorisable arithmetic: in NumPy a
gated GELU was nine passes over (rows, 2F) floats on one thread, a quarter of a v1.1-shaped int8
encoder pass (benchmarks/README.md, "Compiled activations").
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.np.ufunc.parallel import _iget_num_threads

from .activation_formulas import GELU_TANH_CUBIC, SQRT_2_OVER_PI
from .quantised_products import _carve, _place, _quantise_row
from .vector_math import NON_FINITE_SAFE, normal_cdf, sigmoid

# The kinds the kernels compile (`ACTIVATION_KINDS` names them by HF's activation names)
RELU, GELU_TANH, GELU_ERF, SILU = 0, 1, 2, 3
ACTIVATION_KINDS = {"relu": RELU, "gelu_new": GELU_TANH, "gelu_pytorch_tanh": GELU_TANH,
                    "gelu_fast": GELU_TANH, "gelu": GELU_ERF, "silu": SILU, "swish": SILU}
# Elements of the activated rows from which the rows run over the threads: a GELU or SiLU
# element costs several times a ReLU's, so two threads win from two decoding rows of a gated
# 2,048-wide FF on (benchmarks/README.md, "Measurements behind constants"); ReLU keeps the
# norm's threshold.
ACTIVATE_PARALLEL, RELU_PARALLEL = 1 << 12, 1 << 16
# `activate` then the product's own quantisation, and `activate_quantised`, must give the same
# bytes: both call one compiled row function (`_activate_row`, not inlined), so the fast-math
# contraction it takes is the same machine code in both; their own loops only copy and quantise
# (the quantisation as the products compile it: no fast-math). numpy's error model keeps a
# division by zero inf, never an exception.
STRICT = dict(error_model="numpy")

# gelu_tanh(x) = x (1 + tanh(y)) / 2 = x sigmoid(2 y), y = sqrt(2 / pi) (x + GELU_TANH_CUBIC x^3)
_TWO_C = np.float32(2.0 * SQRT_2_OVER_PI)
_TWO_C_CUBE = np.float32(2.0 * SQRT_2_OVER_PI * GELU_TANH_CUBIC)


@njit(cache=True, **NON_FINITE_SAFE)
def _activate_row(src, F, gated, kind, dst):
    """dst[:F] = act(src[:F]) (* src[F:2F] when gated). One loop per kind (a branch on the kind
    inside the loop would keep it scalar; `numba.literally` would cost a dispatch each call from
    Python). dst is another row than src (a thread's own, in L1): writing over src itself would
    make LLVM's overlap check take the scalar loop."""
    if kind == GELU_TANH:
        for c in range(F):
            v = src[c]
            dst[c] = v * sigmoid(v * (_TWO_C + _TWO_C_CUBE * (v * v)))
    elif kind == GELU_ERF:
        for c in range(F):
            dst[c] = src[c] * normal_cdf(src[c])
    elif kind == SILU:
        for c in range(F):
            dst[c] = src[c] * sigmoid(src[c])
    else:
        for c in range(F):
            dst[c] = max(src[c], np.float32(0.0))
    if gated:
        for c in range(F):
            dst[c] *= src[F + c]


@njit(inline="always", **STRICT)
def _rows_in_place(hidden, F, gated, kind, r0, r1):
    h = np.empty(F, np.float32)
    for r in range(r0, r1):
        row = hidden[r]
        _activate_row(row, F, gated, kind, h)
        row[:F] = h


@njit(parallel=True, cache=True, **STRICT)
def activate(hidden, F, gated, kind):
    """In place over hidden (R, F | 2F): its first F columns become act(h) (times the second F
    when `gated`); kind: RELU, GELU_TANH, GELU_ERF or SILU. An encoder pass's rows over the
    threads, a decoding step's few on this one."""
    R = hidden.shape[0]
    if R * F < (RELU_PARALLEL if kind == RELU else ACTIVATE_PARALLEL):
        _rows_in_place(hidden, F, gated, kind, 0, R)
        return
    tasks = min(R, 4 * _iget_num_threads())
    for t in prange(tasks):
        _rows_in_place(hidden, F, gated, kind, t * R // tasks, (t + 1) * R // tasks)


@njit(inline="always", **STRICT)
def _rows_quantised(hidden, F, gated, kind, xq, sums, sx, G, r0, r1):
    R = hidden.shape[0]
    h = np.empty(F, np.float32)
    for r in range(r0, r1):
        _activate_row(hidden[r], F, gated, kind, h)
        base, _, ss, tb, _ = _place(R, F, r)
        sx[r] = _quantise_row(h, xq, base, ss, tb, sums[r], G)


@njit(parallel=True, cache=True, **STRICT)
def activate_quantised(hidden, F, gated, kind, work, groups):
    """The activated rows of hidden (R, F | 2F), as `activate` computes them, quantised into
    `work` exactly as the int8 product in front of which they go would quantise them
    (`quantised_products._carve`'s parts, `groups` sums a row); hidden is left as it was. That
    product then takes them with `ready`."""
    R = hidden.shape[0]
    xq, sums, sx = _carve(work, R, F, groups)
    G = F // groups
    if R * F < (RELU_PARALLEL if kind == RELU else ACTIVATE_PARALLEL):
        _rows_quantised(hidden, F, gated, kind, xq, sums, sx, G, 0, R)
        return
    tasks = min(R, 4 * _iget_num_threads())
    for t in prange(tasks):
        _rows_quantised(hidden, F, gated, kind, xq, sums, sx, G, t * R // tasks,
                        (t + 1) * R // tasks)
