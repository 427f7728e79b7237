"""Elementary functions written out in arithmetic LLVM vectorises: numba's exp / tanh / erf are
scalar libm calls (no SVML here), about ten times NumPy's vector loops per element, so a
compiled sweep that called them lost to NumPy. The softmax of the pass attentions
(pass_softmax.py), the decoding steps' attention (step_ops.py) and the FF's activations
(activations.py) are built on these; NON_FINITE_SAFE, the compile flags of the float kernels.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from . import activation_formulas

# The float kernels take fastmath's reassociation (which vectorises their sums) but not its "no
# NaN / no inf" assumptions, and NumPy's error model (x / 0 is inf, not ZeroDivisionError): an
# overflowed score must come out as NaN logits, which generation names in a one-line error, never
# as a raw exception from inside a kernel or a finite value LLVM made up.
NON_FINITE_SAFE = dict(fastmath={"reassoc", "contract", "arcp", "nsz", "afn"}, error_model="numpy")

# exp(x) for x <= 0 as 2^n * e^r, n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its Taylor series
# to r^7 / 7! (relative error below 3e-8 there: under float32's rounding). x below EXP_FLOOR
# (e^-87.3, float32's smallest normal number) gives 0, as it gives a padded key (NumPy would give
# a subnormal down to e^-103.9: against the row maximum's 1 such a term is lost in the sum), so
# that 2^n stays a normal number, which the exponent bits can hold.
LOG2_E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693145751953125)      # ln 2 split so that n * LN2_HI is exact for |n| < 2^9
LN2_LO = np.float32(1.4286068203094173e-06)
EXP_FLOOR = np.float32(-87.33654)           # 2^-126 * e^(tiny): the smallest normal result
_TAYLOR = tuple(np.float32(1.0 / f) for f in (5040.0, 720.0, 120.0, 24.0, 6.0, 2.0, 1.0, 1.0))


@intrinsic
def _pow2(typingctx, n):
    """2^n for an integral float32 n in [-126, 127]: n + 127 placed in the exponent bits (in IR,
    so the sweep vectorises: numba's own integer arithmetic widens to int64)."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        biased = builder.add(builder.fptosi(args[0], i32), ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(biased, ir.Constant(i32, 23)), ir.FloatType())
    return types.float32(types.float32), codegen


@njit(inline="always", **NON_FINITE_SAFE)
def exp_nonpositive(x):
    """e^x for x <= 0 (a score minus its row's maximum), 0 below EXP_FLOOR; NaN stays NaN
    (through r: the exponent n is taken from 0 instead, an integer conversion of NaN being
    undefined in LLVM)."""
    small = x < EXP_FLOOR
    y = EXP_FLOOR if small else x
    n = np.floor((y if y == y else np.float32(0.0)) * LOG2_E + np.float32(0.5))
    r = (y - n * LN2_HI) - n * LN2_LO
    p = _TAYLOR[0]
    for c in _TAYLOR[1:]:
        p = p * r + c
    return np.float32(0.0) if small else p * _pow2(n)


@njit(inline="always", **NON_FINITE_SAFE)
def sigmoid(z):
    """1 / (1 + e^-z) through e = e^-|z| <= 1: 1 / (1 + e) for z >= 0, e / (1 + e) below, so
    that neither side subtracts nearly equal numbers (relative error a few float32 roundings
    everywhere; 0 below z = -87.3, where e^-|z| is taken as 0). NaN stays NaN."""
    e = exp_nonpositive(-abs(z))
    s = np.float32(1.0) / (np.float32(1.0) + e)
    return s if z >= np.float32(0.0) else e * s


# erfc(a) for a >= 0 as Abramowitz & Stegun 7.1.26 gives it (activation_formulas.ERF_*), without
# ops.erf's 1 - erfc for negative x
ERF_P = np.float32(activation_formulas.ERF_P)
_ERF_A = tuple(np.float32(a) for a in reversed(activation_formulas.ERF_A))   # (Horner's order)
INV_SQRT_2 = np.float32(1.0 / math.sqrt(2.0))


@njit(inline="always", **NON_FINITE_SAFE)
def normal_cdf(x):
    """Phi(x) = (1 + erf(x / sqrt 2)) / 2 = 1 - erfc(|x| / sqrt 2) / 2 for x >= 0, and
    erfc(|x| / sqrt 2) / 2 below (no cancellation in the tail). NaN stays NaN."""
    a = abs(x) * INV_SQRT_2
    t = np.float32(1.0) / (np.float32(1.0) + ERF_P * a)
    p = _ERF_A[0]
    for c in _ERF_A[1:]:
        p = p * t + c
    half_tail = np.float32(0.5) * p * t * exp_nonpositive(-(a * a))
    return np.float32(1.0) - half_tail if x >= np.float32(0.0) else half_tail
