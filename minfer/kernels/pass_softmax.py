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

The exponential is `vector_math.exp_nonpositive`, written out so that LLVM vectorises the sweep.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .vector_math import NON_FINITE_SAFE, exp_nonpositive


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
        e = exp_nonpositive(row[j] - top)
        row[j] = e
        total += e
    return np.float32(1.0) / total


@njit(inline="always", **NON_FINITE_SAFE)
def _softmax_row(row, bias, mask, S):
    """row[:S] = softmax(row + bias + mask) in place (bias, mask: the row's S values)."""
    inv = _exponentials(row, bias, mask, S)
    for j in range(S):
        row[j] *= inv
