"""T5's declaration: its config, its weight table, and the arena buffers its runs keep.

Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer"; v1.1 / flan-t5 / mT5 differ only in what the config says (gated FF, untied head).
LongT5 (Guo et al. 2022) is a T5 whose encoder attends locally (`local_radius`) or locally plus
to transient global tokens (`global_block_size`): its own module names in the encoder layers, a
second bias table and a norm per layer for the global tokens, and an encoder scratch linear in
the input length (`LongEncoderScratch`; the math is long_attention.py).
The weight table maps Hugging Face's tensor names onto minfer's parameters: per layer, q|k|v
fused into one (3I, C) slot, a gated FF's wi_0|wi_1 into one (2F, C) slot, the RMS norms' weights
beside them (applied inside the fused norm, so every slot holds exactly the checkpoint's values),
and each decoder layer's cross-attention k|v as a unit of its own ("cross"): it runs once per
input, not at every step, so it is planned and streamed apart.

UMT5 (Chung et al. 2023, "UniMax") is T5 v1.1 with a relative-attention bias table in every
self-attention layer instead of only block 0's (`bias_per_layer`). An encoder-only model
(`encoder_only`: a T5EncoderModel / MT5EncoderModel / UMT5EncoderModel save, or a full checkpoint
loaded with parts="encoder") declares only the shared embedding and the encoder: the decoder's
tensors, when the file has them, are optional names that are checked but never read or placed,
and its runs plan no decoder state.

Shapes: B batch, T query length, S source length, N decoder positions, H heads, D head dim
(d_kv), I = H*D, C d_model, F d_ff, V vocab, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable

import numpy as np

from ... import ops
from ...arena import BufferSet, BufferSpec, bytes_needed
from ...errors import ConfigError
from ...generation.protocol import TokenIds
from ...io.limits import shown
from ...params.spec import Linear, Tensor, View, WeightTable
from ..config import MAX_COUNT, MAX_VOCAB, MAX_WIDTH, ConfigReader, model_type_of
from ..family import Family

# What a memory limit reserves workspace for unless `workspace=` says otherwise: one prompt of up
# to this many tokens generating up to this many.
DEFAULT_INPUT_LEN, DEFAULT_NEW_TOKENS = 256, 128
MODEL_TYPES = ("t5", "mt5", "umt5", "longt5")
PARTS = ("all", "encoder")   # what `minfer.load(parts=...)` may ask of a T5

# LongT5's encoder takes its queries in chunks of whole blocks of about this many positions (a
# chunk's scores and global bias are rows x (3bl + G): bounded rows keep them linear in T), and
# sums the global tokens' members this many global blocks at a time (one small product each).
QUERY_ROWS = 512
AGGREGATE_BLOCKS = 32

# config.json's encoder_attention_type -> the module name of the encoder's self-attention
ENCODER_ATTENTION = {"full": "SelfAttention", "local": "LocalSelfAttention",
                     "transient-global": "TransientGlobalSelfAttention"}


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
    bias_per_layer: bool = False  # UMT5: every self-attention layer has its own bias table
    encoder_only: bool = False    # only the embedding and the encoder are loaded (and run)
    encoder_attention: str = "full"   # "full" (T5); LongT5: "local" or "transient-global"
    local_radius: int = 0             # LongT5: a query attends to keys at most this far away
    global_block_size: int = 0        # LongT5 transient-global: tokens per global token

    @property
    def inner(self) -> int:
        """Attention inner width H*D (need not equal d_model)."""
        return self.num_heads * self.d_kv

    @property
    def ff_width(self) -> int:
        """Width of the FF input projection: F, or 2F for a gated FF (wi_0 | wi_1 fused)."""
        return self.d_ff * (2 if self.gated else 1)

    @property
    def parts(self) -> tuple[str, ...]:
        """The parts this model runs: "encoder" alone, or also "decoder" and "head"."""
        return ("encoder",) if self.encoder_only else ("encoder", "decoder", "head")

    def bias_tables(self, stack: str) -> int:
        """How many relative-attention bias tables `stack` holds: one per layer (UMT5), else the
        one of block 0, shared by every layer."""
        return (self.num_layers if stack == "encoder" else self.num_decoder_layers) \
            if self.bias_per_layer else 1

    def describe(self) -> list[tuple[str, str]]:
        """Architecture facts for `minfer info`."""
        head = "no head" if self.encoder_only else \
            f"{'tied' if self.tie_word_embeddings else 'untied'} head"
        layers = (f"{self.num_layers} encoder" if self.encoder_only
                  else f"{self.num_layers} encoder / {self.num_decoder_layers} decoder")
        facts = [
            ("family", f"{self.model_type} ({'gated-' if self.gated else ''}{self.act} FF, {head})"),
            ("layers", layers),
            ("width", f"d_model {self.d_model}, {self.num_heads} heads x d_kv {self.d_kv}, "
                      f"d_ff {self.d_ff}"),
            ("vocab", f"{self.vocab_size}"),
            ("position buckets", f"{self.num_buckets}, max distance {self.max_distance}"
                                 + (", a bias table per layer" if self.bias_per_layer else "")),
        ]
        if self.encoder_attention != "full":
            attention = (f"{self.encoder_attention}, radius {self.local_radius} "
                         f"(blocks of {self.local_radius + 1})")
            if self.encoder_attention == "transient-global":
                attention += f", one global token per {self.global_block_size} tokens"
            facts.append(("encoder attention", attention + "; memory linear in the input"))
        return facts

    def summary(self) -> str:
        layers = (f"{self.num_layers} (encoder only)" if self.encoder_only
                  else f"{self.num_layers}/{self.num_decoder_layers}")
        return f"layers={layers}, d_model={self.d_model}, vocab={self.vocab_size}"

    def token_ids(self) -> TokenIds:
        return TokenIds(eos=self.eos_token_ids, pad=self.pad_token_id,
                        start=self.decoder_start_token_id)

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "T5Config":
        # Every key goes through the typed reader (models/config.py): wrong types, absurd sizes
        # and out-of-range ids are one-line ConfigErrors naming the file and the key.
        read = ConfigReader(cfg, source)
        model_type = read.get_str("model_type", model_type_of(cfg))
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"{source}: model_type {shown(model_type)} is not a T5 model "
                              f"({', '.join(MODEL_TYPES)})")
        proj = read.get_str("feed_forward_proj", "relu")
        parts = proj.split("-")
        if not (len(parts) == 1 or (len(parts) == 2 and parts[0] == "gated")) or not parts[-1]:
            raise ConfigError(f"{source}: 'feed_forward_proj' {shown(proj)} is not 'ACT' or "
                              "'gated-ACT'")
        # HF lets explicit config keys override what feed_forward_proj implies.
        act = read.get_str("dense_act_fn", "gelu_new" if proj == "gated-gelu" else parts[-1])
        gated = read.get_bool("is_gated_act", parts[0] == "gated")
        try:
            ops.activation(act)
        except ConfigError as e:  # say which key of which file named it
            key = "dense_act_fn" if "dense_act_fn" in cfg else "feed_forward_proj"
            said = "" if key == "dense_act_fn" else f" {shown(proj)}"
            raise ConfigError(f"{source}: '{key}'{said}: {e}") from None

        vocab = read.get_int("vocab_size", 32128, maximum=MAX_VOCAB)
        pad = read.get_id("pad_token_id", 0, vocab)
        eos_ids = read.get_ids("eos_token_id", 1, vocab)
        start = read.get_id("decoder_start_token_id", pad, vocab, nullable=True)  # null: pad
        start = pad if start is None else start
        num_layers = read.get_int("num_layers", 6, maximum=MAX_COUNT)
        num_buckets = read.get_int("relative_attention_num_buckets", 32, minimum=2,
                                   maximum=MAX_COUNT)
        max_distance = read.get_int("relative_attention_max_distance", 128, minimum=2)
        if max_distance <= num_buckets // 2:
            # the decoder's log(max_distance / max_exact) would be <= 0: the buckets break down
            raise ConfigError(f"{source}: relative_attention_max_distance {max_distance} must exceed "
                              f"num_buckets/2 = {num_buckets // 2}")
        long = {}
        if model_type == "longt5":  # transformers' LongT5Config defaults
            long = dict(
                encoder_attention=read.get_str("encoder_attention_type", "local",
                                               choices=("local", "transient-global")),
                local_radius=read.get_int("local_radius", 127),
                global_block_size=read.get_int("global_block_size", 16))
        return cls(
            vocab_size=vocab, d_model=read.get_int("d_model", 512, maximum=MAX_WIDTH),
            d_kv=read.get_int("d_kv", 64, maximum=MAX_WIDTH),
            d_ff=read.get_int("d_ff", 2048, maximum=MAX_WIDTH),
            num_heads=read.get_int("num_heads", 8, maximum=MAX_COUNT), num_layers=num_layers,
            num_decoder_layers=read.get_int("num_decoder_layers", num_layers, maximum=MAX_COUNT,
                                            nullable=True),  # null: as many as the encoder
            num_buckets=num_buckets, max_distance=max_distance,
            eps=read.get_eps("layer_norm_epsilon", 1e-6), act=act, gated=gated,
            tie_word_embeddings=read.get_bool("tie_word_embeddings", True),
            pad_token_id=pad, eos_token_ids=eos_ids, decoder_start_token_id=start,
            model_type=model_type, bias_per_layer=model_type == "umt5", **long,
        )

    def with_parts(self, names: Iterable[str], parts: str | None, folder: str) -> "T5Config":
        """This config restricted to the parts asked for (None: what the checkpoint holds, whose
        tensor names are `names`: a save without decoder tensors is an encoder-only model)."""
        holds_decoder = any(n.startswith("decoder.") or n == "lm_head.weight" for n in names)
        if parts is None:
            parts = "all" if holds_decoder else "encoder"
        if parts not in PARTS:
            raise ConfigError(f"parts={shown(parts)}: a T5 model loads as "
                              f"{' or '.join(map(repr, PARTS))}")
        if parts == "all" and not holds_decoder:
            raise ConfigError(f"{folder}: holds only an encoder (no decoder.* tensors, as a "
                              "T5EncoderModel saves it): it loads with parts='encoder' (or none)")
        return replace(self, encoder_only=parts == "encoder")


# =====================================================================================================
# Weights
# =====================================================================================================
def _ff_sources(prefix: str, gated: bool) -> tuple[list[str], str]:
    """(the FF input projections, the output projection) of an HF FF sublayer."""
    wi = ["wi_0", "wi_1"] if gated else ["wi"]
    return [f"{prefix}.DenseReluDense.{w}.weight" for w in wi], f"{prefix}.DenseReluDense.wo.weight"


def _self_attention(cfg: T5Config, stack: str) -> str:
    """The module name of a stack's self-attention (LongT5's encoder names its own)."""
    return ENCODER_ATTENTION[cfg.encoder_attention] if stack == "encoder" else "SelfAttention"


def _layer(cfg: T5Config, stack: str, i: int) -> dict[str, dict]:
    """Layer i of 'encoder' or 'decoder': HF tensor shapes, and minfer's units built from them
    ({'block': ..., 'cross': ...} for the decoder)."""
    C, I, F = cfg.d_model, cfg.inner, cfg.d_ff
    p = f"{stack}.block.{i}.layer"
    attn, ln0 = f"{p}.0.{_self_attention(cfg, stack)}", f"{p}.0.layer_norm.weight"
    ff = f"{p}.{2 if stack == 'decoder' else 1}"
    wi, wo = _ff_sources(ff, cfg.gated)
    tensors = {**{f"{attn}.{w}.weight": (I, C) for w in "qkv"}, f"{attn}.o.weight": (C, I),
               ln0: (C,), **{w: (F, C) for w in wi}, wo: (C, F), f"{ff}.layer_norm.weight": (C,)}
    block = {"ln_self": Tensor(ln0), "w_qkv": Linear(tuple(f"{attn}.{w}.weight" for w in "qkv")),
             "w_o": Linear((f"{attn}.o.weight",))}
    if stack == "encoder" and cfg.encoder_attention == "transient-global":
        # each layer's own norm of its global tokens (their k/v are the layer's k and v)
        tensors[f"{attn}.global_input_layer_norm.weight"] = (C,)
        block["ln_global"] = Tensor(f"{attn}.global_input_layer_norm.weight")
    units = {"block": block}
    if stack == "decoder":
        cross, ln1 = f"{p}.1.EncDecAttention", f"{p}.1.layer_norm.weight"
        tensors.update({**{f"{cross}.{w}.weight": (I, C) for w in "qkv"},
                        f"{cross}.o.weight": (C, I), ln1: (C,)})
        block.update(ln_cross=Tensor(ln1), w_cross_q=Linear((f"{cross}.q.weight",)),
                     w_cross_o=Linear((f"{cross}.o.weight",)))
        units["cross"] = {"w_cross_kv": Linear((f"{cross}.k.weight", f"{cross}.v.weight"))}
    block.update(ln_ff=Tensor(f"{ff}.layer_norm.weight"), w_in=Linear(tuple(wi)),
                 w_out=Linear((wo,), float32=True))
    return {"tensors": tensors, **units}


def _bias_name(cfg: T5Config, stack: str, i: int, kind: str = "relative_attention_bias") -> str:
    """A position bias table of block i's self-attention (LongT5's encoder names its own)."""
    return f"{stack}.block.{i}.layer.0.{_self_attention(cfg, stack)}.{kind}.weight"


def weight_table(cfg: T5Config) -> WeightTable:
    """Every tensor a T5 checkpoint holds and every parameter minfer builds from it."""
    C, V, HB = cfg.d_model, cfg.vocab_size, (cfg.num_buckets, cfg.num_heads)
    tensors: dict[str, tuple[int, ...]] = {"shared.weight": (V, C)}
    stacks: dict[str, list] = {"encoder": [], "cross": [], "decoder": []}
    fixed: dict[str, Any] = {}
    for stack, depth in (("encoder", cfg.num_layers), ("decoder", cfg.num_decoder_layers)):
        for i in range(depth):
            layer = _layer(cfg, stack, i)
            tensors.update(layer["tensors"])
            stacks[stack].append(layer["block"])
            if "cross" in layer:
                stacks["cross"].append(layer["cross"])
        for i in range(cfg.bias_tables(stack)):   # block 0's, or every block's (UMT5)
            tensors[_bias_name(cfg, stack, i)] = HB
            fixed[f"{stack}.rel_bias.{i}"] = Tensor(_bias_name(cfg, stack, i), host=True)
        tensors[f"{stack}.final_layer_norm.weight"] = (C,)
        fixed[f"{stack}.final_ln"] = Tensor(f"{stack}.final_layer_norm.weight")
    optional = {
        "encoder.embed_tokens.weight": (V, C),   # aliases of the shared embedding
        "decoder.embed_tokens.weight": (V, C),
        # old checkpoints: a cross-attention position bias HF never applies
        "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight": HB,
    }
    if cfg.tie_word_embeddings and not cfg.encoder_only:
        optional["lm_head.weight"] = (V, C)     # a saved copy of the tied head
        # one (V, C) slot serves both uses: the head's output channels are the embedding's rows
        head = {"lm_head": Linear(("shared.weight",)), "embedding": View("lm_head")}
    elif cfg.encoder_only:
        head = {"embedding": Linear(("shared.weight",))}
        # a full checkpoint loaded for encoding: its decoder and head are checked, never read
        tensors["lm_head.weight"] = (V, C)
        optional.update({n: s for n, s in tensors.items()
                         if n.startswith("decoder.") or n == "lm_head.weight"})
        tensors = {n: s for n, s in tensors.items() if n not in optional}
        stacks = {"encoder": stacks["encoder"]}
        fixed = {n: e for n, e in fixed.items() if not n.startswith("decoder.")}
    else:
        tensors["lm_head.weight"] = (V, C)
        head = {"embedding": Linear(("shared.weight",)), "lm_head": Linear(("lm_head.weight",))}
    if cfg.encoder_attention == "transient-global":
        # the bias of a global token by its distance in global blocks, layer 0's, shared
        source = _bias_name(cfg, "encoder", 0, "global_relative_attention_bias")
        tensors[source] = HB
        fixed["encoder.global_rel_bias"] = Tensor(source, host=True)
    return WeightTable(
        tensors=tensors, fixed={**head, **fixed}, stacks=stacks, optional=optional,
        aliases={"shared.weight": ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")},
        # decoder layers run at every generated token, encoder and cross layers once per input
        priority={"decoder": 1})


# =====================================================================================================
# Arena buffers of a run
# =====================================================================================================
@dataclass
class PassScratch(BufferSet):
    """What one pass of T positions over B rows reuses in every layer (allocated once a pass).
    float16 compute adds the float32 stream and FF output (see math.py)."""
    x: Any        # (B, T, C) the residual stream (float32 when computing in float16)
    h: Any        # (B, T, C) its normalised copy
    proj: Any     # (B, T, C) a sublayer's output
    qkv: Any      # (B, T, 3I)
    ctx: Any      # (B, T, I) attention context
    ff: Any       # (B, T, F | 2F)
    scores: Any   # (B * H * T * K,) flat: viewed per attention as (B, H, T, keys), keys <= K
    ids: Any = None    # (B * T,) int64: the token ids, uploaded
    top: Any = None    # (B * H * T,) softmax row maxima
    total: Any = None  # (B * H * T,) float32: softmax row sums; the norms' inverse rms (B * T)
    q: Any = None      # (B, T, I) queries (decoder passes only: cross-attention; a step's copy)
    act: Any = None    # (B, T, F * k) float32: activation scratch; float16: W_out's input
    ffo: Any = None    # (B, T, C) float32: the FF output (float16 compute)
    lim: Any = None    # (2,) the float16 guard's scratch (float16 compute)

    ROWS = ("x", "h", "proj", "qkv", "ctx", "ff", "q", "act", "ffo")  # per-row (batch first)

    @classmethod
    def specs(cls, cfg: T5Config, B: int, T: int, K: int, dtype: Any,
              cross: bool = False) -> BufferSpec:
        C, I, H = cfg.d_model, cfg.inner, cfg.num_heads
        half = np.dtype(dtype).itemsize < 4
        f32 = np.dtype(np.float32)
        act = cfg.d_ff * max(ops.ACTIVATION_WORK[cfg.act], 1 if half else 0)
        return {"x": ((B, T, C), f32 if half else dtype), "h": ((B, T, C), dtype),
                "proj": ((B, T, C), dtype), "qkv": ((B, T, 3 * I), dtype),
                "ctx": ((B, T, I), dtype), "ff": ((B, T, cfg.ff_width), dtype),
                "scores": ((B * H * T * K,), dtype), "ids": ((B * T,), np.int64),
                "top": ((B * H * T,), dtype), "total": ((B * H * T,), f32),
                **({"q": ((B, T, I), dtype)} if cross else {}),
                **({"act": ((B, T, act), f32)} if act else {}),
                **({"ffo": ((B, T, C), f32), "lim": ((2,), dtype)} if half else {})}

    def scores_as(self, *shape: int) -> Any:
        """The scores scratch viewed as `shape` (contiguous, so products can write into it)."""
        n = 1
        for s in shape:
            n *= s
        return self.scores[:n].reshape(shape)

    def stats_as(self, B: int, H: int, T: int) -> tuple[Any, Any]:
        """The softmax's row scratch for (B, H, T) rows: (maxima, float32 sums), each (.., 1)."""
        n = B * H * T
        return self.top[:n].reshape(B, H, T, 1), self.total[:n].reshape(B, H, T, 1)

    def norm_scratch(self) -> tuple[Any, Any]:
        """(float32 (B, T, C) work, float32 (B, T, 1) inverse rms) for a norm of the stream: the
        FF output (float16 compute) or the sublayer output (float32), both added to the stream
        before the norm reads it."""
        B, T, C = self.x.shape
        return (self.ffo if self.ffo is not None else self.proj), self.total[:B * T].reshape(B, T, 1)


