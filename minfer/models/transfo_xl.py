"""Transformer-XL (transfo-xl-wt103) as pure functions over `be.xp`, with explicit segment memory.

Follows Dai et al. 2019, "Transformer-XL: Attentive Language Models Beyond a Fixed-Length
Context", and the numerics of Hugging Face transformers' TransfoXL (see docs/architecture.md):
an adaptive input embedding scaled by sqrt(d_model); per layer, attention over [memory; segment]
with sinusoidal *relative* positions, score = (q+u).k + rel_shift((q+v).r) scaled by 1/sqrt(d);
post-norm (or pre-norm) residual blocks; a projected adaptive log-softmax head.

The reference implementation is time-major (T, B, C); this file is batch-first throughout and
converts nothing at run time. Shapes: B batch, T segment length, M memory length, K = M + T keys,
H heads, D head dim, C d_model, F d_inner, V vocab, L layers.

Segment memory (`XLMemory`): each layer's INPUT of the last `mem_len` positions, (L, B, mem_len, C)
held in the arena across calls and updated in place. A fresh memory is EMPTY (the paper's
semantics; HF would start from mem_len zero vectors instead).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .. import ops
from ..backend import Backend
from ..checkpoint import Checkpoint, ConfigReader, check_names
from ..errors import CheckpointError, ConfigError, InputError
from ..memory import BufferSpec, align_up, bytes_needed
from ..streaming import (Layout, LayerStack, OwnsWeights, WeightPlan, WeightRuntime, plan_weights,
                         unit_arrays, unit_layout)

NEG_INF = float(np.finfo(np.float32).min)


# =====================================================================================================
# Config
# =====================================================================================================
@dataclass(frozen=True)
class XLConfig:
    vocab_size: int
    cutoffs: tuple[int, ...]       # cluster boundaries inside the vocabulary (may be empty)
    d_model: int
    d_embed: int
    n_head: int
    d_head: int
    d_inner: int
    div_val: int
    n_layer: int
    mem_len: int
    clamp_len: int                 # <= 0: positions are not clamped
    same_length: bool
    pre_lnorm: bool
    untie_r: bool
    tie_word_embeddings: bool
    tie_projs: tuple[bool, ...]
    eps: float
    tgt_len: int                   # the segment length the checkpoint was evaluated with
    eos_token_id: int

    @property
    def cluster_ends(self) -> list[int]:
        """[0, c1, ..., V]: cluster i holds ids [ends[i], ends[i+1])."""
        return [0, *self.cutoffs, self.vocab_size]

    def emb_dim(self, i: int) -> int:
        return self.d_embed // (self.div_val ** i) if self.div_val > 1 else self.d_embed

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "XLConfig":
        get_int = ConfigReader(cfg, source).get_int

        if cfg.get("model_type", "transfo-xl") != "transfo-xl":
            raise ConfigError(f"{source}: model_type {cfg.get('model_type')!r} is not transfo-xl")
        if cfg.get("attn_type", 0) != 0:
            raise ConfigError(f"{source}: attn_type {cfg.get('attn_type')!r} is not supported "
                              "(only 0, relative attention, as in every released checkpoint)")
        vocab = get_int("vocab_size", 267735)
        cutoffs = cfg.get("cutoffs", [20000, 40000, 200000])
        if (not isinstance(cutoffs, list) or not all(isinstance(c, int) for c in cutoffs)
                or list(cutoffs) != sorted(set(cutoffs)) or any(not 0 < c < vocab for c in cutoffs)):
            raise ConfigError(f"{source}: 'cutoffs' must be increasing ids inside the vocabulary "
                              f"(vocab_size {vocab}), got {cutoffs!r}")
        n_clusters = len(cutoffs) + 1
        share = cfg.get("proj_share_all_but_first", True)
        tie_projs = cfg.get("tie_projs", [False] + [bool(share)] * len(cutoffs))
        if not isinstance(tie_projs, list) or len(tie_projs) != n_clusters:
            raise ConfigError(f"{source}: 'tie_projs' must list {n_clusters} booleans, got {tie_projs!r}")
        eps = ConfigReader(cfg, source).get_eps("layer_norm_epsilon", 1e-5)
        eos = cfg.get("eos_token_id", 0)
        if isinstance(eos, list):
            eos = eos[0] if eos else 0
        if not isinstance(eos, int) or not 0 <= eos < vocab:
            raise ConfigError(f"{source}: 'eos_token_id' must be a token id, got {eos!r}")
        d_model = get_int("d_model", 1024)
        if d_model % 2:
            raise ConfigError(f"{source}: 'd_model' must be even (sinusoid halves), got {d_model}")
        div_val = get_int("div_val", 4)
        d_embed = get_int("d_embed", d_model)
        # d_embed // div_val**i may reach 0 for the last clusters: HF builds zero-width tables
        # (their tokens embed to zero, their logits are the biases); the math here does the same.
        clamp = cfg.get("clamp_len", 1000)
        if isinstance(clamp, bool) or not isinstance(clamp, int):
            raise ConfigError(f"{source}: 'clamp_len' must be an integer, got {clamp!r}")
        return cls(
            vocab_size=vocab, cutoffs=tuple(cutoffs), d_model=d_model, d_embed=d_embed,
            n_head=get_int("n_head", 16), d_head=get_int("d_head", 64),
            d_inner=get_int("d_inner", 4096), div_val=div_val, n_layer=get_int("n_layer", 18),
            mem_len=get_int("mem_len", 1600, minimum=0), clamp_len=clamp,
            same_length=bool(cfg.get("same_length", True)), pre_lnorm=bool(cfg.get("pre_lnorm", False)),
            untie_r=bool(cfg.get("untie_r", True)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            tie_projs=tuple(bool(t) for t in tie_projs), eps=float(eps),
            tgt_len=get_int("tgt_len", 128), eos_token_id=eos,
        )


# =====================================================================================================
# Checkpoint names -> parameter tree
# =====================================================================================================
def _shapes(cfg: XLConfig) -> tuple[dict[str, tuple], dict[str, str]]:
    """(required tensors with HF shapes, tied copies a file may omit -> the tensor they copy)."""
    C, H, D, F, V = cfg.d_model, cfg.n_head, cfg.d_head, cfg.d_inner, cfg.vocab_size
    ends = cfg.cluster_ends
    n = len(ends) - 1
    req: dict[str, tuple] = {"transformer.pos_emb.inv_freq": (C // 2,)}
    tied: dict[str, str] = {}
    emb = "transformer.word_emb"
    if cfg.div_val == 1:
        req[f"{emb}.emb_layers.0.weight"] = (V, cfg.d_embed)
        if C != cfg.d_embed:
            req[f"{emb}.emb_projs.0"] = (C, cfg.d_embed)
    else:
        for i in range(n):
            req[f"{emb}.emb_layers.{i}.weight"] = (ends[i + 1] - ends[i], cfg.emb_dim(i))
            req[f"{emb}.emb_projs.{i}"] = (C, cfg.emb_dim(i))
    for l in range(cfg.n_layer):
        p = f"transformer.layers.{l}"
        req.update({
            f"{p}.dec_attn.qkv_net.weight": (3 * H * D, C), f"{p}.dec_attn.o_net.weight": (C, H * D),
            f"{p}.dec_attn.r_net.weight": (H * D, C),
            f"{p}.dec_attn.layer_norm.weight": (C,), f"{p}.dec_attn.layer_norm.bias": (C,),
            f"{p}.pos_ff.CoreNet.0.weight": (F, C), f"{p}.pos_ff.CoreNet.0.bias": (F,),
            f"{p}.pos_ff.CoreNet.3.weight": (C, F), f"{p}.pos_ff.CoreNet.3.bias": (C,),
            f"{p}.pos_ff.layer_norm.weight": (C,), f"{p}.pos_ff.layer_norm.bias": (C,),
        })
        for bias in ("r_w_bias", "r_r_bias"):
            if cfg.untie_r:
                req[f"{p}.dec_attn.{bias}"] = (H, D)
            else:  # per-layer names of the one shared bias (a .bin save keeps them)
                tied[f"{p}.dec_attn.{bias}"] = f"transformer.{bias}"
    if not cfg.untie_r:
        req["transformer.r_w_bias"] = (H, D)
        req["transformer.r_r_bias"] = (H, D)
    if n > 1:
        req["crit.cluster_weight"] = (n - 1, cfg.d_embed)
        req["crit.cluster_bias"] = (n - 1,)
    out_layers = 1 if cfg.div_val == 1 else n
    for i in range(out_layers):
        rows = V if cfg.div_val == 1 else ends[i + 1] - ends[i]
        name = f"crit.out_layers.{i}.weight"
        shape = (rows, cfg.emb_dim(i))
        if cfg.tie_word_embeddings:
            tied[name] = f"{emb}.emb_layers.{i}.weight"
            req.setdefault("__tied_shapes__", {})  # type: ignore[arg-type]
        else:
            req[name] = shape
        req[f"crit.out_layers.{i}.bias"] = (rows,)
    for i in range(n):
        if cfg.div_val == 1 and C == cfg.d_embed:
            continue  # no projections at all
        name = f"crit.out_projs.{i}"
        if cfg.tie_projs[i]:
            tied[name] = f"{emb}.emb_projs.{0 if cfg.div_val == 1 else i}"
        else:
            req[name] = (C, cfg.emb_dim(i))
    req.pop("__tied_shapes__", None)
    return req, tied


LAYER_MATRICES = ("w_qkv", "w_o", "w_r", "w1", "w2")  # what dtype="int8" quantises


def layer_shapes(cfg: XLConfig) -> dict[str, tuple[int, ...]]:
    """One layer's tensors in minfer's layout: matrices (in, out), then vectors."""
    C, HD = cfg.d_model, cfg.n_head * cfg.d_head
    return {"w_qkv": (C, 3 * HD), "w_o": (HD, C), "w_r": (C, HD), "w1": (C, cfg.d_inner),
            "w2": (cfg.d_inner, C), "r_w_bias": (cfg.n_head, cfg.d_head),
            "r_r_bias": (cfg.n_head, cfg.d_head), "b1": (cfg.d_inner,), "b2": (C,),
            "ln_attn_w": (C,), "ln_attn_b": (C,), "ln_ff_w": (C,), "ln_ff_b": (C,)}


def layer_layout(cfg: XLConfig, dtype: Any, quantize: bool) -> Layout:
    return unit_layout(layer_shapes(cfg), dtype, quantize, LAYER_MATRICES)


def _layer_arrays(cfg: XLConfig, read: Callable[[str], np.ndarray], l: int,
                  be: Backend) -> dict[str, np.ndarray]:
    """Layer l as host arrays in `layer_shapes` order (int8 + scales when quantising)."""
    p = f"transformer.layers.{l}"
    r_src = f"{p}.dec_attn" if cfg.untie_r else "transformer"
    t = lambda name: np.ascontiguousarray(read(name).T)  # HF (out, in) -> (in, out)
    arrays = {
        "w_qkv": t(f"{p}.dec_attn.qkv_net.weight"),          # (C, 3HD)
        "w_o": t(f"{p}.dec_attn.o_net.weight"),              # (HD, C)
        "w_r": t(f"{p}.dec_attn.r_net.weight"),              # (C, HD)
        "w1": t(f"{p}.pos_ff.CoreNet.0.weight"),             # (C, F)
        "w2": t(f"{p}.pos_ff.CoreNet.3.weight"),             # (F, C)
        "r_w_bias": read(f"{r_src}.r_w_bias"),               # (H, D): "u"
        "r_r_bias": read(f"{r_src}.r_r_bias"),               # (H, D): "v"
        "b1": read(f"{p}.pos_ff.CoreNet.0.bias"), "b2": read(f"{p}.pos_ff.CoreNet.3.bias"),
        "ln_attn_w": read(f"{p}.dec_attn.layer_norm.weight"),
        "ln_attn_b": read(f"{p}.dec_attn.layer_norm.bias"),
        "ln_ff_w": read(f"{p}.pos_ff.layer_norm.weight"), "ln_ff_b": read(f"{p}.pos_ff.layer_norm.bias"),
    }
    return unit_arrays(arrays, be.dtype, be.quantize, LAYER_MATRICES)


def r_table_rows(cfg: XLConfig) -> int:
    """Distances each layer's projected-sinusoid table covers: every distance a scoring segment
    or a generation step sees (mem_len + tgt_len), or fewer when clamp_len makes all longer
    distances share one row."""
    rows = cfg.mem_len + cfg.tgt_len
    return min(rows, cfg.clamp_len + 1) if cfg.clamp_len > 0 else rows


def fixed_bytes(cfg: XLConfig, dtype: Any) -> int:
    """Bytes of the always-resident weights: adaptive embedding and softmax (all but the layers)
    and each layer's projected-sinusoid table."""
    required, tied = _shapes(cfg)
    shapes = {**required, **{name: required[src] for name, src in tied.items()}}  # copies too
    n = sum(int(np.prod(s)) for name, s in shapes.items()
            if not name.startswith("transformer.layers.") and not name.endswith("r_w_bias")
            and not name.endswith("r_r_bias"))
    item = np.dtype(dtype).itemsize
    r_tables = cfg.n_layer * align_up(r_table_rows(cfg) * cfg.n_head * cfg.d_head * item)
    return align_up(n * item) + r_tables + 64 * 256  # + alignment of each hold


