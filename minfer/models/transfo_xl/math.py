"""Transformer-XL's math: pure functions over the backend's array namespace `be.xp`.

The numerics are Hugging Face transformers' TransfoXL (see docs/architecture.md): an adaptive
input embedding scaled by sqrt(d_model); per layer, attention over [memory; segment] with
sinusoidal *relative* positions, score = (q+u).k + rel_shift((q+v).r) scaled by 1/sqrt(d);
post-norm (or pre-norm) residual blocks; a projected adaptive log-softmax head.

The reference is time-major (T, B, C); everything here is batch-first and nothing is converted at
run time. The segment memory is passed in as its buffers (`buffers.MemoryBuffers`, the live rows)
and its filled length: a call reads each layer's memory, then appends the layer's input to it.

Shapes: B batch, T segment length, M memory length, K = M + T keys, H heads, D head dim,
C d_model, F d_inner, V vocab, L layers.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import numpy as np

from ... import ops
from .buffers import LayerScratch, MemoryBuffers
from .config import XLConfig
from .weights import sinusoids



# =====================================================================================================
# Pieces of the forward pass
# =====================================================================================================
def embed(be: Any, cfg: XLConfig, params: dict, ids: np.ndarray, ws: LayerScratch) -> Any:
    """Adaptive input embedding: (B, T) ids -> ws.x (B, T, C), scaled by sqrt(d_model). With
    several clusters the positions are sorted by cluster on the host, so each cluster's rows
    are one contiguous block (gathered, projected), and one gather puts them back in order."""
    xp = be.xp
    B, T = ids.shape
    n = B * T
    x = ws.x.reshape(n, cfg.d_model)
    flat = ids.reshape(-1)
    ends = cfg.cluster_ends if cfg.div_val > 1 else [0, cfg.vocab_size]
    cluster = np.searchsorted(np.asarray(ends[1:]), flat, side="right")    # (n,) cluster of each id
    order = np.argsort(cluster, kind="stable")
    be.upload(ws.ids[:n], flat[order] - np.asarray(ends)[cluster[order]])
    sorted_out = x if cfg.div_val == 1 else ws.emb_out[:n]               # (n, C) in cluster order
    at = 0
    for i in range(len(ends) - 1):
        count = int((cluster == i).sum())
        if count == 0:
            continue
        d = cfg.emb_dim(i)
        rows = ws.ids[at:at + count]
        vec = ws.emb[:count * d].reshape(count, d)                         # (count, d_i)
        if f"emb_proj.{i}" in params:
            ops.embed(xp, params[f"emb_table.{i}"], rows, vec)
            ops.linear(xp, vec, params[f"emb_proj.{i}"], out=sorted_out[at:at + count])
        else:                                                              # d_embed == C
            ops.embed(xp, params[f"emb_table.{i}"], rows, sorted_out[at:at + count])
        at += count
    if cfg.div_val > 1:
        back = np.empty(n, np.int64)
        back[order] = np.arange(n)
        be.upload(ws.perm[:n], back)
        xp.take(sorted_out, ws.perm[:n], axis=0, out=x)
    x *= math.sqrt(cfg.d_model)
    return ws.x


def relative_source(be: Any, cfg: XLConfig, params: dict, K: int,
                    ws: LayerScratch | None = None) -> tuple[str, Any]:
    """Where a call with K keys gets the projected sinusoids of the distances K-1 ... 0 (the same
    for every layer, so worked out once per call): ("rows", a slice of each layer's table, or
    an index array when clamp_len folds the long distances into one row), or ("project", the
    (K, C) sinusoids to multiply by W_r, for a prompt chunk longer than the tables). Given the
    call's scratch, host arrays are uploaded into it (nothing allocated on the device)."""
    R = params["r_table.0"].shape[0] if cfg.n_layer else 0
    if K <= R:
        return "rows", slice(R - K, R)
    if 0 < cfg.clamp_len < R:
        index = R - 1 - np.minimum(np.arange(K - 1, -1, -1), cfg.clamp_len)
        if ws is None:
            return "rows", be.asarray(index)
        be.upload(ws.ids[:K], index)
        return "rows", ws.ids[:K]
    table = sinusoids(cfg, params["inv_freq"], K)
    if ws is None:
        return "project", be.asarray(table, be.dtype)
    be.upload(ws.sinus, table)
    return "project", ws.sinus


