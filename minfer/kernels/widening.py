"""Widening stored weight bits to float32: in registers inside the products (`widen`), and whole
blocks of rows for the large products, which BLAS then multiplies (the `widen_*` kernels).

numba has no CPU float16 type: float16 and bfloat16 arrive as their uint16 bits. The storage
formats are compile-time constants, so a kernel specialises its body per format and folds the
branch away.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

F32, F16, BF16, I8 = 0, 1, 2, 3  # storage formats (compile-time constants)
E4M3, E5M2 = 4, 5                # fp8 codes (io/formats.py's float8_e4m3 / float8_e5m2)


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


@intrinsic
def _e5m2(typingctx, code):
    """fp8 E5M2 code (uint8) -> float32: the top byte of a float16 (infinities and NaNs too)."""
    def codegen(context, builder, signature, args):
        i16 = ir.IntType(16)
        bits = builder.shl(builder.zext(args[0], i16), ir.Constant(i16, 8))
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())
    return types.float32(types.uint8), codegen


def _e4m3_ir(builder, code, exact):
    """fp8 E4M3 code (uint8) -> float32: shifted left 7, its 7 magnitude bits sit at bit 7 of a
    float16 that reads as the value / 2^8 (exponent bias 15 for 7, subnormals included) and its
    sign at bit 14, which adding that bit to itself carries to bit 15 (3 integer operations in 16
    bits); times 256 when `exact`; S.1111.111 (E4M3's only NaN, no infinities) selected to NaN.
    LLVM vectorises it (vcvtph2ps with F16C)."""
    i16 = ir.IntType(16)
    shifted = builder.shl(builder.zext(code, i16), ir.Constant(i16, 7))
    bits = builder.add(shifted, builder.and_(shifted, ir.Constant(i16, 0x4000)))
    value = builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())
    if exact:
        value = builder.fmul(value, ir.Constant(ir.FloatType(), 256.0))
    nan = builder.icmp_unsigned("==", builder.and_(shifted, ir.Constant(i16, 0x3F80)),
                                ir.Constant(i16, 0x3F80))
    return builder.select(nan, ir.Constant(ir.FloatType(), float("nan")), value)


@intrinsic
def _e4m3(typingctx, code):
    """fp8 E4M3 code (uint8) -> its value, float32 (exact)."""
    def codegen(context, builder, signature, args):
        return _e4m3_ir(builder, args[0], True)
    return types.float32(types.uint8), codegen


@intrinsic
def _e4m3_over_256(typingctx, code):
    """fp8 E4M3 code (uint8) -> its value / 2^8, float32 (exact): a product that scales its
    outputs anyway takes the 2^8 there (`unit_factor`), one multiply an output, not a weight."""
    def codegen(context, builder, signature, args):
        return _e4m3_ir(builder, args[0], False)
    return types.float32(types.uint8), codegen


@njit(inline="always")
def widen(v, fmt):
    if fmt == F16:
        return _f16(v)
    if fmt == BF16:
        return _bf16(v)
    if fmt == E4M3:
        return _e4m3(v)
    if fmt == E5M2:
        return _e5m2(v)
    return np.float32(v)


@njit(inline="always")
def widen_unit(v, fmt):
    """`widen` up to a power-of-two factor, `unit_factor(fmt)`, that the caller multiplies its
    scaled outputs by (E4M3: 2^8; every other format: 1, the value itself)."""
    if fmt == E4M3:
        return _e4m3_over_256(v)
    return widen(v, fmt)


@njit(inline="always")
def unit_factor(fmt):
    return np.float32(256.0) if fmt == E4M3 else np.float32(1.0)



# -- widening blocks of stored rows (the large-M products: BLAS multiplies the float copy) ----------------
# Serial and without the GIL: each part of a split product (kernels.split) widens its own rows on
# its own thread, then multiplies them with BLAS.
@njit(nogil=True, cache=True)
def widen_rows(src, dst, fmt):
    R, K = src.shape
    for r in range(R):
        srow, drow = src[r], dst[r]
        for k in range(K):
            drow[k] = widen(srow[k], fmt)


@njit(nogil=True, cache=True)
def widen_f16(src, dst):
    widen_rows(src, dst, F16)


@njit(nogil=True, cache=True)
def widen_bf16(src, dst):
    widen_rows(src, dst, BF16)


@njit(nogil=True, cache=True)
def widen_i8(src, dst):
    widen_rows(src, dst, I8)



@njit(nogil=True, cache=True)
def widen_e4m3(src, dst):
    widen_rows(src, dst, E4M3)


@njit(nogil=True, cache=True)
def widen_e5m2(src, dst):
    widen_rows(src, dst, E5M2)


@njit(nogil=True, cache=True)
def _widen_nibble_rows(src, dst, bias):
    """Rows of two-codes-a-byte bytes (io/formats.py's int4 layout) -> their codes minus `bias`,
    as floats (unscaled)."""
    R, K = dst.shape
    for r in range(R):
        srow, drow = src[r], dst[r]
        for blk in range(K // 64):
            s, d = srow[blk * 32:blk * 32 + 32], drow[blk * 64:blk * 64 + 64]
            for i in range(32):
                b = np.int32(s[i])
                d[i] = np.float32((b & 15) - bias)
                d[32 + i] = np.float32((b >> 4) - bias)
        tail = K % 64                    # a last partial block pairs column c with c + tail / 2
        if tail:
            half, c0 = tail // 2, K - tail
            for i in range(half):
                b = np.int32(srow[c0 // 2 + i])
                drow[c0 + i] = np.float32((b & 15) - bias)
                drow[c0 + half + i] = np.float32((b >> 4) - bias)


@njit(nogil=True, cache=True)
def widen_i4(src, dst):
    """Rows of an int4 matrix -> their values q (float, unscaled; the nibbles hold q + 8): the
    block-widened products apply the group scales after, as they apply int8's row scales."""
    _widen_nibble_rows(src, dst, 8)


@njit(nogil=True, cache=True)
def widen_i4g(src, dst):
    """Rows of a grouped int4 matrix -> their codes 0..15 (float): the block-widened products
    then apply each group's scale and offset (formats.apply_scale)."""
    _widen_nibble_rows(src, dst, 0)