def plan_placement(cfg: XLConfig, dtype: Any, quantize: bool, limit: int | None,
                   workspace: int) -> WeightPlan:
    layout = layer_layout(cfg, dtype, quantize)
    units = {f"layers.{l}": layout.nbytes for l in range(cfg.n_layer)}
    return plan_weights(units, fixed_bytes(cfg, dtype), workspace, limit,
                        layout.int8_scratch_bytes(dtype))


def load_params(cfg: XLConfig, ckpt: Checkpoint, be: Backend, runtime: WeightRuntime) -> dict:
    """Check names and shapes, resolve tied tensors (a safetensors save omits them), and build the
    parameter tree with (in, out) matrices. A tied copy present in the file (old .bin saves) is
    ignored in favour of its source, as HF re-ties on load."""
    required, tied = _shapes(cfg)
    check_names(ckpt, required, ignorable=tied)
    shapes = dict(required)
    for name, source in tied.items():
        shapes[name] = required[source]
    for name, shape in shapes.items():
        if name in ckpt and ckpt.info(name).shape != shape:
            raise CheckpointError(f"{ckpt.info(name).file}: tensor '{name}' has shape "
                                  f"{list(ckpt.info(name).shape)}, config implies {list(shape)}")

    def read(name: str) -> np.ndarray:
        return ckpt.read(tied.get(name, name), be.dtype)

    def t(name: str) -> Any:  # HF (out, in) -> (in, out), resident
        return runtime.place_fixed(np.ascontiguousarray(read(name).T), name)

    def fixed(name: str, array: np.ndarray | None = None) -> Any:
        return runtime.place_fixed(read(name) if array is None else array, name)

    C = cfg.d_model
    ends = cfg.cluster_ends
    n = len(ends) - 1
    emb = "transformer.word_emb"
    # adaptive input: per cluster a table (n_i, d_i) and a projection to C stored (d_i, C)
    if cfg.div_val == 1:
        tables = [fixed(f"{emb}.emb_layers.0.weight")]
        projs = [t(f"{emb}.emb_projs.0") if C != cfg.d_embed else None]
    else:
        tables = [fixed(f"{emb}.emb_layers.{i}.weight") for i in range(n)]
        projs = [t(f"{emb}.emb_projs.{i}") for i in range(n)]

    def read32(name: str) -> np.ndarray:  # layers are cast or quantised from float32 once
        return ckpt.read(tied.get(name, name), np.float32)

    layers = LayerStack(runtime, [runtime.place_unit(f"layers.{l}", _layer_arrays(cfg, read32, l, be))
                                  for l in range(cfg.n_layer)])
    # r = sinusoid(distance) @ W_r depends on nothing but the distance: one table per layer,
    # projected once here instead of K rows at every call (row j: distance rows-1-j)
    rows = r_table_rows(cfg)
    pos = sinusoids(cfg, read32("transformer.pos_emb.inv_freq"), rows)
    r_tables = [fixed(f"r_table{l}", (pos @ read32(f"transformer.layers.{l}.dec_attn.r_net.weight").T
                                      ).astype(be.dtype))
                for l in range(cfg.n_layer)]

    # output clusters: logits_i = (h @ proj_i) @ W_i + b_i; the head also scores the tail clusters
    clusters = []
    for i in range(n):
        if cfg.div_val == 1:
            w_all = read("crit.out_layers.0.weight")  # (V, d)
            w = w_all[ends[i]:ends[i + 1]]
            b = read("crit.out_layers.0.bias")[ends[i]:ends[i + 1]]
            proj = None if C == cfg.d_embed else fixed(f"crit.out_projs.{i}")
        else:
            w = read(f"crit.out_layers.{i}.weight")
            b = read(f"crit.out_layers.{i}.bias")
            proj = fixed(f"crit.out_projs.{i}")  # (C, d_i): used as h @ proj
        if i == 0 and n > 1:
            w = np.concatenate([w, read("crit.cluster_weight")], axis=0)
            b = np.concatenate([b, read("crit.cluster_bias")], axis=0)
        clusters.append({"proj": proj, "w": fixed(f"cluster{i}.w", np.ascontiguousarray(w.T)),
                         "b": fixed(f"cluster{i}.b", np.ascontiguousarray(b))})
    return {"emb_tables": tables, "emb_projs": projs, "inv_freq": read("transformer.pos_emb.inv_freq"),
            "layers": layers, "clusters": clusters, "r_tables": r_tables}


