"""Fused step functions: one call per sublayer of a decoding step instead of a dozen small NumPy
calls (attention of one query position over a KV cache with its bias and softmax; a residual add
with the RMS norm after it), and decoding's host-side work (top-k of each row,
the rows of a beam reorder).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .vector_math import NON_FINITE_SAFE, exp_nonpositive


# -- fused step functions ---------------------------------------------------------------------------------
@njit(cache=True, **NON_FINITE_SAFE)
def norm_row(x, delta, add, weight, eps, r, h):
    """Row r of x (R, C) += delta's row r when `add`, then h (C,) = weight * x[r] /
    sqrt(mean(x[r]^2) + eps). Not inlined in numba's IR, so the callers' own flags (the fused
    int8 norm has no fast-math) do not change this arithmetic: every caller gets the same h."""
    C = x.shape[1]
    xr = x[r]
    if add:
        dr = delta[r]
        for c in range(C):
            xr[c] += dr[c]
    ss = np.float32(0.0)
    for c in range(C):
        ss += xr[c] * xr[c]
    inv = np.float32(1.0) / math.sqrt(ss / C + eps)
    for c in range(C):
        h[c] = xr[c] * inv * weight[c]


NORM_PARALLEL = 1 << 16        # elements of x above which the rows are normed in parallel


@njit(parallel=True, cache=True, **NON_FINITE_SAFE)
def add_rms_norm(x, delta, weight, eps, h):
    """x (R, C) += delta (R, C) (skipped when delta has no rows), then h = weight * x /
    sqrt(mean(x^2) + eps) per row: a residual add and the RMS norm after it, in one pass
    (an encoder pass's rows over the threads; a decoding step's few on this one)."""
    R, C = x.shape
    add = delta.shape[0] == R
    if R * C >= NORM_PARALLEL:
        for r in prange(R):
            norm_row(x, delta, add, weight, eps, r, h[r])
    else:
        for r in range(R):
            norm_row(x, delta, add, weight, eps, r, h[r])


@njit(cache=True, **NON_FINITE_SAFE)
def _attend_one(q, k, v, S, bias, ctx, b, h, scores, kv_rows):
    """One (row, head): softmax(q . k_j + bias_j) over keys j < S, then the weighted sum of v,
    k and v of row kv_rows[b] (b when kv_rows is empty). k[r, h] and v[r, h] are C-contiguous
    (N, D) cache rows: numba then knows each key is contiguous and vectorises the dot products
    (on strided views it did not)."""
    D = k.shape[3]
    qv = q[b, h]
    r = kv_rows[b] if kv_rows.shape[0] > 0 else b
    kb, vb = k[r, h], v[r, h]
    brow = bias[b if bias.shape[0] > 1 else 0, h if bias.shape[1] > 1 else 0]
    top = -np.inf
    for j in range(S):
        kj = kb[j]
        acc = np.float32(0.0)
        for d in range(D):
            acc += qv[d] * kj[d]
        acc += brow[j]
        scores[j] = acc
        top = max(top, acc)
    total = np.float32(0.0)
    for j in range(S):
        e = exp_nonpositive(scores[j] - top)
        scores[j] = e
        total += e
    out = ctx[b, h]
    out[:] = 0.0
    inv = np.float32(1.0) / total
    for j in range(S):
        p = scores[j] * inv
        vj = vb[j]
        for d in range(D):
            out[d] += p * vj[d]


@njit(cache=True, **NON_FINITE_SAFE)
def attend_query(q, k, v, S, bias, ctx, kv_rows):
    """One query position per (row, head): q (B, H, D), the first S keys/values of C-contiguous
    caches (Bk, H, N, D), row b reading row kv_rows[b] of them (kv_rows empty: row b), additive
    bias (Bb, Hb, >=S) broadcast over rows / heads when Bb / Hb is 1, -> ctx (B, H, D). Softmax
    is max-subtracted: a fully masked row gives uniform weights, not NaN."""
    B, H = q.shape[0], q.shape[1]
    scores = np.empty(S, np.float32)
    for b in range(B):
        for h in range(H):
            _attend_one(q, k, v, S, bias, ctx, b, h, scores, kv_rows)


@njit(parallel=True, cache=True, **NON_FINITE_SAFE)
def attend_query_parallel(q, k, v, S, bias, ctx, kv_rows):
    """`attend_query` with the (row, head) pairs spread over the threads (large batches)."""
    B, H = q.shape[0], q.shape[1]
    for bh in prange(B * H):
        _attend_one(q, k, v, S, bias, ctx, bh // H, bh % H, np.empty(S, np.float32), kv_rows)


# -- decoding's host-side work ------------------------------------------------------------------------
@njit(cache=True)
def top_k(a, k, idx, val):
    """The k largest of each row of a (R, N), best first, ties in index order (what a stable
    descending sort gives): indices into idx (R, k), values into val (R, k). One pass per row,
    inserting into a sorted list only what beats its last entry."""
    R, N = a.shape
    for r in range(R):
        row, ir, vr = a[r], idx[r], val[r]
        filled = 0
        for n in range(N):
            v = row[n]
            if filled == k and not v > vr[k - 1]:
                continue
            j = filled if filled < k else k - 1
            while j > 0 and v > vr[j - 1]:   # strictly greater: equal values keep index order
                vr[j] = vr[j - 1]
                ir[j] = ir[j - 1]
                j -= 1
            vr[j] = v
            ir[j] = n
            if filled < k:
                filled += 1


@njit(parallel=True, cache=True)
def gather_rows(cache, rows, length):
    """cache (L, B, H, N, D): row b of every layer becomes old row rows[b] (b < len(rows)), for
    the first `length` positions; rows may repeat (beams following their parents)."""
    L, B, H, D = cache.shape[0], cache.shape[1], cache.shape[2], cache.shape[4]
    n = rows.shape[0]
    # only rows that change move (a beam that keeps its parent stays), and only the sources
    # they read are saved first (a source may itself be overwritten)
    slot = np.full(B, -1, np.int64)
    count = 0
    for b in range(n):
        if rows[b] != b and slot[rows[b]] < 0:
            slot[rows[b]] = count
            count += 1
    for l in prange(L):
        tmp = np.empty((count, H, length, D), cache.dtype)
        for r in range(B):
            if slot[r] >= 0:
                tmp[slot[r]] = cache[l, r, :, :length]
        for b in range(n):
            if rows[b] != b:
                cache[l, b, :, :length] = tmp[slot[rows[b]]]

