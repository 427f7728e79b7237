"""int8 x int8 products (compute="int8"): input rows quantised to int8 on the fly, integer dot
products on the CPU's dot-product instructions (`tiles`), int32 sums scaled back to float32.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload
from numba.np.ufunc.parallel import _iget_num_threads

from . import NO_FLOOR, tiles
from .float_products import matmul_i8g
from .step_ops import norm_row
from .widening import I8


# -- int8 x int8 products (compute="int8") ----------------------------------------------------------------
# Each input row is quantised on the fly, symmetric, one scale per row (absmax / 127, round to
# nearest even), the integer products run on the dot-product instructions (`tiles`: tiles of R
# weight rows x C input rows of vpdpbusd, int32 sums) and each output is sum * row scale * weight
# scale. The quantised rows, their sums and scales go to `work`, the runtime's scratch (the caller
# passes as many rows at a time as fit: `kernels.quantised_bytes`). `best` False runs the tiles
# built for `tiles.FALLBACK` instead (what a CPU without VNNI runs; the tests compare both).
#
# Layout of the quantised rows (`_place`), M x K bytes as before: rows in groups of 4, each
# group's first K // 64 * 64 columns interleaved 64 at a time (row c's step s at byte
# s * 256 + c * 64 of the group), then the 4 rows' last K % 64 columns one row after another;
# the M % 4 rows past the last group plainly, row after row. A 4-row tile then reads its input
# rows as one sequential stream (as the bfloat16 products do: bfloat16_products.py).
#
# Blocking (as bfloat16_products.py's, measured in benchmarks/bench_int8_products.py): tasks of
# up to MAX_BLOCK weight rows under prange (fewer, down to MIN_BLOCK, where a thread would get
# fewer than 2); in a task the first (up to) 4 input rows take the weight rows one at a time
# (1 x 4 tiles: the weights stream in from memory in order, and the block lands in L2), then each
# further group of 4 input rows takes them 4 at a time (4 x 4 tiles: 16 vpdpbusd per 8 loads,
# the 4 input rows in L1), the last M % 4 rows 4 x 1. Every sum runs over the whole of K at once
# (exact int32; a block of 128 rows of K = 3072 int8 is 384 KiB, within L2, so no K chunking).
#
# From PANEL_MIN_ROWS input rows on (an encoder pass; int8 weights need K a multiple of 64, int4
# ones have it), the products take panels instead (`_panels`, `tiles.make_panel_tile`): each task repacks PANEL
# weight rows so that a vector holds 4 columns of 16 of them, and each group of 4 input rows runs
# the whole of K against the panel with its columns broadcast, 16 outputs per accumulator: no
# lane sums at the end (the 4 x 4 tiles' `_fold` costs about a tenth of the work at K = 768). The
# loop per 64 columns compiles (LLVM 22, znver4) to 256 vpdpbusd zmm, 64 vmovdqu64 and 64
# vpbroadcastd, all on registers.
# int4 panels hold the weights' nibbles unpacked to bytes (q + 8, `_pack4`) and their group
# scales: an int32 sum per group, then one conversion and multiply-add per 16 outputs.
_tile = tiles.make_group_tile({True: tiles.ISA, False: tiles.FALLBACK})
OFFSET_BEST, OFFSET_FALLBACK = tiles.offset(tiles.ISA), tiles.offset(tiles.FALLBACK)
STEP = tiles.STEP                        # columns (bytes) of a row interleaved at a time
I4 = tiles.INT4               # the tiles' kinds: I8 (the int8 storage format) and I4
assert tiles.INT8 == I8
QUANTISE_PARALLEL = 1 << 16             # elements of input above which rows quantise in parallel
MIN_BLOCK, MAX_BLOCK = 32, 128          # weight rows per parallel task (`_block_rows`)
_panel = tiles.make_panel_tile({True: tiles.ISA, False: tiles.FALLBACK})
_panel4 = tiles.make_panel4_tile({True: tiles.ISA, False: tiles.FALLBACK})
_panel_g = tiles.make_panel_grouped_tile({True: tiles.ISA, False: tiles.FALLBACK})
PANEL = tiles.PANEL
TILES = PANEL // 16                     # a panel's vectors of 16 weight rows: always whole
PANEL_MIN_ROWS = 256                    # input rows from which the products take the panels
                                        # (below, repacking the weights costs what it saves)


@intrinsic
def _abs_bits(typingctx, v):
    """|v| as the int32 of its bits: they order as |v| does, inf above every finite value and NaN
    above inf, so one integer max (which vectorises; a float max with NaN semantics does not)
    gives the row's absmax and whether it is finite."""
    def codegen(context, builder, signature, args):
        bits = builder.bitcast(args[0], ir.IntType(32))
        return builder.and_(bits, ir.Constant(ir.IntType(32), 0x7FFFFFFF))
    return types.int32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, v):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@njit(inline="always")