# =====================================================================================================
# Pieces of the forward pass
# =====================================================================================================
def embed(be: Backend, cfg: XLConfig, params: dict, ids: np.ndarray) -> Any:
    """Adaptive input embedding: (B, T) ids -> (B, T, C), scaled by sqrt(d_model)."""
    xp = be.xp
    B, T = ids.shape
    if cfg.div_val == 1:
        out = xp.take(params["emb_tables"][0], be.asarray(ids), axis=0)       # (B, T, d)
        if params["emb_projs"][0] is not None:
            out = out @ params["emb_projs"][0]                                 # (B, T, C)
    else:
        flat = ids.reshape(-1)
        out = xp.zeros((flat.size, cfg.d_model), dtype=be.dtype)
        ends = cfg.cluster_ends
        for i in range(len(ends) - 1):
            rows = np.flatnonzero((flat >= ends[i]) & (flat < ends[i + 1]))
            if rows.size == 0:
                continue
            vec = xp.take(params["emb_tables"][i], be.asarray(flat[rows] - ends[i]), axis=0)
            out[be.asarray(rows)] = vec @ params["emb_projs"][i]               # (n, C)
        out = out.reshape(B, T, cfg.d_model)
    out *= math.sqrt(cfg.d_model)
    return out


def sinusoids(cfg: XLConfig, inv_freq: np.ndarray, klen: int) -> np.ndarray:
    """(K, C) host float32 sinusoids of the distances K-1 ... 0 (clamped at clamp_len), [sin | cos]
    halves, from the checkpoint's inv_freq (the reference's own precision)."""
    pos = np.arange(klen - 1, -1, -1.0, dtype=np.float32)
    if cfg.clamp_len > 0:
        np.minimum(pos, np.float32(cfg.clamp_len), out=pos)
    angles = np.outer(pos, np.asarray(inv_freq, np.float32))                  # (K, C/2)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)