def relative_keys(be: Any, cfg: XLConfig, params: dict, l: int, w_r: Any, K: int,
                  source: tuple[str, Any] | None = None, out: Any = None) -> Any:
    """Layer l's projected sinusoids of the distances K-1 ... 0 as (H, D, K), from its table or
    projected now, per `relative_source` (computed here when not given); `out`: (K, HD) scratch
    for those not a view of the table."""
    how, what = source or relative_source(be, cfg, params, K)
    table = params[f"r_table.{l}"]
    if how == "rows" and isinstance(what, slice):
        r = table[what]
    elif how == "rows":
        r = table[what] if out is None else be.xp.take(table, what, axis=0, out=out)
    else:
        r = ops.linear(be.xp, what, w_r, out=out)
    return r.reshape(K, cfg.n_head, cfg.d_head).transpose(1, 2, 0)


def rel_shift(xp: Any, x: Any) -> Any:
    """Turn scores indexed by position-embedding row into scores indexed by key, as a strided
    view (nothing copied): out[..., i, j] = x[..., i, j + T - 1 - i].

    x (..., T, K), last two axes contiguous: x[..., i, m] pairs query i with embedding row m
    (distance K-1-m). The reference pads a zero column, views (..., K+1, T), drops the first row
    and views back: the same values wherever j <= i + M (M = K - T), i.e. every key the query
    may see; at the masked positions (j > i + M) this view reads other scores of the same
    (T, K) block instead of the reference's zeros, which the mask then overwrites. Element
    (i, j) sits at T-1 + i(K-1) + j of the block: rows of stride K-1."""
    *_, T, K = x.shape
    item = x.dtype.itemsize
    return xp.lib.stride_tricks.as_strided(x[..., 0, T - 1], shape=x.shape,
                                           strides=(*x.strides[:-2], (K - 1) * item, item))


def attention_mask(cfg: XLConfig, qlen: int, mlen: int) -> np.ndarray:
    """(T, K) True where query i may NOT see key j: keys after it; with same_length also keys
    more than `mem_len` back, so every query sees the same number of keys."""
    klen = mlen + qlen
    i = np.arange(qlen)[:, None]
    j = np.arange(klen)[None, :]
    blocked = j > i + mlen
    if cfg.same_length:
        mask_len = klen - cfg.mem_len
        shift = qlen - mask_len if mask_len > 0 else qlen
        blocked |= j <= i - shift
    return blocked


def cluster_logits(xp: Any, params: dict, i: int, h: Any) -> Any:
    """Output cluster i's logits: (h @ proj_i.T) @ W_i.T + b_i. h (N, C) -> (N, n_i)."""
    proj = params.get(f"cluster.{i}.proj")
    if proj is not None:
        h = ops.linear(xp, h, proj)                                            # (N, d_i)
    out = ops.linear(xp, h, params[f"cluster.{i}.w"])
    out += params[f"cluster.{i}.b"]
    return out


def log_probs(be: Any, cfg: XLConfig, params: dict, hidden: Any) -> Any:
    """Projected adaptive log-softmax: hidden (N, C) -> log-probabilities (N, V) float32."""
    xp = be.xp
    n = cfg.n_clusters
    ends = cfg.cluster_ends
    head = ops.log_softmax_(xp, cluster_logits(xp, params, 0, hidden).astype(np.float32, copy=False))
    if n == 1:
        return head                                                            # (N, V)
    out = xp.empty((hidden.shape[0], cfg.vocab_size), dtype=np.float32)
    out[:, :ends[1]] = head[:, :ends[1]]
    for i in range(1, n):
        tail = out[:, ends[i]:ends[i + 1]]
        tail[...] = cluster_logits(xp, params, i, hidden)
        ops.log_softmax_(xp, tail)
        tail += head[:, ends[1] + i - 1:ends[1] + i]  # + log p(cluster i)
    return out


