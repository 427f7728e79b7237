"""T5 (v1.0, v1.1 / flan-t5, mT5) as pure functions over `be.xp`.

Follows Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer", and the numerics of Hugging Face transformers' T5 (see docs/architecture.md):
pre-norm blocks with RMS "layer norm", attention without 1/sqrt(d) scaling, a learned bias per
(bucketed relative distance, head) shared by all layers of a stack, and a tied output head rescaled
by d_model**-0.5.

Shapes: B batch, T query length, S key length, H heads, D head dim (d_kv), C d_model,
F d_ff, V vocab, L layers. Linear weights are stored (in, out) so a layer is `x @ w`.

Layout of this file: config -> checkpoint name map and parameter tree -> position buckets ->
forward functions (encoder, full decoder, one incremental decoder step) -> buffer specs for the
arena -> `T5Model`, the stateful wrapper the public API hands out.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from .. import ops
from ..backend import Backend
from ..checkpoint import Checkpoint, ConfigReader, check_names
from ..errors import CheckpointError, ConfigError, InputError
from ..memory import BufferSpec, align_up, bytes_needed
from ..streaming import (Layout, LayerStack, OwnsWeights, WeightPlan, WeightRuntime, plan_weights,
                         unit_arrays, unit_layout)

NEG_INF = float(np.finfo(np.float32).min)  # HF's additive mask value


# =====================================================================================================
# Config
# =====================================================================================================
@dataclass(frozen=True)
class T5Config:
    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_heads: int
    num_layers: int
    num_decoder_layers: int
    num_buckets: int
    max_distance: int
    eps: float
    act: str                  # activation name of the FF input projection, e.g. "relu", "gelu_new"
    gated: bool               # gated FF (v1.1): act(x @ wi_0) * (x @ wi_1)
    tie_word_embeddings: bool
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    decoder_start_token_id: int
    model_type: str = "t5"

    @property
    def inner(self) -> int:
        """Attention inner width H*D (need not equal d_model)."""
        return self.num_heads * self.d_kv

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "T5Config":
        get_int = ConfigReader(cfg, source).get_int

        model_type = cfg.get("model_type", "t5")
        if model_type not in ("t5", "mt5"):
            raise ConfigError(f"{source}: model_type {model_type!r} is not a T5 model (t5, mt5)")
        proj = cfg.get("feed_forward_proj", "relu")
        parts = proj.split("-") if isinstance(proj, str) else []
        if not (len(parts) == 1 or (len(parts) == 2 and parts[0] == "gated")) or not parts[-1]:
            raise ConfigError(f"{source}: feed_forward_proj {proj!r} is not 'ACT' or 'gated-ACT'")
        act = "gelu_new" if proj == "gated-gelu" else parts[-1]
        gated = parts[0] == "gated"
        # HF lets explicit config keys override what feed_forward_proj implies.
        act = cfg.get("dense_act_fn", act)
        gated = bool(cfg.get("is_gated_act", gated))
        ops.activation(act)  # unsupported activations fail here, naming themselves

        eps = ConfigReader(cfg, source).get_eps("layer_norm_epsilon", 1e-6)
        eos = cfg.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        pad = get_int("pad_token_id", 0, minimum=0)
        start = cfg.get("decoder_start_token_id")
        start = pad if start is None else start
        num_layers = get_int("num_layers", 6)
        vocab = get_int("vocab_size", 32128)
        for name, value in (("eos_token_id", eos_ids), ("decoder_start_token_id", (start,))):
            if not all(isinstance(i, int) and 0 <= i < vocab for i in value):
                raise ConfigError(f"{source}: '{name}' must be token id(s) below vocab_size {vocab}, "
                                  f"got {value!r}")
        num_buckets = get_int("relative_attention_num_buckets", 32, minimum=2)
        max_distance = get_int("relative_attention_max_distance", 128, minimum=2)
        if max_distance <= num_buckets // 2:
            # the decoder's log(max_distance / max_exact) would be <= 0: the buckets break down
            raise ConfigError(f"{source}: relative_attention_max_distance {max_distance} must exceed "
                              f"num_buckets/2 = {num_buckets // 2}")
        return cls(
            vocab_size=vocab, d_model=get_int("d_model", 512), d_kv=get_int("d_kv", 64),
            d_ff=get_int("d_ff", 2048), num_heads=get_int("num_heads", 8), num_layers=num_layers,
            num_decoder_layers=get_int("num_decoder_layers", num_layers) if cfg.get(
                "num_decoder_layers") is not None else num_layers,
            num_buckets=num_buckets, max_distance=max_distance, eps=float(eps), act=act,
            gated=gated, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            pad_token_id=pad, eos_token_ids=eos_ids, decoder_start_token_id=start,
            model_type=model_type,
        )


# =====================================================================================================
# Checkpoint names -> parameter tree
# =====================================================================================================
def _ff_names(prefix: str, gated: bool) -> list[str]:
    wi = ["wi_0", "wi_1"] if gated else ["wi"]
    return [f"{prefix}.DenseReluDense.{w}.weight" for w in wi + ["wo"]]


def folded_norms(cfg: T5Config, stack: str, i: int) -> dict[str, str]:
    """Layer `i` of `stack` ('encoder' / 'decoder'): each HF matrix fed by an RMS norm -> that
    norm's weight. The loader folds the weight into the matrix ((x/rms * g) @ W == (x/rms) @
    (g W)); `convert --dtype int8` folds it before quantising, so the file's int8 is exactly
    what quantising at load would make (no second rounding)."""
    p = f"{stack}.block.{i}.layer"
    feeds = {f"{p}.0.SelfAttention.{w}.weight": f"{p}.0.layer_norm.weight" for w in "qkv"}
    if stack == "decoder":
        feeds[f"{p}.1.EncDecAttention.q.weight"] = f"{p}.1.layer_norm.weight"
    ff = f"{p}.{2 if stack == 'decoder' else 1}"
    feeds.update({w: f"{ff}.layer_norm.weight" for w in _ff_names(ff, cfg.gated)[:-1]})
    return feeds


def all_folded_norms(cfg: T5Config) -> dict[str, str]:
    """`folded_norms` of every layer of both stacks."""
    folds: dict[str, str] = {}
    for stack in ("encoder", "decoder"):
        for i in range(stack_depth(cfg, stack)):
            folds.update(folded_norms(cfg, stack, i))
    return folds


def expected_shapes(cfg: T5Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `cfg` must hold, with its HF (out, in) shape."""
    C, I, F, V = cfg.d_model, cfg.inner, cfg.d_ff, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"shared.weight": (V, C)}

    def attention(prefix: str) -> None:
        for w in "qkv":
            shapes[f"{prefix}.{w}.weight"] = (I, C)
        shapes[f"{prefix}.o.weight"] = (C, I)

    def ff(prefix: str) -> None:
        for name in _ff_names(prefix, cfg.gated):
            shapes[name] = (C, F) if name.endswith("wo.weight") else (F, C)
        shapes[f"{prefix}.layer_norm.weight"] = (C,)

    for stack, depth in (("encoder", cfg.num_layers), ("decoder", cfg.num_decoder_layers)):
        for i in range(depth):
            block = f"{stack}.block.{i}.layer"
            attention(f"{block}.0.SelfAttention")
            shapes[f"{block}.0.layer_norm.weight"] = (C,)
            if stack == "decoder":
                attention(f"{block}.1.EncDecAttention")
                shapes[f"{block}.1.layer_norm.weight"] = (C,)
            ff(f"{block}.{2 if stack == 'decoder' else 1}")
        shapes[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = (
            cfg.num_buckets, cfg.num_heads)
        shapes[f"{stack}.final_layer_norm.weight"] = (C,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, C)
    return shapes


def ignorable_shapes(cfg: T5Config) -> dict[str, tuple[int, ...]]:
    """Tensors some checkpoints carry that the math does not use (aliases and a legacy bias)."""
    V, C = cfg.vocab_size, cfg.d_model
    extra = {
        "encoder.embed_tokens.weight": (V, C),
        "decoder.embed_tokens.weight": (V, C),
        # old checkpoints: a cross-attention position bias HF never applies
        "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight":
            (cfg.num_buckets, cfg.num_heads),
    }
    if cfg.tie_word_embeddings:
        extra["lm_head.weight"] = (V, C)  # a saved copy of the tied head
    return extra


def check_checkpoint(cfg: T5Config, ckpt: Checkpoint) -> str:
    """Check names and shapes against `cfg`; returns the name holding the shared embedding."""
    expected = expected_shapes(cfg)
    ignorable = ignorable_shapes(cfg)
    if "shared.weight" not in ckpt:
        for alias in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            if alias in ckpt:  # some saves keep only an alias of the shared embedding
                expected[alias] = expected.pop("shared.weight")
                ignorable.pop(alias)
                break
    check_names(ckpt, expected, ignorable)
    for name, shape in {**expected, **{k: v for k, v in ignorable.items() if k in ckpt}}.items():
        got = ckpt.info(name).shape
        if got != shape:
            raise CheckpointError(f"{ckpt.info(name).file}: tensor '{name}' has shape {list(got)}, "
                                  f"config implies {list(shape)}")
    return "shared.weight" if "shared.weight" in expected else next(
        n for n in expected if n.endswith("embed_tokens.weight"))


# Each layer is a unit of placement (resident or streamed, see streaming.py). A decoder layer's
# cross-attention K/V projection is a unit of its own ("cross"): it runs once per encode, not at
# every step, so streaming it with the step's layers would waste transfers.
STACKS = ("encoder", "cross", "decoder")


def block_shapes(cfg: T5Config, stack: str) -> dict[str, tuple[int, int]]:
    """(in, out) shapes of one layer's matrices in minfer's layout (fused, transposed)."""
    C, I, F = cfg.d_model, cfg.inner, cfg.d_ff
    if stack == "cross":
        return {"w_cross_kv": (C, 2 * I)}
    shapes = {"w_qkv": (C, 3 * I), "w_o": (I, C)}
    if stack == "decoder":
        shapes.update(w_cross_q=(C, I), w_cross_o=(I, C))
    shapes.update(w_in=(C, 2 * F if cfg.gated else F), w_out=(F, C))
    return shapes


def stack_depth(cfg: T5Config, stack: str) -> int:
    return cfg.num_layers if stack == "encoder" else cfg.num_decoder_layers


def read_block(cfg: T5Config, ckpt: Checkpoint, stack: str, i: int) -> dict[str, np.ndarray]:
    """Layer `i` of `stack` as float32 host matrices (in, out), fused, with norm weights folded."""

    hf_stack = "encoder" if stack == "encoder" else "decoder"
    norm_of = folded_norms(cfg, hf_stack, i)

    def read(name: str) -> np.ndarray:  # (out, in) as stored
        return ckpt.read(name, np.float32)

    def linear(*names: str) -> np.ndarray:
        """HF (out, in) weights fused along `out` -> (in, sum(out)), with the weight of the RMS
        norm feeding them folded in (saves a multiply per sublayer; a rounding-level change)."""
        w = np.ascontiguousarray(np.concatenate([read(n) for n in names], axis=0).T)
        if names[0] in norm_of:
            w *= read(norm_of[names[0]])[:, None]
        return w

    p = f"{hf_stack}.block.{i}.layer"
    if stack == "cross":
        return {"w_cross_kv": linear(f"{p}.1.EncDecAttention.k.weight",
                                     f"{p}.1.EncDecAttention.v.weight")}
    attn = f"{p}.0.SelfAttention"
    out = {"w_qkv": linear(*(f"{attn}.{w}.weight" for w in "qkv")),
           "w_o": linear(f"{attn}.o.weight")}
    if stack == "decoder":
        out.update(w_cross_q=linear(f"{p}.1.EncDecAttention.q.weight"),
                   w_cross_o=linear(f"{p}.1.EncDecAttention.o.weight"))
    ff = f"{p}.{2 if stack == 'decoder' else 1}"
    *wi, wo = _ff_names(ff, cfg.gated)
    out.update(w_in=linear(*wi), w_out=linear(wo))
    return out


def block_layout(cfg: T5Config, stack: str, dtype: Any, quantize: bool) -> Layout:
    """The packed layout of one layer: float `dtype` matrices, or int8 + per-column scales."""
    return unit_layout(block_shapes(cfg, stack), dtype, quantize)


def fixed_bytes(cfg: T5Config, dtype: Any) -> int:
    """Bytes of the always-resident weights: embedding, untied head, position biases, final norms."""
    item = np.dtype(dtype).itemsize
    n = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_word_embeddings else 2)
    return align_up(n * item) + 2 * align_up(cfg.d_model * item)


