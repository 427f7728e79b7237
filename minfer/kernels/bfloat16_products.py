"""bfloat16 x bfloat16 products (compute="bfloat16"): out (M, N) float32 = bf16(x) (M, K) @
w (N, K).T, for weights stored as bfloat16 (uint16 bits, the layout minfer already keeps them in)
or as fp8 codes with a scale per row (every fp8 value is a bfloat16: see the fp8 section). Each
activation is rounded to bfloat16 (to nearest, ties to even, NaN kept NaN, as torch rounds) once
per product into the caller's scratch, then the products run on the
bfloat16 dot-product tiles (`bfloat16_tiles`: vdpbf16ps on AVX512_BF16 CPUs, a widening
fallback elsewhere), accumulating in float32.

The scratch (`work`, bytes: `bmatmul_work_bytes`) holds the rounded rows in groups of 4,
interleaved 32 columns at a time (`_carve`), each row padded to whole 32-column steps, from a
64-byte boundary. `best` False runs the tiles built for `bfloat16_tiles.FALLBACK` (what a CPU
without AVX512_BF16 runs; the tests compare both).

Blocking (measured on 2 Zen 4 cores, benchmarks/bench_bfloat16_products.py): blocks of up to
128 weight rows are spread over the threads (`prange`, `_block_rows`). In a block, the first 4
input rows take the weight rows one at a time (1 x 4 tiles: one sequential stream from memory,
which the hardware prefetcher follows; it also brings the block into L2), then every further
4 input rows take them 4 at a time (4 x 4 tiles, 16 vdpbf16ps per 8 loads, the 4 input rows in
L1), KC columns per pass. On (2048, 768) x (3072, 768) that is 2.0x OpenBLAS's sgemm on the
same shapes (400 against 196 GFLOP/s, 2 threads), 1.6-1.8x on (2048, 3072) x (768, 3072), and
1.2-3x `matmul_bf16` (float32 compute, widening in registers) at 1-8 rows. From PANEL_MIN_ROWS
input rows (an encoder pass) the products take panels instead (`_panels`,
`bfloat16_tiles.make_panel_tile`): no lane sums, whole outputs per accumulator lane.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic
from numba.np.ufunc.parallel import _iget_num_threads

from ..io.tensors import FP8_BFLOAT16
from . import bfloat16_tiles, tiles
from .float_products import matmul_e4m3, matmul_e5m2

_tile = bfloat16_tiles.make_tile({True: bfloat16_tiles.ISA, False: bfloat16_tiles.FALLBACK})
_panel = bfloat16_tiles.make_panel_tile({True: bfloat16_tiles.ISA, False: bfloat16_tiles.FALLBACK})
PANEL = bfloat16_tiles.PANEL
PANEL_MIN_ROWS = 256                   # input rows from which the products take the panels
                                       # (below, repacking the weights costs what it saves)
# fp8 codes -> their exact bfloat16 bits (every E4M3 / E5M2 value is a bfloat16, subnormals
# included): the panels of fp8 weights hold these, and the row scale multiplies the sums
E4M3_BFLOAT16 = FP8_BFLOAT16["F8_E4M3"]
E5M2_BFLOAT16 = FP8_BFLOAT16["F8_E5M2"]
NO_TABLE = np.zeros(0, np.uint16)      # bfloat16 weights: their bits as they are
STEP = bfloat16_tiles.STEP             # columns per tile step: rows are padded to a multiple
GROUP = bfloat16_tiles.GROUP           # rows interleaved step by step in the scratch
ALIGN = 64                             # bytes: each rounded row starts on a cache line
MIN_BLOCK, MAX_BLOCK = 32, 128          # weight rows per parallel task (`_block_rows`)
KC = 2048                              # columns per pass over a block: 128 rows x 2048 x 2 bytes
                                       # = 512 KiB, half of a Zen 4 core's L2 (a multiple of STEP)
ROUND_PARALLEL = 1 << 16               # elements of input above which rows round in parallel


def bmatmul_work_bytes(M: int, K: int) -> int:
    """Bytes of scratch `bmatmul_bf16` needs for M input rows of K columns: the rows as bfloat16
    in groups of 4 (the last group padded with rows), each padded to a multiple of 32 columns,
    plus room to align the start to 64 bytes."""
    return _work_bytes(M, K)


@njit(inline="always")
def _padded(K):
    return (K + STEP - 1) // STEP * STEP


@njit(inline="always")
def _groups(M):
    return (M + GROUP - 1) // GROUP


@njit(inline="always")
def _work_bytes(M, K):
    return _groups(M) * GROUP * _padded(K) * 2 + ALIGN


# -- rounding activations to bfloat16 -------------------------------------------------------------------
@intrinsic
def _to_bf16(typingctx, v):
    """float32 -> bfloat16 bits (uint16), to nearest with ties to even: add 0x7FFF plus the bit
    that will be the lowest one kept, then drop the low 16 bits (a carry into the exponent gives
    the next binade, or inf past the largest bfloat16, as it should). NaN -> 0x7FC0, a quiet NaN
    (the addition could carry a NaN's payload into inf). In IR so the loop vectorises: numba's
    integer arithmetic would widen to int64."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        lowest_kept = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        rounded = builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), lowest_kept)
        half = builder.trunc(builder.lshr(rounded, ir.Constant(i32, 16)), ir.IntType(16))
        nan = builder.fcmp_unordered("uno", args[0], args[0])
        return builder.select(nan, ir.Constant(ir.IntType(16), 0x7FC0), half)
    return types.uint16(types.float32), codegen


@njit(inline="always")
def _round_row(src, dst, K):
    """src (K,) float32 rounded to bfloat16 into its interleaved place: columns s * 32 ..
    s * 32 + 31 to dst[s * GROUP * 32:][:32] (dst: its row's first step, a view of the group's
    row), the padding past K zero."""
    for s in range(_padded(K) // STEP):
        part = dst[s * GROUP * STEP:s * GROUP * STEP + STEP]
        k0 = s * STEP
        n = min(STEP, K - k0)
        for k in range(n):
            part[k] = _to_bf16(src[k0 + k])
        for k in range(n, STEP):
            part[k] = 0


@njit(cache=True)
def _carve(work, M, K):
    """The rounded rows in `work`, from its first 64-byte boundary: (groups of GROUP rows,
    GROUP x padded K) uint16, row m's step s (32 columns) at [m // GROUP, (s * GROUP + m % GROUP)
    * 32:][:32]. A tile of 4 rows then reads them as one sequential stream (4 rows apart, they
    were 4 short streams that the hardware prefetcher does not follow from L3)."""
    skip = (ALIGN - tiles.address(work) % ALIGN) % ALIGN
    G, width = _groups(M), GROUP * _padded(K)
    return work[skip:skip + G * width * 2].view(np.uint16).reshape((G, width))


@njit(parallel=True, cache=True)
def _round_rows(x, xb):
    """x (M, K) float32 (any layout) rounded to bfloat16 into xb (`_carve`'s layout)."""
    M, K = x.shape
    if M * K >= ROUND_PARALLEL:
        for m in prange(M):
            _round_row(x[m], xb[m // GROUP, (m % GROUP) * STEP:], K)
    else:
        for m in range(M):
            _round_row(x[m], xb[m // GROUP, (m % GROUP) * STEP:], K)


# -- the product ------------------------------------------------------------------------------------------
@njit(inline="always")
def _stream_pass(w, xb, out, n0, n1, m, cols, K, best):
    """out[m:m + cols, n0:n1] one weight row at a time (1 x cols tiles, cols <= 4): the rows are
    read in order, one sequential stream, which the hardware prefetcher follows (tiles of 2 or
    4 rows read as many interleaved streams, which it does not: half the bandwidth from memory,
    11 against 27 GB/s on one Zen 4 core). It brings the block into L2 for the later passes."""
    for i in range(n0, n1):
        if cols == 4:
            _tile(1, 4, best, w, i, xb, m, 0, K, 0, out)
        elif cols == 3:
            _tile(1, 3, best, w, i, xb, m, 0, K, 0, out)
        elif cols == 2:
            _tile(1, 2, best, w, i, xb, m, 0, K, 0, out)
        else:
            _tile(1, 1, best, w, i, xb, m, 0, K, 0, out)


@njit(inline="always")
def _cached_pass(w, xb, out, n0, n1, m, cols, k0, k1, best):
    """Columns k0:k1's share of out[m:m + cols, n0:n1] (cols 4 or 1; added to out unless k0 is
    0), from a block of weight rows already in L2: 4 weight rows x cols input rows per tile (16
    products per 8 loads at cols = 4), 1 x cols at the block's edge."""
    add = k0
    i = n0
    while i < n1:
        rows = 4 if i + 4 <= n1 else 1
        if rows == 4 and cols == 4:
            _tile(4, 4, best, w, i, xb, m, k0, k1, add, out)
        elif rows == 4:
            _tile(4, 1, best, w, i, xb, m, k0, k1, add, out)
        elif cols == 4:
            _tile(1, 4, best, w, i, xb, m, k0, k1, add, out)
        else:
            _tile(1, 1, best, w, i, xb, m, k0, k1, add, out)
        i += rows


@njit(inline="always")
def _block(w, xb, out, n0, n1, M, K, best):
    """out[:, n0:n1]: the first (up to) 4 input rows streaming the block's weight rows in from
    memory, then the other input rows 4 at a time (1 at a time for the last M % 4), KC columns
    at a time so that 4 input rows' and 4 weight rows' share stays in L1."""
    first = min(M, 4)
    _stream_pass(w, xb, out, n0, n1, 0, first, K, best)
    for k0 in range(0, K, KC):
        k1 = min(K, k0 + KC)
        m = first
        while m < M:
            cols = 4 if m + 4 <= M else 1
            _cached_pass(w, xb, out, n0, n1, m, cols, k0, k1, best)
            m += cols


@njit(inline="always")
def _block_rows(N, threads):
    """Weight rows per parallel task: MAX_BLOCK, or fewer (down to MIN_BLOCK, whole tiles of 4)
    where that would leave a thread without 2 tasks. Every task reads all the input rows again
    and large blocks read them fewer times: (2048, 3072) x (768, 3072) on one Zen 4 core ran
    at 150 GFLOP/s in 32-row blocks, 160 in 64-row ones and 185 in 128-row ones."""
    per_task = (N + 2 * threads - 1) // (2 * threads)
    return min(MAX_BLOCK, max(MIN_BLOCK, (per_task + 3) // 4 * 4))


@njit(parallel=True, cache=True)
def _bmatmul(xb, w, out, x_rows, K, best):
    numba.literally(best)                # one build per instruction set
    M = x_rows
    N = w.shape[0]
    # (numba's own get_num_threads reads a ctypes pointer, which numba cannot cache; this is
    # the symbol its parallel loops call, resolved when the cached code loads)
    rows = _block_rows(N, _iget_num_threads())
    for b in prange((N + rows - 1) // rows):
        n0 = b * rows
        _block(w, xb, out, n0, min(N, n0 + rows), M, K, best)


# -- panels: many input rows ---------------------------------------------------------------------------
@njit(inline="always")
def _bits(v, table):
    """A stored weight as bfloat16 bits: itself (bfloat16 weights, an empty table) or its fp8
    code's entry in `table`."""
    return table[v] if table.shape[0] else np.uint16(v)


@njit(inline="always")
def _pack_panel(w, table, n0, nb, K, width, words):
    """Weight rows n0 .. n0 + nb - 1 (N, K) as bfloat16 bits into `words` (uint32, pairs x
    width): word q * width + r holds columns 2q (low half) and 2q + 1 of row n0 + r, the pairs
    past K / 2 (and the half past an odd K) zero, rows nb .. width - 1 zero."""
    pairs = _padded(K) // 2
    for r in range(nb):
        row = w[n0 + r]
        for q in range(K // 2):
            lo = np.uint32(_bits(row[2 * q], table))
            hi = np.uint32(_bits(row[2 * q + 1], table))
            words[q * width + r] = lo | (hi << np.uint32(16))
        q = K // 2
        if K % 2:
            words[q * width + r] = np.uint32(_bits(row[K - 1], table))
            q += 1
        for j in range(q, pairs):
            words[j * width + r] = 0
    for r in range(nb, width):
        for j in range(pairs):
            words[j * width + r] = 0


@njit(inline="always")
def _panel_row(P, C, scaled, best, pw, xb, m, n, scale, n0, nb, out):
    if P == 4:
        _panel(4, C, scaled, best, pw, xb, m, n, scale, n0, nb, out)
    elif P == 3:
        _panel(3, C, scaled, best, pw, xb, m, n, scale, n0, nb, out)
    elif P == 2:
        _panel(2, C, scaled, best, pw, xb, m, n, scale, n0, nb, out)
    else:
        _panel(1, C, scaled, best, pw, xb, m, n, scale, n0, nb, out)


@njit(inline="always")
def _panel_rows(P, scaled, best, pw, xb, M, n, scale, n0, nb, out):
    """out[:M, n0:n0 + nb] from one packed panel of P vectors of weight rows: every 4 input rows
    of a group take it whole (4 x P accumulators), the last M % 4 rows one at a time."""
    m = 0
    while m + 4 <= M:
        _panel_row(P, 4, scaled, best, pw, xb, m, n, scale, n0, nb, out)
        m += 4
    while m < M:
        _panel_row(P, 1, scaled, best, pw, xb, m, n, scale, n0, nb, out)
        m += 1


@njit(parallel=True, cache=True)
def _panels(xb, w, table, scale, out, M, K, scaled, best):
    """out (M, N) by panels of PANEL weight rows, one per parallel task: the panel repacked
    (`_pack_panel`, into a 64-byte aligned buffer of the task's own: about K x 128 bytes), then
    every 4 input rows of a group take it whole (4 x 4 accumulators: 16 vdpbf16ps per 4 loads of
    weights and 4 broadcasts), the last M % 4 rows one at a time."""
    numba.literally(scaled)
    numba.literally(best)
    N = w.shape[0]
    n = _padded(K) // STEP
    pairs = n * STEP // 2
    for b in prange((N + PANEL - 1) // PANEL):
        n0 = b * PANEL
        nb = min(N, n0 + PANEL) - n0
        P = (nb + 15) // 16
        pw = tiles.aligned_bytes(pairs * P * 16 * 4).view(np.uint32)
        _pack_panel(w, table, n0, nb, K, P * 16, pw)
        _panel_rows(P, scaled, best, pw, xb, M, n, scale, n0, nb, out)


@njit(inline="always")
def _check(x, w, out, work):
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K or out.shape[0] != M or out.shape[1] != N:
        raise ValueError("bmatmul_bf16: shapes do not match: x (M, K), w (N, K), out (M, N)")
    if (N > 1 and K > 0 and w.strides[1] != 2) or (M > 0 and N > 1 and out.strides[1] != 4):
        raise ValueError("bmatmul_bf16: w and out need contiguous rows")
    if work.shape[0] < _work_bytes(M, K):
        raise ValueError("bmatmul_bf16: work is smaller than bmatmul_work_bytes(M, K)")


@njit(inline="always")
def _bf16_product(x, w, out, work, best):
    _check(x, w, out, work)
    M, K = x.shape
    xb = _carve(work, M, K)
    _round_rows(x, xb)
    if M >= PANEL_MIN_ROWS:
        _panels(xb, w, NO_TABLE, out[0], out, M, K, False, best)
    else:
        _bmatmul(xb, w, out, M, K, best)


@njit(cache=True)
def bmatmul_bf16(x, w, out, work):
    """out (M, N) float32 = bf16(x) (M, K) @ w (N, K).T on the bfloat16 tiles; x float32, w
    uint16 bfloat16 bits, work uint8 of at least bmatmul_work_bytes(M, K)."""
    _bf16_product(x, w, out, work, True)


@njit(cache=True)
def bmatmul_bf16_fallback(x, w, out, work):
    """bmatmul_bf16 on the tiles a CPU without AVX512_BF16 runs."""
    _bf16_product(x, w, out, work, False)


# -- fp8 weights (compute="bfloat16") ------------------------------------------------------------------
# Every fp8 value is a bfloat16, so bfloat16 products multiply the file's own values exactly (no
# second rounding of the weights; the activations are rounded as for bfloat16 weights) and the
# row scale multiplies each sum. From PANEL_MIN_ROWS input rows the panels hold the codes' bfloat16
# bits; below, the rounded rows (as float32) go to the fp8 float32 product, which widens the codes
# in registers: the same products, summed in another order.
def fp8_work_bytes(M: int, K: int) -> int:
    """Scratch bytes of `bmatmul_e4m3` / `bmatmul_e5m2` for M input rows of K columns."""
    return _fp8_work_bytes(M, K)


@njit(inline="always")
def _fp8_work_bytes(M, K):
    return _work_bytes(M, K) if M >= PANEL_MIN_ROWS else M * K * 4 + ALIGN


@njit(inline="always")
def _rounded_floats(x, work):
    """x (M, K) rounded to bfloat16, as float32 (the bits' low half zero), in `work`."""
    M, K = x.shape
    skip = (ALIGN - tiles.address(work) % ALIGN) % ALIGN
    bits = work[skip:skip + M * K * 4].view(np.uint32).reshape((M, K))
    for m in range(M):
        for k in range(K):
            bits[m, k] = np.uint32(_to_bf16(x[m, k])) << np.uint32(16)
    return bits.view(np.float32)


@njit(inline="always")
def _fp8_product(x, w, scale, out, work, table, e4m3, best):
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K or out.shape[0] != M or out.shape[1] != N or scale.shape[0] != N:
        raise ValueError("bmatmul_fp8: shapes do not match: x (M, K), w (N, K), scale (N,), out (M, N)")
    if work.shape[0] < _fp8_work_bytes(M, K):
        raise ValueError("bmatmul_fp8: work is smaller than fp8_work_bytes(M, K)")
    if M >= PANEL_MIN_ROWS:
        xb = _carve(work, M, K)
        _round_rows(x, xb)
        _panels(xb, w, table, scale, out, M, K, True, best)
    elif e4m3:
        matmul_e4m3(_rounded_floats(x, work), w, scale, out)
    else:
        matmul_e5m2(_rounded_floats(x, work), w, scale, out)


@njit(cache=True)
def bmatmul_e4m3(x, w, scale, out, work):
    """out (M, N) float32 = bf16(x) (M, K) @ (w's E4M3 values x scale per row).T; w uint8 codes,
    scale float32 (N,), work uint8 of at least fp8_work_bytes(M, K)."""
    _fp8_product(x, w, scale, out, work, E4M3_BFLOAT16, True, True)


@njit(cache=True)
def bmatmul_e5m2(x, w, scale, out, work):
    """bmatmul_e4m3 for E5M2 codes."""
    _fp8_product(x, w, scale, out, work, E5M2_BFLOAT16, False, True)


@njit(cache=True)
def bmatmul_e4m3_fallback(x, w, scale, out, work):
    """bmatmul_e4m3 on the tiles a CPU without AVX512_BF16 runs."""
    _fp8_product(x, w, scale, out, work, E4M3_BFLOAT16, True, False)
