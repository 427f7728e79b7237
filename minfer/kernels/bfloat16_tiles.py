"""bfloat16 dot-product tiles written in LLVM IR: the inner loops of `compute="bfloat16"`
(imported by bfloat16_products.py, which says what the products are for).

A tile takes R weight rows and C activation rows, both bfloat16 bits (uint16) laid out along K,
and writes their R x C dot products in float32. Each row pair's sum is kept in one 16-lane
float32 vector for the whole inner loop, lane j holding the products of columns 2j and 2j + 1
of every 32-column step, and the lanes are summed once at the end, all R x C together
(`tiles._fold`, as the integer tiles do). numba has no vector types, so the loops are built here
through numba's `intrinsic`, around `llvm.x86.avx512bf16.dpbf16ps.512` (IntrinsicsX86.td in
LLVM 22, the LLVM of llvmlite 0.50 / numba 0.68: <16 x float> (<16 x float>, <32 x bfloat>,
<32 x bfloat>); LLVM 17 and older declared the pairs as <16 x i32>, which LLVM 22 still
upgrades): `vdpbf16ps` multiplies 32 bfloat16 pairs and adds each lane's two products to its
float32 lane. The activations come in groups of 4 rows interleaved step by step (`_group_rows`:
a 4-row tile reads them as one sequential stream). Checked in the assembly (`inspect_asm`,
LLVM 22, znver4): the 4 x 4 tile's loop is, per 32 columns, 4 weight-row loads, 4 activation
loads (consecutive 64-byte lines) and 16 vdpbf16ps zmm on registers, unrolled 4 steps an
iteration (64 vdpbf16ps, 32 vmovups, 2 adds and a branch); the 1 x 4 tile (the first pass
over a block of weights) keeps 2 accumulators per pair (`_chains`), one weight-row load and 4
vdpbf16ps with the activations as memory operands per step; the fallback's 4 x 4 loop is 8
loads, 8 vpslld, 8 vpandq and 32 vfmadd231ps per step. The K tail is one more step with
{k}-masked vmovdqu16 loads.

Which instructions: the CPU numba compiles for (the host unless NUMBA_CPU_NAME /
NUMBA_CPU_FEATURES name another) decides once, in `ISA`: "avx512bf16" (Cooper Lake, Sapphire
Rapids and later Xeons, AMD Zen 4 and later), else `FALLBACK`, "widen": the same tile in plain
IR, each 32-bit lane's two bfloat16 values widened to float32 by a shift and a mask (a bfloat16
is the high half of its float32) and two multiply-adds (`llvm.fmuladd`: one FMA each where the
CPU has FMA; LLVM vectorises it for whatever vectors the CPU has). Both compute the same
function up to the order of the float32 sum: a bfloat16 x bfloat16 product has 16 significant
bits and is exact in float32, so only the additions round. Two differences of the instruction,
documented by Intel: vdpbf16ps treats denormal inputs as zero and flushes denormal results to
zero (the fallback keeps them), and it does not consult MXCSR (round to nearest even always).
No tile is built for instructions the CPU lacks (LLVM aborts the process: "Cannot select").

The K tail (K not a multiple of 32) is one more step with masked loads (`llvm.masked.load`,
zeros in the lanes past K), so rows are never read past their end and nothing past K enters a
sum (a zero weight past the end would still turn an infinite activation into NaN).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .tiles import (
    literals,
    F32,
    I16,
    I32,
    I64,
    _declare,
    _elem,
    _fold,
    _lane_masks,
    _load_vec,
    _loop,
    _rows,
    _splat,
    _target_features,
    _tile_vector,
    _vec,
)


class _BFloat(ir.Type):
    """LLVM's `bfloat` (llvmlite has no such type): only ever the element of the vectors the
    dot-product intrinsic takes, made by bitcasting 16-bit integers."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash(_BFloat)


# Each build of the tiles, best first, with the CPU features it needs.
NEEDS = {"avx512bf16": {"avx512bf16", "avx512f", "avx512bw"}, "widen": set()}
STEP = 32                  # columns (bfloat16 values) one step of a tile consumes: 64 bytes
GROUP = 4                  # activation rows interleaved step by step (`_group_rows`)
LANES = 16                 # float32 lanes of an accumulator


def runnable(features: set[str]) -> list[str]:
    """The builds of the tiles a CPU with `features` can run, best first."""
    return [isa for isa, needs in NEEDS.items() if needs <= features]


_FEATURES = _target_features()
ISA = runnable(_FEATURES)[0]          # what the kernels use
FALLBACK = "widen"                    # what a CPU without AVX512_BF16 uses (and the tests here)


