"""Integer dot-product tiles written in LLVM IR: the inner loops of `compute="int8"` (imported by
quantised_products.py, which says what the products are for).

A tile takes R weight rows and C quantised activation rows and writes their R x C scaled dot
products, each row pair's sum kept in a vector register of 32-bit lanes for the whole inner loop
and the lanes summed once at the end, all R x C together. numba has no vector types and LLVM does not find the instruction
these loops want on its own: a plain `acc += int32(u8[k]) * int32(s8[k])` loop compiles (LLVM 22,
znver4) to vpmovzxbd + vpmovsxbd + vpdpwssd, 16 products per instruction. So the loops are built
here, through numba's `intrinsic` (as the float16 widening is), around
`llvm.x86.avx512.vpdpbusd.{512,256}`: `vpdpbusd` multiplies 64 (zmm) or 32 (ymm) unsigned bytes
by as many signed bytes and adds each group of 4 products into one of 16 (8) int32 lanes. Checked
in the assembly (`inspect_asm`, LLVM 22, znver4): per 64 input columns the int8 4x4 tile's loop
is 16 vpdpbusd zmm, 4 vpxorq (the weights' sign flip) and 8 loads (LLVM unrolls it twice); the
int4 tile's, per weight row, vbroadcasti64x4 + vpsrlvw + vpandq (the nibbles of 64 columns) and
one vpdpbusd per input row, then a vcvtdq2ps and a vfmadd per group; the AVX-512 BW fallback's,
per weight row and input row, vpabsb / vpblendmb (the sign moved to the inputs), vpmaddubsw and
vpmaddwd (LLVM fuses the latter with its add into vpdpwssd where the CPU has VNNI).

Which instructions: the CPU numba compiles for (the host, unless NUMBA_CPU_NAME /
NUMBA_CPU_FEATURES name another) decides once, in `ISA`: "avx512vnni" (64-byte vectors),
"avxvnni" (the same intrinsic at 256 bits, which LLVM encodes as AVX-VNNI's `{vex} vpdpbusd` on
CPUs without AVX-512: checked for alderlake), else `FALLBACK`: "avx512bw" / "avx2" (vpmaddubsw, u8 x s8 pairs summed into
int16, then vpmaddwd by ones into int32: 2 instructions where VNNI takes one) or "generic" (16-bit
products in plain IR, for CPUs that are not x86). Every build is exact: integer sums, no
saturation. The kernels build `ISA` and `FALLBACK` (the same on a CPU without VNNI), so a machine
with VNNI also tests the fallback; no tile is built for instructions the CPU lacks (LLVM would
abort the process: "Cannot select X86ISD::VPDPBUSD" on haswell).

The operands: vpdpbusd and vpmaddubsw want one unsigned operand. int8 weights are signed: the
VNNI tile flips their sign bit (w + 128, unsigned) and the caller subtracts 128 x the
activations' sum (`offset()`); the vpmaddubsw tile gives the activations each weight's sign and
multiplies by its magnitude (|w| <= 128 and |x| <= 127 keep the int16 pair sums exact). int4 weights are stored
as unsigned nibbles q + 8, so they are the unsigned operand as they are and the tile subtracts
8 x each group's activation sum before applying the group's scale.
"""

from __future__ import annotations

import llvmlite.binding as ll
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

I8, I16, I32, I64, F32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                          ir.FloatType())


def _target_features() -> set[str]:
    """The features of the CPU numba generates code for."""
    from numba.core import config
    if config.CPU_NAME or config.CPU_FEATURES:     # a portable target the user chose
        return {f[1:] for f in (config.CPU_FEATURES or "").split(",") if f.startswith("+")}
    return {name for name, on in ll.get_host_cpu_features().items() if on}


# Each build of the tiles, best first, with the CPU features it needs.
NEEDS = {"avx512vnni": {"avx512vnni", "avx512bw", "avx512vl"}, "avxvnni": {"avxvnni"},
         "avx512bw": {"avx512bw"}, "avx2": {"avx2"}, "generic": set()}


def runnable(features: set[str]) -> list[str]:
    """The builds of the tiles a CPU with `features` can run, best first."""
    return [isa for isa, needs in NEEDS.items() if needs <= features]


def detect_isa(features: set[str]) -> str:
    """The best instruction set for the tiles among the CPU's `features`."""
    return runnable(features)[0]


def fallback_isa(features: set[str]) -> str:
    """The best one without VNNI: vpmaddubsw + vpmaddwd (AVX-512 BW, AVX2), else generic IR."""
    return next(isa for isa in runnable(features) if isa not in _VNNI)


_VNNI = ("avx512vnni", "avxvnni")
_FEATURES = _target_features()
ISA = detect_isa(_FEATURES)              # what the kernels use
FALLBACK = fallback_isa(_FEATURES)       # what they use on CPUs without VNNI (and in tests here)
_WIDTH = {"avx512vnni": 64, "avxvnni": 32, "avx512bw": 64, "avx2": 32, "generic": 32}


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