@dataclass
class EncoderScratch(PassScratch):
    bias: Any = None     # (B, H, T, T) position bias + padding mask, shared by all layers
    mask: Any = None     # (B, 1, 1, T) the padding mask, uploaded

    @classmethod
    def specs(cls, cfg: T5Config, B: int, T: int, dtype: Any) -> BufferSpec:
        return {**PassScratch.specs(cfg, B, T, T, dtype),
                "bias": ((B, cfg.num_heads, T, T), dtype), "mask": ((B, 1, 1, T), dtype)}


@dataclass(frozen=True)
class LongShape:
    """How LongT5's encoder cuts a pass of T positions (long_attention.py)."""
    block: int         # bl: positions per local block, local_radius + 1 (at most T: the same keys)
    blocks: int        # nb = ceil(T / bl)
    chunk: int         # blocks per chunk of queries
    globals: int       # G = T // global_block_size global tokens (0: local attention)
    group: int         # global blocks whose members one product sums (AGGREGATE_BLOCKS or fewer)
    groups: int        # ceil(T / (group * global_block_size)) such products

    @property
    def keys(self) -> int:
        """Keys of one query: three blocks, then the global tokens."""
        return 3 * self.block + self.globals

    @classmethod
    def of(cls, cfg: T5Config, T: int) -> "LongShape":
        block = min(cfg.local_radius + 1, T)
        blocks = -(-T // block)
        G, group, groups = 0, 0, 0
        if cfg.encoder_attention == "transient-global":
            G = T // cfg.global_block_size
            group = min(AGGREGATE_BLOCKS, -(-T // cfg.global_block_size))
            groups = -(-T // (group * cfg.global_block_size))
        return cls(block, blocks, max(1, min(blocks, QUERY_ROWS // block)), G, group, groups)


@dataclass
class LongEncoderScratch(PassScratch):
    """LongT5's encoder pass (long_attention.py): PassScratch's per-position buffers, queries,
    keys and values in whole blocks, and per chunk of queries their scores against their three
    blocks and the global tokens. Every size is linear in T: B*T*(3bl + G) scores never exist
    at once (G itself is T / global_block_size)."""
    q_blocks: Any = None     # (B, H, nb*bl, D) queries; a chunk's context is written over them
    k_blocks: Any = None     # (B, H, (nb+2)*bl, D) keys, a zero block each side (edge windows)
    v_blocks: Any = None
    key_mask: Any = None     # (B, (nb+2)*bl) additive: 0 for a real key, the mask value else
    local_bias: Any = None   # (H, bl, 3bl) position bias of each window slot + locality mask
    global_ctx: Any = None   # flat: a chunk's context from the global tokens (B, H, rows, D)
    membership: Any = None   # (groups, B, group+2, group*gbs) 1 where a token joins a global
    global_part: Any = None  # (B, group+2, C) one product's sums
    global_h: Any = None     # (B, G, C) the global tokens (sums, then normed)
    global_qkv: Any = None   # (B, G, 3I) their projection (k and v used)
    global_mask: Any = None  # (B, G) additive: a global token past a row's last block is masked
    global_table: Any = None  # (H, 2G) global bias by distance g - block of the query
    global_offset: Any = None  # (B, nb*bl) int: where each query's row starts in global_table
    global_range: Any = None  # (G,) int: 0..G-1
    global_index: Any = None  # flat: a chunk's (B, rows, G) indices into global_table
    global_bias: Any = None   # flat: a chunk's (H, B, rows, G) global bias

    @classmethod
    def specs(cls, cfg: T5Config, B: int, T: int, dtype: Any) -> BufferSpec:
        shape = LongShape.of(cfg, T)
        H, D, C, bl, G = cfg.num_heads, cfg.d_kv, cfg.d_model, shape.block, shape.globals
        rows, span = shape.chunk * bl, (shape.blocks + 2) * bl
        specs = {**PassScratch.specs(cfg, B, T, 0, dtype),
                 "scores": ((B * H * rows * shape.keys,), dtype),
                 "q_blocks": ((B, H, shape.blocks * bl, D), dtype),
                 "k_blocks": ((B, H, span, D), dtype), "v_blocks": ((B, H, span, D), dtype),
                 "key_mask": ((B, span), dtype), "local_bias": ((H, bl, 3 * bl), dtype)}
        if G:
            group, width = shape.group, shape.group * cfg.global_block_size
            specs.update({
                "global_ctx": ((B * H * rows * D,), dtype),
                "membership": ((shape.groups, B, group + 2, width), dtype),
                "global_part": ((B, group + 2, C), dtype), "global_h": ((B, G, C), dtype),
                "global_qkv": ((B, G, 3 * cfg.inner), dtype), "global_mask": ((B, G), dtype),
                "global_table": ((H, 2 * G), dtype),
                "global_offset": ((B, shape.blocks * bl), np.int64),
                "global_range": ((G,), np.int64), "global_index": ((B * rows * G,), np.int64),
                "global_bias": ((H * B * rows * G,), dtype)})
        return specs


def encoder_scratch(cfg: T5Config) -> type[PassScratch]:
    """The encoder pass's buffers: T5's (a (B, H, T, T) bias) or LongT5's (linear in T)."""
    return EncoderScratch if cfg.encoder_attention == "full" else LongEncoderScratch


@dataclass
class DecoderScratch(PassScratch):
    """A teacher-forced pass of T decoder positions over S source positions."""
    self_bias: Any = None  # (1, H, T, T) position bias + causal mask
    cross_k: Any = None    # (L, B, H, S, D)
    cross_v: Any = None
    cross_bias: Any = None  # (B, 1, 1, S) the source padding mask
    logits: Any = None     # (B, T, V)

    @classmethod
    def specs(cls, cfg: T5Config, B: int, T: int, S: int, dtype: Any) -> BufferSpec:
        H, D, L = cfg.num_heads, cfg.d_kv, cfg.num_decoder_layers
        return {**PassScratch.specs(cfg, B, T, max(T, S), dtype, cross=True),
                "self_bias": ((1, H, T, T), dtype),
                "cross_k": ((L, B, H, S, D), dtype), "cross_v": ((L, B, H, S, D), dtype),
                "cross_bias": ((B, 1, 1, S), dtype), "logits": ((B, T, cfg.vocab_size), dtype)}


@dataclass
class StepScratch(PassScratch):
    """A step taken together for R rows of several decode states (continuous batching): the
    products' rows stacked, attention over at most K keys, and the R rows' logits."""
    logits: Any = None     # (R, 1, V)

    @classmethod
    def specs(cls, cfg: T5Config, R: int, K: int, dtype: Any) -> BufferSpec:
        return {**PassScratch.specs(cfg, R, 1, K, dtype, cross=True),
                "logits": ((R, 1, cfg.vocab_size), dtype)}


@dataclass
class DecodeBuffers(PassScratch):
    """One request's incremental decoding state, kept for its whole length: the KV caches of N
    positions, the cross-attention K/V, the bias tables, and the one-position step scratch."""
    self_k: Any = None      # (L, B, H, N, D)
    self_v: Any = None
    cross_k: Any = None     # (L, B, H, S, D)
    cross_v: Any = None
    cross_bias: Any = None  # (B, 1, 1, S) the source padding mask
    self_bias: Any = None   # (Lb, H, N) the causal bias by reversed distance (see math.py), one
                            # table per bias table of the decoder (Lb: 1, or L for UMT5)
    logits: Any = None      # (B, 1, V)

    @classmethod
    def specs(cls, cfg: T5Config, B: int, S: int, N: int, dtype: Any) -> BufferSpec:
        H, D, L = cfg.num_heads, cfg.d_kv, cfg.num_decoder_layers
        return {"self_k": ((L, B, H, N, D), dtype), "self_v": ((L, B, H, N, D), dtype),
                "cross_k": ((L, B, H, S, D), dtype), "cross_v": ((L, B, H, S, D), dtype),
                "cross_bias": ((B, 1, 1, S), dtype),
                "self_bias": ((cfg.bias_tables("decoder"), H, N), dtype),
                **PassScratch.specs(cfg, B, 1, max(N, S), dtype, cross=True),
                "logits": ((B, 1, cfg.vocab_size), dtype)}

    def rows(self, b: int) -> "DecodeBuffers":
        """Views of the first b rows (the live batch after rows finished), built once per size."""
        live = {f: getattr(self, f)[:b] for f in (*self.ROWS, "logits", "cross_bias", "ids")
                if getattr(self, f) is not None}
        live.update({f: getattr(self, f)[:, :b] for f in ("self_k", "self_v", "cross_k", "cross_v")})
        return DecodeBuffers(**{**self.__dict__, **live})


def reorder_elements(self_shape: tuple[int, ...], cross_shape: tuple[int, ...], rows: int) -> int:
    """Elements of the scratch a reorder of `rows` rows moves one layer's cache through."""
    _, _, H, N, D = self_shape
    return rows * H * max(N, cross_shape[3]) * D


def run_bytes(cfg: T5Config, dtype: Any, batch: int, input_len: int | None,
              max_new_tokens: int | None) -> dict[str, int]:
    """Arena bytes of one generation: its decode state plus the largest of the encoder pass, the
    cross K/V projection and a beam reorder (the device's library temporaries fit its arena's
    own pool, arena.SCOPE_TEMPORARIES; the model code itself allocates nothing on the device);
    of an encoder-only model, one encoder pass and its output."""
    S = input_len or DEFAULT_INPUT_LEN
    out = bytes_needed({"out": ((batch, S, cfg.d_model), dtype)})
    encoder = out + encoder_scratch(cfg).nbytes(cfg, batch, S, dtype)
    if cfg.encoder_only:
        return {"encoder_scratch": encoder, "peak": encoder}
    N = max_new_tokens or DEFAULT_NEW_TOKENS
    state = DecodeBuffers.nbytes(cfg, batch, S, N, dtype)
    cross = out + bytes_needed({"raw": ((batch, S, 2 * cfg.inner), dtype)})
    H, D, L = cfg.num_heads, cfg.d_kv, cfg.num_decoder_layers
    reorder = bytes_needed({"tmp": ((reorder_elements(
        (L, batch, H, N, D), (L, batch, H, S, D), batch),), dtype)})
    return {"decode_state": state, "encoder_scratch": encoder, "cross_kv_scratch": cross,
            "reorder_scratch": reorder, "peak": state + max(encoder, cross, reorder)}


FAMILY = Family(name="t5", model_types=MODEL_TYPES, config=T5Config, weight_table=weight_table,
                run_bytes=run_bytes, is_encoder_decoder=True, add_eos_to_prompt=True,
                with_parts=T5Config.with_parts)
