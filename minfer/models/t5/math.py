"""T5's math: pure functions over the backend's array namespace `be.xp`.

The numerics are Hugging Face transformers' T5 (see docs/architecture.md): pre-norm residual
blocks with RMS "layer norm" (its weight folded into the next matrix at load), attention without
1/sqrt(d) scaling, a learned bias per (bucketed relative distance, head) that block 0 of each
stack owns and all its layers share (UMT5: every layer its own table, `cfg.bias_per_layer`),
and a tied head that sees the decoder output rescaled by d_model**-0.5.

One block function serves every pass: the encoder (bidirectional self-attention), the teacher-
forced decoder (causal self-attention over its own T positions, then cross-attention), and the
incremental step (self-attention over the layer's KV cache, written at position t). Scratch
comes from the caller's typed arena buffers (buffers.py), and host inputs (ids, masks, bias tables)
are uploaded into them: device work allocates nothing (on a GPU a temporary is arena memory the
plan must count), and a step allocates nothing anywhere. LongT5's encoder runs the same block
with its local / transient-global attention (long_attention.py).

float16 (CUDA) follows transformers: the FF output projection computes in float32 (HF keeps `wo`
float32: `_keep_in_fp32_modules`), so the residual stream is float32 from the first FF on; before
it (layer 0) the stream is rounded to float16 after each sublayer and, only when an inf appears,
clamped to +-(float16 max - 1000); norms sum in float32 and round once into float16.

Shapes: B batch, T query length, S source length, N decoder positions, H heads, D head dim,
I = H*D, C d_model, V vocab, L layers.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import numpy as np

from ... import ops
from ...backend import encoder_attention_kind
from .long_attention import LongAttention
from .buffers import (DecodeBuffers, DecoderScratch, EncoderScratch, LongEncoderScratch,
                      PassScratch, reorder_elements)
from .config import T5Config

FP16_MAX = float(np.finfo(np.float16).max)
FP16_CLAMP = FP16_MAX - 1000  # HF T5's guard value, used once an inf has appeared


# =====================================================================================================
# Relative position buckets (host-side integer work, cached)
# =====================================================================================================
def relative_bucket(relative_position: np.ndarray, bidirectional: bool, num_buckets: int,
                    max_distance: int) -> np.ndarray:
    """T5's bucket of each relative position (key - query).

    Distances below max_exact get their own bucket; larger ones share log-spaced buckets up to
    max_distance. The log is taken in float32, as the reference does, so truncation at bucket
    edges matches it exactly. Bidirectional: half the buckets for keys after the query.
    """
    rel = np.asarray(relative_position, dtype=np.int64)
    bucket = np.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        bucket += (rel > 0) * num_buckets
        n = np.abs(rel)
    else:
        n = np.maximum(-rel, 0)
    max_exact = num_buckets // 2
    scaled = (np.log(np.maximum(n, 1).astype(np.float32) / np.float32(max_exact))
              / np.float32(math.log(max_distance / max_exact))
              * np.float32(num_buckets - max_exact))
    large = np.minimum(max_exact + scaled.astype(np.int64), num_buckets - 1)
    return bucket + np.where(n < max_exact, n, large)


def fill_position_bias(be: Any, out: Any, cfg: T5Config, rel_bias: np.ndarray,
                       bidirectional: bool, extra: np.ndarray | None = None) -> None:
    """out (H, T, S), an arena buffer, = rel_bias[bucket(key - query)] (+ extra (T, S)), one
    head at a time. The bias depends on key - query alone (-(T-1) .. S-1): one row of T + S - 1
    values per head, in which query t's keys are a window, so a head is a strided view of its
    row. Neither a (T, S) bucket matrix nor the int64 temporaries that build one (10 MiB over
    512 tokens) is made, nor a whole (H, T, S) on the host (64 MiB for 64 heads)."""
    H, T, S = out.shape
    buckets = relative_bucket(np.arange(-(T - 1), S), bidirectional, cfg.num_buckets,
                              cfg.max_distance)                           # (T + S - 1,)
    rows = np.ascontiguousarray(rel_bias[buckets].T, dtype=np.float32)    # (H, T + S - 1)
    info = np.finfo(out.dtype) if extra is not None else None
    for h in range(H):
        # window i holds distances i - (T-1) .. i - (T-1) + S-1: query t's is window T-1-t
        head = np.lib.stride_tricks.sliding_window_view(rows[h], S)[::-1]   # (T, S) view
        if extra is not None:   # + the causal mask, clipped to the buffer's range
            head = np.add(head, extra)
            np.clip(head, info.min, info.max, out=head)
        be.upload(out[h], head)


def distance_bias(cfg: T5Config, rel_bias: np.ndarray, T: int, S: int) -> np.ndarray:
    """(H, T + S - 1) float32 bidirectional position bias by distance: column c holds the bias
    of key - query = c - (T - 1) (ops.DistanceBias). Its (H, T, S) matrix is never built."""
    rel = np.arange(-(T - 1), S)
    buckets = relative_bucket(rel, True, cfg.num_buckets, cfg.max_distance)
    return np.ascontiguousarray(rel_bias[buckets].T, dtype=np.float32)


def causal_bias_by_distance(cfg: T5Config, rel_bias: np.ndarray, max_len: int) -> np.ndarray:
    """(H, max_len) decoder bias indexed by reversed distance: column max_len-1-n holds distance n.

    Step t's row over keys 0..t is then the contiguous slice [:, max_len-1-t:], so one table of
    O(H * max_len) serves every step of a generation.
    """
    distance = np.arange(max_len - 1, -1, -1)  # reversed: column j has distance max_len-1-j
    buckets = relative_bucket(-distance, False, cfg.num_buckets, cfg.max_distance)
    return np.ascontiguousarray(rel_bias[buckets].T)  # (H, max_len)


def bias_table(cfg: T5Config, params: dict, stack: str, i: int) -> np.ndarray:
    """(num_buckets, H) host table of layer i of `stack`: its own (UMT5) or block 0's."""
    return params[f"{stack}.rel_bias.{i if cfg.bias_per_layer else 0}"]