def describe() -> str:
    """Which instructions the bfloat16 products run on (`minfer info`)."""
    return {"avx512bf16": "AVX-512 BF16 (vdpbf16ps, 512-bit)",
            "widen": "no bfloat16 dot-product instructions (widened to float32, FMA)"}[ISA]


# -- one step: acc + the products of 32 bfloat16 pairs -------------------------------------------------
def _dot2(builder, acc, w, x, isa):
    """acc (<16 x float>) + w * x for w, x <32 x i16> bfloat16 bits, lane j taking the products
    of elements 2j and 2j + 1."""
    if isa == "avx512bf16":
        pairs = _vec(_BFloat(), STEP)
        fn = _declare(builder, "llvm.x86.avx512bf16.dpbf16ps.512", acc.type, acc.type, pairs, pairs)
        return builder.call(fn, [acc, builder.bitcast(w, pairs), builder.bitcast(x, pairs)])
    fmuladd = _declare(builder, "llvm.fmuladd.v16f32", acc.type, acc.type, acc.type, acc.type)
    we, wo = _halves(builder, w)
    xe, xo = _halves(builder, x)
    acc = builder.call(fmuladd, [we, xe, acc])
    return builder.call(fmuladd, [wo, xo, acc])


def _halves(builder, v):
    """<32 x i16> bfloat16 bits -> (even elements, odd elements) as <16 x float>: in each 32-bit
    lane the even element is the low half (shifted up 16 it is its float32) and the odd one the
    high half (its float32 once the low half is cleared)."""
    lanes = builder.bitcast(v, _vec(I32, LANES))
    even = builder.shl(lanes, ir.Constant(_vec(I32, LANES), [16] * LANES))
    odd = builder.and_(lanes, ir.Constant(_vec(I32, LANES), [-65536] * LANES))   # 0xFFFF0000
    return builder.bitcast(even, _vec(F32, LANES)), builder.bitcast(odd, _vec(F32, LANES))


def _masked_load(builder, ptr, offset, mask):
    """<32 x i16> at element `offset` of `ptr`, zeros where `mask` (<32 x i1>) is off (and
    nothing read there)."""
    vty = _vec(I16, STEP)
    mty = _vec(ir.IntType(1), STEP)
    fn = _declare(builder, "llvm.masked.load.v32i16.p0", vty, vty.as_pointer(), I32, mty, vty)
    at = builder.bitcast(builder.gep(ptr, [offset]), vty.as_pointer())
    return builder.call(fn, [at, ir.Constant(I32, 2), mask, ir.Constant(vty, None)])


def _tail_mask(builder, tail):
    """<32 x i1>: lanes below `tail` (i64, 0..31) on."""
    lanes = ir.Constant(_vec(I32, STEP), list(range(STEP)))
    t = builder.trunc(tail, I32)
    splat = builder.shuffle_vector(
        builder.insert_element(ir.Constant(_vec(I32, STEP), ir.Undefined), t, ir.Constant(I32, 0)),
        ir.Constant(_vec(I32, STEP), ir.Undefined), ir.Constant(_vec(I32, STEP), [0] * STEP))
    return builder.icmp_unsigned("<", lanes, splat)


