"""Transformer-XL's run buffers: the arena `BufferSet`s of a run (the segment memory and its
cached keys / values in `MemoryBuffers`, one call's `LayerScratch`), the head's temporaries,
the segments a prompt runs in, and `run_bytes`, the plan of a run.

Shapes: B batch, T segment length, M memory length, K = M + T keys, H heads, D head dim,
C d_model, F d_inner, V vocab, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...arena import BufferSet, BufferSpec, bytes_needed, scope_bytes
from .config import XLConfig
from .weights import r_table_rows


@dataclass
class MemoryBuffers(BufferSet):
    """The segment memory of B rows: each layer's input over the last mem_len positions and,
    beside it, that input's key/value projections, so a call projects only its new positions."""
    states: Any   # (L, B, M, C)
    kv: Any       # (L, B, M, 2, H, D)

    @classmethod
    def specs(cls, cfg: XLConfig, B: int, dtype: Any) -> BufferSpec:
        L, M = cfg.n_layer, cfg.mem_len
        return {"states": ((L, B, M, cfg.d_model), dtype),
                "kv": ((L, B, M, 2, cfg.n_head, cfg.d_head), dtype)}


@dataclass
class LayerScratch(BufferSet):
    """One forward call's scratch over T new positions and K keys, reused by every layer: every
    buffer its device work writes, so that nothing else is allocated (host inputs are uploaded)."""
    qkv: Any      # (B, T, 3HD) the new positions' projections
    kv: Any       # (B, K, 2, H, D) the memory's cached keys/values, then the new ones
    scores: Any   # (B, H, T, K)
    bd: Any       # (B, H, T, K) the position term before rel_shift
    ctx: Any      # (B, T, HD)
    ff: Any       # (B, T, F)
    x: Any = None       # (B, T, C) the layer's input, then its output (the stream)
    a: Any = None       # (B, T, C) x + attention (then normed, post-norm)
    attn: Any = None    # (B, T, C) the attention's output projection, then the FF's output
    h: Any = None       # (B, T, C) the pre-norm inputs (pre_lnorm only)
    work: Any = None    # (B, T, C) float32: the layer norms' scratch
    ln_stats: Any = None  # (B, T, 2) float32: their mean and inverse deviation
    qb: Any = None      # (B, H, T, D) q + u, then q + v
    top: Any = None     # (B, H, T, 1) softmax row maxima
    total: Any = None   # (B, H, T, 1) float32 softmax row sums
    mask: Any = None    # (T, K) bool: blocked (query, key) pairs
    r: Any = None       # (K, HD) the relative keys, when not a view of the table
    ids: Any = None     # (max(BT, K),) int64: token ids by cluster; the table rows (clamp_len)
    emb: Any = None     # (BT * d_embed,) a cluster's embedding rows before projection
    emb_out: Any = None  # (BT, C) projected embeddings in cluster order (div_val > 1)
    perm: Any = None    # (BT,) int64: their positions in the batch (div_val > 1)
    sinus: Any = None   # (K, C) sinusoids to project, for calls longer than the tables
    shift: Any = None   # (B, mem_len, C) the kept memory states on their way to the front

    @classmethod
    def specs(cls, cfg: XLConfig, B: int, T: int, K: int, dtype: Any) -> BufferSpec:
        H, D, C = cfg.n_head, cfg.d_head, cfg.d_model
        f32 = np.dtype(np.float32)
        R = r_table_rows(cfg) if cfg.n_layer else 0
        project = K > R and not 0 < cfg.clamp_len < R
        return {"qkv": ((B, T, 3 * H * D), dtype), "kv": ((B, K, 2, H, D), dtype),
                "scores": ((B, H, T, K), dtype), "bd": ((B, H, T, K), dtype),
                "ctx": ((B, T, H * D), dtype), "ff": ((B, T, cfg.d_inner), dtype),
                "x": ((B, T, C), dtype), "a": ((B, T, C), dtype), "attn": ((B, T, C), dtype),
                **({"h": ((B, T, C), dtype)} if cfg.pre_lnorm else {}),
                "work": ((B, T, C), f32), "ln_stats": ((B, T, 2), f32),
                "qb": ((B, H, T, D), dtype), "top": ((B, H, T, 1), dtype),
                "total": ((B, H, T, 1), f32), "mask": ((T, K), np.bool_),
                "r": ((K, H * D), dtype), "ids": ((max(B * T, K),), np.int64),
                "emb": ((B * T * cfg.d_embed,), dtype),
                **({"emb_out": ((B * T, C), dtype), "perm": ((B * T,), np.int64)}
                   if cfg.div_val > 1 else {}),
                **({"sinus": ((K, C), dtype)} if project else {}),
                **({"shift": ((B, cfg.mem_len, C), dtype)} if cfg.mem_len else {})}