def refills_bias(cfg: T5Config, i: int) -> bool:
    """Whether layer i needs a position bias other than the previous layer's."""
    return i == 0 or cfg.bias_per_layer


def mask_bias(be: Any, attention_mask: np.ndarray, out: Any) -> Any:
    """The additive mask (B, S) into `out` ((B, 1, 1, S) or (B, S)): 0 where attended,
    `mask_value` where padded."""
    host = np.where(attention_mask.astype(bool), 0.0, ops.mask_value(out.dtype))
    be.upload(out, host.reshape(out.shape).astype(out.dtype))
    return out


# =====================================================================================================
# Sublayers and the block
# =====================================================================================================
def clamp_if_inf(xp: Any, h: Any, lim: Any) -> None:
    """HF T5's float16 guard, without a host sync: when any value of h is +-inf, clamp all of h
    to +-(max - 1000); otherwise clamp to +-max (which changes nothing finite). lim: (2,) scratch
    in h's dtype."""
    top, low = lim[0:1].reshape(()), lim[1:2].reshape(())
    h.max(out=top)
    h.min(out=low)
    xp.negative(low, out=low)
    xp.maximum(top, low, out=top)               # max |h|: inf when any inf
    xp.subtract(top, FP16_MAX, out=top)         # <= 0, or inf
    xp.clip(top, 0, FP16_MAX - FP16_CLAMP, out=top)
    xp.subtract(FP16_MAX, top, out=top)         # the bound: max, or max - 1000
    xp.negative(top, out=low)
    xp.clip(h, low, top, out=h)


def residual_norm(xp: Any, cfg: T5Config, x: Any, delta: Any, weight: Any, ws: Any,
                  half_stream: bool = False, into: Any = None) -> Any:
    """x += delta (the previous sublayer's output; None at the start of a pass), then
    ws.h = weight * x / rms(x): the norm in front of the next sublayer. One compiled pass on the
    CPU in float32; `into`, the slot the norm feeds: with compute="int8" the rows may go straight
    to it quantised (`ops.add_rms_norm`). float16 compute: the stream x is float32; `half_stream`
    (layer 0, before its FF) rounds it to float16 and applies HF's guard first, as HF's float16
    stream would be."""
    work, inv = ws.norm_scratch()
    if x.dtype == ws.h.dtype:
        return ops.add_rms_norm(xp, x, delta, weight, cfg.eps, ws.h, work, inv, into)
    if delta is not None:
        x += delta
        if half_stream:
            ws.h[...] = x
            clamp_if_inf(xp, ws.h, ws.lim)
            x[...] = ws.h
    return ops.rms_norm(xp, x, weight, cfg.eps, ws.h, work, inv)