def plan_placement(cfg: T5Config, dtype: Any, quantize: bool, limit: int | None,
                   workspace: int) -> WeightPlan:
    """Which layers of `cfg` stay resident under `limit` (pure: nothing is read or allocated)."""
    units, scratch = {}, 0
    for stack in STACKS:
        layout = block_layout(cfg, stack, dtype, quantize)
        scratch = max(scratch, layout.int8_scratch_bytes(dtype))
        for i in range(stack_depth(cfg, stack)):
            units[f"{stack}.{i}"] = layout.nbytes
    # decoder layers run at every generated token, encoder and cross layers once per input
    return plan_weights(units, fixed_bytes(cfg, dtype), workspace, limit, scratch,
                        priority=lambda name: 1 if name.startswith("decoder") else 0)


def _place_vocab_matrix(runtime: WeightRuntime, ckpt: Checkpoint, name: str, dtype: Any,
                        transpose: bool) -> Any:
    """A (V, C) checkpoint matrix placed as (V, C), or as (C, V) with `transpose`, read in blocks
    of rows so loading never holds a second whole copy (mT5's is 1 GB in float32)."""
    V, C = ckpt.info(name).shape
    out = runtime.alloc_fixed((C, V) if transpose else (V, C), dtype, name)
    step = max(1, (16 << 20) // (C * np.dtype(dtype).itemsize))  # 16 MiB of rows at a time
    for a in range(0, V, step):
        b = min(V, a + step)
        rows = ckpt.read(name, dtype, rows=(a, b))
        runtime.be.upload(out[:, a:b] if transpose else out[a:b], rows.T if transpose else rows)
    return out


def load_params(cfg: T5Config, ckpt: Checkpoint, be: Backend, plan: WeightPlan,
                runtime: WeightRuntime) -> dict:
    """Check the checkpoint, then place every weight per `plan`: fixed ones resident, each layer
    resident or streamed (read one layer at a time, so host memory stays bounded)."""
    shared_name = check_checkpoint(cfg, ckpt)
    params: dict[str, Any] = {}
    if cfg.tie_word_embeddings:
        # One copy serves both uses, stored as the head wants it: (C, V) row-major. BLAS reads a
        # row-major head 25-40% faster than the transposed (V, C) view, and the embedding lookup
        # (a few rows per step) does not mind gathering from the transposed view.
        params["lm_head"] = _place_vocab_matrix(runtime, ckpt, shared_name, be.dtype, True)
        params["shared"] = params["lm_head"].T                                 # (V, C) view
    else:
        params["shared"] = _place_vocab_matrix(runtime, ckpt, shared_name, be.dtype, False)
        params["lm_head"] = _place_vocab_matrix(runtime, ckpt, "lm_head.weight", be.dtype, True)
    for stack in STACKS:
        units = []
        for i in range(stack_depth(cfg, stack)):
            arrays = unit_arrays(read_block(cfg, ckpt, stack, i), be.dtype, be.quantize)
            units.append(runtime.place_unit(f"{stack}.{i}", arrays))
        params[stack] = {"blocks": LayerStack(runtime, units)}
    for stack in ("encoder", "decoder"):
        params[stack].update(
            rel_bias=ckpt.read(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
            final_ln=runtime.place_fixed(ckpt.read(f"{stack}.final_layer_norm.weight", be.dtype),
                                         f"{stack}.final_ln"))
    return params


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


@functools.lru_cache(maxsize=64)
def _bucket_matrix(q_len: int, k_len: int, bidirectional: bool, num_buckets: int,
                   max_distance: int) -> np.ndarray:
    rel = np.arange(k_len)[None, :] - np.arange(q_len)[:, None]  # (T, S): key - query
    out = relative_bucket(rel, bidirectional, num_buckets, max_distance)
    out.setflags(write=False)
    return out


def position_bias(cfg: T5Config, rel_bias: np.ndarray, q_len: int, k_len: int,
                  bidirectional: bool) -> np.ndarray:
    """(H, T, S) bias of every (query, key) pair: rel_bias[bucket(key - query)]."""
    buckets = _bucket_matrix(q_len, k_len, bidirectional, cfg.num_buckets, cfg.max_distance)
    return rel_bias[buckets].transpose(2, 0, 1)  # (T, S, H) -> (H, T, S)


def causal_bias_by_distance(cfg: T5Config, rel_bias: np.ndarray, max_len: int) -> np.ndarray:
    """(H, max_len) decoder bias indexed by reversed distance: column max_len-1-n holds distance n.

    Step t's row over keys 0..t is then the contiguous slice [:, max_len-1-t:], so one table of
    O(H * max_len) serves every step of a generation.
    """
    distance = np.arange(max_len - 1, -1, -1)  # reversed: column j has distance max_len-1-j
    buckets = relative_bucket(-distance, False, cfg.num_buckets, cfg.max_distance)
    return np.ascontiguousarray(rel_bias[buckets].T)  # (H, max_len)


# =====================================================================================================
# Forward functions
# =====================================================================================================
FP16_CLAMP = float(np.finfo(np.float16).max) - 1000  # HF T5's guard value


def _clamp_half(xp: Any, x: Any) -> None:
    """float16 only (CUDA): keep the residual stream finite after each sublayer, as HF's T5 does
    by clamping to +-(max - 1000); T5's activations outgrow float16 in deep checkpoints."""
    if x.dtype == np.float16:
        xp.clip(x, -FP16_CLAMP, FP16_CLAMP, out=x)


def _attend(xp: Any, q: Any, k: Any, v: Any, bias: Any, scores: Any, ctx: Any) -> None:
    """softmax(q k^T + bias) v into ctx. q (B,H,T,D), k/v (B,H,S,D), bias broadcast to
    (B,H,T,S), scores a (B,H,T,S) scratch buffer, ctx a (B,T,H,D) output buffer. No 1/sqrt(D):
    T5 folds it into its initialisation."""
    xp.matmul(q, k.swapaxes(-1, -2), out=scores)   # (B, H, T, S)
    scores += bias
    ops.softmax_(xp, scores)
    xp.matmul(scores, v, out=ctx.transpose(0, 2, 1, 3))  # (B, H, T, D) written as (B, T, H, D)


def _feed_forward(be: Backend, cfg: T5Config, h: Any, w_in: Any, w_out: Any, hidden: Any,
                  out: Any) -> Any:
    """FF sublayer into `out` (B,T,C). hidden: (B,T,F) or (B,T,2F) when gated (scratch)."""
    xp = be.xp
    ops.linear(xp, h, w_in, out=hidden)                      # (B, T, F | 2F)
    act = ops.activation(cfg.act)
    if cfg.gated:
        F = cfg.d_ff
        gate = act(xp, hidden[..., :F])                # wi_0 branch is the activated one
        gate *= hidden[..., F:]
        return ops.linear(xp, gate, w_out, out=out)
    return ops.linear(xp, act(xp, hidden), w_out, out=out)   # (B, T, C)


def encoder_specs(cfg: T5Config, B: int, T: int, dtype: Any) -> BufferSpec:
    H, I = cfg.num_heads, cfg.inner
    return {
        "encoder.x": ((B, T, cfg.d_model), dtype),
        "encoder.proj": ((B, T, cfg.d_model), dtype),
        "encoder.qkv": ((B, T, 3 * I), dtype),
        "encoder.ctx": ((B, T, I), dtype),
        "encoder.bias": ((B, H, T, T), dtype),
        "encoder.scores": ((B, H, T, T), dtype),
        "encoder.ff": ((B, T, cfg.d_ff * (2 if cfg.gated else 1)), dtype),
    }


def mask_bias(be: Backend, attention_mask: np.ndarray) -> Any:
    """(B, 1, 1, S) additive mask: 0 where attended, finfo(float32).min where padded."""
    B, S = attention_mask.shape
    return be.asarray(np.where(attention_mask.astype(bool), 0.0, NEG_INF).reshape(B, 1, 1, S),
                      be.dtype)


def encode(be: Backend, cfg: T5Config, params: dict, input_ids: np.ndarray,
           attention_mask: np.ndarray, out: Any) -> Any:
    """Encoder stack: (B, T) ids -> final-normed states written into `out` (B, T, C)."""
    xp = be.xp
    B, T = input_ids.shape
    H, D, I = cfg.num_heads, cfg.d_kv, cfg.inner
    p = params["encoder"]
    with be.arena.scope():
        ws = be.arena.alloc_many(encoder_specs(cfg, B, T, be.dtype))
        x = ws["encoder.x"]
        ops.embed(xp, params["shared"], be.asarray(input_ids), x)  # (B, T, C)
        # position bias (1,H,T,T) + padding mask (B,1,1,T), built once and shared by all layers
        bias = ws["encoder.bias"]
        bias[...] = be.asarray(position_bias(cfg, p["rel_bias"], T, T, bidirectional=True))
        bias += mask_bias(be, attention_mask)
        for blk in p["blocks"]:
            h = ops.rms_normalize(xp, x, cfg.eps)
            qkv = ops.linear(xp, h, blk["w_qkv"], out=ws["encoder.qkv"]).reshape(B, T, 3, H, D)
            q, k, v = (qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3))  # (B, H, T, D)
            _attend(xp, q, k, v, bias, ws["encoder.scores"], ws["encoder.ctx"].reshape(B, T, H, D))
            x += ops.linear(xp, ws["encoder.ctx"], blk["w_o"], out=ws["encoder.proj"])
            _clamp_half(xp, x)
            h = ops.rms_normalize(xp, x, cfg.eps)
            x += _feed_forward(be, cfg, h, blk["w_in"], blk["w_out"], ws["encoder.ff"],
                               ws["encoder.proj"])
            _clamp_half(xp, x)
        out[...] = ops.rms_norm(xp, x, p["final_ln"], cfg.eps)
    return out


def cross_kv(be: Backend, cfg: T5Config, params: dict, encoder_states: Any, cache_k: Any,
             cache_v: Any) -> None:
    """Every decoder layer's cross-attention K and V from the encoder output, computed once.

    encoder_states (B, S, C) -> cache_k / cache_v (L, B, H, S, D)."""
    xp = be.xp
    B, S, _ = encoder_states.shape
    H, D = cfg.num_heads, cfg.d_kv
    with be.arena.scope():
        raw = be.arena.alloc((B, S, 2 * H * D), be.dtype, "cross K/V projection")
        for i, unit in enumerate(params["cross"]["blocks"]):
            kv = ops.linear(xp, encoder_states, unit["w_cross_kv"], out=raw).reshape(B, S, 2, H, D)
            cache_k[i] = kv[:, :, 0].transpose(0, 2, 1, 3)  # (B, H, S, D)
            cache_v[i] = kv[:, :, 1].transpose(0, 2, 1, 3)


def decoder_specs(cfg: T5Config, B: int, T: int, S: int, dtype: Any) -> BufferSpec:
    """Scratch of a full (teacher-forced) decoder pass over T target and S source positions."""
    H, I, L = cfg.num_heads, cfg.inner, cfg.num_decoder_layers
    return {
        "decoder.x": ((B, T, cfg.d_model), dtype),
        "decoder.proj": ((B, T, cfg.d_model), dtype),
        "decoder.qkv": ((B, T, 3 * I), dtype),
        "decoder.q": ((B, T, I), dtype),
        "decoder.ctx": ((B, T, I), dtype),
        "decoder.self_bias": ((1, H, T, T), dtype),
        "decoder.self_scores": ((B, H, T, T), dtype),
        "decoder.cross_scores": ((B, H, T, S), dtype),
        "decoder.cross_k": ((L, B, H, S, cfg.d_kv), dtype),
        "decoder.cross_v": ((L, B, H, S, cfg.d_kv), dtype),
        "decoder.ff": ((B, T, cfg.d_ff * (2 if cfg.gated else 1)), dtype),
        "decoder.logits": ((B, T, cfg.vocab_size), dtype),
    }


def _cross_attention(be: Backend, cfg: T5Config, blk: dict, h: Any, k: Any, v: Any, bias: Any,
                     q_buf: Any, scores: Any, ctx: Any, out: Any) -> Any:
    """Cross-attention sublayer: h (B,T,C) attends to precomputed k/v (B,H,S,D); no position bias."""
    xp = be.xp
    B, T, _ = h.shape
    q = ops.linear(xp, h, blk["w_cross_q"], out=q_buf).reshape(B, T, cfg.num_heads, cfg.d_kv)
    _attend(xp, q.transpose(0, 2, 1, 3), k, v, bias, scores, ctx.reshape(B, T, cfg.num_heads,
                                                                          cfg.d_kv))
    return ops.linear(xp, ctx, blk["w_cross_o"], out=out)


def _lm_head(be: Backend, cfg: T5Config, params: dict, x: Any, out: Any, h: Any = None) -> Any:
    """Decoder states (..., C) -> final norm -> logits (..., V) in `out` (h: optional scratch)."""
    h = ops.rms_norm(be.xp, x, params["decoder"]["final_ln"], cfg.eps, out=h)
    if cfg.tie_word_embeddings:
        h *= cfg.d_model ** -0.5  # the tied head sees rescaled states
    return ops.linear(be.xp, h, params["lm_head"], out)


def decode_full(be: Backend, cfg: T5Config, params: dict, decoder_input_ids: np.ndarray,
                encoder_states: Any, attention_mask: np.ndarray) -> np.ndarray:
    """Teacher-forced decoder: (B, T) ids over encoder states (B, S, C) -> logits (B, T, V) host."""
    xp = be.xp
    B, T = decoder_input_ids.shape
    S = encoder_states.shape[1]
    H, D = cfg.num_heads, cfg.d_kv
    p = params["decoder"]
    with be.arena.scope():
        ws = be.arena.alloc_many(decoder_specs(cfg, B, T, S, be.dtype))
        cross_kv(be, cfg, params, encoder_states, ws["decoder.cross_k"], ws["decoder.cross_v"])
        x = ws["decoder.x"]
        ops.embed(xp, params["shared"], be.asarray(decoder_input_ids), x)  # (B, T, C)
        self_bias = ws["decoder.self_bias"]
        self_bias[0] = be.asarray(position_bias(cfg, p["rel_bias"], T, T, bidirectional=False))
        self_bias += be.asarray(np.triu(np.full((T, T), NEG_INF, np.float32), 1), be.dtype)
        cross_bias = mask_bias(be, attention_mask)
        for i, blk in enumerate(p["blocks"]):
            h = ops.rms_normalize(xp, x, cfg.eps)
            qkv = ops.linear(xp, h, blk["w_qkv"], out=ws["decoder.qkv"]).reshape(B, T, 3, H, D)
            q, k, v = (qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3))  # (B, H, T, D)
            _attend(xp, q, k, v, self_bias, ws["decoder.self_scores"],
                    ws["decoder.ctx"].reshape(B, T, H, D))
            x += ops.linear(xp, ws["decoder.ctx"], blk["w_o"], out=ws["decoder.proj"])
            _clamp_half(xp, x)
            h = ops.rms_normalize(xp, x, cfg.eps)
            x += _cross_attention(be, cfg, blk, h, ws["decoder.cross_k"][i],
                                  ws["decoder.cross_v"][i], cross_bias, ws["decoder.q"],
                                  ws["decoder.cross_scores"], ws["decoder.ctx"], ws["decoder.proj"])
            _clamp_half(xp, x)
            h = ops.rms_normalize(xp, x, cfg.eps)
            x += _feed_forward(be, cfg, h, blk["w_in"], blk["w_out"], ws["decoder.ff"],
                               ws["decoder.proj"])
            _clamp_half(xp, x)
        logits = _lm_head(be, cfg, params, x, ws["decoder.logits"])
        return np.array(be.to_host(logits), dtype=np.float32)


