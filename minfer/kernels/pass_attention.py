"""An encoder pass's self-attention with bfloat16 products: softmax(q k^T + bias) v for every
(batch row, head), the position bias read by distance (as kernels/pass_softmax.py), both products
on the bfloat16 panel tiles (bfloat16_tiles.py: `vdpbf16ps` where the CPU has AVX512_BF16), the
softmax in float32, and no (B, H, T, T) score tensor: a thread holds one block of query rows'
scores at a time. What compute="bfloat16" runs (ops.rounded_distance_attention; compute="int8"
runs pass_attention_int8.py).

`_heads` gives each thread its share of the (batch row, head) pairs and its own parts of the
scratch (attention_layout.py), and for each pair:
1. `_pack_head`: its q, k and v (the q|k|v product's output, (B, T, 3, H, D)) rounded to
   bfloat16 into the layouts the tiles read, in the thread's parts (in L2 while the pair runs):
   the queries as the tiles' interleaved input rows (bfloat16_products._carve's layout), the
   keys as panels of PANEL keys (word q * width + r: columns 2q, 2q + 1 of key r:
   bfloat16_products._pack_panel's layout), the values transposed into panels of PANEL value
   columns over the keys (word q * width + r: keys 2q, 2q + 1 of column r), LANE_ROWS
   positions at a time; q, k and v in three loops, which ran faster than one loop doing all
   three (benchmarks/README.md, "Measurements behind constants in the code"). (Packing every
   pair first, into parts of the whole (B, H), then reading them back ran 6-10% slower.)
2. per block of up to QUERY_BLOCK queries, their scores against every key panel (float32, into
   the thread's (QUERY_BLOCK, T)), each row's softmax with the bias and key mask added
   (`_softmax_rounded`: its last sweep writes the weights rounded to bfloat16 straight into the
   interleaved rows the value product reads), the weights times the value panels into the
   output rows.

Rounding, as the bfloat16 products': queries, keys, values and the softmax weights to bfloat16
(nearest, ties to even), every sum in float32. The weights are rounded after the division, so a
row of weights sums to 1 within bfloat16's 2^-9 relative error per term.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from . import bfloat16_tiles
from .attention_layout import GROUP, LANE_ROWS, PANEL, QUERY_BLOCK, STEP, AttentionShape
from .bfloat16_products import _padded, _panel_rows, _to_bf16
from .pass_softmax import _exponentials
from .vector_math import NON_FINITE_SAFE

# the layout's constants are the tiles' own
assert (PANEL, GROUP, STEP) == (bfloat16_tiles.PANEL, bfloat16_tiles.GROUP, bfloat16_tiles.STEP)
NO_SCALE = np.ones(1, np.float32)     # (the panel tile's scale: not read, the products unscaled)
HEAD_DIM = 64                         # every T5 size's d_kv but t5-11b's (128): a constant in the
                                      # packing where it is this


@njit(inline="always")
def _up(n, m):
    return (n + m - 1) // m * m


# -- phase 1: q, k and v rounded and packed -------------------------------------------------------
@njit(inline="always")
def _panel_width(n, first):
    """Lanes of the panel whose first row is `first` of n rows: PANEL, or the last panel's rows
    rounded up to whole vectors of 16 (what the tile reads: `_product`)."""
    return min(PANEL, _up(n - first, 16))


@njit(inline="always")
def _pair(lo, hi):
    """Two float32s rounded to bfloat16, as one 32-bit word (lo in the low half)."""
    return np.uint32(_to_bf16(lo)) | (np.uint32(_to_bf16(hi)) << np.uint32(16))


# Loops that LLVM should vectorise index their arrays by the loop's own counter, on views that
# start where the run starts: an index such as `at + j` may be negative as far as numba knows, so
# it adds a wrap-around select to every access, and such loops stayed scalar (3-8x slower:
# benchmarks/README.md, "Measurements behind constants in the code"). Each packing computes a
# block's words into a small buffer first (`_round_rows`), then copies them into the layout.
@njit(inline="always")
def _round_rows(qkv, b, t0, n, part, h, D, rows):
    """rows[r, c] = columns 2c, 2c + 1 of position t0 + r's q (part 0), k (1) or v (2) row of
    head h, rounded to bfloat16, as one word (r < n; an odd D's last column alone)."""
    for r in range(n):
        src = qkv[b, t0 + r, part, h]
        for c in range(D // 2):
            rows[r, c] = _pair(src[2 * c], src[2 * c + 1])
        if D % 2:
            rows[r, D // 2] = np.uint32(_to_bf16(src[D - 1]))


@njit(inline="always")
def _pack_queries(qkv, b, h, t0, t1, D, qx, rows):
    """Query rows t0 .. t1 - 1 (t0 a multiple of GROUP) of head h of batch row b into the
    thread's interleaved rows qx (a step of a row: STEP / 2 words)."""
    half = STEP // 2
    words = qx.view(np.uint32)
    _round_rows(qkv, b, t0, t1 - t0, 0, h, D, rows)
    for r in range(t1 - t0):
        g, c = (t0 + r) // GROUP, ((t0 + r) % GROUP) * half
        for s in range((D + 1) // 2 // half + ((D + 1) // 2 % half > 0)):
            n = min(half, (D + 1) // 2 - s * half)
            dst = words[g, s * GROUP * half + c:]
            src = rows[r, s * half:]
            for j in range(n):
                dst[j] = src[j]


@njit(inline="always")
def _pack_keys(qkv, b, h, t0, t1, S, D, kp, rows):
    """Keys t0 .. t1 - 1 (within one panel) of head h of batch row b into their panel's lanes
    in the thread's kp: each column pair's run of lanes."""
    Dp = _padded(D)
    p0 = t0 // PANEL * PANEL
    width = _panel_width(S, p0)
    at = p0 * Dp // 2 + t0 - p0           # the block's first lane (panels of PANEL x Dp / 2 words)
    words = kp.view(np.uint32)
    _round_rows(qkv, b, t0, t1 - t0, 1, h, D, rows)
    for c in range((D + 1) // 2):
        dst = words[at + c * width:]
        for r in range(t1 - t0):
            dst[r] = rows[r, c]


@njit(inline="always")
def _pack_values(qkv, b, h, t0, t1, S, D, vp, rows):
    """Value rows t0 .. t1 - 1 (t0 even) of head h of batch row b into the thread's value
    panels' words (keys 2q, 2q + 1 of column r): a run of columns per pair of positions."""
    Sp = _padded(S)
    words = vp.view(np.uint32)
    halves = rows.view(np.uint16)         # (LANE_ROWS, Dp): row r's column d at [r, d]
    _round_rows(qkv, b, t0, t1 - t0, 2, h, D, rows)
    for r in range(0, t1 - t0, 2):
        t = t0 + r
        for d0 in range(0, D, PANEL):
            dst = words[d0 * Sp // 2 + (t // 2) * _panel_width(D, d0):]
            lo = halves[r, d0:]
            nd = min(PANEL, D - d0)
            if t + 1 < t1:
                hi = halves[r + 1, d0:]
                for j in range(nd):
                    dst[j] = np.uint32(lo[j]) | (np.uint32(hi[j]) << np.uint32(16))
            else:
                for j in range(nd):
                    dst[j] = np.uint32(lo[j])


@njit(inline="always")
def _zero_padding(T, S, D, qx, kp, vp):
    """The padding of a thread's packed parts, which the rows never write: the queries' columns
    past D and rows past T, the keys' columns past D and lanes past S, the values' keys past S
    and lanes past D; all zero (a zero weight or value adds nothing: no garbage enters a sum).
    Once a call: every (batch row, head) the thread packs leaves them as they are."""
    Dp, Sp = _padded(D), _padded(S)
    for t in range(T, _up(T, GROUP)):
        g, c = t // GROUP, (t % GROUP) * STEP
        for col in range(Dp):
            qx[g, (col // STEP) * GROUP * STEP + c + col % STEP] = 0
    for t in range(T):
        g, c = t // GROUP, (t % GROUP) * STEP
        for col in range(D, Dp):
            qx[g, (col // STEP) * GROUP * STEP + c + col % STEP] = 0
    for p0 in range(0, S, PANEL):
        width = _panel_width(S, p0)
        base = p0 * Dp
        for r in range(width):
            first = D if p0 + r < S else 0
            for col in range(first, Dp):
                kp[base + 2 * ((col // 2) * width + r) + col % 2] = 0
    for d0 in range(0, D, PANEL):
        width = _panel_width(D, d0)
        base = d0 * Sp
        for j in range(Sp):
            first = min(PANEL, D - d0) if j < S else 0
            for r in range(first, width):
                vp[base + 2 * ((j // 2) * width + r) + j % 2] = 0


@njit(inline="always")
def _pack_part(qkv, part, b, h, D, qx, kp, vp, rows):
    """Part `part` (0 q, 1 k, 2 v) of head h of batch row b, every position, LANE_ROWS at a time."""
    T = qkv.shape[1]
    for t0 in range(0, T, LANE_ROWS):
        t1 = min(T, t0 + LANE_ROWS)
        if part == 0:
            _pack_queries(qkv, b, h, t0, t1, D, qx, rows)
        elif part == 1:
            _pack_keys(qkv, b, h, t0, t1, T, D, kp, rows)
        else:
            _pack_values(qkv, b, h, t0, t1, T, D, vp, rows)


@njit(inline="always")
def _pack_head(qkv, b, h, qx, kp, vp, rows):
    """Head h of batch row b's q, k and v rounded into the thread's packed parts (in three
    loops, not one: see the module's docstring). T5's head size as a constant where it is 64:
    LLVM then unrolls and vectorises the rows' loops (benchmarks/README.md)."""
    D = qkv.shape[4]
    for part in range(3):
        if D == HEAD_DIM:
            _pack_part(qkv, part, b, h, HEAD_DIM, qx, kp, vp, rows)
        else:
            _pack_part(qkv, part, b, h, D, qx, kp, vp, rows)


# -- phase 2: per (batch row, head), blocks of queries ------------------------------------------------
@njit(inline="always", **NON_FINITE_SAFE)
def _softmax_rounded(row, bias, mask, S, dst, at):
    """softmax(row + bias + mask) over S, rounded to bfloat16 into dst from element `at` (a row's
    first step in the interleaved layout: steps GROUP * STEP apart; the padding past S zero).
    row is overwritten with the exponentials. Max-subtracted, as pass_softmax's: a row of equal
    (even all-masked) values gives uniform weights; NaN or +inf scores give NaN."""
    inv = _exponentials(row, bias, mask, S)
    for s in range(_padded(S) // STEP):
        k0 = s * STEP
        part = dst[at + s * GROUP * STEP:]
        src = row[k0:]
        if k0 + STEP <= S:
            for k in range(STEP):
                part[k] = _to_bf16(src[k] * inv)
        else:
            for k in range(STEP):
                part[k] = _to_bf16(src[k] * inv) if k0 + k < S else 0


@njit(inline="always")
def _product(x, rows, packed, K, N, out, best):
    """out[:rows, :N] = x's interleaved rows times the N packed rows (uint16 halves: panels of
    PANEL rows of padded K, the last one `_panel_width` lanes), 4 rows a tile and the last
    rows % 4 alone."""
    n = _padded(K) // STEP
    words = packed.view(np.uint32)
    size = _padded(K) // 2 * PANEL
    for p0 in range(0, N, PANEL):
        nb = min(N - p0, PANEL)
        P = (nb + 15) // 16
        pw = words[p0 // PANEL * size:p0 // PANEL * size + size]
        _panel_rows(P, False, best, pw, x, rows, n, NO_SCALE, p0, nb, out)


@njit(inline="always")
def _heads(qkv, table, key_mask, ctx, queries, keys, values, rounded, scores, weights, best):
    """Each thread its share of the (batch row, head) pairs, its own packed parts, scores and
    weights (see the module's docstring)."""
    B, T, H, D = ctx.shape
    S = key_mask.shape[1]
    threads = scores.shape[0]
    shared = table.shape[0] == 1
    for t in prange(threads):
        qx, kp, vp, sc, px = queries[t], keys[t], values[t], scores[t], weights[t]
        flat = px.reshape(-1)
        _zero_padding(T, S, D, qx, kp, vp)
        for task in range(t, B * H, threads):
            b, h = task // H, task % H
            tb = table[0 if shared else h]
            _pack_head(qkv, b, h, qx, kp, vp, rounded[t])
            for t0 in range(0, T, QUERY_BLOCK):
                rows = min(T - t0, QUERY_BLOCK)
                _product(qx[t0 // GROUP:], rows, kp, D, S, sc, best)
                for r in range(rows):
                    i = t0 + r
                    _softmax_rounded(sc[r], tb[T - 1 - i:T - 1 - i + S], key_mask[b], S, flat,
                                     (r // GROUP) * px.shape[1] + (r % GROUP) * STEP)
                _product(px, rows, vp, S, D, ctx[b, t0:t0 + rows, h], best)


@njit(parallel=True, cache=True, **NON_FINITE_SAFE)
def _attend_best(qkv, table, key_mask, ctx, qx, kp, vp, rounded, scores, weights):
    _heads(qkv, table, key_mask, ctx, qx, kp, vp, rounded, scores, weights, True)


@njit(parallel=True, cache=True, **NON_FINITE_SAFE)
def _attend_fallback(qkv, table, key_mask, ctx, qx, kp, vp, rounded, scores, weights):
    _heads(qkv, table, key_mask, ctx, qx, kp, vp, rounded, scores, weights, False)


def attend_bf16(qkv, table, key_mask, ctx, work, best: bool = True) -> None:
    """ctx (B, T, H, D) = softmax(q k^T + bias) v with bfloat16 products, the self-attention of
    T positions: qkv (B, T, 3, H, D) float32 (the q|k|v product's output, contiguous), the bias
    table[h, j - i + T - 1] (H, 2T - 1) (or (1, ...) for every head) plus key_mask[b, j] (B, T);
    work a contiguous buffer of at least AttentionShape(B, H, T, T, D, threads).nbytes() bytes
    for numba's current thread count. best False: the tiles a CPU without AVX512_BF16 runs."""
    shape = AttentionShape.of_call("bfloat16", qkv, table, key_mask, ctx, numba.get_num_threads())
    p = shape.carve(work)
    run = _attend_best if best else _attend_fallback
    run(qkv, table, key_mask, ctx, p["queries"], p["keys"], p["values"], p["rounded"],
        p["scores"], p["weights"])