class PassAttention:
    """Attention of the teacher-forced decoder over its own positions, and its cross-attention,
    which reads each layer's K/V of the encoder output: one additive bias for every layer
    (position bias + masks)."""

    def __init__(self, xp: Any, bias: Any, cross: tuple[Any, Any, Any] | None = None):
        self.xp, self.bias, self.cross = xp, bias, cross   # cross: K, V (L, B, H, S, D), mask

    def self_attend(self, i: int, q: Any, k: Any, v: Any, ws: PassScratch) -> None:
        B, H, T, D = q.shape
        ops.attention(self.xp, q, k, v, self.bias, ws.scores_as(B, H, T, T),
                      ws.ctx.reshape(B, T, H, D), stats=ws.stats_as(B, H, T))

    def cross_attend(self, i: int, q: Any, ws: PassScratch) -> None:
        k, v, mask = self.cross
        B, H, T, D = q.shape
        ops.attention(self.xp, q, k[i], v[i], mask, ws.scores_as(B, H, T, k.shape[3]),
                      ws.ctx.reshape(B, T, H, D), stats=ws.stats_as(B, H, T))


class EncoderAttention:
    """The encoder's self-attention over its own positions, the bias given by distance (T5's
    position bias) and key (padding), by `kind` (backend.encoder_attention_kind): "bfloat16"
    ops.rounded_distance_attention, "int8" ops.quantised_distance_attention, "float32"
    ops.float_distance_attention (all over the pass's q|k|v, compiled where the kernels run),
    None ops.distance_attention."""

    def __init__(self, xp: Any, bias: Any, kind: str | None = None):
        self.xp, self.bias, self.kind = xp, bias, kind

    def self_attend(self, i: int, q: Any, k: Any, v: Any, ws: PassScratch) -> None:
        B, H, T, D = q.shape
        ctx, stats = ws.ctx.reshape(B, T, H, D), ws.stats_as(B, H, T)
        if self.kind is None:
            ops.distance_attention(self.xp, q, k, v, self.bias, ws.scores, ctx, stats=stats)
            return
        qkv = ws.qkv.reshape(B, T, 3, H, D)        # (q, k and v are views of it)
        attend = {"bfloat16": ops.rounded_distance_attention,
                  "int8": ops.quantised_distance_attention}.get(self.kind,
                                                                ops.float_distance_attention)
        attend(self.xp, qkv, self.bias, ws.scores, ctx, stats)


class StepAttention:
    """One new position per row over KV caches: the rows of a step belong to one or more decode
    states (`groups`: (rows of the step, the state's live buffers, its position t)), each with
    its own caches, position, causal-bias slice and source. Step t's bias over keys 0..t is the
    slice [:, N-1-t:] of the state's distance table: nothing is recomputed."""

    def __init__(self, xp: Any, groups: list[tuple[slice, DecodeBuffers, int]]):
        self.xp, self.groups = xp, []
        for rows, buf, t in groups:
            Lb, H, N = buf.self_bias.shape   # one table, or one per layer (UMT5)
            self.groups.append((rows, buf, t, [buf.self_bias[j, :, N - 1 - t:].reshape(1, H, 1, t + 1)
                                               for j in range(Lb)]))

    def self_attend(self, i: int, q: Any, k: Any, v: Any, ws: PassScratch) -> None:
        R, H, _, D = q.shape
        ctx = ws.ctx.reshape(R, 1, H, D)
        # the queries contiguous (ws.q is free until the cross-attention): every row's heads
        # then sit one stride apart, one batched product per state on a GPU
        qc = ws.q.reshape(R, 1, H, D).transpose(0, 2, 1, 3)
        qc[...] = q
        for rows, buf, t, biases in self.groups:
            bias = biases[min(i, len(biases) - 1)]
            k_cache, v_cache = buf.self_k[i], buf.self_v[i]            # (b, H, N, D)
            k_cache[:, :, t:t + 1] = k[rows]
            v_cache[:, :, t:t + 1] = v[rows]
            qr = qc[rows]
            b = qr.shape[0]
            ops.attention(self.xp, qr, k_cache, v_cache, bias, ws.scores_as(b, H, 1, t + 1),
                          ctx[rows], keys=t + 1, stats=ws.stats_as(b, H, 1))

    def cross_attend(self, i: int, q: Any, ws: PassScratch) -> None:
        ctx = ws.ctx.reshape(q.shape[0], 1, q.shape[1], q.shape[3])
        for rows, buf, _, _ in self.groups:
            qr, k = q[rows], buf.cross_k[i]                  # (b, H, 1, D), (inputs, H, S, D)
            ops.attention(self.xp, qr, k, buf.cross_v[i], buf.cross_bias,
                          ws.scores_as(qr.shape[0], qr.shape[1], 1, k.shape[2]), ctx[rows],
                          stats=ws.stats_as(qr.shape[0], qr.shape[1], 1),
                          kv_rows=buf.cross_rows)