# -- incremental decoding -----------------------------------------------------------------------------
def generation_specs(cfg: T5Config, B: int, S: int, max_len: int, dtype: Any) -> BufferSpec:
    """Everything one generation keeps for its whole length: KV caches, cross K/V, the bias table,
    and the per-step scratch (allocated once, reused by every step)."""
    H, D, I, L, C = cfg.num_heads, cfg.d_kv, cfg.inner, cfg.num_decoder_layers, cfg.d_model
    return {
        "state.self_k": ((L, B, H, max_len, D), dtype),
        "state.self_v": ((L, B, H, max_len, D), dtype),
        "state.cross_k": ((L, B, H, S, D), dtype),
        "state.cross_v": ((L, B, H, S, D), dtype),
        "state.cross_bias": ((B, 1, 1, S), dtype),
        "state.self_bias": ((H, max_len), dtype),
        "step.x": ((B, 1, C), dtype),
        "step.h": ((B, 1, C), dtype),
        "step.proj": ((B, 1, C), dtype),
        "step.qkv": ((B, 1, 3 * I), dtype),
        "step.q": ((B, 1, I), dtype),
        "step.ctx": ((B, 1, I), dtype),
        "step.scores": ((B * H * max(max_len, S),), dtype),  # viewed per step as (B, H, 1, keys)
        "step.ff": ((B, 1, cfg.d_ff * (2 if cfg.gated else 1)), dtype),
        "step.logits": ((B, 1, cfg.vocab_size), dtype),
    }


