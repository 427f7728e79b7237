"""Integer dot-product tiles written in LLVM IR: the inner loops of `compute="int8"` (imported by
_numba_kernels.py, which says what the products are for).

A tile takes R weight rows and C quantised activation rows and returns the R x C dot products,
each row pair's sum kept in a vector register of 32-bit lanes for the whole inner loop and summed
across lanes once at the end. numba has no vector types and LLVM does not find the instruction
these loops want on its own: a plain `acc += int32(u8[k]) * int32(s8[k])` loop compiles (LLVM 22,
znver4) to vpmovzxbd + vpmovsxbd + vpdpwssd, 16 products per instruction. So the loops are built
here, through numba's `intrinsic` (as the float16 widening is), around
`llvm.x86.avx512.vpdpbusd.{512,256}`: `vpdpbusd` multiplies 64 (zmm) or 32 (ymm) unsigned bytes by
as many signed bytes and adds each group of 4 products into one of 16 (8) int32 lanes. Checked in
the assembly (`inspect_asm`): the int8 4x4 tile compiles to 16 vpdpbusd zmm per 64 input
columns (with 4 vpxord for the weights' sign flip), the int4 tile to vpandd/vpsrlw + vinserti64x4
+ vpdpbusd per 64 columns and a vcvtdq2ps + vfmadd per group.

Which instructions: the CPU numba compiles for (the host, unless NUMBA_CPU_NAME /
NUMBA_CPU_FEATURES name another) decides once, in `ISA`: "avx512vnni" (64-byte vectors),
"avxvnni" (the same intrinsic at 256 bits, which LLVM encodes as AVX-VNNI's VEX form on CPUs
without AVX-512), else `FALLBACK`: "avx512bw" / "avx2" (vpmaddubsw, u8 x s8 pairs summed into
int16, then vpmaddwd by ones into int32: 2 instructions where VNNI takes one) or "generic" (16-bit
products in plain IR, for CPUs that are not x86). Every build is exact: integer sums, no
saturation. The kernels build `ISA` and `FALLBACK` (the same on a CPU without VNNI), so a machine
with VNNI also tests the fallback; no tile is built for instructions the CPU lacks.

The operands: vpdpbusd and vpmaddubsw want one unsigned operand. int8 weights are signed: the
VNNI tile flips their sign bit (w + 128, unsigned) and the caller subtracts 128 x the
activations' sum (`offset()`); the vpmaddubsw tile gives the activations each weight's sign and
multiplies by its magnitude (|w| <= 127 keeps the int16 pair sums exact). int4 weights are stored
as unsigned nibbles q + 8, so they are the unsigned operand as they are and the tile subtracts
8 x each group's activation sum before applying the group's scale.
"""

from __future__ import annotations

import llvmlite.binding as ll
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

I8, I16, I32, I64, F32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                          ir.FloatType())


def _target_features() -> set[str]:
    """The features of the CPU numba generates code for."""
    from numba.core import config
    if config.CPU_NAME or config.CPU_FEATURES:     # a portable target the user chose
        return {f[1:] for f in (config.CPU_FEATURES or "").split(",") if f.startswith("+")}
    return {name for name, on in ll.get_host_cpu_features().items() if on}


def detect_isa(features: set[str]) -> str:
    """The best instruction set for the tiles among the CPU's `features`."""
    if {"avx512vnni", "avx512bw", "avx512vl"} <= features:
        return "avx512vnni"
    if "avxvnni" in features:
        return "avxvnni"
    return fallback_isa(features)


def fallback_isa(features: set[str]) -> str:
    """The best one without VNNI: vpmaddubsw + vpmaddwd (AVX-512 BW, AVX2), else generic IR."""
    return "avx512bw" if "avx512bw" in features else "avx2" if "avx2" in features else "generic"


_FEATURES = _target_features()
ISA = detect_isa(_FEATURES)              # what the kernels use
FALLBACK = fallback_isa(_FEATURES)       # what they use on CPUs without VNNI (and in tests here)
_WIDTH = {"avx512vnni": 64, "avxvnni": 32, "avx512bw": 64, "avx2": 32, "generic": 32}
_VNNI = ("avx512vnni", "avxvnni")