def relative_source(be: Backend, cfg: XLConfig, params: dict, K: int) -> tuple[str, Any]:
    """Where a call with K keys gets the projected sinusoids of the distances K-1 ... 0 (the same
    for every layer, so worked out once per call): ("rows", a slice of each layer's table, or
    an index array when clamp_len folds the long distances into one row), or ("project", the
    (K, C) sinusoids to multiply by W_r, for a prompt chunk longer than the tables)."""
    R = params["r_tables"][0].shape[0] if params["r_tables"] else 0
    if K <= R:
        return "rows", slice(R - K, R)
    if 0 < cfg.clamp_len < R:
        return "rows", be.asarray(R - 1 - np.minimum(np.arange(K - 1, -1, -1), cfg.clamp_len))
    return "project", be.asarray(sinusoids(cfg, params["inv_freq"], K), be.dtype)


def relative_keys(be: Backend, cfg: XLConfig, params: dict, l: int, w_r: Any, K: int,
                  source: tuple[str, Any] | None = None) -> Any:
    """Layer l's projected sinusoids of the distances K-1 ... 0 as (H, D, K), from its table or
    projected now, per `relative_source` (computed here when not given)."""
    how, what = source or relative_source(be, cfg, params, K)
    r = params["r_tables"][l][what] if how == "rows" else ops.linear(be.xp, what, w_r)
    return r.reshape(K, cfg.n_head, cfg.d_head).transpose(1, 2, 0)


def rel_shift(xp: Any, x: Any) -> Any:
    """Turn scores indexed by position-embedding row into scores indexed by key.

    x (..., T, K): x[..., i, m] pairs query i with embedding row m (distance K-1-m). Pad one zero
    column, view (..., K+1, T), drop the first row, view back (..., T, K): then
    out[..., i, j] = x[..., i, j + T - 1 - i] wherever that index is in range, i.e. for every key
    j <= i + M the query may see (the rest is masked)."""
    *lead, T, K = x.shape
    padded = xp.concatenate([xp.zeros((*lead, T, 1), dtype=x.dtype), x], axis=-1)  # (..., T, K+1)
    return padded.reshape(*lead, K + 1, T)[..., 1:, :].reshape(*lead, T, K)


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


def _cluster_logits(c: dict, h: Any) -> Any:
    """One output cluster's logits: (h @ proj_i) @ W_i + b_i. h (N, C) -> (N, n_i)."""
    if c["proj"] is not None:
        h = h @ c["proj"]                                                      # (N, d_i)
    out = h @ c["w"]
    out += c["b"]
    return out