def literals(*args: types.Type) -> list:
    """The compile-time values of a tile's constant arguments (its kind, shape, instruction
    set), or RequireLiteralValue, which makes numba compile the caller again with literals."""
    from numba.core.errors import RequireLiteralValue
    known = [getattr(t, "literal_value", None) for t in args]
    if None in known:
        raise RequireLiteralValue("the tile's kind, shape and instruction set")
    return known


@intrinsic
def address(typingctx, a):
    """The address of an array's data (the kernels align their scratch with it)."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.ptrtoint(ary.data, ir.IntType(64))
    return types.int64(a), codegen


@njit(inline="always")
def aligned_bytes(n):
    """n bytes from a 64-byte boundary, in a buffer of the caller's own (a panel task's)."""
    raw = np.empty(n + 64, np.uint8)
    skip = (64 - address(raw) % 64) % 64
    return raw[skip:skip + n]


# -- IR pieces -------------------------------------------------------------------------------------
def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _rows(context, builder, aryty, value, first, count):
    """Pointers to rows first .. first + count - 1 of a 2-D array (typed as its elements). Rows
    are addressed inside the tile rather than passed as row views: numba reference-counts every
    view it makes with atomic operations, which cost about as much as a short row's products."""
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


def _declare(builder, name, ret, *args):
    module = builder.module
    fn = module.globals.get(name)
    if fn is None:
        fn = ir.Function(module, ir.FunctionType(ret, args), name)
    return fn


def _dot4(builder, acc, u, s, isa, u_signed=False):
    """acc (<W/4 x i32>) + the exact products of u (<W x i8>, unsigned unless u_signed) and s
    (<W x i8>, signed, never -128), lane j taking products 4j .. 4j + 3."""
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
    # generic: exact 16-bit products (|u| <= 255, |s| <= 127) widened to 32 bits, lane j taking
    # products 4j .. 4j + 3 as the instructions do (the panel tiles need it: a lane is an output)
    w16 = _vec(ir.IntType(16), W)
    ext = builder.sext if u_signed else builder.zext
    p = builder.sext(builder.mul(ext(u, w16), builder.sext(s, w16)), _vec(I32, W))
    quarters = [builder.shuffle_vector(p, p, ir.Constant(_vec(I32, L), [4 * j + q for j in range(L)]))
                for q in range(4)]
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
def _elem(context, builder, aryty, value, index):
    """Pointer to element `index` of a 1-D array (any stride)."""
    ary = context.make_array(aryty)(context, builder, value)
    at = builder.mul(index, builder.extract_value(ary.strides, 0))
    return builder.bitcast(builder.gep(builder.bitcast(ary.data, I8.as_pointer()), [at]),
                           ary.data.type)


def _gather(builder, context, aryty, value, first, count, ty):
    """Elements first .. first + count - 1 of a 1-D array as a <count x ty> vector."""
    v = ir.Constant(_vec(ty, count), None)
    for j in range(count):
        x = builder.load(_elem(context, builder, aryty, value, builder.add(first, ir.Constant(I64, j))))
        v = builder.insert_element(v, x, ir.Constant(I32, j))
    return v


def _spread(builder, v, R, C, by_row):
    """A <R or C x t> vector spread over the tile's R*C lanes (lane c * R + r): its element r
    (by_row) or c in each lane."""
    mask = [r if by_row else c for c in range(C) for r in range(R)]
    return builder.shuffle_vector(v, v, ir.Constant(_vec(I32, R * C), mask))


def _tile_vector(builder, sums_vectors, n):
    """The first n lanes of the folded accumulators (`_fold`'s vectors) as one vector."""
    a = sums_vectors[0]
    b = sums_vectors[1] if len(sums_vectors) > 1 else a
    return builder.shuffle_vector(a, b, ir.Constant(_vec(I32, n), list(range(n))))


def _store_rows(context, builder, aryty, value, first, col, values, R, C):
    """values (<R*C x float>, lane c * R + r) into out[first + c, col + r]."""
    for c, p in enumerate(_rows(context, builder, aryty, value, first, C)):
        part = builder.shuffle_vector(values, values, ir.Constant(_vec(I32, R),
                                                                  list(range(c * R, c * R + R))))
        builder.store(part, builder.bitcast(builder.gep(p, [col]), _vec(F32, R).as_pointer()),
                      align=4)