def _place(M, K, m):
    """Where quantised row m is (`_carve`'s int8 buffer, byte offsets): (base, rs, ss, tb, ts),
    its step s (columns s * STEP ..) at base + s * ss, its last K % STEP columns at tb; rows
    m + c of the same group (or, past the groups, the next rows) at base + c * rs and tb + c * ts."""
    main = K // STEP * STEP
    if m < M // 4 * 4:
        g0, c = (m // 4) * 4 * K, m % 4
        return g0 + c * STEP, STEP, 4 * STEP, g0 + 4 * main + c * (K - main), K - main
    return m * K, K, STEP, m * K + main, K


@njit(inline="always")
def _quantise_row(xr, xq, base, ss, tb, sums, G):
    """Row xr quantised into its place in xq (`_place`): round(xr * 127 / absmax) (int8), sums[g]
    the sum of columns g * G .. g * G + G - 1 of it (G a multiple of STEP, or K, or a divisor
    of STEP where K is a multiple of STEP); returns the
    row's scale absmax / 127 (NaN when the row holds inf or NaN: its outputs are NaN, which
    generation names; 0 for a zero row, its quantised values and sums 0)."""
    K = xr.shape[0]
    main = K // STEP * STEP
    top = np.int32(0)
    for k in range(K):
        top = max(top, _abs_bits(xr[k]))
    sums[:] = 0
    if top >= np.int32(0x7F800000) or top == 0:
        for s in range(K // STEP):
            xq[base + s * ss:base + s * ss + STEP] = 0
        xq[tb:tb + K - main] = 0
        return np.float32(np.nan) if top else np.float32(0.0)
    amax = _bits_f32(top)
    inv = np.float32(127.0) / amax
    for s in range(K // STEP):
        part = xq[base + s * ss:base + s * ss + STEP]
        src = xr[s * STEP:s * STEP + STEP]
        if G >= STEP:
            t = np.int32(0)
            for k in range(STEP):
                q = np.int8(np.rint(src[k] * inv))
                part[k] = q
                t += np.int32(q)
            sums[s * STEP // G] += t
            continue
        for k0 in range(0, STEP, G):                  # (GGUF's groups: 16 or 32 columns)
            t = np.int32(0)
            for k in range(k0, k0 + G):
                q = np.int8(np.rint(src[k] * inv))
                part[k] = q
                t += np.int32(q)
            sums[(s * STEP + k0) // G] += t
    tail = xq[tb:tb + K - main]
    t = np.int32(0)
    for k in range(K - main):
        q = np.int8(np.rint(xr[main + k] * inv))
        tail[k] = q
        t += np.int32(q)
    if K > main:
        sums[main // G] += t
    return amax / np.float32(127.0)


@njit(cache=True)
def _carve(work, M, K, groups):
    """The quantised rows (M x K int8 in `_place`'s layout, 1-D), their group sums (M, groups)
    int32 and scales (M,) float32 in the byte buffer `work` (64-byte aligned parts;
    kernels.quantised_bytes sizes it: keep the two layouts the same)."""
    a = (M * K + 63) // 64 * 64
    b = a + (M * groups * 4 + 63) // 64 * 64
    xq = work[:M * K].view(np.int8)
    sums = work[a:a + M * groups * 4].view(np.int32).reshape((M, groups))
    sx = work[b:b + M * 4].view(np.float32)
    return xq, sums, sx


@njit(parallel=True, cache=True)
def _quantise(x, work, groups):
    M, K = x.shape
    xq, sums, sx = _carve(work, M, K, groups)
    G = K // groups
    if M * K >= QUANTISE_PARALLEL:
        for m in prange(M):
            base, _, ss, tb, _ = _place(M, K, m)
            sx[m] = _quantise_row(x[m], xq, base, ss, tb, sums[m], G)
    else:
        for m in range(M):
            base, _, ss, tb, _ = _place(M, K, m)
            sx[m] = _quantise_row(x[m], xq, base, ss, tb, sums[m], G)
    return xq, sums, sx


@njit(inline="always")
def _run(kind, R, C, best, w, scale, i, xq, M, K, m, sums, n, tail, per, sx, out, off):
    base, rs, ss, tb, ts = _place(M, K, m)
    _tile(kind, R, C, best, w, scale, i, xq, base, rs, ss, tb, ts, sums, m, n, tail, per, sx,
          out, off)


@njit(inline="always")
def _stream_pass(kind, best, w, scale, n0, n1, xq, M, K, cols, sums, n, tail, per, sx, out, off):
    """out[:cols, n0:n1] one weight row at a time (1 x cols tiles, cols <= 4): the weight rows
    are read in order, one sequential stream, which the hardware prefetcher follows (4 rows at
    a time are 4 interleaved streams), and the block lands in L2 for the later passes. The 1 x 4
    tile's loop (LLVM 22, znver4) is, per 4 steps of 64 columns, 4 vpxorq that load and flip the
    weights and 16 vpdpbusd with the input rows as memory operands (2 accumulators per pair):
    5 vector loads per 4 vpdpbusd, so it is bound by loads, not by the products, where the
    weights are in cache (decoding's 1-16 rows: measured in benchmarks/bench_int8_products.py)."""
    for i in range(n0, n1):
        if cols == 4:
            _run(kind, 1, 4, best, w, scale, i, xq, M, K, 0, sums, n, tail, per, sx, out, off)
        elif cols == 3:
            _run(kind, 1, 3, best, w, scale, i, xq, M, K, 0, sums, n, tail, per, sx, out, off)
        elif cols == 2:
            _run(kind, 1, 2, best, w, scale, i, xq, M, K, 0, sums, n, tail, per, sx, out, off)
        else:
            _run(kind, 1, 1, best, w, scale, i, xq, M, K, 0, sums, n, tail, per, sx, out, off)


@njit(inline="always")
def _cached_pass(kind, best, w, scale, n0, n1, xq, M, K, m, cols, sums, n, tail, per, sx, out,
                 off):
    """out[m:m + cols, n0:n1] (cols 4 or 1) from a block of weight rows already in L2: 4 weight
    rows x cols input rows per tile, 1 x cols at the block's edge."""
    i = n0
    while i < n1:
        rows = 4 if i + 4 <= n1 else 1
        if rows == 4 and cols == 4:
            _run(kind, 4, 4, best, w, scale, i, xq, M, K, m, sums, n, tail, per, sx, out, off)
        elif rows == 4:
            _run(kind, 4, 1, best, w, scale, i, xq, M, K, m, sums, n, tail, per, sx, out, off)
        elif cols == 4:
            _run(kind, 1, 4, best, w, scale, i, xq, M, K, m, sums, n, tail, per, sx, out, off)
        else:
            _run(kind, 1, 1, best, w, scale, i, xq, M, K, m, sums, n, tail, per, sx, out, off)
        i += rows


@njit(inline="always")
def _block_rows(N, threads):
    """Weight rows per parallel task: MAX_BLOCK, or fewer (down to MIN_BLOCK, whole tiles of 4)
    where that would leave a thread without 2 tasks (every task reads all the input rows again:
    large blocks read them fewer times)."""
    per_task = (N + 2 * threads - 1) // (2 * threads)
    return min(MAX_BLOCK, max(MIN_BLOCK, (per_task + 3) // 4 * 4))


@njit(inline="always")
def _pack(w, n0, nb, width, flip, words):
    """Weight rows n0 .. n0 + nb - 1 (int8, K % 4 == 0) into `words` (uint32, K / 4 x width):
    word j * width + r holding columns 4 j .. 4 j + 3 of row n0 + r, each byte XOR flip (0x80
    makes them the unsigned w + 128 that vpdpbusd takes), rows nb .. width - 1 zero."""
    K = w.shape[1]
    for r in range(nb):
        src = w[n0 + r].view(np.uint32)
        for j in range(K // 4):
            words[j * width + r] = src[j] ^ flip
    for r in range(nb, width):
        for j in range(K // 4):
            words[j * width + r] = 0


@njit(inline="always")
def _panel_row(C, best, pw, xq, M, K, m, sums, sx, scale, n0, nb, out, off, low):
    base, rs, ss, _, _ = _place(M, K, m)
    n = K // STEP
    _panel(TILES, C, best, pw, xq, base, rs, ss, n, sums, m, sx, scale, n0, nb, out, off, low)


def _scale_at(scale, n, g):
    """scale[n, g] (int4's group scales); typed for int8's 1-D scales too, which never reach it
    (both kinds share one kernel body, typed whole)."""


@overload(_scale_at)
def _scale_at_typed(scale, n, g):
    if scale.ndim == 1:
        return lambda scale, n, g: scale[n]
    return lambda scale, n, g: scale[n, g]


@njit(inline="always")
def _pack4(w, scale, groups, n0, nb, width, words, ps):
    """int4 weight rows n0 .. n0 + nb - 1 (32 bytes per 64 columns: byte j of block b holds column
    64 b + j in its low nibble, 64 b + 32 + j in its high one) unpacked to their nibbles q + 8
    into `words` as `_pack` lays them out, and their group scales into ps (groups x width
    float32); rows nb .. width - 1 zero."""
    K = w.shape[1] * 2
    row = np.empty(K, np.uint8)
    for r in range(nb):
        src = w[n0 + r]
        for b in range(K // 64):
            for j in range(32):
                v = src[b * 32 + j]
                row[b * 64 + j] = np.uint8(v) & np.uint8(15)
                row[b * 64 + 32 + j] = np.uint8(v) >> np.uint8(4)
        packed = row.view(np.uint32)
        for j in range(K // 4):
            words[j * width + r] = packed[j]
        for g in range(groups):
            ps[g * width + r] = _scale_at(scale, n0 + r, g)
    for r in range(nb, width):
        for j in range(K // 4):
            words[j * width + r] = 0
        for g in range(groups):
            ps[g * width + r] = 0


@njit(inline="always")
def _panel4_row(C, best, pw, xq, M, K, m, groups, per, sums, sx, ps, n0, nb, out, low):
    base, rs, ss, _, _ = _place(M, K, m)
    _panel4(TILES, C, best, pw, xq, base, rs, ss, groups, per, sums, m, sx, ps, n0, nb, out, low)


@njit(inline="always")
def _panels4(w, scale, groups, out, xq, sums, sx, M, K, best, low):
    """`_panels` for int4 weights: the panel holds their nibbles unpacked (q + 8) and their
    group scales (`_pack4`), the tile a float32 sum of the groups' exact int32 sums."""
    N = w.shape[0]
    per = K // groups // STEP
    for b in prange((N + PANEL - 1) // PANEL):
        n0 = b * PANEL
        nb = min(N, n0 + PANEL) - n0
        pw = tiles.aligned_bytes(K * PANEL)   # (a partial panel: zero rows past nb)
        ps = np.empty(groups * PANEL, np.float32)
        _pack4(w, scale, groups, n0, nb, PANEL, pw.view(np.uint32), ps)
        m = 0
        while m + 4 <= M:
            _panel4_row(4, best, pw, xq, M, K, m, groups, per, sums, sx, ps, n0, nb, out, low)
            m += 4
        while m < M:
            _panel4_row(1, best, pw, xq, M, K, m, groups, per, sums, sx, ps, n0, nb, out, low)
            m += 1


@njit(inline="always")
def _panels(w, scale, out, xq, sums, sx, M, K, best, off, low):
    """out (int8 weights, K a multiple of STEP) by panels of PANEL weight rows, one per parallel
    task: the panel repacked (`_pack`, into a buffer of the task's own, 64-byte aligned), then
    every 4 input rows of a group take it whole (4 x 16 accumulators: 16 vpdpbusd per 4 loads of
    weights and 4 broadcasts), the last M % 4 rows one at a time. The last panel of N % PANEL
    rows is packed whole, zero rows past nb, and runs the same tile (its stores masked): one
    build of the tile, not one per width (a cold compile of the int8, int4 and grouped
    products 55.6 -> 44-49 s, benchmarks/README.md)."""
    N = w.shape[0]
    flip = np.uint32(0x80808080) if off else np.uint32(0)
    for b in prange((N + PANEL - 1) // PANEL):
        n0 = b * PANEL
        nb = min(N, n0 + PANEL) - n0
        pw = tiles.aligned_bytes(K * PANEL)   # (a partial panel: zero rows past nb)
        _pack(w, n0, nb, PANEL, flip, pw.view(np.uint32))
        m = 0
        while m + 4 <= M:
            _panel_row(4, best, pw, xq, M, K, m, sums, sx, scale, n0, nb, out, off, low)
            m += 4
        while m < M:
            _panel_row(1, best, pw, xq, M, K, m, sums, sx, scale, n0, nb, out, off, low)
            m += 1


@njit(inline="always")
def _norm_quantise_rows(x, delta, add, weight, eps, xq, sums, sx, G, m0, m1):
    M, K = x.shape
    h = np.empty(K, np.float32)               # one normed row, in L1
    for m in range(m0, m1):
        norm_row(x, delta, add, weight, eps, m, h)
        base, _, ss, tb, _ = _place(M, K, m)
        sx[m] = _quantise_row(h, xq, base, ss, tb, sums[m], G)


@njit(parallel=True, cache=True)
def add_rms_norm_quantised(x, delta, weight, eps, work, groups):
    """x (M, K) += delta (skipped when delta has no rows), then each row's RMS norm
    (`step_ops.norm_row`, the float norm's own arithmetic) quantised into `work` exactly as
    `_quantise` quantises the float norm (`_carve`'s parts, `groups` sums a row): the norm in
    front of an int8 x int8 product, whose float rows are never written. The product then takes
    them with `ready` (its x only giving the shape)."""
    M, K = x.shape
    xq, sums, sx = _carve(work, M, K, groups)
    G = K // groups
    add = delta.shape[0] == M
    if M * K < QUANTISE_PARALLEL:             # a decoding step's rows: no parallel region
        _norm_quantise_rows(x, delta, add, weight, eps, xq, sums, sx, G, 0, M)
        return
    tasks = min(M, 4 * _iget_num_threads())
    for t in prange(tasks):
        _norm_quantise_rows(x, delta, add, weight, eps, xq, sums, sx, G, t * M // tasks,
                            (t + 1) * M // tasks)


@njit(inline="always")
def _rows_of(x, work, groups, ready):
    """The quantised rows of x in `work` (`_carve`'s parts): quantised here, or, when `ready`,
    already there (`add_rms_norm_quantised` wrote them; x only gives the shape)."""
    M, K = x.shape
    if ready:
        return _carve(work, M, K, groups)
    return _quantise(x, work, groups)


@njit(inline="always")
def _floor_all(out, low):
    """out = max(out, low) (NaN kept): the epilogue's ReLU where the tiles store plainly."""
    if low > -np.inf:
        M, N = out.shape
        for m in range(M):
            row = out[m]
            for n in range(N):
                if row[n] < low:
                    row[n] = low


@njit(parallel=True, cache=True)
def _qmatmul(x, w, scale, out, work, kind, best, low, ready):
    """out = max(quantised(x) @ w.T, low) with int8 (kind I8: scale per row) or int4 (I4: scale
    per group) weights, on the `best` tiles or the fallback's (low: 0 a ReLU, -inf none; ready:
    `_rows_of`)."""
    numba.literally(kind)                # one build per kind and instruction set: the others'
    numba.literally(best)                # tiles are not compiled
    M, K = x.shape
    N = w.shape[0]
    # (both kinds' code is typed whatever the kind, so it reads only what both arrays have)
    if kind == I8:
        groups, n, per = 1, K // STEP, 0
        tail = K - n * STEP              # one more masked step: every sum is over all of K
        off = OFFSET_BEST if best else OFFSET_FALLBACK
    else:
        groups = scale.shape[-1]
        n, tail, off = groups, 0, 0
        per = K // groups // 64          # 64-column blocks per group (K: whole blocks)
    xq, sums, sx = _rows_of(x, work, groups, ready)
    if kind == I8 and M >= PANEL_MIN_ROWS and tail == 0:
        _panels(w, scale, out, xq, sums, sx, M, K, best, off, low)
        return
    if kind == I4 and M >= PANEL_MIN_ROWS:
        _panels4(w, scale, groups, out, xq, sums, sx, M, K, best, low)
        return
    # (numba's own get_num_threads reads a ctypes pointer, which numba cannot cache; this is
    # the symbol its parallel loops call, resolved when the cached code loads)
    rows = _block_rows(N, _iget_num_threads())
    first = min(M, 4)
    for b in prange((N + rows - 1) // rows):
        n0 = b * rows
        n1 = min(N, n0 + rows)
        _stream_pass(kind, best, w, scale, n0, n1, xq, M, K, first, sums, n, tail, per, sx,
                     out, off)
        m = first
        while m < M:
            cols = 4 if m + 4 <= M else 1
            _cached_pass(kind, best, w, scale, n0, n1, xq, M, K, m, cols, sums, n, tail, per,
                         sx, out, off)
            m += cols
    _floor_all(out, low)


# -- GGUF's blocks (int8g32 / int8g16): int8 q with a scale and an offset per group ----------------------
# compute="int8" multiplies the blocks' own q (no second rounding of the weights) by the quantised
# input rows: each group's int32 sum times its scale, plus its offset times the group's sum of the
# input row (value = q * scale + offset). From PANEL_MIN_ROWS rows (K a multiple of STEP) the
# panels, as int8's, with the group scales and offsets packed beside them
# (`tiles.make_panel_grouped_tile`); fewer rows multiply the quantised rows, as float32, by the
# widened blocks (`matmul_i8g`): the same products, summed in float32.
@njit(inline="always")
def _pack_grouped(w, params, n0, nb, width, flip, words, ps):
    """`_pack` for the grouped format, and the rows' (scale, offset) per group g into ps at
    (2 g) * width + r and (2 g + 1) * width + r (zero past nb)."""
    _pack(w, n0, nb, width, flip, words)
    groups = params.shape[1]
    for r in range(width):
        for g in range(groups):
            ps[2 * g * width + r] = params[n0 + r, g, 0] if r < nb else 0
            ps[(2 * g + 1) * width + r] = params[n0 + r, g, 1] if r < nb else 0


@njit(inline="always")
def _grouped_row(C, Q, best, pw, xq, M, K, m, groups, sums, sx, ps, n0, nb, out, off, low):
    base, rs, ss, _, _ = _place(M, K, m)
    _panel_g(TILES, C, Q, best, pw, xq, base, rs, ss, groups, sums, m, sx, ps, n0, nb, out, off,
             low)


@njit(inline="always")
def _grouped_panels(w, params, out, xq, sums, sx, M, K, Q, best, off, low):
    """`_panels` for the grouped format: Q quads (4 Q columns) a group."""
    N = w.shape[0]
    groups = params.shape[1]
    flip = np.uint32(0x80808080) if off else np.uint32(0)
    for b in prange((N + PANEL - 1) // PANEL):
        n0 = b * PANEL
        nb = min(N, n0 + PANEL) - n0
        pw = tiles.aligned_bytes(K * PANEL)   # (a partial panel: zero rows past nb)
        ps = np.empty(2 * groups * PANEL, np.float32)
        _pack_grouped(w, params, n0, nb, PANEL, flip, pw.view(np.uint32), ps)
        m = 0
        while m + 4 <= M:
            _grouped_row(4, Q, best, pw, xq, M, K, m, groups, sums, sx, ps, n0, nb, out, off,
                         low)
            m += 4
        while m < M:
            _grouped_row(1, Q, best, pw, xq, M, K, m, groups, sums, sx, ps, n0, nb, out, off,
                         low)
            m += 1


@njit(inline="always")
def _quantised_floats(x, work):
    """x (M, K) with each row rounded to int8 steps of its own (`_quantise_row`'s rounding), as
    float32 in `work` (a row holding inf or NaN: NaN; a zero row: zeros)."""
    M, K = x.shape
    skip = (64 - tiles.address(work) % 64) % 64
    xf = work[skip:skip + M * K * 4].view(np.float32).reshape((M, K))
    for m in range(M):
        top = np.int32(0)
        for k in range(K):
            top = max(top, _abs_bits(x[m, k]))
        if top >= np.int32(0x7F800000):
            xf[m, :] = np.nan
            continue
        if top == 0:
            xf[m, :] = 0
            continue
        amax = _bits_f32(top)
        inv, step = np.float32(127.0) / amax, amax / np.float32(127.0)
        for k in range(K):
            xf[m, k] = np.float32(np.rint(x[m, k] * inv)) * step
    return xf


def grouped_work_bytes(M: int, K: int, groups: int) -> int:
    """Scratch bytes of `qmatmul_i8g` for M input rows of K columns in `groups` groups: the
    panels' quantised rows where `_qmatmul_grouped` takes the panels, else the rows as float32
    (a caller that cuts M rows into parts to fit its scratch keeps parts of 256 rows and more on
    the panels: their bytes grow with M alone)."""
    from . import quantised_bytes
    if _takes_panels(M, K, groups):
        return quantised_bytes(M, K, groups)
    return M * K * 4 + 64


@njit(inline="always")
def _takes_panels(M, K, groups):
    """Whether `_qmatmul_grouped` runs M rows of K columns in `groups` groups on the panels."""
    G = K // groups if groups else 0
    return M >= PANEL_MIN_ROWS and K % STEP == 0 and (G == 32 or G == 16)


@njit(parallel=True, cache=True)
def _qmatmul_grouped(x, w, params, out, work, best, low):
    numba.literally(best)
    M, K = x.shape
    groups = params.shape[1]
    G = K // groups if groups else 0
    if _takes_panels(M, K, groups):
        off = OFFSET_BEST if best else OFFSET_FALLBACK
        xq, sums, sx = _quantise(x, work, groups)
        if G == 32:
            _grouped_panels(w, params, out, xq, sums, sx, M, K, 8, best, off, low)
        else:
            _grouped_panels(w, params, out, xq, sums, sx, M, K, 4, best, off, low)
        return
    matmul_i8g(_quantised_floats(x, work), w, params, out)
    _floor_all(out, low)


# The entries. `low` floors the outputs in the products' epilogue (0: the FF's ReLU; NO_FLOOR:
# none); `ready` says the int8 and int4 products' input rows are already quantised in `work`
# (`add_rms_norm_quantised`: the norm in front of the product wrote them, not float rows; x then
# gives only the shape). The compiled entries take both always (one build each); the Python
# names default them.
@njit(cache=True)
def _qmatmul_i8g(x, w, params, out, work, low):
    _qmatmul_grouped(x, w, params, out, work, True, low)


@njit(cache=True)
def _qmatmul_i8g_fallback(x, w, params, out, work, low):
    _qmatmul_grouped(x, w, params, out, work, False, low)


@njit(cache=True)
def _qmatmul_i8(x, w, scale, out, work, low, ready):
    _qmatmul(x, w, scale, out, work, I8, True, low, ready)


@njit(cache=True)
def _qmatmul_i8_fallback(x, w, scale, out, work, low, ready):
    _qmatmul(x, w, scale, out, work, I8, False, low, ready)


@njit(cache=True)
def _qmatmul_i4(x, w, scale, out, work, low, ready):
    _qmatmul(x, w, scale, out, work, I4, True, low, ready)


@njit(cache=True)
def _qmatmul_i4_fallback(x, w, scale, out, work, low, ready):
    _qmatmul(x, w, scale, out, work, I4, False, low, ready)


def qmatmul_i8g(x, w, params, out, work, low=NO_FLOOR):
    """out = max(quantised(x) @ (w * scale + offset per group).T, low): GGUF's blocks (int8 q
    (N, K), params (N, groups, 2) float32 scale and offset) times the input rows quantised per
    row; work: grouped_work_bytes(M, K, groups) bytes."""
    _qmatmul_i8g(x, w, params, out, work, np.float32(low))


def qmatmul_i8g_fallback(x, w, params, out, work, low=NO_FLOOR):
    """qmatmul_i8g on the tiles a CPU without VNNI runs."""
    _qmatmul_i8g_fallback(x, w, params, out, work, np.float32(low))


def qmatmul_i8(x, w, scale, out, work, low=NO_FLOOR, ready=False):
    """out = max(quantised(x) @ (w * scale).T, low), int8 weights (N, K), scale (N,)."""
    _qmatmul_i8(x, w, scale, out, work, np.float32(low), ready)


def qmatmul_i8_fallback(x, w, scale, out, work, low=NO_FLOOR, ready=False):
    _qmatmul_i8_fallback(x, w, scale, out, work, np.float32(low), ready)


def qmatmul_i4(x, w, scale, out, work, low=NO_FLOOR, ready=False):
    """qmatmul_i8 for int4 weights (N, K / 2 bytes), scale (N, groups)."""
    _qmatmul_i4(x, w, scale, out, work, np.float32(low), ready)


def qmatmul_i4_fallback(x, w, scale, out, work, low=NO_FLOOR, ready=False):
    _qmatmul_i4_fallback(x, w, scale, out, work, np.float32(low), ready)
