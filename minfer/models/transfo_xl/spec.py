"""Transformer-XL's declaration: its config, its weight table, and the arena buffers of a run.

Dai et al. 2019, "Transformer-XL: Attentive Language Models Beyond a Fixed-Length Context"; the
checkpoint layout is Hugging Face's TransfoXL (transfo-xl-wt103). The weight table resolves the
tied tensors (a safetensors save omits them; an old .bin save keeps copies, which are ignored in
favour of their source, as HF re-ties on load), concatenates the head's cluster logits onto the
first cluster, and projects each layer's sinusoid table once at load.

Shapes: B batch, T segment length, M memory length, K = M + T keys, H heads, D head dim,
C d_model, F d_inner, V vocab, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...arena import BufferSet, BufferSpec, bytes_needed, scope_bytes
from ...errors import ConfigError
from ...generation.protocol import TokenIds
from ...params.spec import Derived, Linear, Tensor, View, WeightTable
from ..config import MAX_COUNT, MAX_LENGTH, MAX_VOCAB, MAX_WIDTH, ConfigReader, shown
from ..family import Family


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

    @property
    def n_clusters(self) -> int:
        return len(self.cutoffs) + 1

    def emb_dim(self, i: int) -> int:
        return self.d_embed // (self.div_val ** i) if self.div_val > 1 else self.d_embed

    def describe(self) -> list[tuple[str, str]]:
        """Architecture facts for `minfer info`."""
        return [
            ("family", f"transfo-xl ({'pre' if self.pre_lnorm else 'post'}-norm, "
                       f"{'untied' if self.untie_r else 'shared'} u/v biases)"),
            ("layers", f"{self.n_layer}"),
            ("width", f"d_model {self.d_model}, {self.n_head} heads x d_head {self.d_head}, "
                      f"d_inner {self.d_inner}, d_embed {self.d_embed}"),
            ("vocab", f"{self.vocab_size}, clusters at {list(self.cutoffs) or 'none'}, "
                      f"div_val {self.div_val}"),
            ("memory", f"mem_len {self.mem_len}, segment {self.tgt_len}, clamp_len "
                       f"{self.clamp_len}, same_length {self.same_length}"),
        ]

    def summary(self) -> str:
        return (f"layers={self.n_layer}, d_model={self.d_model}, vocab={self.vocab_size}, "
                f"mem_len={self.mem_len}")

    def token_ids(self) -> TokenIds:
        # <eos> ends a WT103 line, not a document: generation continues past it (it prints as a
        # newline); use stop=["\n"] to end at a line break.
        return TokenIds(eos=(), pad=self.eos_token_id)

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "XLConfig":
        # Every key goes through the typed reader (models/config.py): wrong types, absurd sizes
        # and out-of-range ids are one-line ConfigErrors naming the file and the key.
        read = ConfigReader(cfg, source)
        model_type = read.get_str("model_type", "transfo-xl")
        if model_type != "transfo-xl":
            raise ConfigError(f"{source}: model_type {shown(model_type)} is not transfo-xl")
        attn_type = read.get_int("attn_type", 0, minimum=0, maximum=3)
        if attn_type != 0:
            raise ConfigError(f"{source}: attn_type {attn_type!r} is not supported "
                              "(only 0, relative attention, as in every released checkpoint)")
        vocab = read.get_int("vocab_size", 267735, maximum=MAX_VOCAB)
        cutoffs = read.get_int_list("cutoffs", [20000, 40000, 200000])
        if cutoffs != sorted(set(cutoffs)) or any(not 0 < c < vocab for c in cutoffs):
            raise ConfigError(f"{source}: 'cutoffs' must be increasing ids inside the vocabulary "
                              f"(vocab_size {vocab}), got {shown(cutoffs)}")
        n_clusters = len(cutoffs) + 1
        share = read.get_bool("proj_share_all_but_first", True)
        tie_projs = read.get_bool_list("tie_projs", [False] + [share] * len(cutoffs), n_clusters)
        # HF allows a list; <eos> is its first entry (it only pads and prints as a newline here)
        eos = read.get_ids("eos_token_id", 0, vocab)[0]
        d_model = read.get_int("d_model", 1024, maximum=MAX_WIDTH)
        if d_model % 2:
            raise ConfigError(f"{source}: 'd_model' must be even (sinusoid halves), got {d_model}")
        # d_embed // div_val**i may reach 0 for the last clusters: HF builds zero-width tables
        # (their tokens embed to zero, their logits are the biases); the math here does the same.
        div_val = read.get_int("div_val", 4, maximum=MAX_WIDTH)
        d_embed = read.get_int("d_embed", d_model, maximum=MAX_WIDTH)
        return cls(
            vocab_size=vocab, cutoffs=tuple(cutoffs), d_model=d_model, d_embed=d_embed,
            n_head=read.get_int("n_head", 16, maximum=MAX_COUNT),
            d_head=read.get_int("d_head", 64, maximum=MAX_WIDTH),
            d_inner=read.get_int("d_inner", 4096, maximum=MAX_WIDTH), div_val=div_val,
            n_layer=read.get_int("n_layer", 18, maximum=MAX_COUNT),
            mem_len=read.get_int("mem_len", 1600, minimum=0),
            # <= 0: positions are not clamped
            clamp_len=read.get_int("clamp_len", 1000, minimum=-MAX_LENGTH),
            same_length=read.get_bool("same_length", True),
            pre_lnorm=read.get_bool("pre_lnorm", False), untie_r=read.get_bool("untie_r", True),
            tie_word_embeddings=read.get_bool("tie_word_embeddings", True),
            tie_projs=tuple(tie_projs), eps=read.get_eps("layer_norm_epsilon", 1e-5),
            tgt_len=read.get_int("tgt_len", 128), eos_token_id=eos,
        )



# =====================================================================================================
# Weights
# =====================================================================================================
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


# =====================================================================================================
# Arena buffers of a run
# =====================================================================================================
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
              max_new_tokens: int | None = None, whole_fits: bool = False) -> dict[str, int]:
    """Arena bytes of a run: the segment memory plus the largest of one segment's scratch with
    its head's temporaries (the segments a prompt of `input_len` tokens runs in, default
    tgt_len: one call when `whole_fits`, see `prompt_segment` and `XLModel.plan`; generation
    steps need less) and a reorder of the memory. A plan without `max_new_tokens` (forward and
    scoring, the workspace at load) counts the head of every position of the segment (forward's,
    which keeps their (rows, V) log-probs: scoring needs less); a generation plan the last
    position's log-probs."""
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


FAMILY = Family(name="transfo-xl", model_types=("transfo-xl",), config=XLConfig,
                weight_table=weight_table, run_bytes=run_bytes, is_encoder_decoder=False,
                add_eos_to_prompt=False)