def target_log_probs(be: Any, cfg: XLConfig, params: dict, hidden: Any,
                     targets: np.ndarray) -> np.ndarray:
    """log p(targets[n] | hidden[n]) for each row: (N, C), (N,) ids -> (N,) float64 on the host.

    What scoring needs, without the (N, V) matrix: the head's logits and log-normaliser for every
    row, and each tail cluster's only for the rows whose target lies in that cluster (the
    computation HF's adaptive softmax does when given labels). Equal to gathering `log_probs`
    at the targets, up to float32 rounding."""
    xp = be.xp
    ends, n = cfg.cluster_ends, cfg.n_clusters
    targets = np.asarray(targets, np.int64)
    N = len(targets)
    head = cluster_logits(xp, params, 0, hidden).astype(np.float32, copy=False)  # (N, head)
    at = np.arange(N)
    in_head = targets < ends[1]
    # what is read from the head's logits before logsumexp_ uses them as scratch: the targets
    # that lie in it and the tail clusters' columns (log p(cluster i) = logit - lse)
    picked = be.to_host(head[be.asarray(at), be.asarray(np.where(in_head, targets, 0))])
    cluster_lp = np.array(be.to_host(head[:, ends[1]:ends[1] + n - 1]), np.float64)  # (N, n - 1)
    lse = be.to_host(ops.logsumexp_(xp, head))                                  # (N,)
    out = np.where(in_head, picked, 0.0).astype(np.float64) - lse
    cluster_lp = cluster_lp - lse[:, None]
    for i in range(1, n):
        rows = np.nonzero((targets >= ends[i]) & (targets < ends[i + 1]))[0]
        if len(rows) == 0:
            continue
        r = be.asarray(rows)
        tail = cluster_logits(xp, params, i, hidden[r]).astype(np.float32, copy=False)  # (n_r, n_i)
        got = be.to_host(tail[xp.arange(len(rows)), be.asarray(targets[rows] - ends[i])])
        out[rows] = got - be.to_host(ops.logsumexp_(xp, tail)) + cluster_lp[rows, i - 1]
    return out


# =====================================================================================================
# Segment memory
# =====================================================================================================


# =====================================================================================================
# The forward pass with segment memory
# =====================================================================================================
def append_memory(buf: Any, new: Any, old_length: int, scratch: Any = None) -> None:
    """buf (B, cap, ...) holds `old_length` positions: append new (B, T, ...), keep the last cap.
    Moving the kept positions to the front overlaps itself (a GPU copy would read what it has
    overwritten): through `scratch` (B, >= cap, ...) when given, else a copy."""
    cap, T = buf.shape[1], new.shape[1]
    if T >= cap:
        buf[:, :cap] = new[:, T - cap:]
        return
    keep = min(old_length, cap - T)
    if keep and old_length > keep:
        kept = buf[:, old_length - keep:old_length]
        if scratch is None:
            kept = kept.copy()
        else:
            scratch[:, :keep] = kept
            kept = scratch[:, :keep]
        buf[:, :keep] = kept
    buf[:, keep:keep + T] = new


def feed_forward(xp: Any, cfg: XLConfig, p: dict, x: Any, attn: Any, ws: LayerScratch) -> Any:
    """The attention residual and the position-wise FF of one layer: x, attn (B, T, C) -> the
    layer's output, written into x (B, T, C). Post-norm (the released checkpoints):
    LN(a + FF(a)) with a = LN(x + attn); pre-norm: a + FF(LN(a)) with a = x + attn."""
    a = xp.add(x, attn, out=ws.a)
    norm = dict(eps=cfg.eps, work=ws.work, stats=ws.ln_stats)
    if not cfg.pre_lnorm:
        ops.layer_norm(xp, a, p["ln_attn_w"], p["ln_attn_b"], out=a, **norm)
    h = ops.layer_norm(xp, a, p["ln_ff_w"], p["ln_ff_b"], out=ws.h, **norm) if cfg.pre_lnorm else a
    hidden = ops.linear(xp, h, p["w1"], ws.ff)                                # (B, T, F)
    hidden += p["b1"]
    out = ops.linear(xp, ops.relu_(xp, hidden), p["w2"], ws.attn)             # attn was used
    out += p["b2"]
    out += a
    if cfg.pre_lnorm:
        x[...] = out
        return x
    return ops.layer_norm(xp, out, p["ln_ff_w"], p["ln_ff_b"], out=x, **norm)


def relative_attention(xp: Any, p: dict, q: Any, k: Any, v: Any, r: Any, mask: Any,
                       scale: float, ws: LayerScratch, h0: int, h1: int) -> None:
    """Heads h0:h1 of one layer's attention into ws.ctx: softmax((AC + rel_shift(BD)) * scale)
    @ v, with AC = (q + u) k^T (content) and BD = (q + v_bias) r (position). q (B, H, T, D);
    k, v (B, H, K, D); r (H, D, K); mask (T, K) True where blocked, or None."""
    B, H, T, D = q.shape
    hs = slice(h0, h1)
    qb = ws.qb[:, hs]                                                          # (B, h, T, D)
    xp.add(q[:, hs], p["r_w_bias"][hs, None, :], out=qb)
    scores = xp.matmul(qb, k[:, hs].swapaxes(-1, -2), out=ws.scores[:, hs])    # AC (B, h, T, K)
    xp.add(q[:, hs], p["r_r_bias"][hs, None, :], out=qb)
    bd = xp.matmul(qb, r[hs], out=ws.bd[:, hs])                                # (B, h, T, K)
    scores += rel_shift(xp, bd)
    scores *= scale
    if mask is not None:   # an elementwise select: boolean indexing would count on the host
        xp.copyto(scores, ops.mask_value(scores.dtype), where=mask)
    ops.softmax_(xp, scores, (ws.top[:, hs], ws.total[:, hs]))
    xp.matmul(scores, v[:, hs], out=ws.ctx.reshape(B, T, H, D).transpose(0, 2, 1, 3)[:, hs])