def width(isa: str) -> int:
    """Bytes of activations one step of an int8 tile built for `isa` consumes."""
    return _WIDTH[isa]


def offset(isa: str) -> int:
    """What an int8 tile built for `isa` adds to every weight (the caller subtracts it x the
    activations' sum): VNNI's unsigned operand is the weight with its sign bit flipped."""
    return 128 if isa in _VNNI else 0


def describe() -> str:
    """Which instructions the int8 x int8 products run on (`minfer info`)."""
    return {"avx512vnni": "AVX-512 VNNI (vpdpbusd, 512-bit)",
            "avxvnni": "AVX-VNNI (vpdpbusd, 256-bit)",
            "avx512bw": "AVX-512 BW without VNNI (vpmaddubsw + vpmaddwd)",
            "avx2": "AVX2 without VNNI (vpmaddubsw + vpmaddwd)",
            "generic": "no x86 dot-product instructions (16-bit products)"}[ISA]


# -- IR pieces -------------------------------------------------------------------------------------
def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _rows(context, builder, aryty, value, first, count):
    """Pointers to rows first .. first + count - 1 of a 2-D array (typed as its elements). Rows
    are addressed inside the tile rather than passed as row views: numba reference-counts every
    view it makes, and those atomic counts cost as much as a row's products at K = 512."""
    ary = context.make_array(aryty)(context, builder, value)
    stride = builder.extract_value(ary.strides, 0)
    base = builder.bitcast(ary.data, I8.as_pointer())
    out = []
    for j in range(count):
        at = builder.mul(builder.add(first, ir.Constant(I64, j)), stride)
        out.append(builder.bitcast(builder.gep(base, [at]), ary.data.type))
    return out


def _load_vec(builder, ptr, offset, vty):
    """An unaligned vector load of `vty` at element `offset` of the byte pointer `ptr`."""
    return builder.load(builder.bitcast(builder.gep(ptr, [offset]), vty.as_pointer()), align=1)


def _load_at(builder, ptr, index):
    return builder.load(builder.gep(ptr, [index]))


