"""A float32 panel tile in LLVM IR: the inner loop of the encoder's float32 attention
(pass_attention_float.py). As the integer and bfloat16 panel tiles (tiles.py, bfloat16_tiles.py),
lane j of an accumulator is one output whole: each step loads one row of the right-hand matrix
(P vectors of 16 lanes: 16 P output columns) and broadcasts one column of each of C input
rows, C x P fused multiply-adds (`llvm.fmuladd`: vfmadd231ps where the CPU has FMA), so the
epilogue is a masked store per 16 outputs, no lane sums.

Unlike those tiles it reads both operands where they are (no repacking into panels): the input
rows and the right-hand matrix's rows at any row stride, their columns contiguous. numba alone
does not keep a C x P block of vector accumulators in registers (it spills a loop's arrays), so
the loop is built here.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .attention_layout import FLOAT_LANES as LANES   # float32 lanes of a 512-bit vector (LLVM
                                                      # splits them where the CPU's are narrower)
from .tiles import F32, I32, I64, _declare, _lane_masks, _load_vec, _loop, _rows, _splat, _vec, literals
PANEL = 64                 # the widest panel: 4 vectors (16 accumulators at 4 input rows)


def _panel_codegen(P, C, context, builder, a, args):
    """out[om + c, oc + 16 p + j] = the sum over k < K of x[m + c, k] * w[k, n0 + 16 p + j], for
    c < C, p < P, 16 p + j < valid (the other lanes are read from w but not stored)."""
    (x, m, K, w, n0, valid, out, om, oc) = args
    xp = _rows(context, builder, a[0], x, m, C)
    wary = context.make_array(a[3])(context, builder, w)
    wstride = builder.extract_value(wary.strides, 0)
    wbase = builder.bitcast(wary.data, ir.IntType(8).as_pointer())
    fty = _vec(F32, LANES)
    fma = _declare(builder, f"llvm.fmuladd.v{LANES}f32", fty, fty, fty, fty)

    def body(b, k, accs):
        row = b.bitcast(b.gep(wbase, [b.mul(k, wstride)]), F32.as_pointer())
        wv = [_load_vec(b, row, b.add(n0, ir.Constant(I64, p * LANES)), fty) for p in range(P)]
        accs = list(accs)
        for c in range(C):
            xv = _splat(b, b.load(b.gep(xp[c], [k])), LANES)
            for p in range(P):
                accs[c * P + p] = b.call(fma, [xv, wv[p], accs[c * P + p]])
        return accs

    accs = _loop(builder, K, [ir.Constant(fty, None)] * (C * P), body)
    outp = _rows(context, builder, a[6], out, om, C)
    mstore, lane_mask = _lane_masks(builder, valid, LANES)
    for p in range(P):
        mask = lane_mask(p * LANES)
        for c in range(C):
            at = builder.gep(outp[c], [builder.add(oc, ir.Constant(I64, p * LANES))])
            builder.call(mstore, [accs[c * P + p], builder.bitcast(at, fty.as_pointer()),
                                  ir.Constant(I32, 4), mask])


@intrinsic
def panel(typingctx, P, C, x, m, K, w, n0, valid, out, om, oc):
    """out[om + c, oc + 16 p + j] = x[m + c, :K] . w[:K, n0 + 16 p + j] for c < C, p < P and
    16 p + j < valid (see `_panel_codegen`). x, w, out: 2-D float32 arrays whose columns are
    contiguous (rows at any stride); w's rows must be readable across all 16 P lanes from n0.
    P (1-4) and C (1-4) are compile-time constants."""
    panels, cols = literals(P, C)
    i64 = types.int64
    sig = types.none(P, C, x, i64, i64, w, i64, i64, out, i64, i64)

    def codegen(context, builder, signature, args):
        _panel_codegen(panels, cols, context, builder, signature.args[2:], args[2:])
        return context.get_dummy_value()
    return sig, codegen