def forward_hidden(be: Any, cfg: XLConfig, params: dict, ids: np.ndarray, memory: MemoryBuffers,
                   M: int) -> Any:
    """(B, T) ids over a memory of M filled positions -> last layer output (B, T, C). Each
    layer's input (and its keys/values) is appended to `memory` (the live rows' buffers) after
    the layer has read it; the caller advances the filled length.

    Call inside an arena scope: the layer scratch (the result is its `x`) lives until it
    closes; nothing else is allocated on the device."""
    xp = be.xp
    B, T = ids.shape
    K = M + T
    H, D = cfg.n_head, cfg.d_head
    ws = LayerScratch.allocate(be.arena, cfg, B, T, K, be.dtype)
    x = embed(be, cfg, params, ids, ws)                                        # (B, T, C)
    blocked = attention_mask(cfg, T, M)                                        # (T, K)
    mask = None
    if blocked.any():
        be.upload(ws.mask, blocked)
        mask = ws.mask
    scale = 1.0 / math.sqrt(D)
    r_source = relative_source(be, cfg, params, K, ws)
    for l, p in enumerate(params["layers"]):
        # projections of the T new positions only; the memory's come from its cache
        inp = (ops.layer_norm(xp, x, p["ln_attn_w"], p["ln_attn_b"], cfg.eps, ws.h, ws.work,
                              ws.ln_stats) if cfg.pre_lnorm else x)
        qkv = ops.linear(xp, inp, p["w_qkv"], ws.qkv).reshape(B, T, 3, H, D)
        kv = ws.kv                                                             # (B, K, 2, H, D)
        kv[:, :M] = memory.kv[l, :, :M]
        kv[:, M:] = qkv[:, :, 1:]
        q = qkv[:, :, 0].transpose(0, 2, 1, 3)                                 # (B, H, T, D)
        k = kv[:, :, 0].transpose(0, 2, 1, 3)                                  # (B, H, K, D)
        v = kv[:, :, 1].transpose(0, 2, 1, 3)
        r = relative_keys(be, cfg, params, l, p["w_r"], K, r_source, ws.r)     # (H, D, K)
        ops.over_heads(xp, H, partial(relative_attention, xp, p, q, k, v, r, mask, scale, ws))
        attn = ops.linear(xp, ws.ctx, p["w_o"], ws.attn)                       # (B, T, C)
        if cfg.mem_len:  # this layer's input (and its K/V: the tail of [memory; new]) join it
            append_memory(memory.states[l], x, M, ws.shift)
            n = min(cfg.mem_len, K)
            memory.kv[l, :, :n] = kv[:, K - n:]
        x = feed_forward(xp, cfg, p, x, attn, ws)
    return x


def reorder_memory(be: Any, memory: MemoryBuffers, rows: np.ndarray, M: int) -> None:
    """Rows `rows` of the live batch become rows 0..n-1 (a row may repeat); only the filled
    positions move, one layer at a time (through a scratch of one layer's rows: `reorder_scratch`,
    in a scope, so that its device work stays inside the plan)."""
    n = len(rows)
    k = ops.compiled(np, memory.states) if isinstance(memory.states, np.ndarray) else None
    if k is not None and memory.states.flags.c_contiguous and memory.kv.flags.c_contiguous:
        for buf in (memory.states, memory.kv):   # (L, B, M, ...) viewed as (L, B, 1, M, rest)
            L, B = buf.shape[:2]
            k.gather_rows(buf.reshape(L, B, 1, buf.shape[2], -1), rows, M)
        return
    with be.arena.scope():
        idx = be.arena.alloc((n,), np.int64, "reorder rows")
        be.upload(idx, rows)
        width = max(int(np.prod(b.shape[3:])) for b in (memory.states, memory.kv))
        tmp = be.arena.alloc((n * max(M, 1) * width,), memory.states.dtype, "reorder scratch")
        for buf in (memory.states, memory.kv):
            for l in range(buf.shape[0]):
                filled = buf[l, :, :M]
                got = tmp[:n * filled[0].size].reshape(n, *filled.shape[1:])
                be.xp.take(filled, idx, axis=0, out=got)
                filled[:n] = got