def self_attention(xp: Any, cfg: T5Config, blk: dict, i: int, h: Any, ws: PassScratch,
                   attn: Any) -> Any:
    """h (B, T, C) -> ws.proj (B, T, C): q|k|v in one product, the attention `attn` gives
    (among the pass's positions, or over KV caches), the output projection."""
    B, T, _ = h.shape
    H, D = cfg.num_heads, cfg.d_kv
    qkv = ops.linear(xp, h, blk["w_qkv"], out=ws.qkv).reshape(B, T, 3, H, D)
    q, k, v = (qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3))    # (B, H, T, D)
    attn.self_attend(i, q, k, v, ws)
    return ops.linear(xp, ws.ctx, blk["w_o"], out=ws.proj)


def cross_attention(xp: Any, cfg: T5Config, blk: dict, i: int, h: Any, ws: PassScratch,
                    attn: Any) -> Any:
    """h (B, T, C) attends to the encoder's precomputed K/V, no position bias; -> ws.proj."""
    B, T, _ = h.shape
    q = ops.linear(xp, h, blk["w_cross_q"], out=ws.q).reshape(B, T, cfg.num_heads, cfg.d_kv)
    attn.cross_attend(i, q.transpose(0, 2, 1, 3), ws)
    return ops.linear(xp, ws.ctx, blk["w_cross_o"], out=ws.proj)


def feed_forward(xp: Any, cfg: T5Config, blk: dict, h: Any, ws: PassScratch) -> Any:
    """h (B, T, C) -> the FF's output (B, T, C): act(h W_in) W_out, or gated (v1.1):
    (act(h W_0) * (h W_1)) W_out with W_0|W_1 fused into one (2F, C) product. float16 compute:
    W_out computes in float32 (HF keeps `wo` float32), into ws.ffo."""
    if cfg.act == "relu" and not cfg.gated:     # (in the int8 products' epilogue)
        gate = ops.linear(xp, h, blk["w_in"], out=ws.ff, relu=True)       # (B, T, F)
    else:   # (quantised straight into W_out's scratch where its product takes them so)
        hidden = ops.linear(xp, h, blk["w_in"], out=ws.ff)                # (B, T, F | 2F)
        gate = ops.activate(xp, cfg.act, hidden, cfg.d_ff, cfg.gated, ws.act,
                            into=blk["w_out"] if ws.ffo is None else None)  # (B, T, F)
    if ws.ffo is None:
        return ops.linear(xp, gate, blk["w_out"], out=ws.proj)
    wide = ws.act[..., :cfg.d_ff]
    wide[...] = gate
    return ops.linear(xp, wide, blk["w_out"], out=ws.ffo)


def block(xp: Any, cfg: T5Config, blk: dict, i: int, x: Any, ws: PassScratch, attn: Any,
          pending: Any, cross: bool = False) -> Any:
    """Layer i over the residual stream x (B, T, C), updated in place: self-attention as `attn`
    gives it (among the pass's positions, or over KV caches), cross-attention to the encoder's
    K/V when `cross` (decoder layers), then the feed-forward; each a pre-norm residual.
    `pending`: the previous layer's last output, not yet added to x (its add is fused with this
    layer's first norm). Returns this layer's last output, pending likewise."""
    h = residual_norm(xp, cfg, x, pending, blk["ln_self"], ws, into=blk["w_qkv"])
    out = self_attention(xp, cfg, blk, i, h, ws, attn)
    if cross:
        h = residual_norm(xp, cfg, x, out, blk["ln_cross"], ws, half_stream=i == 0,
                          into=blk["w_cross_q"])
        out = cross_attention(xp, cfg, blk, i, h, ws, attn)
    h = residual_norm(xp, cfg, x, out, blk["ln_ff"], ws, half_stream=i == 0, into=blk["w_in"])
    return feed_forward(xp, cfg, blk, h, ws)