def log_probs(be: Backend, cfg: XLConfig, params: dict, hidden: Any) -> Any:
    """Projected adaptive log-softmax: hidden (N, C) -> log-probabilities (N, V) float32."""
    xp = be.xp
    clusters = params["clusters"]
    ends = cfg.cluster_ends
    head = ops.log_softmax_(xp, _cluster_logits(clusters[0], hidden).astype(np.float32, copy=False))
    if len(clusters) == 1:
        return head                                                            # (N, V)
    out = xp.empty((hidden.shape[0], cfg.vocab_size), dtype=np.float32)
    out[:, :ends[1]] = head[:, :ends[1]]
    for i in range(1, len(clusters)):
        tail = out[:, ends[i]:ends[i + 1]]
        tail[...] = _cluster_logits(clusters[i], hidden)
        ops.log_softmax_(xp, tail)
        tail += head[:, ends[1] + i - 1:ends[1] + i]  # + log p(cluster i)
    return out


def target_log_probs(be: Backend, cfg: XLConfig, params: dict, hidden: Any,
                     targets: np.ndarray) -> np.ndarray:
    """log p(targets[n] | hidden[n]) for each row: (N, C), (N,) ids -> (N,) float64 on the host.

    What scoring needs, without the (N, V) matrix: the head's log-softmax for every row, and each
    tail cluster's logits only for the rows whose target lies in that cluster (the computation
    HF's adaptive softmax does when given labels). Equal to gathering `log_probs` at the targets."""
    xp = be.xp
    clusters = params["clusters"]
    ends = cfg.cluster_ends
    targets = np.asarray(targets, np.int64)
    head = ops.log_softmax_(xp, _cluster_logits(clusters[0], hidden).astype(np.float32, copy=False))
    out = np.zeros(len(targets), np.float64)
    rows = np.nonzero(targets < ends[1])[0]
    out[rows] = be.to_host(head[be.asarray(rows), be.asarray(targets[rows])])
    for i in range(1, len(clusters)):
        rows = np.nonzero((targets >= ends[i]) & (targets < ends[i + 1]))[0]
        if len(rows) == 0:
            continue
        r = be.asarray(rows)
        tail = ops.log_softmax_(xp, _cluster_logits(clusters[i], hidden[r]).astype(np.float32,
                                                                                 copy=False))
        picked = tail[xp.arange(len(rows)), be.asarray(targets[rows] - ends[i])]
        out[rows] = be.to_host(picked + head[r, ends[1] + i - 1])
    return out


# =====================================================================================================
# Segment memory
# =====================================================================================================
def memory_specs(cfg: XLConfig, batch: int, dtype: Any) -> BufferSpec:
    """The segment memory: each layer's input (the model's state) and, beside it, that input's
    key/value projections, so a call projects only its new positions (see `XLMemory`)."""
    L, M = cfg.n_layer, cfg.mem_len
    return {"memory": ((L, batch, M, cfg.d_model), dtype),
            "memory_kv": ((L, batch, M, 2, cfg.n_head, cfg.d_head), dtype)}


def _append(buf: Any, new: Any, old_length: int) -> None:
    """buf (B, cap, ...) holds `old_length` positions: append new (B, T, ...), keep the last cap."""
    cap, T = buf.shape[1], new.shape[1]
    if T >= cap:
        buf[:, :cap] = new[:, T - cap:]
        return
    keep = min(old_length, cap - T)
    if keep:
        buf[:, :keep] = buf[:, old_length - keep:old_length].copy()
    buf[:, keep:keep + T] = new


class XLMemory:
    """Each layer's input over the last `mem_len` positions: (L, B, mem_len, C) in the arena.

    `length` positions are filled (0 = empty memory). Forward calls read it and update it in place;
    `release()` (or garbage collection) hands the arena block back.

    Beside the states it keeps their key/value projections (L, B, mem_len, 2, H, D): a memory
    position's K/V is a function of that position's layer input alone (pre-norm included), so
    it is computed once, when the position is new, instead of at every later call (in generation
    a step would otherwise project mem_len + 1 rows to produce one). HF recomputes them."""

    def __init__(self, be: Backend, cfg: XLConfig, batch: int):
        self.cfg, self.batch = cfg, batch
        self._hold = be.arena.hold(memory_specs(cfg, batch, be.dtype))
        self.states = self._hold.buffers["memory"]
        self.kv = self._hold.buffers["memory_kv"]
        self.length = 0
        self._finalizer = weakref.finalize(self, self._hold.release)

    def layer(self, l: int) -> Any:
        """(B, M, C) view of layer l's filled memory."""
        return self.states[l, :, :self.length]

    def layer_kv(self, l: int) -> Any:
        """(B, M, 2, H, D) view of the keys/values of layer l's filled memory."""
        return self.kv[l, :, :self.length]

    def update(self, l: int, hidden: Any, kv: Any, old_length: int) -> None:
        """Append layer l's input `hidden` (B, T, C) and its keys/values `kv` (B, T, 2, H, D),
        keeping the last mem_len positions."""
        if self.cfg.mem_len == 0:
            return
        _append(self.states[l], hidden, old_length)
        _append(self.kv[l], kv, old_length)

    def advance(self, T: int) -> None:
        self.length = min(self.length + T, self.cfg.mem_len)

    def reorder(self, rows: np.ndarray) -> None:
        """Keep / duplicate batch rows (finished rows leave; beams follow their parents)."""
        n = len(rows)
        for l in range(self.cfg.n_layer):
            for buf in (self.states, self.kv):
                filled = buf[l, :, :self.length]
                filled[:n] = filled[rows]
        self.batch = n

    def reset(self) -> None:
        self.length = 0

    def release(self) -> None:
        self._finalizer()

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def to_host(self) -> np.ndarray:
        """(L, B, M, C) float32 copy of the filled memory."""
        return np.array(self.states[:, :self.batch, :self.length], dtype=np.float32)