# -- the tile ------------------------------------------------------------------------------------------
def _chains(R, C):
    """Accumulators per row pair: enough independent ones (about 8) that the loop is not bound by
    the latency of a dependent chain (vdpbf16ps: 6 cycles on Zen 4) in the small tiles."""
    return max(1, 8 // (R * C))


def _group_rows(context, builder, aryty, value, m, count):
    """Pointers to the first step of activation rows m .. m + count - 1 (all in one group of
    GROUP rows) in the interleaved layout: row m's steps are in row m // GROUP of the 2-D array,
    at element (m % GROUP) * STEP of every GROUP * STEP."""
    ary = context.make_array(aryty)(context, builder, value)
    stride = builder.extract_value(ary.strides, 0)
    base = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
    group = builder.udiv(m, ir.Constant(I64, GROUP))
    first = builder.urem(m, ir.Constant(I64, GROUP))
    start = builder.gep(base, [builder.mul(group, stride)])
    return [builder.gep(builder.bitcast(start, ary.data.type),
                        [builder.mul(builder.add(first, ir.Constant(I64, c)), ir.Constant(I64, STEP))])
            for c in range(count)]


def _bf16_codegen(R, C, isa, context, builder, a, args):
    """<R*C x float>, lane c * R + r: the dot product of w[i + r, k0:k1] and x[m + c, k0:k1] (w,
    x 2-D uint16 bfloat16 bits with contiguous rows; k0 a multiple of 32)."""
    w, i, x, m, k0, k1 = args
    wp = _rows(context, builder, a[0], w, i, R)
    xp = _group_rows(context, builder, a[2], x, m, C)
    U = _chains(R, C)
    step = ir.Constant(I64, STEP)
    count = builder.sub(k1, k0)
    whole = builder.udiv(count, step)
    tail = builder.urem(count, step)

    def step_at(b, at, accs, load):
        wv = [load(b, p, at) for p in wp]
        xv = [load(b, p, b.mul(at, ir.Constant(I64, GROUP))) for p in xp]
        return [_dot2(b, accs[c * R + r], wv[r], xv[c], isa) for c in range(C) for r in range(R)]

    def plain(b, p, at):
        return _load_vec(b, p, at, _vec(I16, STEP))

    def unrolled(b, j, chains):           # U steps, each into its own accumulators
        first = b.add(k0, b.mul(j, ir.Constant(I64, STEP * U)))
        return [acc for u in range(U) for acc in
                step_at(b, b.add(first, ir.Constant(I64, STEP * u)), chains[u * R * C:(u + 1) * R * C],
                        plain)]

    zero = ir.Constant(_vec(F32, LANES), None)
    chains = _loop(builder, builder.udiv(whole, ir.Constant(I64, U)), [zero] * (U * R * C), unrolled)
    accs = chains[:R * C]
    for u in range(1, U):
        accs = [builder.fadd(p, q) for p, q in zip(accs, chains[u * R * C:(u + 1) * R * C])]
    done = builder.add(k0, builder.mul(builder.sub(whole, builder.urem(whole, ir.Constant(I64, U))), step))

    def single(b, j, accs):               # the whole steps left over (fewer than U)
        return step_at(b, b.add(done, b.mul(j, step)), accs, plain)

    def last(b, _, accs):                 # the (k1 - k0) % 32 columns past the whole steps, if any
        mask = _tail_mask(b, tail)
        return step_at(b, b.add(k0, b.mul(whole, step)), accs,
                       lambda b, p, at: _masked_load(b, p, at, mask))

    accs = _loop(builder, builder.urem(whole, ir.Constant(I64, U)), accs, single)
    accs = _loop(builder, builder.zext(builder.icmp_unsigned("!=", tail, ir.Constant(I64, 0)), I64),
                 accs, last)
    return _tile_vector(builder, _fold(builder, accs, LANES, builder.fadd), R * C)


def _store(context, builder, aryty, value, m, i, values, R, C, add):
    """out[m + c, i + r] = lane c * R + r of values, plus what out holds there when `add` (i64)
    is nonzero (a select, not a multiply: whatever out held otherwise, NaN included, is dropped)."""
    keep = builder.icmp_unsigned("!=", add, ir.Constant(I64, 0))
    rows = []
    for c, p in enumerate(_rows(context, builder, aryty, value, m, C)):
        at = builder.bitcast(builder.gep(p, [i]), _vec(F32, R).as_pointer())
        part = builder.shuffle_vector(values, values,
                                      ir.Constant(_vec(I32, R), list(range(c * R, c * R + R))))
        rows.append((at, part))
    for at, part in rows:
        old = builder.load(at, align=4)
        builder.store(builder.select(keep, builder.fadd(old, part), part), at, align=4)


def make_tile(isas: dict[bool, str]):
    """The tile intrinsic: tile(R, C, best, w, i, x, m, k0, k1, add, out) writes out[m + c, i + r]
    = the float32 dot product of w[i + r, k0:k1] and x[m + c, k0:k1] for r < R, c < C
    (R * C <= 32), or adds it to what out holds there when `add` is nonzero. w, x: 2-D uint16
    (bfloat16 bits), rows contiguous, k0 a multiple of 32; out: 2-D float32, columns contiguous
    (rows may be strided). R, C and best are compile-time constants: best picks the instruction
    set `isas[best]` (the kernels pass {True: ISA, False: FALLBACK}; the tests build others)."""
    @intrinsic
    def tile(typingctx, R, C, best, w, i, x, m, k0, k1, add, out):
        rows, cols, b = literals(R, C, best)
        sig = types.none(R, C, best, w, types.int64, x, types.int64, types.int64, types.int64,
                         types.int64, out)

        def codegen(context, builder, signature, args):
            values = _bf16_codegen(rows, cols, isas[b], context, builder, signature.args[3:9],
                                   args[3:9])
            _store(context, builder, signature.args[10], args[10], args[6], args[4], values,
                   rows, cols, args[9])
            return context.get_dummy_value()
        return sig, codegen
    return tile


# -- panel tiles: weights repacked, activations broadcast (many input rows) ---------------------------
# As the integer panel tiles (tiles.py): with many input rows the dot-product tiles' lane sums
# (`_fold`, per output) are avoidable. A panel of PANEL weight rows is repacked per call
# (bfloat16_products._pack_panel) into [K / 2][PANEL] 32-bit words, word (q, r) holding columns
# 2q and 2q + 1 of weight row r, so one 64-byte vector holds a column pair of 16 weight rows; an
# input row's pair, broadcast to the 16 lanes, makes lane j of an accumulator the whole output
# of weight row 16 p + j. The epilogue is a multiply by the row's scale (fp8 weights) and a
# masked store per 16 outputs.
PANEL = 64                 # weight rows of a panel: 4 vectors of 16


def _panel_codegen(P, C, scaled, isa, context, builder, a, args):
    """out[m + c, i + 16 p + j] = (scale[i + 16 p + j] if scaled) x the sum over the n * 16 column
    pairs q of pw's pair q of weight row 16 p + j times x's columns 2q, 2q + 1 of row m + c, for
    c < C, p < P, 16 p + j < valid (the other lanes are not written). pw: the panel (1-D uint32,
    word q * P * 16 + r); x: the rounded rows in bfloat16_products._carve's layout, rows m ..
    m + C - 1 in one group."""
    (pw, x, m, n, scale, i, valid, out) = args
    words = builder.bitcast(context.make_array(a[0])(context, builder, pw).data, I32.as_pointer())
    xp = [builder.bitcast(p, I16.as_pointer()) for p in _group_rows(context, builder, a[1], x, m, C)]
    pairs = STEP // 2
    width = P * LANES                   # words of one column pair across the panel

    def body(b, s, accs):               # one step: STEP columns, STEP / 2 pairs
        accs = list(accs)
        for q in range(pairs):
            at = b.mul(b.add(b.mul(s, ir.Constant(I64, pairs)), ir.Constant(I64, q)),
                       ir.Constant(I64, width))
            wv = [b.bitcast(_load_vec(b, words, b.add(at, ir.Constant(I64, p * LANES)),
                                      _vec(I32, LANES)), _vec(I16, STEP)) for p in range(P)]
            xoff = b.add(b.mul(s, ir.Constant(I64, GROUP * STEP)), ir.Constant(I64, 2 * q))
            xv = []
            for p_ in xp:
                word = b.load(b.bitcast(b.gep(p_, [xoff]), I32.as_pointer()), align=2)
                xv.append(b.bitcast(_splat(b, word, LANES), _vec(I16, STEP)))
            for c in range(C):
                for p in range(P):
                    accs[c * P + p] = _dot2(b, accs[c * P + p], wv[p], xv[c], isa)
        return accs

    zero = ir.Constant(_vec(F32, LANES), None)
    accs = _loop(builder, n, [zero] * (C * P), body)
    outp = _rows(context, builder, a[7], out, m, C)
    fty = _vec(F32, LANES)
    mstore, lane_mask = _lane_masks(builder, valid, LANES)
    if scaled:
        scp = _elem(context, builder, a[4], scale, i)
        mload = _declare(builder, f"llvm.masked.load.v{LANES}f32.p0", fty, fty.as_pointer(), I32,
                         _vec(ir.IntType(1), LANES), fty)
    for p in range(P):
        first = p * LANES
        mask = lane_mask(first)
        if scaled:
            ws = builder.call(mload, [builder.bitcast(builder.gep(scp, [ir.Constant(I64, first)]),
                                                      fty.as_pointer()),
                                      ir.Constant(I32, 4), mask, ir.Constant(fty, None)])
        for c in range(C):
            value = accs[c * P + p]
            if scaled:
                value = builder.fmul(value, ws)
            at = builder.bitcast(builder.gep(outp[c], [builder.add(i, ir.Constant(I64, first))]),
                                 fty.as_pointer())
            builder.call(mstore, [value, at, ir.Constant(I32, 4), mask])


def make_panel_tile(isas: dict[bool, str]):
    """The panel tile: tile(P, C, scaled, best, pw, x, m, n, scale, i, valid, out) writes
    out[m + c, i + 16 p + j] for c < C, p < P, 16 p + j < valid (see `_panel_codegen`; scale 1-D
    float32 contiguous, read only when `scaled`; out's rows contiguous). P, C, scaled and best
    are compile-time constants, best picking the instruction set `isas[best]`."""
    @intrinsic
    def tile(typingctx, P, C, scaled, best, pw, x, m, n, scale, i, valid, out):
        panels, cols, sc, b = literals(P, C, scaled, best)
        sig = types.none(P, C, scaled, best, pw, x, types.int64, types.int64, scale, types.int64,
                         types.int64, out)

        def codegen(context, builder, signature, args):
            _panel_codegen(panels, cols, sc, isas[b], context, builder, signature.args[4:],
                           args[4:])
            return context.get_dummy_value()
        return sig, codegen
    return tile
