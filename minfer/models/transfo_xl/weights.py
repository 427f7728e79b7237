"""Transformer-XL's weight table: every tensor a TransfoXL checkpoint holds and the parameters
minfer builds from them, with the sinusoids its per-layer position tables are projected from.

The table resolves the tied tensors (a safetensors save omits them; an old .bin save keeps
copies, which are ignored in favour of their source, as HF re-ties on load), concatenates the
head's cluster logits onto the first cluster, and projects each layer's sinusoid table once at load.

Shapes: H heads, D head dim, C d_model, F d_inner, V vocab.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...params.table import Derived, Linear, Tensor, View, WeightTable
from .config import XLConfig


def r_table_rows(cfg: XLConfig) -> int:
    """Distances each layer's projected-sinusoid table covers: every distance a scoring segment
    or a generation step sees (mem_len + tgt_len), or fewer when clamp_len makes all longer
    distances share one row."""
    rows = cfg.mem_len + cfg.tgt_len
    return min(rows, cfg.clamp_len + 1) if cfg.clamp_len > 0 else rows


def sinusoids(cfg: XLConfig, inv_freq: np.ndarray, klen: int) -> np.ndarray:
    """(K, C) host float32 sinusoids of the distances K-1 ... 0 (clamped at clamp_len), [sin | cos]
    halves, from the checkpoint's inv_freq (the reference's own precision)."""
    pos = np.arange(klen - 1, -1, -1.0, dtype=np.float32)
    if cfg.clamp_len > 0:
        np.minimum(pos, np.float32(cfg.clamp_len), out=pos)
    angles = np.outer(pos, np.asarray(inv_freq, np.float32))                  # (K, C/2)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)


INV_FREQ = "transformer.pos_emb.inv_freq"


def _layer(cfg: XLConfig, l: int, tensors: dict, optional: dict) -> dict:
    """Layer l: its tensors (added to `tensors` / `optional`) and its unit."""
    C, H, D, F = cfg.d_model, cfg.n_head, cfg.d_head, cfg.d_inner
    p, a = f"transformer.layers.{l}", f"transformer.layers.{l}.dec_attn"
    tensors.update({
        f"{a}.qkv_net.weight": (3 * H * D, C), f"{a}.o_net.weight": (C, H * D),
        f"{a}.r_net.weight": (H * D, C),
        f"{a}.layer_norm.weight": (C,), f"{a}.layer_norm.bias": (C,),
        f"{p}.pos_ff.CoreNet.0.weight": (F, C), f"{p}.pos_ff.CoreNet.0.bias": (F,),
        f"{p}.pos_ff.CoreNet.3.weight": (C, F), f"{p}.pos_ff.CoreNet.3.bias": (C,),
        f"{p}.pos_ff.layer_norm.weight": (C,), f"{p}.pos_ff.layer_norm.bias": (C,),
    })
    # the u / v biases: per layer, or one pair shared by all (a .bin save keeps per-layer copies)
    for bias in ("r_w_bias", "r_r_bias"):
        (tensors if cfg.untie_r else optional)[f"{a}.{bias}"] = (H, D)
    r_src = a if cfg.untie_r else "transformer"
    return {
        "w_qkv": Linear((f"{a}.qkv_net.weight",)),                    # (3HD, C)
        "w_o": Linear((f"{a}.o_net.weight",)),                        # (C, HD)
        "w_r": Linear((f"{a}.r_net.weight",)),                        # (HD, C)
        "w1": Linear((f"{p}.pos_ff.CoreNet.0.weight",)),              # (F, C)
        "w2": Linear((f"{p}.pos_ff.CoreNet.3.weight",)),              # (C, F)
        "r_w_bias": Tensor(f"{r_src}.r_w_bias"),                      # (H, D): "u"
        "r_r_bias": Tensor(f"{r_src}.r_r_bias"),                      # (H, D): "v"
        "b1": Tensor(f"{p}.pos_ff.CoreNet.0.bias"), "b2": Tensor(f"{p}.pos_ff.CoreNet.3.bias"),
        "ln_attn_w": Tensor(f"{a}.layer_norm.weight"), "ln_attn_b": Tensor(f"{a}.layer_norm.bias"),
        "ln_ff_w": Tensor(f"{p}.pos_ff.layer_norm.weight"),
        "ln_ff_b": Tensor(f"{p}.pos_ff.layer_norm.bias"),
    }


def weight_table(cfg: XLConfig) -> WeightTable:
    """Every tensor a TransfoXL checkpoint holds and every parameter minfer builds from it.

    Fixed parameters: per output cluster `cluster.i.w` (n_i, d_i) (cluster 0 also scores the
    tail clusters: their logit rows are appended), `cluster.i.b` and `cluster.i.proj` (d_i, C);
    `emb_table.i` (n_i, d_i) and `emb_proj.i` (C, d_i) of the adaptive input (a tied table is
    the same slot as its cluster's weight: only its first n_i rows are ever looked up);
    `inv_freq` (host); `r_table.l` (distances, HD) per layer."""
    C, V, n = cfg.d_model, cfg.vocab_size, cfg.n_clusters
    ends, emb = cfg.cluster_ends, "transformer.word_emb"
    single = cfg.div_val == 1                   # one embedding table for the whole vocabulary
    tensors: dict[str, tuple[int, ...]] = {INV_FREQ: (C // 2,)}
    optional: dict[str, tuple[int, ...]] = {}
    fixed: dict[str, Any] = {}
    for i in range(1 if single else n):
        tensors[f"{emb}.emb_layers.{i}.weight"] = (V if single else ends[i + 1] - ends[i],
                                                    cfg.emb_dim(i))
        if not single or C != cfg.d_embed:
            tensors[f"{emb}.emb_projs.{i}"] = (C, cfg.emb_dim(i))
    # the head: cluster i's logits are (h @ proj_i.T) @ W_i.T + b_i
    if n > 1:
        tensors["crit.cluster_weight"] = (n - 1, cfg.d_embed)
        tensors["crit.cluster_bias"] = (n - 1,)
    for i in range(1 if single else n):
        out = f"crit.out_layers.{i}"
        shape = (V if single else ends[i + 1] - ends[i], cfg.emb_dim(i))
        (optional if cfg.tie_word_embeddings else tensors)[f"{out}.weight"] = shape
        tensors[f"{out}.bias"] = shape[:1]
    for i in range(n):
        span = (ends[i], ends[i + 1]) if single else None
        out = f"crit.out_layers.{0 if single else i}"
        weight = f"{emb}.emb_layers.{0 if single else i}.weight" if cfg.tie_word_embeddings \
            else f"{out}.weight"
        tail = ("crit.cluster_weight",) if i == 0 and n > 1 else ()
        fixed[f"cluster.{i}.w"] = Linear((weight, *tail), rows=span)
        fixed[f"cluster.{i}.b"] = Tensor(f"{out}.bias", rows=span,
                                         append=("crit.cluster_bias",) if tail else ())
        if single and C == cfg.d_embed:
            continue                             # no projections at all
        proj = f"crit.out_projs.{i}"
        if cfg.tie_projs[i]:
            source = f"{emb}.emb_projs.{0 if single else i}"
            optional[proj] = tensors[source]
        else:
            source = proj
            tensors[proj] = (C, cfg.emb_dim(i))
        fixed[f"cluster.{i}.proj"] = Linear((source,), transpose=True)  # stored (C, d_i)
    for i in range(1 if single else n):
        tied = cfg.tie_word_embeddings and not single
        fixed[f"emb_table.{i}"] = (View(f"cluster.{i}.w") if tied
                                   else Linear((f"{emb}.emb_layers.{i}.weight",)))
        if not single or C != cfg.d_embed:
            fixed[f"emb_proj.{i}"] = Linear((f"{emb}.emb_projs.{i}",))  # (C, d_i) as F.linear
    fixed["inv_freq"] = Tensor(INV_FREQ, host=True)
    layers = [_layer(cfg, l, tensors, optional) for l in range(cfg.n_layer)]
    if not cfg.untie_r:
        tensors["transformer.r_w_bias"] = tensors["transformer.r_r_bias"] = (cfg.n_head, cfg.d_head)
    # r = sinusoid(distance) @ W_r.T depends on nothing but the distance: one table per layer,
    # projected once at load instead of K rows at every call (row j: distance rows-1-j)
    rows, HD = r_table_rows(cfg), cfg.n_head * cfg.d_head
    for l in range(cfg.n_layer):
        w_r = f"transformer.layers.{l}.dec_attn.r_net.weight"
        fixed[f"r_table.{l}"] = Derived((rows, HD), lambda read, w_r=w_r: (
            sinusoids(cfg, read(INV_FREQ), rows) @ read(w_r).T))
    return WeightTable(tensors=tensors, fixed=fixed, stacks={"layers": layers},
                       optional=optional, buffers=(INV_FREQ,))
