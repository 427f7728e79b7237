"""The softmax of a row of a pass's attention scores with T5's position bias read from its
distance table: what the compiled encoder attentions (pass_attention_float.py in float32,
pass_attention.py in bfloat16) run on each row of a block of scores, instead of a (B, H, T, S)
bias tensor and five NumPy passes.

T5's position bias depends only on the key's distance from the query (and the head), so a pass
of T queries over S keys needs one row of T + S - 1 values per head, `table[h, j - i + T - 1]`,
not the (H, T, S) matrix built from it: the encoder then keeps no (B, H, T, T) bias buffer (64
MiB a batch row for T5-XXL's 64 heads over 512 tokens) and reads the bias from L1 while the
row is there. Each row (S float32s, in L1) takes three sweeps: scores + bias + key mask and
their maximum, the exponentials and their sum, the division.

The exponential is written out (`_exp_nonpositive`) so that LLVM vectorises the sweep: numba's
exp is a scalar libm call (no SVML here), about ten times NumPy's vector loop per element.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .step_ops import NON_FINITE_SAFE

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
def _exp_nonpositive(x):
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


@intrinsic
def _ordered_bits(typingctx, v):
    """float32 -> an int32 that orders as the float does: its bits, the others than the sign
    flipped for a negative value (-0 just below +0; a NaN with the sign clear above +inf, one
    with it set below -inf). Its own inverse (`_ordered_float`). In IR: an integer maximum
    vectorises (vpmaxsd), a float one with NaN semantics does not."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        flip = builder.and_(builder.ashr(bits, ir.Constant(i32, 31)), ir.Constant(i32, 0x7FFFFFFF))
        return builder.xor(bits, flip)
    return types.int32(types.float32), codegen


@intrinsic
def _ordered_float(typingctx, v):
    """The float32 of `_ordered_bits`' int32."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        flip = builder.and_(builder.ashr(args[0], ir.Constant(i32, 31)), ir.Constant(i32, 0x7FFFFFFF))
        return builder.bitcast(builder.xor(args[0], flip), ir.FloatType())
    return types.float32(types.int32), codegen


@njit(inline="always")
def _largest(row, S):
    """max(row[:S]) as an integer maximum of the ordered bits (`_ordered_bits`), which LLVM
    vectorises, where the float loop does not (benchmarks/README.md, "Measurements behind
    constants in the code"). A NaN with its sign set is not the maximum, but the sum of exponentials still
    has its NaN term, so the row becomes NaN, as NumPy's softmax makes it."""
    top = np.int32(-2147483648)
    for j in range(S):
        top = max(top, _ordered_bits(row[j]))
    return _ordered_float(top)


@njit(inline="always", **NON_FINITE_SAFE)
def _exponentials(row, bias, mask, S):
    """row[:S] = exp(row + bias + mask - their maximum) in place (bias, mask: the row's S
    values); returns 1 / their sum, the softmax's scale."""
    for j in range(S):
        row[j] += bias[j] + mask[j]
    top = _largest(row, S)
    total = np.float32(0.0)
    for j in range(S):
        e = _exp_nonpositive(row[j] - top)
        row[j] = e
        total += e
    return np.float32(1.0) / total


@njit(inline="always", **NON_FINITE_SAFE)
def _softmax_row(row, bias, mask, S):
    """row[:S] = softmax(row + bias + mask) in place (bias, mask: the row's S values)."""
    inv = _exponentials(row, bias, mask, S)
    for j in range(S):
        row[j] *= inv