def lm_head(xp: Any, cfg: T5Config, params: dict, x: Any, pending: Any, out: Any,
            ws: PassScratch) -> Any:
    """Decoder states (..., C) + the last layer's pending output -> final norm -> logits (..., V)
    in `out`."""
    h = residual_norm(xp, cfg, x, pending, params["decoder.final_ln"], ws)
    if cfg.tie_word_embeddings:
        h *= cfg.d_model ** -0.5  # the tied head sees rescaled states
    return ops.linear(xp, h, params["lm_head"], out)


def embed_tokens(be: Any, params: dict, ids: np.ndarray, ws: PassScratch) -> None:
    """(B, T) host ids -> their embeddings in the stream ws.x: the ids uploaded into ws.ids, the
    rows gathered in the embedding's dtype (into ws.h when the stream is wider)."""
    n = ids.size
    be.upload(ws.ids[:n], ids.reshape(-1).astype(np.int64))
    idx = ws.ids[:n].reshape(ids.shape)
    if ws.x.dtype == ws.h.dtype:
        ops.embed(be.xp, params["embedding"], idx, ws.x)
        return
    ops.embed(be.xp, params["embedding"], idx, ws.h)
    ws.x[...] = ws.h


# =====================================================================================================
# Passes
# =====================================================================================================
def encoder_attention(be: Any, cfg: T5Config, params: dict,
                      attention_mask: np.ndarray) -> tuple[PassScratch, Callable[[int, dict], Any]]:
    """An encoder pass's scratch and each layer's self-attention (a function of the layer's
    index and weights): T5's full attention with its bias by distance (an (H, 2T - 1) table,
    filled once and shared by all layers; UMT5: refilled per layer from its own table) and the
    padding mask by key (ops.distance_attention: no (B, H, T, T) bias exists), or
    LongT5's local / transient-global attention (long_attention.py), linear in T."""
    B, T = attention_mask.shape
    if cfg.encoder_attention != "full":
        ws = LongEncoderScratch.allocate(be.arena, cfg, B, T, be.dtype)
        bucket = functools.partial(relative_bucket, bidirectional=True,
                                   num_buckets=cfg.num_buckets, max_distance=cfg.max_distance)
        long = LongAttention(be, cfg, ws, attention_mask, bucket,
                             bias_table(cfg, params, "encoder", 0),
                             params.get("encoder.global_rel_bias"))
        return ws, lambda i, blk: long.layer(blk)
    on_host = be.xp is np
    ws = EncoderScratch.allocate(be.arena, cfg, B, T, be.dtype, be.compute, on_host)
    mask_bias(be, attention_mask, ws.mask)                                 # (B, T)
    attn = EncoderAttention(be.xp, ops.DistanceBias(ws.distance, ws.mask),
                            encoder_attention_kind(be.compute, ws.qkv.dtype, on_host))

    def layer(i: int, blk: dict) -> EncoderAttention:
        if refills_bias(cfg, i):   # (H, 2T - 1): once, or per layer (UMT5)
            be.upload(ws.distance, distance_bias(cfg, bias_table(cfg, params, "encoder", i), T,
                                                 T).astype(ws.distance.dtype))
        return attn
    return ws, layer


def encode(be: Any, cfg: T5Config, params: dict, input_ids: np.ndarray,
           attention_mask: np.ndarray, out: Any, probe: Any = None) -> Any:
    """Encoder stack: (B, T) ids -> final-normed states written into `out` (B, T, C).
    `probe(label, *arrays)`, when given, sees each layer's output (numerics.first_non_finite)."""
    xp = be.xp
    with be.arena.scope():
        ws, attention = encoder_attention(be, cfg, params, attention_mask)
        embed_tokens(be, params, input_ids, ws)                                # (B, T, C)
        if probe is not None:
            probe("encoder embedding", ws.x)
        pending = None
        for i, blk in enumerate(params["encoder"]):
            pending = block(xp, cfg, blk, i, ws.x, ws, attention(i, blk), pending)
            if probe is not None:   # the layer's output: the stream plus its pending output
                probe(f"encoder layer {i}", ws.x, pending)
        out[...] = residual_norm(xp, cfg, ws.x, pending, params["encoder.final_ln"], ws)
        if probe is not None:
            probe("encoder final norm", out)
    return out