def layer_specs(cfg: XLConfig, B: int, T: int, K: int, dtype: Any) -> BufferSpec:
    """Scratch of one forward call (reused by every layer)."""
    H, D = cfg.n_head, cfg.d_head
    return {
        "qkv": ((B, T, 3 * H * D), dtype),  # the new positions' projections
        "kv": ((B, K, 2, H, D), dtype),      # memory's cached keys/values, then the new ones
        "scores": ((B, H, T, K), dtype),
        "bd": ((B, H, T, K), dtype),
        "ctx": ((B, T, H * D), dtype),
        "ff": ((B, T, cfg.d_inner), dtype),
    }


def forward_hidden(be: Backend, cfg: XLConfig, params: dict, ids: np.ndarray,
                   memory: XLMemory) -> Any:
    """(B, T) ids with `memory` (read, then updated in place) -> last layer output (B, T, C).

    Call inside an arena scope: the layer scratch and (on CUDA, where CuPy's allocator is routed
    to the arena within scopes) every temporary, the result included, live until it closes."""
    xp = be.xp
    B, T = ids.shape
    M = memory.length
    K = M + T
    H, D = cfg.n_head, cfg.d_head
    x = embed(be, cfg, params, ids)                                            # (B, T, C)
    blocked = attention_mask(cfg, T, M)                                        # (T, K)
    mask = be.asarray(blocked) if blocked.any() else None
    scale = 1.0 / math.sqrt(D)
    ws = be.arena.alloc_many(layer_specs(cfg, B, T, K, be.dtype))
    r_source = relative_source(be, cfg, params, K)
    for l, p in enumerate(params["layers"]):
        # projections of the T new positions only; the memory's come from its cache
        inp = (ops.layer_norm(xp, x, p["ln_attn_w"], p["ln_attn_b"], cfg.eps) if cfg.pre_lnorm
               else x)
        qkv = ops.linear(xp, inp, p["w_qkv"], ws["qkv"]).reshape(B, T, 3, H, D)
        kv = ws["kv"]                                                          # (B, K, 2, H, D)
        kv[:, :M] = memory.layer_kv(l)
        kv[:, M:] = qkv[:, :, 1:]
        q = qkv[:, :, 0].transpose(0, 2, 1, 3)                                 # (B, H, T, D)
        k = kv[:, :, 0].transpose(0, 2, 1, 3)                                  # (B, H, K, D)
        v = kv[:, :, 1].transpose(0, 2, 1, 3)
        r = relative_keys(be, cfg, params, l, p["w_r"], K, r_source)            # (H, D, K)
        scores = xp.matmul(q + p["r_w_bias"][:, None, :], k.swapaxes(-1, -2),
                           out=ws["scores"])                                   # AC (B, H, T, K)
        bd = xp.matmul(q + p["r_r_bias"][:, None, :], r, out=ws["bd"])         # (B, H, T, K)
        scores += rel_shift(xp, bd)
        scores *= scale
        if mask is not None:
            scores[:, :, blocked] = NEG_INF
        ops.softmax_(xp, scores)
        ctx = ws["ctx"]
        xp.matmul(scores, v, out=ctx.reshape(B, T, H, D).transpose(0, 2, 1, 3))
        attn = ops.linear(xp, ctx, p["w_o"])                                  # (B, T, C)
        memory.update(l, x, qkv[:, :, 1:], M)  # this layer's input (and its K/V) join its memory
        if cfg.pre_lnorm:
            a = x + attn
            h = ops.linear(xp, ops.layer_norm(xp, a, p["ln_ff_w"], p["ln_ff_b"], cfg.eps), p["w1"],
                           ws["ff"])
            h += p["b1"]
            x = a + (ops.linear(xp, ops.relu_(xp, h), p["w2"]) + p["b2"])
        else:
            a = ops.layer_norm(xp, x + attn, p["ln_attn_w"], p["ln_attn_b"], cfg.eps)
            h = ops.linear(xp, a, p["w1"], ws["ff"])
            h += p["b1"]
            ff = ops.linear(xp, ops.relu_(xp, h), p["w2"]) + p["b2"]
            x = ops.layer_norm(xp, a + ff, p["ln_ff_w"], p["ln_ff_b"], cfg.eps)
    memory.advance(T)
    return x


# =====================================================================================================
# Incremental decoding state (the generation loops' protocol)
# =====================================================================================================
PROMPT_CHUNK = 512  # prompts up to this many tokens run in one call; longer ones by tgt_len segments


class XLDecodeState:
    """Generation state: the prompt's memory plus the log-probs of its last position.

    The loops feed `first_tokens` (the prompt's last token) at step 0: that step returns the log-
    probs the prompt already produced instead of running the model again; later steps run one token
    through the model with the carried memory."""

    def __init__(self, model: "XLModel", memory: XLMemory, first_log_probs: Any,
                 first_tokens: np.ndarray):
        self.model, self.memory = model, memory
        self.first_tokens = first_tokens
        self._pending = first_log_probs
        self.batch = len(first_tokens)

    def step(self, tokens: np.ndarray) -> Any:
        if self._pending is not None:
            out, self._pending = self._pending, None
            return out
        m = self.model
        with m.backend.arena.scope():
            h = forward_hidden(m.backend, m.config, m.params,
                               np.asarray(tokens, np.int64).reshape(self.batch, 1), self.memory)
            return m.backend.to_host(log_probs(m.backend, m.config, m.params, h[:, 0]))  # (b, V)

    def reorder(self, rows: Sequence[int] | np.ndarray, cross: bool = True) -> None:
        rows = np.asarray(rows, np.int64)
        if self._pending is not None:
            self._pending = self._pending[rows]
        self.memory.reorder(rows)
        self.batch = len(rows)