def run_bytes(cfg: T5Config, dt: Any, batch: int, src_len: int, max_new_tokens: int) -> dict[str, int]:
    """Arena bytes of one generation: its decode state plus the larger of encoder / cross scratch."""
    state = bytes_needed(generation_specs(cfg, batch, src_len, max_new_tokens, dt))
    encoder = (bytes_needed(encoder_specs(cfg, batch, src_len, dt))
               + bytes_needed({"out": ((batch, src_len, cfg.d_model), dt)}))
    cross = bytes_needed({"raw": ((batch, src_len, 2 * cfg.inner), dt)})
    return {"decode_state": state, "encoder_scratch": encoder, "cross_kv_scratch": cross,
            "peak": state + max(encoder, cross)}


# What a memory limit reserves for runs unless `workspace=` says otherwise: one prompt of up to
# this many tokens generating up to this many.
DEFAULT_RUN_SHAPE = {"batch": 1, "src_len": 256, "max_new_tokens": 128}


class DecodeState:
    """The run state of one incremental decode: views into the arena plus the step counter.

    Created by `T5Model.start_decoding` inside an arena scope; every array here is released when
    that scope closes, so the state must not be used afterwards.
    """

    def __init__(self, be: Backend, cfg: T5Config, params: dict, buffers: dict, batch: int,
                 src_len: int, max_len: int):
        self.be, self.cfg, self.params, self.buf = be, cfg, params, buffers
        self.batch, self.src_len, self.max_len = batch, src_len, max_len
        self.length = 0  # positions already in the self-attention cache
        # self.batch: rows currently live (<= the allocated batch); `reorder` shrinks it

    def step(self, token_ids: np.ndarray) -> Any:
        """Feed one token per live row (b,), get that position's logits (b, V) (an arena view,
        valid until the next step)."""
        with self.be.arena.scope():  # on CUDA, CuPy's temporaries of this step come from here
            return self._step(token_ids)

    def _step(self, token_ids: np.ndarray) -> Any:
        be, cfg, params = self.be, self.cfg, self.params
        xp = be.xp
        t, b = self.length, self.batch
        if t >= self.max_len:
            raise InputError(f"decode state is full ({self.max_len} positions)")
        H, D = cfg.num_heads, cfg.d_kv
        buf = {name: a[:b] for name, a in self.buf.items() if name.startswith("step.")}
        x = buf["step.x"]
        ops.embed(xp, params["shared"], be.asarray(token_ids).reshape(b, 1), x)  # (b, 1, C)
        self_bias = self.buf["state.self_bias"][:, self.max_len - 1 - t:].reshape(1, H, 1, t + 1)
        scores = self.buf["step.scores"]
        self_scores = scores[:b * H * (t + 1)].reshape(b, H, 1, t + 1)
        cross_scores = scores[:b * H * self.src_len].reshape(b, H, 1, self.src_len)
        cross_bias = self.buf["state.cross_bias"][:b]
        ctx = buf["step.ctx"]
        for i, blk in enumerate(params["decoder"]["blocks"]):
            h = ops.rms_normalize(xp, x, cfg.eps, out=buf["step.h"])
            qkv = ops.linear(xp, h, blk["w_qkv"], out=buf["step.qkv"]).reshape(b, 3, H, 1, D)
            k_cache = self.buf["state.self_k"][i, :b]  # (b, H, max_len, D)
            v_cache = self.buf["state.self_v"][i, :b]
            k_cache[:, :, t] = qkv[:, 1, :, 0]
            v_cache[:, :, t] = qkv[:, 2, :, 0]
            _attend(xp, qkv[:, 0], k_cache[:, :, :t + 1], v_cache[:, :, :t + 1], self_bias,
                    self_scores, ctx.reshape(b, 1, H, D))
            x += ops.linear(xp, ctx, blk["w_o"], out=buf["step.proj"])
            _clamp_half(xp, x)
            h = ops.rms_normalize(xp, x, cfg.eps, out=buf["step.h"])
            x += _cross_attention(be, cfg, blk, h, self.buf["state.cross_k"][i, :b],
                                  self.buf["state.cross_v"][i, :b], cross_bias, buf["step.q"],
                                  cross_scores, ctx, buf["step.proj"])
            _clamp_half(xp, x)
            h = ops.rms_normalize(xp, x, cfg.eps, out=buf["step.h"])
            x += _feed_forward(be, cfg, h, blk["w_in"], blk["w_out"], buf["step.ff"],
                               buf["step.proj"])
            _clamp_half(xp, x)
        self.length = t + 1
        return _lm_head(be, cfg, params, x, buf["step.logits"], buf["step.h"])[:, 0]  # (b, V)

    def reorder(self, rows: Sequence[int] | np.ndarray, cross: bool = True) -> None:
        """Make the live batch `rows` of the current one (drop finished rows, or let beams follow
        their parents; a row may repeat). Only the filled part of the caches moves. `cross=False`
        skips the cross-attention K/V when every row keeps its source sentence (beams of one input)."""
        rows = np.asarray(rows, np.int64)
        if rows.ndim != 1 or len(rows) == 0 or len(rows) > self.batch \
                or rows.min() < 0 or rows.max() >= self.batch:
            raise InputError(f"reorder: rows must be 1..{self.batch} indices below {self.batch}")
        n, t = len(rows), self.length
        if not (n == self.batch and (rows == np.arange(n)).all()):
            self._move_rows(rows, n, t, cross)
        self.batch = n

    def _move_rows(self, rows: np.ndarray, n: int, t: int, cross: bool) -> None:
        with self.be.arena.scope():
            idx = self.be.asarray(rows)
            names = ["state.self_k", "state.self_v"] + (["state.cross_k", "state.cross_v"] if cross
                                                        else [])
            for name in names:
                cache = self.buf[name]
                for layer in range(cache.shape[0]):  # one layer at a time bounds the temporary
                    filled = cache[layer, :, :, :t] if name.startswith("state.self") else cache[layer]
                    filled[:n] = filled[idx]
            if cross:
                self.buf["state.cross_bias"][:n] = self.buf["state.cross_bias"][idx]


