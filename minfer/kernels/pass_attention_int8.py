"""An encoder pass's self-attention with int8 products (compute="int8"): softmax(q k^T + bias) v
for every (batch row, head) with both products on the int8 panel tiles (tiles.make_panel_tile:
`vpdpbusd` where the CPU has AVX-512 VNNI, the products' fallback build elsewhere), the position
bias read by distance and the softmax in float32 (kernels/pass_softmax.py), and no (B, H, T, T)
score tensor: a thread holds one block of query rows' scores at a time. What compute="int8" runs
(ops.quantised_distance_attention); the same steps as the bfloat16 kernel (pass_attention.py).

Quantisation, symmetric and rounded to nearest (even) as the int8 products quantise their input
rows (quantised_products._quantise_row): each query and each key row (one position of one
head, D columns) with its own scale absmax / 127; each value column (one of D, over the S
positions) with its own, which the value product applies per output column as a weight row's;
the softmax weights of a row as round(127 e_j), e_j = exp(s_j - max s) in 0 .. 1 (the largest
exactly 127: no absmax to find), divided by their sum, so a row of weights sums to 1 whatever
the rounding. The weights are the products' signed operand, so they keep 7 bits. Accuracy
against the bfloat16 attention (benchmarks/accuracy_modes.py --attention): on the trained T5
and the parity fixtures, compute="int8"'s outputs move by less than its products' own rounding.

Per (batch row, head), on one thread, into the thread's parts (attention_layout.py, kind "int8"):
1. the queries quantised into the int8 products' input layout (quantised_products._place: groups
   of 4 rows interleaved STEP columns at a time, each row padded with zeros to Dp, a multiple
   of STEP), with their sums and scales; the keys quantised into rows of Dp, then repacked into
   panels of PANEL keys (quantised_products._pack: word j * PANEL + r holds columns 4 j .. 4 j +
   3 of key r, each byte with the tiles' offset); the values' column scales from their absmax
   over the positions, then the values transposed into panels of PANEL value columns over Sp
   positions (word j * PANEL + r holds positions 4 j .. 4 j + 3 of column r), zeros past S.
2. per block of up to QUERY_BLOCK queries: their scores against every key panel (float32, the
   tile's epilogue scaling each int32 sum by the query's and the key's scale), each row's
   softmax with the bias and key mask added (`_exponentials`), its weights quantised into the
   block's input rows, then those rows times the value panels straight into ctx.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from . import NO_FLOOR, tiles
from .attention_layout import INT8_STEP, PANEL, QUERY_BLOCK, WEIGHT_LEVELS, AttentionShape
from .pass_softmax import _exponentials
from .quantised_products import (OFFSET_BEST, OFFSET_FALLBACK, STEP, TILES, _abs_bits, _bits_f32,
                                 _pack, _panel, _place)
from .vector_math import NON_FINITE_SAFE

assert PANEL == tiles.PANEL and STEP == tiles.STEP == INT8_STEP
LEVELS = np.float32(WEIGHT_LEVELS)    # (as the float32 the codes are rounded from)
NOT_FINITE = np.int32(0x7F800000)     # |v|'s bits from here: inf or NaN


@njit(inline="always")
def _up(n, m):
    return (n + m - 1) // m * m


# -- phase 1: q, k and v quantised and packed --------------------------------------------------
@njit(inline="always")
def _codes(src, n, inv, part):
    """part[:n] = src[:n] * inv rounded to int8 codes (to nearest even), the rest of part 0;
    returns the codes' sum."""
    total = np.int32(0)
    for k in range(n):
        q = np.int8(np.rint(src[k] * inv))
        part[k] = q
        total += np.int32(q)
    for k in range(n, part.shape[0]):
        part[k] = 0
    return total


@njit(inline="always")
def _inverse_and_scale(top):
    """For a line whose |values|' largest bits are `top` (`_abs_bits`): (127 / absmax, the
    line's scale absmax / 127), or (0, 0) for a zero line and (0, NaN) for one holding inf or
    NaN (its codes then 0: its outputs are NaN, which generation names)."""
    if top >= NOT_FINITE:
        return np.float32(0.0), np.float32(np.nan)
    if top == 0:
        return np.float32(0.0), np.float32(0.0)
    return np.float32(127.0) / _bits_f32(top), _bits_f32(top) / np.float32(127.0)