def cross_kv(be: Any, cfg: T5Config, params: dict, encoder_states: Any, cache_k: Any,
             cache_v: Any) -> None:
    """Every decoder layer's cross-attention K and V from the encoder output, computed once
    per input: encoder_states (B, S, C) -> cache_k / cache_v (L, B, H, S, D)."""
    xp = be.xp
    B, S, _ = encoder_states.shape
    H, D = cfg.num_heads, cfg.d_kv
    with be.arena.scope():
        raw = be.arena.alloc((B, S, 2 * H * D), be.dtype, "cross K/V projection")
        for i, unit in enumerate(params["cross"]):
            kv = ops.linear(xp, encoder_states, unit["w_cross_kv"], out=raw).reshape(B, S, 2, H, D)
            cache_k[i] = kv[:, :, 0].transpose(0, 2, 1, 3)  # (B, H, S, D)
            cache_v[i] = kv[:, :, 1].transpose(0, 2, 1, 3)


def decode_full(be: Any, cfg: T5Config, params: dict, decoder_input_ids: np.ndarray,
                encoder_states: Any, attention_mask: np.ndarray, probe: Any = None) -> np.ndarray:
    """Teacher-forced decoder: (B, T) ids over encoder states (B, S, C) -> logits (B, T, V)
    float32 on the host. `probe` as in `encode`."""
    xp = be.xp
    B, T = decoder_input_ids.shape
    S = encoder_states.shape[1]
    with be.arena.scope():
        ws = DecoderScratch.allocate(be.arena, cfg, B, T, S, be.dtype)
        cross_kv(be, cfg, params, encoder_states, ws.cross_k, ws.cross_v)
        embed_tokens(be, params, decoder_input_ids, ws)                       # (B, T, C)
        if probe is not None:
            probe("decoder cross-attention keys and values", ws.cross_k, ws.cross_v)
            probe("decoder embedding", ws.x)
        causal = np.triu(np.full((T, T), ops.mask_value(ws.self_bias.dtype), np.float32), 1)
        attn = PassAttention(xp, ws.self_bias, (ws.cross_k, ws.cross_v,
                                                mask_bias(be, attention_mask, ws.cross_bias)))
        pending = None
        for i, blk in enumerate(params["decoder"]):
            if refills_bias(cfg, i):   # block 0's table (UMT5: each layer's own) + causal mask
                fill_position_bias(be, ws.self_bias[0], cfg, bias_table(cfg, params, "decoder", i),
                                   bidirectional=False, extra=causal)
            pending = block(xp, cfg, blk, i, ws.x, ws, attn, pending, cross=True)
            if probe is not None:
                probe(f"decoder layer {i}", ws.x, pending)
        logits = lm_head(xp, cfg, params, ws.x, pending, ws.logits, ws)
        if probe is not None:
            probe("the output head", logits)
        return np.array(be.to_host(logits), dtype=np.float32)


def start_state(be: Any, cfg: T5Config, params: dict, input_ids: np.ndarray,
                attention_mask: np.ndarray, buf: DecodeBuffers, max_len: int,
                repeat: int = 1, encoder: Any = None) -> None:
    """Fill a fresh decode state of B * repeat rows: encode the B inputs once, every layer's
    cross K/V (once per input: row i * repeat + j reads input i's, `cross_rows`), the causal
    bias table and the source mask; row i * repeat + j decodes input i. `encoder(enc)`, when
    given, fills enc (B, S, C) instead of the encoder pass (a cache)."""
    B, S = input_ids.shape
    for j in range(buf.self_bias.shape[0]):   # one table, or one per layer (UMT5)
        be.upload(buf.self_bias[j], causal_bias_by_distance(
            cfg, bias_table(cfg, params, "decoder", j), max_len))
    mask_bias(be, attention_mask, buf.cross_bias[:B])
    with be.arena.scope():
        enc = be.arena.alloc((B, S, cfg.d_model), be.dtype, "encoder output")
        if encoder is None:
            encode(be, cfg, params, input_ids, attention_mask, enc)
        else:
            encoder(enc)
        cross_kv(be, cfg, params, enc, buf.cross_k, buf.cross_v)   # (one row per input)
    buf.cross_rows = np.repeat(np.arange(B), repeat)
    if repeat > 1:  # spread each input's mask over its repeat rows, last first (no overwrite)
        for i in range(B - 1, -1, -1):
            buf.cross_bias[i * repeat + (i == 0):(i + 1) * repeat] = buf.cross_bias[i:i + 1]