# =====================================================================================================
# The model object the public API hands out
# =====================================================================================================
@dataclass(frozen=True)
class _GenerationIds:
    """What the model-agnostic generation code needs to know about token ids."""
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    decoder_start_token_id: int | None = None


def run_bytes(cfg: XLConfig, dt: Any, batch: int, seg_len: int) -> dict[str, int]:
    """Arena bytes of a run: the segment memory plus one segment's scratch."""
    memory = bytes_needed(memory_specs(cfg, batch, dt))
    scratch = bytes_needed(layer_specs(cfg, batch, seg_len, cfg.mem_len + seg_len, dt))
    return {"memory": memory, "segment_scratch": scratch, "peak": memory + scratch}


class XLModel(OwnsWeights):
    """A loaded Transformer-XL: forward with explicit memory, scoring, generation, sessions."""

    family = "transfo-xl"
    is_encoder_decoder = False
    add_eos_to_prompt = False

    def __init__(self, config: XLConfig, params: dict, backend: Backend, folder: str,
                 hf_config: dict | None = None, generation_config: dict | None = None,
                 tokenizer: Any = None):
        self.config = config
        self.params = params
        self.backend = backend
        self.folder = folder
        self.hf_config = hf_config or {}
        self.generation_config = generation_config or {}
        self.tokenizer = tokenizer
        # <eos> ends a WT103 line, not a document: generation continues past it (it prints as a
        # newline); use stop=["\n"] to end at a line break.
        self.generation_ids = _GenerationIds(eos_token_ids=(), pad_token_id=config.eos_token_id)

    # -- batches, memory, plan ------------------------------------------------------------------------
    def batch(self, input_ids: Any, attention_mask: Any = None) -> tuple[np.ndarray, np.ndarray]:
        from .t5 import as_batch
        ids, mask = as_batch(input_ids, self.config.eos_token_id, self.config.vocab_size,
                             "input_ids", attention_mask)
        if not mask.all():
            raise InputError("input_ids: Transformer-XL batches need rows of equal length "
                             "(no padding); run different lengths one at a time")
        return ids, mask

    def new_memory(self, batch: int = 1) -> XLMemory:
        """An empty segment memory for `batch` rows (arena-backed; `release()` when done)."""
        return XLMemory(self.backend, self.config, batch)

    def plan(self, batch: int, seg_len: int | None = None) -> dict[str, int]:
        return run_bytes(self.config, self.backend.dtype, batch, seg_len or self.config.tgt_len)

    def parameter_count(self) -> int:
        required, _ = _shapes(self.config)
        return sum(int(np.prod(s)) for n, s in required.items() if n != "transformer.pos_emb.inv_freq")

    def describe(self) -> list[tuple[str, str]]:
        """Architecture facts for `minfer info`."""
        c = self.config
        return [
            ("family", f"transfo-xl ({'pre' if c.pre_lnorm else 'post'}-norm, "
                       f"{'untied' if c.untie_r else 'shared'} u/v biases)"),
            ("layers", f"{c.n_layer}"),
            ("width", f"d_model {c.d_model}, {c.n_head} heads x d_head {c.d_head}, "
                      f"d_inner {c.d_inner}, d_embed {c.d_embed}"),
            ("vocab", f"{c.vocab_size}, clusters at {list(c.cutoffs) or 'none'}, div_val {c.div_val}"),
            ("memory", f"mem_len {c.mem_len}, segment {c.tgt_len}, clamp_len {c.clamp_len}, "
                       f"same_length {c.same_length}"),
        ]

    # -- the public surface ---------------------------------------------------------------------------
    def forward(self, input_ids: Any, memory: XLMemory | None = None) -> tuple[np.ndarray, XLMemory]:
        """(B, T) ids -> (log-probs (B, T, V) float32 numpy, memory). `memory=None` starts from an
        empty memory; a given memory is read and updated in place (and returned)."""
        ids, _ = self.batch(input_ids)
        if memory is None:
            memory = self.new_memory(ids.shape[0])
        elif memory.released or memory.batch != ids.shape[0]:
            raise InputError(f"memory: holds {memory.batch} rows"
                             + (" and was released" if memory.released else "")
                             + f", input_ids has {ids.shape[0]}")
        B, T = ids.shape
        with self.backend.arena.scope():
            h = forward_hidden(self.backend, self.config, self.params, ids, memory)
            lp = log_probs(self.backend, self.config, self.params, h.reshape(B * T, -1))
            return np.asarray(self.backend.to_host(lp), np.float32).reshape(B, T, -1), memory

    def score(self, inputs: Any, segment_len: int | None = None, memory: XLMemory | None = None,
              progress: Callable[[int, int], None] | None = None) -> dict:
        """Log-likelihood of a text (str; one WT103 line per line, <eos> after each) or id list,
        processed in segments of `segment_len` (default tgt_len) with memory carried.
        Returns {"log_likelihood", "tokens" (predicted tokens = ids - 1), "perplexity", "seconds"}."""
        import time
        if isinstance(inputs, str):
            if self.tokenizer is None:
                raise InputError(f"text input requires a tokenizer, and {self.folder} has none")
            lines = inputs.split("\n")
            if lines and lines[-1] == "":
                lines.pop()
            ids = [t for line in lines for t in self.tokenizer.encode(line, add_eos=True)]
        else:
            ids = [int(t) for t in inputs]
        if len(ids) < 2:
            raise InputError("score: need at least 2 tokens (the first one is only context)")
        arr, _ = self.batch([ids])
        T = segment_len or self.config.tgt_len
        if isinstance(T, bool) or not isinstance(T, int) or T < 1:
            raise InputError(f"segment_len must be a positive integer, got {segment_len!r}")
        own = memory is None
        memory = self.new_memory(1) if own else memory
        if memory.released or memory.batch != 1:
            raise InputError("score: memory must be a live one-row memory")
        total, n = 0.0, arr.shape[1] - 1
        t0 = time.perf_counter()
        try:
            for start in range(0, n, T):
                seg = arr[:, start:min(start + T, n)]
                targets = arr[0, start + 1:start + 1 + seg.shape[1]]
                with self.backend.arena.scope():
                    h = forward_hidden(self.backend, self.config, self.params, seg, memory)
                    total += float(target_log_probs(self.backend, self.config, self.params,
                                                    h.reshape(seg.shape[1], -1), targets).sum())
                if progress is not None:
                    progress(start + seg.shape[1], n)
        finally:
            if own:
                memory.release()
        return {"log_likelihood": total, "tokens": n, "perplexity": math.exp(-total / n),
                "seconds": time.perf_counter() - t0}

    @contextlib.contextmanager
    def start_decoding(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                       max_len: int, memory: XLMemory | None = None) -> Iterator[XLDecodeState]:
        """Run the prompt (one call up to PROMPT_CHUNK tokens, else tgt_len segments) and yield
        the state the generation loops step. A memory passed in (a session's) is continued."""
        ids, _ = self.batch(input_ids, attention_mask)
        own = memory is None
        memory = self.new_memory(ids.shape[0]) if own else memory
        try:
            P = ids.shape[1]
            chunk = P if P <= PROMPT_CHUNK else self.config.tgt_len
            with self.backend.arena.scope():
                for start in range(0, P, chunk):
                    h = forward_hidden(self.backend, self.config, self.params,
                                       ids[:, start:start + chunk], memory)
                first = self.backend.to_host(log_probs(self.backend, self.config, self.params,
                                                       h[:, -1]))                # (B, V) host
            yield XLDecodeState(self, memory, first, ids[:, -1].copy())
        finally:
            if own:
                memory.release()

    def generate(self, inputs: Any, *, stream: bool = False, return_details: bool = False,
                 **options: Any) -> Any:
        """Continue a prompt (str, list of str, or token ids) one token per step with cached
        memory; the shared generation options and streaming apply (see T5Model.generate).
        Token-id results are the new ids only. <eos> does not stop generation (it is a line end
        in WT103); pass stop=["\\n"] to end at a line."""
        from .. import generation
        return generation.generate(self, inputs, stream_output=stream, return_details=return_details,
                                   **options)

    def session(self) -> "XLSession":
        """Keep memory between successive generate / score calls (a chat, a long document)."""
        return XLSession(self)

    def __repr__(self) -> str:
        c = self.config
        return (f"XLModel({self.folder!r}, layers={c.n_layer}, d_model={c.d_model}, "
                f"vocab={c.vocab_size}, mem_len={c.mem_len}, device={self.backend.device!r})")