@njit(inline="always")
def _quantise_padded(src, D, xq, base, ss, Dp):
    """src[:D] quantised into the row whose step s (STEP columns) is at xq[base + s * ss], zeros
    from column D to Dp; returns (its sum, its scale: `_inverse_and_scale`'s)."""
    top = np.int32(0)
    for k in range(D):
        top = max(top, _abs_bits(src[k]))
    inv, scale = _inverse_and_scale(top)
    total = np.int32(0)
    for s in range(Dp // STEP):
        n = max(min(STEP, D - s * STEP), 0) if inv > 0 else 0
        total += _codes(src[s * STEP:], n, inv, xq[base + s * ss:base + s * ss + STEP])
    return total, scale


@njit(inline="always")
def _pack_queries(qkv, b, h, D, Dp, xq, sums, scales):
    T = qkv.shape[1]
    for t in range(T):
        base, _, ss, _, _ = _place(T, Dp, t)
        sums[t, 0], scales[t] = _quantise_padded(qkv[b, t, 0, h], D, xq, base, ss, Dp)


@njit(inline="always")
def _pack_keys(qkv, b, h, D, Dp, rows, panels, scales, flip):
    """Keys quantised into rows (Sk, Dp) (rows past S zero), then PANEL at a time into panels."""
    S = qkv.shape[1]
    flat = rows.reshape(-1)
    for t in range(S):
        _, scales[t] = _quantise_padded(qkv[b, t, 1, h], D, flat, t * Dp, STEP, Dp)
    words = panels.view(np.uint32)
    for p0 in range(0, S, PANEL):
        nb = min(S - p0, PANEL)
        _pack(rows, p0, nb, PANEL, flip, words[p0 * Dp // 4:(p0 + PANEL) * Dp // 4])


@njit(inline="always")
def _code(v, inv):
    """v * inv rounded to an int8 code, as the low byte of a uint32."""
    return np.uint32(np.int32(np.rint(v * inv))) & np.uint32(0xFF)


@njit(inline="always")
def _pack_values(qkv, b, h, D, Sp, panels, scales, top, inv, flip):
    """The values' column scales (absmax over the positions: `_inverse_and_scale`) and
    the values transposed into panels of PANEL columns over Sp positions, zeros past S (with
    the tiles' offset: a zero weight times a zero input adds nothing)."""
    S = qkv.shape[1]
    top[:] = 0
    for t in range(S):
        row = qkv[b, t, 2, h]
        for d in range(D):
            top[d] = max(top[d], _abs_bits(row[d]))
    for d in range(D):
        inv[d], scales[d] = _inverse_and_scale(top[d])
    words = panels.view(np.uint32)
    for d0 in range(0, D, PANEL):
        nd = min(PANEL, D - d0)
        panel = words[d0 * Sp // 4:(d0 + PANEL) * Sp // 4]
        iv = inv[d0:]
        for j in range(Sp // 4):
            dst = panel[j * PANEL:(j + 1) * PANEL]
            t = 4 * j
            if t + 4 <= S:
                r0, r1 = qkv[b, t, 2, h, d0:], qkv[b, t + 1, 2, h, d0:]
                r2, r3 = qkv[b, t + 2, 2, h, d0:], qkv[b, t + 3, 2, h, d0:]
                for r in range(nd):
                    dst[r] = (_code(r0[r], iv[r]) | (_code(r1[r], iv[r]) << np.uint32(8))
                              | (_code(r2[r], iv[r]) << np.uint32(16))
                              | (_code(r3[r], iv[r]) << np.uint32(24))) ^ flip
            else:                            # the last positions, and zeros past S
                for r in range(nd):
                    word = np.uint32(0)
                    for c in range(4):
                        if t + c < S:
                            word |= _code(qkv[b, t + c, 2, h, d0 + r], iv[r]) << np.uint32(8 * c)
                    dst[r] = word ^ flip
            for r in range(nd, PANEL):
                dst[r] = 0


# -- phase 2: per (batch row, head), blocks of queries --------------------------------------------
@njit(inline="always", **NON_FINITE_SAFE)
def _weights_quantised(row, bias, mask, S, Sp, xq, base, ss):
    """softmax(row + bias + mask) over S as codes round(127 e) into the input row whose step s is
    at xq[base + s * ss] (zeros past S); returns (their sum, the row's scale 1 / that sum), the
    scale NaN (codes 0) where a score was NaN or +inf (row is overwritten with the
    exponentials)."""
    inv = _exponentials(row, bias, mask, S)
    finite = inv == inv and inv > 0
    total = np.int32(0)
    for s in range(Sp // STEP):
        n = max(min(STEP, S - s * STEP), 0) if finite else 0
        total += _codes(row[s * STEP:], n, LEVELS, xq[base + s * ss:base + s * ss + STEP])
    if not finite or total == 0:
        return np.int32(0), np.float32(np.nan)
    return total, np.float32(1.0) / np.float32(total)


@njit(inline="always")
def _rows_times_panel(xq, M, K, m0, rows, whole, sums, scales, pw, weight_scales, i, valid,
                      out, best, off):
    """out[r, i + c] (r < rows, c < valid) = input rows m0 .. m0 + rows - 1 (of M in `_place`'s
    layout over K) times the panel pw, scaled: 4 rows a tile where they are one of the layout's
    groups (below `whole`), else one. sums, scales and out are indexed from m0 (views)."""
    r = 0
    while r < rows:
        base, rs, ss, _, _ = _place(M, K, m0 + r)
        if m0 + r + 4 <= whole and r + 4 <= rows:
            _panel(TILES, 4, best, pw, xq, base, rs, ss, K // STEP, sums, r, scales,
                   weight_scales, i, valid, out, off, NO_FLOOR)
            r += 4
        else:
            _panel(TILES, 1, best, pw, xq, base, rs, ss, K // STEP, sums, r, scales,
                   weight_scales, i, valid, out, off, NO_FLOOR)
            r += 1


@njit(inline="always")
def _heads(qkv, table, key_mask, ctx, p, best):
    """Each thread its share of the (batch row, head) pairs and its own parts (module docstring)."""
    (queries, query_sums, query_scales, key_rows, keys, key_scales, values, value_scales,
     column_top, column_inv, scores, weights, weight_sums, weight_scales) = p
    B, T, H, D = ctx.shape
    S = key_mask.shape[1]
    Dp, Sp = _up(D, STEP), _up(S, STEP)
    threads = scores.shape[0]
    shared = table.shape[0] == 1
    off = OFFSET_BEST if best else OFFSET_FALLBACK
    flip = np.uint32(0x80808080) if off else np.uint32(0)
    for t in prange(threads):
        xq, qs, qsc = queries[t], query_sums[t], query_scales[t]
        kr, kp, ksc = key_rows[t], keys[t], key_scales[t]
        vp, vsc, sc = values[t], value_scales[t], scores[t]
        px, ps, psc = weights[t], weight_sums[t], weight_scales[t]
        for task in range(t, B * H, threads):
            b, h = task // H, task % H
            tb = table[0 if shared else h]
            _pack_queries(qkv, b, h, D, Dp, xq, qs, qsc)
            _pack_keys(qkv, b, h, D, Dp, kr, kp, ksc, flip)
            _pack_values(qkv, b, h, D, Sp, vp, vsc, column_top[t], column_inv[t], flip)
            for t0 in range(0, T, QUERY_BLOCK):
                rows = min(T - t0, QUERY_BLOCK)
                for p0 in range(0, S, PANEL):
                    _rows_times_panel(xq, T, Dp, t0, rows, T // 4 * 4, qs[t0:], qsc[t0:],
                                      kp[p0 * Dp:(p0 + PANEL) * Dp], ksc, p0,
                                      min(PANEL, S - p0), sc, best, off)
                for r in range(rows):
                    i = t0 + r
                    base, _, ss, _, _ = _place(rows, Sp, r)
                    ps[r, 0], psc[r] = _weights_quantised(sc[r], tb[T - 1 - i:T - 1 - i + S],
                                                          key_mask[b], S, Sp, px, base, ss)
                out = ctx[b, t0:t0 + rows, h]
                for d0 in range(0, D, PANEL):
                    _rows_times_panel(px, rows, Sp, 0, rows, rows // 4 * 4, ps, psc,
                                      vp[d0 * Sp:(d0 + PANEL) * Sp], vsc, d0,
                                      min(PANEL, D - d0), out, best, off)


@njit(parallel=True, cache=True, **NON_FINITE_SAFE)
def _attend_best(qkv, table, key_mask, ctx, p):
    _heads(qkv, table, key_mask, ctx, p, True)


@njit(parallel=True, cache=True, **NON_FINITE_SAFE)
def _attend_fallback(qkv, table, key_mask, ctx, p):
    _heads(qkv, table, key_mask, ctx, p, False)


PARTS = ("queries", "query_sums", "query_scales", "key_rows", "keys", "key_scales", "values",
         "value_scales", "column_top", "column_inv", "scores", "weights", "weight_sums",
         "weight_scales")


def attend_i8(qkv, table, key_mask, ctx, work, best: bool = True) -> None:
    """ctx (B, T, H, D) = softmax(q k^T + bias) v with int8 products, the self-attention of T
    positions: qkv (B, T, 3, H, D) float32 (the q|k|v product's output, contiguous), the bias
    table[h, j - i + T - 1] (H, 2T - 1) (or (1, ...) for every head) plus key_mask[b, j] (B, T);
    work a contiguous buffer of at least AttentionShape(B, H, T, T, D, threads, "int8").nbytes()
    bytes for numba's current thread count. best False: the tiles a CPU without VNNI runs."""
    shape = AttentionShape.of_call("int8", qkv, table, key_mask, ctx, numba.get_num_threads())
    p = shape.carve(work)
    run = _attend_best if best else _attend_fallback
    run(qkv, table, key_mask, ctx, tuple(p[name] for name in PARTS))