def head_temporaries(cfg: XLConfig, rows: int, dtype: Any, scoring: bool = False) -> int:
    """Bytes of device temporaries the adaptive log-softmax of `rows` rows has alive at once
    (on a GPU, the recycled pool of its scope; on the CPU ordinary memory): `log_probs` keeps
    the float32 head and the (rows, V) result while a cluster's logits, their exponentials and
    projection are alive; scoring (`target_log_probs`) keeps no (rows, V) result but gathers
    each cluster's hidden rows. An upper bound, checked against the stand-in's pool peaks."""
    ends = cfg.cluster_ends
    widest = max(b - a for a, b in zip(ends[:-1], ends[1:])) + cfg.n_clusters - 1
    dim = max(cfg.emb_dim(i) for i in range(cfg.n_clusters))
    item = np.dtype(dtype).itemsize
    whole = 0 if scoring else cfg.vocab_size
    return rows * (4 * (whole + 2 * widest) + item * (widest + dim + cfg.d_model) + 64)


PROMPT_CHUNK = 512  # prompts up to this many tokens run in one call; longer ones by tgt_len segments


def prompt_segment(cfg: XLConfig, prompt_len: int, whole_fits: bool = True) -> int:
    """The segment length a prompt of `prompt_len` tokens runs in: all of it in one call up to
    PROMPT_CHUNK tokens when that call's scratch fits (`whole_fits`: fastest, and what one
    forward over the prompt gives); otherwise tgt_len segments with the memory carried, as
    Transformer-XL reads any text longer than a segment (scratch bounded whatever the length;
    positions further back than mem_len are then out of sight, as in the model's training)."""
    if prompt_len <= PROMPT_CHUNK and whole_fits:
        return prompt_len
    return min(prompt_len, cfg.tgt_len)


def segment_scratch_bytes(cfg: XLConfig, dtype: Any, batch: int, T: int) -> int:
    """One forward call's scratch over T new positions after a full memory."""
    return LayerScratch.nbytes(cfg, batch, T, cfg.mem_len + T, dtype)


def prompt_call_bytes(cfg: XLConfig, dtype: Any, batch: int, T: int) -> int:
    """Arena bytes of one call of a generation's prompt over T positions: its scratch and the
    temporaries of its last position's log-probs."""
    return (segment_scratch_bytes(cfg, dtype, batch, T)
            + scope_bytes(head_temporaries(cfg, batch, dtype)))


def run_bytes(cfg: XLConfig, dtype: Any, batch: int, input_len: int | None,
              max_new_tokens: int | None = None, whole_fits: bool = False,
              compute: str = "float32") -> dict[str, int]:
    """Arena bytes of a run: the segment memory plus the largest of one segment's scratch with
    its head's temporaries (the segments a prompt of `input_len` tokens runs in, default
    tgt_len: one call when `whole_fits`, see `prompt_segment` and `XLModel.plan`; generation
    steps need less) and a reorder of the memory. A plan without `max_new_tokens` (forward and
    scoring, the workspace at load) counts the head of every position of the segment (forward's,
    which keeps their (rows, V) log-probs: scoring needs less); a generation plan the last
    position's log-probs. (compute: no buffer here depends on it; the family's signature.)"""
    T = cfg.tgt_len if input_len is None else prompt_segment(cfg, input_len, whole_fits)
    memory = MemoryBuffers.nbytes(cfg, batch, dtype)
    scratch = segment_scratch_bytes(cfg, dtype, batch, T)
    head = (prompt_call_bytes(cfg, dtype, batch, T) - scratch if max_new_tokens is not None
            else scope_bytes(head_temporaries(cfg, batch * T, dtype)))   # forward's, >= score's
    width = max(cfg.d_model, 2 * cfg.n_head * cfg.d_head)
    reorder = bytes_needed({"rows": ((batch,), np.int64), "tmp": (
        (batch * max(cfg.mem_len, 1) * width,), dtype)})
    return {"memory": memory, "segment_scratch": scratch, "head_temporaries": head,
            "reorder_scratch": reorder, "peak": memory + max(scratch + head, reorder)}