class XLSession:
    """A memory carried across calls: `score` and `generate` continue where the last call ended
    (one row). Use as a context manager, or call `close()`, to give the memory back."""

    def __init__(self, model: XLModel):
        self.model = model
        self.memory = model.new_memory(1)
        self.last_token: int | None = None  # the last token seen, not yet run through the model

    def _feed_pending(self) -> None:
        if self.last_token is not None:
            with self.model.backend.arena.scope():
                forward_hidden(self.model.backend, self.model.config, self.model.params,
                               np.array([[self.last_token]]), self.memory)
            self.last_token = None

    def score(self, inputs: Any, segment_len: int | None = None) -> dict:
        self._feed_pending()
        return self.model.score(inputs, segment_len, memory=self.memory)

    def generate(self, prompt: Any, **options: Any) -> Any:
        """Continue the session: the prompt (may be empty "" to just continue) goes after what the
        session has seen; the generated tokens are remembered too."""
        from .. import generation
        return generation.session_generate(self, prompt, **options)

    def close(self) -> None:
        self.memory.release()

    def __enter__(self) -> "XLSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load(ckpt: Checkpoint, be: Backend, generation_config: dict | None = None,
         tokenizer: Any = None, recorder: Any = None) -> XLModel:
    """Build an XLModel: plan where the layers go (all resident without a memory limit), then
    read them one at a time into place; embedding and softmax clusters stay resident."""
    cfg = XLConfig.from_hf(ckpt.config, str(ckpt.folder / "config.json"))
    workspace = run_bytes(cfg, be.dtype, 1, cfg.tgt_len)["peak"]
    plan = plan_placement(cfg, be.dtype, be.quantize, be.memory_limit, be.workspace_reserve(workspace))
    runtime = WeightRuntime(be, plan, recorder)
    model = XLModel(cfg, load_params(cfg, ckpt, be, runtime), be, str(ckpt.folder), ckpt.config,
                    generation_config, tokenizer)
    model.attach_runtime(plan, runtime)
    return model