def decode_steps(be: Any, cfg: T5Config, params: dict, groups: list[tuple[DecodeBuffers, int]],
                 token_ids: np.ndarray, ws: PassScratch, logits: Any) -> Any:
    """One step for the live rows of one or more decode states (`groups`: each state's live
    buffers and position t), their rows stacked in order: token_ids (R,) -> logits (R, V) in
    `logits` (R, 1, V). The products run once over all R rows (weights read once for every
    request); attention runs per state over its own caches. `ws`: scratch for R rows (a single
    state's own step scratch)."""
    xp = be.xp
    R = ws.x.shape[0]
    embed_tokens(be, params, np.asarray(token_ids).reshape(R, 1), ws)     # (R, 1, C)
    spans, at = [], 0
    for buf, t in groups:
        b = buf.x.shape[0]
        spans.append((slice(at, at + b), buf, t))
        at += b
    attn, pending = StepAttention(xp, spans), None
    for i, blk in enumerate(params["decoder"]):
        pending = block(xp, cfg, blk, i, ws.x, ws, attn, pending, cross=True)
    return lm_head(xp, cfg, params, ws.x, pending, logits, ws)[:, 0]  # (R, V)


def reorder_state(be: Any, buf: DecodeBuffers, rows: np.ndarray, length: int, cross: bool) -> None:
    """Rows `rows` of the live batch become rows 0..n-1 (a row may repeat). Only the filled part
    of the self-attention caches moves, one layer at a time, through one layer's scratch (planned:
    `buffers.reorder_elements`); the cross K/V stay where they are, each row's `cross_rows` entry
    following it; `cross`: the source masks move too (rows of other inputs than before)."""
    n = len(rows)
    buf.cross_rows[:n] = buf.cross_rows[rows]
    k = ops.compiled(be.xp, buf.self_k)
    if k is not None:  # one compiled pass per cache, the layers spread over the threads
        for cache in (buf.self_k, buf.self_v):
            k.gather_rows(cache, rows, length)
        if cross:
            buf.cross_bias[:n] = buf.cross_bias[rows]
        return
    xp = be.xp
    with be.arena.scope():
        be.upload(buf.ids[:n], rows)
        idx = buf.ids[:n]
        _, _, H, N, D = buf.self_k.shape
        elements = reorder_elements(buf.self_k.shape, n)
        if elements * buf.self_k.itemsize + be.arena.alignment <= be.arena.available:
            tmp = be.arena.alloc((elements,), buf.self_k.dtype, "reorder scratch")
        else:   # other requests hold what the plan counted for this: move the caches a few
            # positions at a time through the state's own step scratch (slower; an admitted
            # request never fails for want of memory): qkv holds 3 positions of every row,
            # scores a whole source's mask row of every row
            tmp = max((buf.scores, buf.qkv.reshape(-1)), key=lambda a: a.size)
        step = max(1, tmp.size // (n * H * D))                         # positions at a time
        for cache in (buf.self_k, buf.self_v):
            for layer in range(cache.shape[0]):
                for p in range(0, length, step):                       # rows of all chunks
                    filled = cache[layer, :, :, p:min(length, p + step)]  # (b, H, <=step, D)
                    got = tmp[:n * H * filled.shape[2] * D].reshape(n, H, filled.shape[2], D)
                    xp.take(filled, idx, axis=0, out=got)
                    filled[:n] = got
        if cross:
            S = buf.cross_bias.shape[3]
            got = (tmp if tmp.size >= n * S else buf.scores)[:n * S].reshape(n, 1, 1, S)
            xp.take(buf.cross_bias, idx, axis=0, out=got)
            buf.cross_bias[:n] = got