# =====================================================================================================
# The model object the public API hands out
# =====================================================================================================
def as_batch(inputs: Any, pad_id: int, vocab_size: int, what: str = "input_ids",
             attention_mask: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (a list of id lists, or a (B, T) array) -> right-padded (B, T) int64 ids + mask."""
    if isinstance(inputs, np.ndarray) or (hasattr(inputs, "shape") and hasattr(inputs, "dtype")):
        ids = np.asarray(inputs)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
            raise InputError(f"{what}: expected a non-empty (batch, length) array, "
                             f"got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"{what}: expected integer token ids, got dtype {ids.dtype}")
        ids = ids.astype(np.int64)
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask)
        if mask.shape != ids.shape:
            raise InputError(f"attention_mask: shape {mask.shape} does not match {what} {ids.shape}")
        mask = mask.astype(np.int64)
    else:
        rows = list(inputs) if isinstance(inputs, (list, tuple)) else None
        if not rows:
            raise InputError(f"{what}: expected a non-empty list of token-id lists")
        if all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in rows):
            rows = [rows]  # a single sequence
        lengths = []
        for r, row in enumerate(rows):
            if not isinstance(row, (list, tuple, np.ndarray)) or len(row) == 0:
                raise InputError(f"{what}: row {r} is empty or not a list of token ids")
            if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in row):
                raise InputError(f"{what}: row {r} holds something other than integer token ids")
            lengths.append(len(row))
        ids = np.full((len(rows), max(lengths)), pad_id, np.int64)
        mask = np.zeros_like(ids)
        for r, row in enumerate(rows):
            ids[r, :len(row)] = row
            mask[r, :len(row)] = 1
        if attention_mask is not None:
            raise InputError("attention_mask: pass it only with an array of token ids")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise InputError(f"{what}: token id {ids[r, c]} at row {r}, position {c} is outside the "
                         f"vocabulary (0..{vocab_size - 1})")
    if not mask.any(axis=1).all():
        raise InputError(f"attention_mask: row {int(np.argmin(mask.any(axis=1)))} masks every token")
    return ids, mask


class T5Model(OwnsWeights):
    """A loaded T5: config, parameters on a backend, and the encode / forward / generate API."""

    family = "t5"

    def __init__(self, config: T5Config, params: dict, backend: Backend, folder: str,
                 hf_config: dict | None = None, generation_config: dict | None = None,
                 tokenizer: Any = None):
        self.config = config
        self.params = params
        self.backend = backend
        self.folder = folder
        self.hf_config = hf_config or {}                  # config.json as read (task params, ...)
        self.generation_config = generation_config or {}  # generation_config.json, if any
        self.tokenizer = tokenizer

    # -- batches and sizes ----------------------------------------------------------------------------
    def batch(self, input_ids: Any, attention_mask: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Token-id lists or a (B, T) array -> right-padded (B, T) ids and mask, validated."""
        return as_batch(input_ids, self.config.pad_token_id, self.config.vocab_size, "input_ids",
                        attention_mask)

    def plan(self, batch: int, src_len: int, max_new_tokens: int) -> dict[str, int]:
        """Bytes of arena workspace a generation of this shape needs (pure: nothing allocated)."""
        return run_bytes(self.config, self.backend.dtype, batch, src_len, max_new_tokens)

    def parameter_count(self) -> int:
        return sum(int(np.prod(s)) for s in expected_shapes(self.config).values())

    def describe(self) -> list[tuple[str, str]]:
        """Architecture facts for `minfer info`."""
        c = self.config
        return [
            ("family", f"{c.model_type} ({'gated-' if c.gated else ''}{c.act} FF, "
                       f"{'tied' if c.tie_word_embeddings else 'untied'} head)"),
            ("layers", f"{c.num_layers} encoder / {c.num_decoder_layers} decoder"),
            ("width", f"d_model {c.d_model}, {c.num_heads} heads x d_kv {c.d_kv}, d_ff {c.d_ff}"),
            ("vocab", f"{c.vocab_size}"),
            ("position buckets", f"{c.num_buckets}, max distance {c.max_distance}"),
        ]

    # -- the public surface ---------------------------------------------------------------------------
    def encode(self, input_ids: Any, attention_mask: Any = None) -> np.ndarray:
        """(B, T) token ids -> encoder states (B, T, C) float32 on the host."""
        ids, mask = self.batch(input_ids, attention_mask)
        be = self.backend
        with be.arena.scope():
            out = be.arena.alloc((*ids.shape, self.config.d_model), be.dtype, "encoder output")
            encode(be, self.config, self.params, ids, mask, out)
            return np.array(be.to_host(out), dtype=np.float32)

    def forward(self, input_ids: Any, decoder_input_ids: Any, attention_mask: Any = None) -> np.ndarray:
        """Teacher-forced logits (B, T_dec, V) float32 for given encoder and decoder ids."""
        ids, mask = self.batch(input_ids, attention_mask)
        dec, _ = as_batch(decoder_input_ids, self.config.pad_token_id, self.config.vocab_size,
                          "decoder_input_ids")
        if dec.shape[0] != ids.shape[0]:
            raise InputError(f"decoder_input_ids: batch {dec.shape[0]} != input_ids batch "
                             f"{ids.shape[0]}")
        be = self.backend
        with be.arena.scope():
            enc = be.arena.alloc((*ids.shape, self.config.d_model), be.dtype, "encoder output")
            encode(be, self.config, self.params, ids, mask, enc)
            return decode_full(be, self.config, self.params, dec, enc, mask)

    @contextlib.contextmanager
    def start_decoding(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                       max_len: int) -> Iterator[DecodeState]:
        """Encode once, fill the cross-attention K/V and yield a `DecodeState` of `max_len`
        positions. Everything it holds is arena memory released when the `with` block exits."""
        be, cfg = self.backend, self.config
        B, S = input_ids.shape
        with be.arena.scope():
            buf = be.arena.alloc_many(generation_specs(cfg, B, S, max_len, be.dtype))
            buf["state.self_bias"][...] = be.asarray(causal_bias_by_distance(
                cfg, self.params["decoder"]["rel_bias"], max_len))
            buf["state.cross_bias"][...] = mask_bias(be, attention_mask)
            with be.arena.scope():
                enc = be.arena.alloc((B, S, cfg.d_model), be.dtype, "encoder output")
                encode(be, cfg, self.params, input_ids, attention_mask, enc)
                cross_kv(be, cfg, self.params, enc, buf["state.cross_k"], buf["state.cross_v"])
            yield DecodeState(be, cfg, self.params, buf, B, S, max_len)

    def generate(self, inputs: Any, *, stream: bool = False, task: str | None = None,
                 return_details: bool = False, attention_mask: Any = None, **options: Any) -> Any:
        """Generate from a prompt, a list of prompts, or token ids.

        inputs: str -> str; list of str -> list of str; token-id lists (or a (B, T) array) -> id
            lists that start with the decoder start token and end at eos (included).
            With num_return_sequences n > 1 each prompt gives a list of n (ids: n rows each).
        stream: return an iterator of text pieces (token ids for id input) for one prompt.
        task: apply the checkpoint's task_specific_params (prefix and settings), e.g.
            "translation_en_to_de" or "summarization".
        return_details: per prompt a list of `generation.Result` (text, ids, finish reason, time).
        options: max_new_tokens, min_new_tokens, do_sample, temperature, top_k, top_p,
            repetition_penalty, no_repeat_ngram_size, num_beams, length_penalty, early_stopping,
            num_return_sequences, stop, seed. Unset ones come from generation_config.json, then
            config.json, then minfer's defaults (max_new_tokens 256; never a silent 20-token cap).
        """
        from .. import generation  # generation depends on models, not vice versa
        return generation.generate(self, inputs, stream_output=stream, task=task,
                                   return_details=return_details, attention_mask=attention_mask,
                                   **options)

    def __repr__(self) -> str:
        c = self.config
        return (f"T5Model({self.folder!r}, layers={c.num_layers}/{c.num_decoder_layers}, "
                f"d_model={c.d_model}, vocab={c.vocab_size}, device={self.backend.device!r})")


def load(ckpt: Checkpoint, be: Backend, generation_config: dict | None = None,
         tokenizer: Any = None, recorder: Any = None) -> T5Model:
    """Build a T5Model: plan where the weights go (all resident without a memory limit), then
    read them layer by layer into place."""
    cfg = T5Config.from_hf(ckpt.config, str(ckpt.folder / "config.json"))
    plan = plan_placement(cfg, be.dtype, be.quantize, be.memory_limit,
                          be.workspace_reserve(run_bytes(cfg, be.dtype, **DEFAULT_RUN_SHAPE)["peak"]))
    runtime = WeightRuntime(be, plan, recorder)
    model = T5Model(cfg, load_params(cfg, ckpt, be, plan, runtime), be, str(ckpt.folder),
                    ckpt.config, generation_config, tokenizer)
    model.attach_runtime(plan, runtime)
    return model