def _fold(builder, vectors, L, add):
    """The lane sums of several L-lane vectors, lane j of the result (of its vector j // L)
    holding vector j's sum. Vectors are folded in pairs: each level adds the two halves of every
    block of lanes, a's halved blocks then b's in one vector, so after log2(L) levels each lane
    is one vector's sum (a vector is paired with itself when one is left). 16 accumulators take
    45 shuffles and adds, not 16 x 12."""
    vs, size = list(vectors), L
    while size > 1:
        half = size // 2
        lo = [j * size + i for j in range(L // size) for i in range(half)]
        hi = [j * size + half + i for j in range(L // size) for i in range(half)]
        lo_ab = ir.Constant(_vec(I32, L), lo + [L + i for i in lo])
        hi_ab = ir.Constant(_vec(I32, L), hi + [L + i for i in hi])
        pairs = [(vs[i], vs[i + 1] if i + 1 < len(vs) else vs[i]) for i in range(0, len(vs), 2)]
        vs = [add(builder.shuffle_vector(a, b, lo_ab), builder.shuffle_vector(a, b, hi_ab))
              for a, b in pairs]
        size = half
    return vs


INT8, INT4 = 3, 4          # the weight kinds a tile multiplies (widening's I8, and I4)


# -- tiles over quantised rows in groups of 4 (the products' layout) ---------------------------------
# The int8 products keep their quantised input rows in `work` in groups of 4, interleaved STEP
# columns (bytes) at a time, so that a tile of 4 rows reads one sequential stream (4 rows apart
# they are 4 streams, which the hardware prefetcher follows less well from L3); the rows past the
# last whole group are stored plainly. A tile addresses its C rows by 5 byte offsets into the
# int8 buffer (`quantised_products._place`): row c's step s (columns s * STEP ..) at
# base + c * rs + s * ss, its last K % STEP columns (int8 only) at tb + c * ts.
STEP = 64


def _chains(R: int, C: int) -> int:
    """Accumulators per row pair: enough independent ones (about 8) that a small tile is not bound
    by the latency of one dependent chain of vpdpbusd (5 cycles on Zen 4)."""
    return max(1, 8 // (R * C))


def _masked_bytes(builder, ptr, count):
    """<STEP x i8> from the byte pointer `ptr`: its first `count` (i64, 0 .. STEP - 1) bytes, zeros
    in the others (which are not read)."""
    vty = _vec(I8, STEP)
    mty = _vec(ir.IntType(1), STEP)
    lanes = ir.Constant(_vec(I8, STEP), list(range(STEP)))
    mask = builder.icmp_unsigned("<", lanes, _splat(builder, builder.trunc(count, I8), STEP))
    fn = _declare(builder, f"llvm.masked.load.v{STEP}i8.p0", vty, vty.as_pointer(), I32, mty, vty)
    return builder.call(fn, [builder.bitcast(ptr, vty.as_pointer()), ir.Constant(I32, 1), mask,
                             ir.Constant(vty, None)])


def _pieces(builder, v, W):
    """A <STEP x i8> vector as STEP // W vectors of <W x i8>."""
    return [v] if W == STEP else [_slice(builder, v, h * W, W) for h in range(STEP // W)]


def _grouped_rows(context, builder, aryty, value, base, rs, C):
    """Byte pointers to base + c * rs, c < C, in the 1-D int8 buffer (the first step of the
    tile's C input rows, or with tb, ts their tails)."""
    data = builder.bitcast(context.make_array(aryty)(context, builder, value).data, I8.as_pointer())
    return [builder.gep(data, [builder.add(base, builder.mul(rs, ir.Constant(I64, c)))])
            for c in range(C)]


def _group_int8_codegen(R, C, isa, context, builder, a, args):
    """out[m + c, i + r] = (sum over k < K of (w[i + r, k] + offset(isa)) * x_c[k] - off *
    sums[m + c, 0]) * sx[m + c] * scale[i + r] for r < R, c < C, K = n * STEP + tail; x_c is
    input row c of the tile, addressed as the header above says. One exact int32 sum per output:
    the last `tail` columns are one more step of masked loads (zeros past K in both operands)."""
    (w, scale, i, xq, base, rs, ss, tb, ts, sums, m, n, tail, _, sx, out, off) = args
    W = _WIDTH[isa]
    L = W // 4
    U = _chains(R, C)
    wp = [builder.bitcast(p, I8.as_pointer()) for p in _rows(context, builder, a[0], w, i, R)]
    xp = _grouped_rows(context, builder, a[3], xq, base, rs, C)
    flip = ir.Constant(_vec(I8, W), [-128] * W)
    step = ir.Constant(I64, STEP)

    def products(b, accs, wv, xv):
        if isa in _VNNI:
            wv = [[b.xor(v, flip) for v in row] for row in wv]      # w + 128: the unsigned operand
        out = []
        for c in range(C):
            for r in range(R):
                acc = accs[c * R + r]
                for u, v in zip(wv[r], xv[c]):
                    acc = _dot4(b, acc, u, v, isa, u_signed=isa not in _VNNI)
                out.append(acc)
        return out

    def at_step(b, s, accs):
        wv = [[_load_vec(b, p, b.add(b.mul(s, step), ir.Constant(I64, h * W)), _vec(I8, W))
               for h in range(STEP // W)] for p in wp]
        xv = [[_load_vec(b, p, b.add(b.mul(s, ss), ir.Constant(I64, h * W)), _vec(I8, W))
               for h in range(STEP // W)] for p in xp]
        return products(b, accs, wv, xv)

    def unrolled(b, j, chains):            # U steps, each into its own accumulators
        first = b.mul(j, ir.Constant(I64, U))
        return [acc for u in range(U) for acc in
                at_step(b, b.add(first, ir.Constant(I64, u)), chains[u * R * C:(u + 1) * R * C])]

    zero = ir.Constant(_vec(I32, L), None)
    Uc = ir.Constant(I64, U)
    chains = _loop(builder, builder.udiv(n, Uc), [zero] * (U * R * C), unrolled)
    accs = chains[:R * C]
    for u in range(1, U):
        accs = [builder.add(p, q) for p, q in zip(accs, chains[u * R * C:(u + 1) * R * C])]
    done = builder.sub(n, builder.urem(n, Uc))
    accs = _loop(builder, builder.urem(n, Uc), accs,
                 lambda b, j, accs: at_step(b, b.add(done, j), accs))

    def last(b, _, accs):                  # the K % STEP columns past the whole steps
        wv = [_pieces(b, _masked_bytes(b, b.gep(p, [b.mul(n, step)]), tail), W) for p in wp]
        xv = [_pieces(b, _masked_bytes(b, p, tail), W)
              for p in _grouped_rows(context, b, a[3], xq, tb, ts, C)]
        return products(b, accs, wv, xv)

    accs = _loop(builder, builder.zext(builder.icmp_unsigned("!=", tail, ir.Constant(I64, 0)), I64),
                 accs, last)
    total = _tile_vector(builder, _fold(builder, accs, L, builder.add), R * C)
    fix = ir.Constant(_vec(I32, C), None)
    for c, p in enumerate(_rows(context, builder, a[9], sums, m, C)):     # sums[m + c, 0]
        fix = builder.insert_element(fix, builder.load(p), ir.Constant(I32, c))
    fix = builder.mul(fix, _splat(builder, builder.trunc(off, I32), C))
    total = builder.sub(total, _spread(builder, fix, R, C, by_row=False))
    scales = builder.fmul(
        _spread(builder, _gather(builder, context, a[14], sx, m, C, F32), R, C, by_row=False),
        _spread(builder, _gather(builder, context, a[1], scale, i, R, F32), R, C, by_row=True))
    return builder.fmul(builder.sitofp(total, _vec(F32, R * C)), scales)


def _group_int4_codegen(R, C, isa, context, builder, a, args):
    """out[m + c, i + r] = sx[m + c] * the sum over g < groups (n) of scale[i + r, g] * the sum
    over group g of (q - 8) * x_c, for r < R, c < C; a group is `per` blocks of 64 columns, a
    block 32 bytes of row w[i + r], byte j holding column j in its low nibble and column 32 + j
    in its high one (q + 8, unsigned); sums[m + c, g] is the group's sum of x_c (int32); x_c is
    input row c of the tile, addressed as the header above says (K a multiple of 64: no tail)."""
    (w, scale, i, xq, base, rs, ss, tb, ts, sums, m, n, tail, per, sx, out, _) = args
    W = _WIDTH[isa]
    L = W // 4
    wp = _rows(context, builder, a[0], w, i, R)
    sp = _rows(context, builder, a[1], scale, i, R)
    xp = _grouped_rows(context, builder, a[3], xq, base, rs, C)
    tp = _rows(context, builder, a[9], sums, m, C)
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
                    both = b.shuffle_vector(packed, packed,
                                            ir.Constant(_vec(I32, 64), list(range(32)) * 2))
                    shifted = b.lshr(b.bitcast(both, _vec(I16, 32)), shift)
                    pieces.append([b.and_(b.bitcast(shifted, _vec(I8, 64)), low64)])
                else:
                    pieces.append([b.and_(packed, low), b.lshr(packed, four)])
            at = b.mul(k, ss)
            xv = [[_load_vec(b, p, b.add(at, ir.Constant(I64, h * W)), _vec(I8, W))
                   for h in range(64 // W)] for p in xp]
            out = []
            for c in range(C):
                for r in range(R):
                    acc = iaccs[c * R + r]
                    for u, v in zip(pieces[r], xv[c]):
                        acc = _dot4(b, acc, u, v, isa)
                    out.append(acc)
            return out
        iaccs = _loop(b, per, [izero] * (R * C), block)
        fix = [b.insert_element(izero, b.mul(_load_at(b, p, g), ir.Constant(I32, 8)),
                                ir.Constant(I32, 0)) for p in tp]
        scales = [_splat(b, _load_at(b, p, g), L) for p in sp]
        return [b.call(fma, [b.sitofp(b.sub(iaccs[c * R + r], fix[c]), _vec(F32, L)),
                             scales[r], faccs[c * R + r]])
                for c in range(C) for r in range(R)]
    faccs = _loop(builder, n, [fzero] * (R * C), group)
    total = _tile_vector(builder, _fold(builder, faccs, L, builder.fadd), R * C)
    sxv = _spread(builder, _gather(builder, context, a[14], sx, m, C, F32), R, C, by_row=False)
    return builder.fmul(total, sxv)


def make_group_tile(isas: dict[bool, str]):
    """The tile over grouped input rows: tile(kind, R, C, best, w, scale, i, xq, base, rs, ss, tb,
    ts, sums, m, n, tail, per, sx, out, off) writes out[m + c, i + r] for r < R, c < C. xq: the
    1-D int8 buffer of quantised rows, row c of the tile addressed by base, rs, ss, tb, ts (the
    header above); int8 (kind INT8): n whole steps of STEP columns and `tail` more, sums[m + c, 0]
    the row's sum over all K, off the build's `offset`; int4 (INT4): n groups of `per` blocks,
    sums[m + c, g] group g's sum (see `_group_int8_codegen`, `_group_int4_codegen`). kind, R, C
    and best are compile-time constants, best picking the instruction set `isas[best]`."""
    @intrinsic
    def tile(typingctx, kind, R, C, best, w, scale, i, xq, base, rs, ss, tb, ts, sums, m, n,
             tail, per, sx, out, off):
        k, rows, cols, b = literals(kind, R, C, best)
        sig = types.none(kind, R, C, best, w, scale, types.int64, xq, *[types.int64] * 5, sums,
                         *[types.int64] * 4, sx, out, types.int64)
        build = _group_int8_codegen if k == INT8 else _group_int4_codegen

        def codegen(context, builder, signature, args):
            values = build(rows, cols, isas[b], context, builder, signature.args[4:], args[4:])
            _store_rows(context, builder, signature.args[19], args[19], args[14], args[6],
                        values, rows, cols)
            return context.get_dummy_value()
        return sig, codegen
    return tile


# -- panel tiles: weights repacked, activations broadcast (many input rows) ---------------------------
# The tiles above keep one accumulator per output and sum its 16 lanes at the end (`_fold`: 45
# shuffles and adds per 16 outputs), which at K = 768 costs about as much as a tenth of the
# products. With many input rows the products take the other orientation: a panel of PANEL
# weight rows repacked per call into [K / 4][PANEL][4] bytes (`quantised_products._pack`), so
# that one 64-byte vector holds 4 columns of 16 weight rows, and each input row's 4 columns
# broadcast to all 16 lanes: lane j of an accumulator is then one output, out[m, i + j], whole,
# and the epilogue is a subtraction, a conversion, a multiply and a store per 16 outputs.
PANEL = 64                 # weight rows of a panel: 4 vectors of 16
QUAD = 4                   # columns per lane


def _quad(b, wdata, at, xp, xoff, accs, P, isa, u_signed):
    """One quad (4 columns) of a panel tile: the P x 64 bytes of weights at byte `at` of the
    panel (16 weight rows x 4 columns a 64-byte vector), each input row's 4 bytes at `xoff` of
    its pointer in xp broadcast to every lane, their products added into accs (index (c * P +
    p) * vectors + h, c < len(xp)); returns the new accumulators."""
    W = _WIDTH[isa]
    nvec = 64 // W
    wv = [[_load_vec(b, wdata, b.add(at, ir.Constant(I64, p * 64 + h * W)), _vec(I8, W))
           for h in range(nvec)] for p in range(P)]
    xv = [b.bitcast(_splat(b, b.load(b.bitcast(b.gep(p_, [xoff]), I32.as_pointer()), align=1),
                           W // 4), _vec(I8, W)) for p_ in xp]
    accs = list(accs)
    for c in range(len(xp)):
        for p in range(P):
            for h in range(nvec):
                k = (c * P + p) * nvec + h
                accs[k] = _dot4(b, accs[k], wv[p][h], xv[c], isa, u_signed=u_signed)
    return accs


def _panel_codegen(P, C, isa, context, builder, a, args):
    """The panel tile's outputs: out[m + c, i + 16 p + j] for c < C, p < P, j < 16 where
    16 p + j < valid (the others are not written). pw: the packed panel (1-D, bytes), quad q of
    weight row 16 p + j at byte (q * P * 16 + 16 p + j) * 4, each weight + offset(isa); the input
    rows as `make_group_tile`'s (K = n * STEP, no tail); sums[m + c, 0] the row's sum."""
    (pw, xq, base, rs, ss, n, sums, m, sx, scale, i, valid, out, off, low) = args
    W = _WIDTH[isa]
    lanes = W // 4
    per = 64 // W                      # vectors per 16 weight rows x 4 columns (64 bytes)
    wdata = builder.bitcast(context.make_array(a[0])(context, builder, pw).data, I8.as_pointer())
    xp = _grouped_rows(context, builder, a[1], xq, base, rs, C)
    row_bytes = P * 16 * QUAD

    def body(b, s, accs):             # one step: STEP columns, STEP / 4 quads
        accs = list(accs)
        for q in range(STEP // QUAD):
            at = b.add(b.mul(s, ir.Constant(I64, (STEP // QUAD) * row_bytes)),
                       ir.Constant(I64, q * row_bytes))
            accs = _quad(b, wdata, at, xp, b.add(b.mul(s, ss), ir.Constant(I64, q * QUAD)), accs,
                         P, isa, isa not in _VNNI)
        return accs

    zero = ir.Constant(_vec(I32, lanes), None)
    accs = _loop(builder, n, [zero] * (C * P * per), body)
    sdata = _rows(context, builder, a[6], sums, m, C)
    sxp = _elem(context, builder, a[8], sx, m)
    scp = _elem(context, builder, a[9], scale, i)
    outp = _rows(context, builder, a[12], out, m, C)
    fty = _vec(F32, lanes)
    mload = _declare(builder, f"llvm.masked.load.v{lanes}f32.p0", fty, fty.as_pointer(), I32,
                     _vec(ir.IntType(1), lanes), fty)
    mstore, lane_mask = _lane_masks(builder, valid, lanes)
    floor = _splat(builder, low, lanes)
    for p in range(P):
        for h in range(per):
            first = p * 16 + h * lanes
            mask = lane_mask(first)
            ws = builder.call(mload, [builder.bitcast(builder.gep(scp, [ir.Constant(I64, first)]),
                                                      fty.as_pointer()),
                                      ir.Constant(I32, 4), mask, ir.Constant(fty, None)])
            for c in range(C):
                fix = builder.mul(builder.load(sdata[c]), builder.trunc(off, I32))
                total = builder.sub(accs[(c * P + p) * per + h], _splat(builder, fix, lanes))
                rscale = builder.load(builder.gep(sxp, [ir.Constant(I64, c)]))
                value = builder.fmul(builder.sitofp(total, fty),
                                     builder.fmul(ws, _splat(builder, rscale, lanes)))
                value = _floor(builder, value, floor)
                at = builder.bitcast(builder.gep(outp[c], [builder.add(i, ir.Constant(I64, first))]),
                                     fty.as_pointer())
                builder.call(mstore, [value, at, ir.Constant(I32, 4), mask])


def _floor(builder, value, floor):
    """max(value, floor) lane by lane, NaN kept (an ordered compare: NaN < floor is false):
    the epilogue's ReLU with floor 0, nothing with floor -inf."""
    return builder.select(builder.fcmp_ordered("<", value, floor), floor, value)


def _lane_masks(builder, valid, lanes):
    """A panel's output edge: (llvm.masked.store of `lanes` float32s, mask(first): the lanes
    first .. first + lanes - 1 whose output column is below `valid`)."""
    idx = ir.Constant(_vec(I32, lanes), list(range(lanes)))
    vcount = _splat(builder, builder.trunc(valid, I32), lanes)
    fty = _vec(F32, lanes)
    mstore = _declare(builder, f"llvm.masked.store.v{lanes}f32.p0", ir.VoidType(), fty,
                      fty.as_pointer(), I32, _vec(ir.IntType(1), lanes))

    def mask(first: int):
        return builder.icmp_signed("<", builder.add(idx, ir.Constant(_vec(I32, lanes),
                                                                     [first] * lanes)), vcount)
    return mstore, mask


def make_panel_tile(isas: dict[bool, str]):
    """The panel tile: tile(P, C, best, pw, xq, base, rs, ss, n, sums, m, sx, scale, i, valid,
    out, off, low) writes max(out[m + c, i + 16 p + j], low) for c < C, p < P, 16 p + j < valid
    (see `_panel_codegen`; sx, scale 1-D float32 contiguous, out's rows contiguous; low float32:
    0 for a ReLU, -inf for none). P, C and best are compile-time constants, best picking the
    instruction set `isas[best]`."""
    @intrinsic
    def tile(typingctx, P, C, best, pw, xq, base, rs, ss, n, sums, m, sx, scale, i, valid, out,
             off, low):
        panels, cols, b = literals(P, C, best)
        sig = types.none(P, C, best, pw, xq, *[types.int64] * 4, sums, types.int64, sx, scale,
                         types.int64, types.int64, out, types.int64, types.float32)

        def codegen(context, builder, signature, args):
            _panel_codegen(panels, cols, isas[b], context, builder, signature.args[3:], args[3:])
            return context.get_dummy_value()
        return sig, codegen
    return tile


def _panel4_codegen(P, C, isa, context, builder, a, args):
    """The int4 panel tile: out[m + c, i + 16 p + j] (16 p + j < valid) = sx[m + c] * the sum over
    groups g of ps[g * P * 16 + 16 p + j] * (the int32 sum over group g's `per` steps of
    (q + 8) x - 8 * sums[m + c, g]), the weights unpacked into the panel as their stored nibbles
    q + 8 (unsigned, 0 .. 15: vpdpbusd's and vpmaddubsw's unsigned operand as they are) and ps
    the group scales packed beside them."""
    (pw, xq, base, rs, ss, groups, per, sums, m, sx, ps, i, valid, out, low) = args
    W = _WIDTH[isa]
    lanes = W // 4
    nvec = 64 // W
    wdata = builder.bitcast(context.make_array(a[0])(context, builder, pw).data, I8.as_pointer())
    sdata = builder.bitcast(context.make_array(a[10])(context, builder, ps).data, F32.as_pointer())
    xp = _grouped_rows(context, builder, a[1], xq, base, rs, C)
    tp = _rows(context, builder, a[7], sums, m, C)
    row_bytes = P * 16 * QUAD
    fty = _vec(F32, lanes)
    fma = _declare(builder, f"llvm.fma.v{lanes}f32", fty, fty, fty, fty)

    def group(b, g, faccs):
        def step(b, j, accs):
            s = b.add(b.mul(g, per), j)
            accs = list(accs)
            for q in range(STEP // QUAD):
                at = b.add(b.mul(s, ir.Constant(I64, (STEP // QUAD) * row_bytes)),
                           ir.Constant(I64, q * row_bytes))
                accs = _quad(b, wdata, at, xp, b.add(b.mul(s, ss), ir.Constant(I64, q * QUAD)),
                             accs, P, isa, False)
            return accs
        izero = ir.Constant(_vec(I32, lanes), None)
        iaccs = _loop(b, per, [izero] * (C * P * nvec), step)
        out = list(faccs)
        for c in range(C):
            fix = _splat(b, b.mul(_load_at(b, tp[c], g), ir.Constant(I32, 8)), lanes)
            for p in range(P):
                for h in range(nvec):
                    k = (c * P + p) * nvec + h
                    at = b.add(b.mul(g, ir.Constant(I64, P * 16)), ir.Constant(I64, p * 16 + h * lanes))
                    scl = b.load(b.bitcast(b.gep(sdata, [at]), fty.as_pointer()), align=4)
                    out[k] = b.call(fma, [b.sitofp(b.sub(iaccs[k], fix), fty), scl, faccs[k]])
        return out

    fzero = ir.Constant(fty, None)
    faccs = _loop(builder, groups, [fzero] * (C * P * nvec), group)
    _store_row_scaled(context, builder, (a[9], sx), (a[13], out), m, i, valid, faccs, P, C, lanes,
                      low)


def _store_row_scaled(context, builder, sx, out, m, i, valid, faccs, P, C, lanes, low):
    """The grouped panel tiles' epilogue: out[m + c, i + 16 p + j] = max(sx[m + c] * the float32
    accumulator of (c, p), low) (`lanes` outputs a vector, 16 / lanes vectors per p), masked to
    the outputs below `valid`. sx, out: (type, value) of the row scales (1-D) and the output
    (2-D); low: float32 (`_floor`)."""
    nvec = 16 // lanes
    fty = _vec(F32, lanes)
    sxp = _elem(context, builder, sx[0], sx[1], m)
    outp = _rows(context, builder, out[0], out[1], m, C)
    mstore, lane_mask = _lane_masks(builder, valid, lanes)
    floor = _splat(builder, low, lanes)
    for p in range(P):
        for h in range(nvec):
            first = p * 16 + h * lanes
            mask = lane_mask(first)
            for c in range(C):
                rscale = builder.load(builder.gep(sxp, [ir.Constant(I64, c)]))
                value = builder.fmul(faccs[(c * P + p) * nvec + h], _splat(builder, rscale, lanes))
                value = _floor(builder, value, floor)
                at = builder.bitcast(builder.gep(outp[c], [builder.add(i, ir.Constant(I64, first))]),
                                     fty.as_pointer())
                builder.call(mstore, [value, at, ir.Constant(I32, 4), mask])


def make_panel4_tile(isas: dict[bool, str]):
    """The int4 panel tile: tile(P, C, best, pw, xq, base, rs, ss, groups, per, sums, m, sx, ps,
    i, valid, out, low) (see `_panel4_codegen`; outputs floored at low as the panel tile's); P,
    C and best compile-time constants."""
    @intrinsic
    def tile(typingctx, P, C, best, pw, xq, base, rs, ss, groups, per, sums, m, sx, ps, i, valid,
             out, low):
        panels, cols, b = literals(P, C, best)
        sig = types.none(P, C, best, pw, xq, *[types.int64] * 5, sums, types.int64, sx, ps,
                         types.int64, types.int64, out, types.float32)

        def codegen(context, builder, signature, args):
            _panel4_codegen(panels, cols, isas[b], context, builder, signature.args[3:], args[3:])
            return context.get_dummy_value()
        return sig, codegen
    return tile


def _panel_grouped_codegen(P, C, Q, isa, context, builder, a, args):
    """The grouped int8 panel tile (GGUF's blocks, io/formats.py's int8g32 / int8g16): out[m + c,
    i + 16 p + j] (16 p + j < valid) = sx[m + c] * the sum over groups g of Q quads (4 Q columns)
    of ps[(2 g) * P * 16 + 16 p + j] * (the int32 sum of the group's (w + off) x - off *
    sums[m + c, g]) + ps[(2 g + 1) * P * 16 + 16 p + j] * sums[m + c, g]: each group's scale
    and offset (value = q * scale + offset), packed beside the panel's weights (`_pack`'s layout,
    each weight + off(isa)). A group lies within one STEP of the input rows (4 Q divides STEP)."""
    (pw, xq, base, rs, ss, groups, sums, m, sx, ps, i, valid, out, off, low) = args
    W = _WIDTH[isa]
    lanes = W // 4
    nvec = 64 // W
    wdata = builder.bitcast(context.make_array(a[0])(context, builder, pw).data, I8.as_pointer())
    sdata = builder.bitcast(context.make_array(a[9])(context, builder, ps).data, F32.as_pointer())
    xp = _grouped_rows(context, builder, a[1], xq, base, rs, C)
    tp = _rows(context, builder, a[6], sums, m, C)
    row_bytes = P * 16 * QUAD
    fty = _vec(F32, lanes)
    fma = _declare(builder, f"llvm.fma.v{lanes}f32", fty, fty, fty, fty)
    per_step = STEP // (QUAD * Q)      # groups in one STEP of the input rows

    def group(b, g, faccs):
        s = b.udiv(g, ir.Constant(I64, per_step))
        first = b.add(b.mul(s, ss), b.mul(b.urem(g, ir.Constant(I64, per_step)),
                                          ir.Constant(I64, Q * QUAD)))
        izero = ir.Constant(_vec(I32, lanes), None)
        iaccs = [izero] * (C * P * nvec)
        for q in range(Q):
            at = b.mul(b.add(b.mul(g, ir.Constant(I64, Q)), ir.Constant(I64, q)),
                       ir.Constant(I64, row_bytes))
            iaccs = _quad(b, wdata, at, xp, b.add(first, ir.Constant(I64, q * QUAD)), iaccs, P,
                          isa, isa not in _VNNI)
        out = list(faccs)
        for c in range(C):
            total = _load_at(b, tp[c], g)
            fix = _splat(b, b.mul(total, b.trunc(off, I32)), lanes)
            tsum = _splat(b, b.sitofp(total, F32), lanes)
            for p in range(P):
                for h in range(nvec):
                    k = (c * P + p) * nvec + h
                    lane0 = ir.Constant(I64, p * 16 + h * lanes)
                    at = b.add(b.mul(g, ir.Constant(I64, 2 * P * 16)), lane0)
                    scl = b.load(b.bitcast(b.gep(sdata, [at]), fty.as_pointer()), align=4)
                    at = b.add(at, ir.Constant(I64, P * 16))
                    ofs = b.load(b.bitcast(b.gep(sdata, [at]), fty.as_pointer()), align=4)
                    value = b.call(fma, [b.sitofp(b.sub(iaccs[k], fix), fty), scl, faccs[k]])
                    out[k] = b.call(fma, [tsum, ofs, value])
        return out

    fzero = ir.Constant(fty, None)
    faccs = _loop(builder, groups, [fzero] * (C * P * nvec), group)
    _store_row_scaled(context, builder, (a[8], sx), (a[12], out), m, i, valid, faccs, P, C, lanes,
                      low)


def make_panel_grouped_tile(isas: dict[bool, str]):
    """The grouped int8 panel tile: tile(P, C, Q, best, pw, xq, base, rs, ss, groups, sums, m,
    sx, ps, i, valid, out, off, low) (see `_panel_grouped_codegen`; outputs floored at low as
    the panel tile's); P, C, Q (quads per group) and best compile-time constants."""
    @intrinsic
    def tile(typingctx, P, C, Q, best, pw, xq, base, rs, ss, groups, sums, m, sx, ps, i, valid,
             out, off, low):
        panels, cols, quads, b = literals(P, C, Q, best)
        sig = types.none(P, C, Q, best, pw, xq, *[types.int64] * 4, sums, types.int64, sx, ps,
                         types.int64, types.int64, out, types.int64, types.float32)

        def codegen(context, builder, signature, args):
            _panel_grouped_codegen(panels, cols, quads, isas[b], context, builder,
                                   signature.args[4:], args[4:])
            return context.get_dummy_value()
        return sig, codegen
    return tile