def _splat(builder, value, n):
    v = builder.insert_element(ir.Constant(_vec(value.type, n), ir.Undefined), value,
                               ir.Constant(I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(_vec(I32, n), [0] * n))


def _slice(builder, v, start, n):
    return builder.shuffle_vector(v, v, ir.Constant(_vec(I32, n), list(range(start, start + n))))


def _hsum(builder, v, n, add):
    """Sum of a vector's n lanes: halves added until one lane is left."""
    while n > 1:
        n //= 2
        v = add(_slice(builder, v, 0, n), _slice(builder, v, n, n))
    return builder.extract_element(v, ir.Constant(I32, 0))


def _declare(builder, name, ret, *args):
    module = builder.module
    fn = module.globals.get(name)
    if fn is None:
        fn = ir.Function(module, ir.FunctionType(ret, args), name)
    return fn


def _dot4(builder, acc, u, s, isa, u_signed=False):
    """acc (<W/4 x i32>) + the exact products of u (<W x i8>, unsigned unless u_signed) and s
    (<W x i8>, signed, never -128), each lane taking 4 of them (generic: 4 of them too, but not
    adjacent ones: the lanes are summed at the end either way)."""
    W = u.type.count
    L = W // 4
    lanes = _vec(I32, L)
    if isa in _VNNI:                     # u must be unsigned: int8 weights come flipped
        fn = _declare(builder, f"llvm.x86.avx512.vpdpbusd.{W * 8}", lanes, lanes, lanes, lanes)
        return builder.call(fn, [acc, builder.bitcast(u, lanes), builder.bitcast(s, lanes)])
    if isa in ("avx512bw", "avx2"):
        # vpmaddubsw sums pairs of u8 x s8 into saturating int16: exact when |u| <= 127, so a
        # signed u gives its magnitude and its sign to s (llama.cpp's trick); vpmaddwd by ones
        # then sums pairs into int32
        if u_signed:
            neg = builder.icmp_signed("<", u, ir.Constant(u.type, None))
            s = builder.select(neg, builder.sub(ir.Constant(s.type, None), s), s)
            absolute = _declare(builder, f"llvm.abs.v{W}i8", u.type, u.type, ir.IntType(1))
            u = builder.call(absolute, [u, ir.Constant(ir.IntType(1), 0)])
        w16 = _vec(ir.IntType(16), W // 2)
        ubs, wd = (("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512") if W == 64
                   else ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd"))
        pairs = builder.call(_declare(builder, ubs, w16, u.type, s.type), [u, s])
        ones = ir.Constant(w16, [1] * (W // 2))
        quads = builder.call(_declare(builder, wd, _vec(I32, W // 4), w16, w16), [pairs, ones])
        return builder.add(acc, quads)
    # generic: exact 16-bit products (|u| <= 255, |s| <= 127) widened to 32 bits and summed in
    # quarters
    w16 = _vec(ir.IntType(16), W)
    ext = builder.sext if u_signed else builder.zext
    p = builder.sext(builder.mul(ext(u, w16), builder.sext(s, w16)), _vec(I32, W))
    quarters = [_slice(builder, p, q * L, L) for q in range(4)]
    return builder.add(acc, builder.add(builder.add(quarters[0], quarters[1]),
                                        builder.add(quarters[2], quarters[3])))


def _loop(builder, count, init, body):
    """A counted loop carrying `init` values: body(builder, i, values) -> new values; returns the
    values after `count` iterations (none when count <= 0)."""
    before = builder.block
    header = builder.append_basic_block("tile.header")
    inside = builder.append_basic_block("tile.body")
    after = builder.append_basic_block("tile.exit")
    builder.branch(header)
    builder.position_at_end(header)
    i = builder.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), before)
    carried = []
    for v in init:
        p = builder.phi(v.type)
        p.add_incoming(v, before)
        carried.append(p)
    builder.cbranch(builder.icmp_signed("<", i, count), inside, after)
    builder.position_at_end(inside)
    new = body(builder, i, carried)
    end = builder.block                      # the body may have added blocks (a nested loop)
    i.add_incoming(builder.add(i, ir.Constant(I64, 1)), end)
    builder.branch(header)
    for p, v in zip(carried, new):
        p.add_incoming(v, end)
    builder.position_at_end(after)
    return carried


# -- the tiles -------------------------------------------------------------------------------------
def int8_tile(R: int, C: int, isa: str):
    """tile(w, i, x, m, n) -> R*C int32 sums (index r * C + c) of (w[i + r, k] + offset(isa))
    * x[m + c, k] over k < n * width(isa): rows of C-contiguous 2-D int8 arrays, n whole
    vectors."""
    W = _WIDTH[isa]
    L = W // 4

    @intrinsic
    def tile(typingctx, w, i, x, m, n):
        sig = types.UniTuple(types.int32, R * C)(w, types.int64, x, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            wp = _rows(context, builder, signature.args[0], args[0], args[1], R)
            xp = _rows(context, builder, signature.args[2], args[2], args[3], C)
            flip = ir.Constant(_vec(I8, W), [-128] * W)

            def body(b, i, accs):
                at = b.mul(i, ir.Constant(I64, W))
                wv = [_load_vec(b, p, at, _vec(I8, W)) for p in wp]
                if isa in _VNNI:
                    wv = [b.xor(v, flip) for v in wv]       # w + 128: the unsigned operand
                xv = [_load_vec(b, p, at, _vec(I8, W)) for p in xp]
                return [_dot4(b, accs[r * C + c], wv[r], xv[c], isa, u_signed=isa not in _VNNI)
                        for r in range(R) for c in range(C)]
            zero = ir.Constant(_vec(I32, L), None)
            accs = _loop(builder, args[4], [zero] * (R * C), body)
            sums = [_hsum(builder, a, L, builder.add) for a in accs]
            return context.make_tuple(builder, signature.return_type, sums)
        return sig, codegen
    return tile


def int4_tile(R: int, C: int, isa: str):
    """tile(w, scale, i, x, sums, m, groups, chunks) -> R*C float32 sums (index r * C + c) over
    g < groups of scale[i + r, g] * the sum over group g of (q - 8) * x[m + c], a group being
    `chunks` blocks of 64 columns: a block is 32 bytes of row w[i + r], byte j holding column j
    in its low nibble and column 32 + j in its high one (q + 8, unsigned); sums[m + c, g] is the
    group's sum of x[m + c] (int32). C-contiguous 2-D arrays."""
    W = _WIDTH[isa]
    L = W // 4

    @intrinsic
    def tile(typingctx, w, scale, i, x, xsums, m, groups, chunks):
        sig = types.UniTuple(types.float32, R * C)(w, scale, types.int64, x, xsums, types.int64,
                                                   types.int64, types.int64)

        def codegen(context, builder, signature, args):
            a = signature.args
            wp = _rows(context, builder, a[0], args[0], args[2], R)
            sp = _rows(context, builder, a[1], args[1], args[2], R)
            xp = _rows(context, builder, a[3], args[3], args[5], C)
            tp = _rows(context, builder, a[4], args[4], args[5], C)
            per = args[7]
            low = ir.Constant(_vec(I8, 32), [15] * 32)
            four = ir.Constant(_vec(I8, 32), [4] * 32)
            low64 = ir.Constant(_vec(I8, 64), [15] * 64)
            shift = ir.Constant(_vec(I16, 32), [0] * 16 + [4] * 16)
            izero, fzero = ir.Constant(_vec(I32, L), None), ir.Constant(_vec(F32, L), None)
            fma = _declare(builder, f"llvm.fma.v{L}f32", _vec(F32, L), *[_vec(F32, L)] * 3)

            def group(b, g, faccs):
                first = b.mul(g, per)

                def block(b, j, iaccs):
                    k = b.add(first, j)
                    pieces = []
                    for p in wp:
                        packed = _load_vec(b, p, b.mul(k, ir.Constant(I64, 32)), _vec(I8, 32))
                        if W == 64:
                            # both halves from one broadcast load, the upper shifted by 4 in
                            # 16-bit lanes (vpsrlvw), then one mask: 3 instructions a block
                            both = b.shuffle_vector(packed, packed, ir.Constant(
                                _vec(I32, 64), list(range(32)) * 2))
                            shifted = b.lshr(b.bitcast(both, _vec(I16, 32)), shift)
                            pieces.append([b.and_(b.bitcast(shifted, _vec(I8, 64)), low64)])
                        else:
                            pieces.append([b.and_(packed, low), b.lshr(packed, four)])
                    base = b.mul(k, ir.Constant(I64, 64))
                    xv = [[_load_vec(b, p, b.add(base, ir.Constant(I64, h * W)), _vec(I8, W))
                           for h in range(64 // W)] for p in xp]
                    out = []
                    for r in range(R):
                        for c in range(C):
                            acc = iaccs[r * C + c]
                            for u, s in zip(pieces[r], xv[c]):
                                acc = _dot4(b, acc, u, s, isa)
                            out.append(acc)
                    return out
                iaccs = _loop(b, per, [izero] * (R * C), block)
                # the nibbles are q + 8: take 8 x the group's activation sum off (in lane 0)
                fix = [b.insert_element(izero, b.mul(_load_at(b, p, g), ir.Constant(I32, 8)),
                                        ir.Constant(I32, 0)) for p in tp]
                scales = [_splat(b, _load_at(b, p, g), L) for p in sp]
                return [b.call(fma, [b.sitofp(b.sub(iaccs[r * C + c], fix[c]), _vec(F32, L)),
                                     scales[r], faccs[r * C + c]])
                        for r in range(R) for c in range(C)]
            faccs = _loop(builder, args[6], [fzero] * (R * C), group)
            sums = [_hsum(builder, a, L, builder.fadd) for a in faccs]
            return context.make_tuple(builder, signature.return_type, sums)
        return sig, codegen
    return tile
