"""T5's config: `T5Config` (t5, mt5, umt5, longt5), read from config.json, and the parts a
checkpoint loads as (`with_parts`).

Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer"; v1.1 / flan-t5 / mT5 differ only in what the config says (gated FF, untied head).
LongT5 (Guo et al. 2022) is a T5 whose encoder attends locally (`local_radius`) or locally plus
to transient global tokens (`global_block_size`).

UMT5 (Chung et al. 2023, "UniMax") is T5 v1.1 with a relative-attention bias table in every
self-attention layer instead of only block 0's (`bias_per_layer`). An encoder-only model
(`encoder_only`: a T5EncoderModel / MT5EncoderModel / UMT5EncoderModel save, or a full checkpoint
loaded with parts="encoder") declares only the shared embedding and the encoder.

A single .safetensors file of an encoder (ComfyUI's t5xxl_*.safetensors, umt5_xxl_*) has no
config.json: `config_from_tensors` infers one from its tensors' names and shapes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterable, Mapping

from ... import ops
from ...errors import CheckpointError, ConfigError
from ...generation.protocol import TokenIds
from ...io.limits import shown
from ..config import MAX_COUNT, MAX_VOCAB, MAX_WIDTH, ConfigReader, model_type_of

MODEL_TYPES = ("t5", "mt5", "umt5", "longt5")
PARTS = ("all", "encoder")   # what `minfer.load(parts=...)` may ask of a T5


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
    # where the weights came from when that is more than a folder's config.json says: a single
    # file, its inferred config, what its fp8 tensors were read as (`minfer info`'s "weights")
    source_note: str = ""

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
        if self.source_note:
            facts.append(("weights", self.source_note))
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


# What a single file's tensors cannot say, as Hugging Face's T5Config / UMT5Config default them
# (and ComfyUI's T5 hard-codes the distance): every released T5, mT5 and UMT5 uses these.
INFERRED_DEFAULTS = dict(relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
                         pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
_BLOCK = re.compile(r"(encoder|decoder)\.block\.(\d+)\.")


def config_from_tensors(shapes: Mapping[str, tuple[int, ...]], source: str) -> dict:
    """The config.json of the T5 / UMT5 encoder whose tensors (Hugging Face's names) have these
    `shapes`, as far as the shapes say it: vocabulary and d_model from the embedding, layers
    from the encoder's blocks, heads and buckets from block 0's relative_attention_bias
    (buckets x heads), d_kv from q (heads x d_kv rows), d_ff from the FF input; a gated FF
    (wi_0 / wi_1) is v1.1's gated-gelu (gelu_new, untied head; mT5 and UMT5 too), an ungated
    one v1.0's relu (tied head); a bias table in every block is UMT5. The rest is
    INFERRED_DEFAULTS. A file that is no T5 encoder, or whose shapes disagree with each other,
    is a one-line CheckpointError naming `source` and the tensor; the model's weight table
    checks every other name and shape against the result."""
    def shape(name: str, rank: int) -> tuple[int, ...]:
        got = shapes[name]
        if len(got) != rank or not all(got):
            raise CheckpointError(f"{source}: tensor '{name}' has shape {list(got)}, not a T5 "
                                  f"{'matrix' if rank == 2 else 'vector'}")
        return got

    attn = "encoder.block.{}.layer.0.SelfAttention"
    embedding = next((n for n in ("shared.weight", "encoder.embed_tokens.weight") if n in shapes),
                     None)
    if embedding is None or f"{attn.format(0)}.q.weight" not in shapes:
        longt5 = any(".LocalSelfAttention." in n or ".TransientGlobalSelfAttention." in n
                     for n in shapes)
        some = ", ".join(f"'{n}'" for n in list(shapes)[:3]) or "no tensors"
        raise CheckpointError(
            f"{source}: not a T5 / UMT5 encoder in Hugging Face's names (no 'shared.weight' and "
            f"'{attn.format(0)}.q.weight'; it holds {some}, ...)"
            + ("; a LongT5 file needs config= (its config.json)" if longt5 else ""))
    vocab, d_model = shape(embedding, 2)
    blocks = {"encoder": set(), "decoder": set()}
    for name in shapes:
        m = _BLOCK.match(name)
        if m:
            blocks[m.group(1)].add(int(m.group(2)))
    for stack, numbers in blocks.items():   # (a block number is the file's: any size)
        if not numbers:
            continue
        top = max(numbers)
        if top >= MAX_COUNT:
            raise CheckpointError(f"{source}: {stack} block {top}: more than {MAX_COUNT} blocks")
        if len(numbers) != top + 1:   # the first gap, found in O(blocks)
            gap = next(i for i in range(len(numbers) + 1) if i not in numbers)
            raise CheckpointError(f"{source}: {stack} block {gap} is missing (the file holds "
                                  f"blocks up to {top})")
    layers = max(blocks["encoder"]) + 1
    bias = f"{attn.format(0)}.relative_attention_bias.weight"
    if bias not in shapes:
        raise CheckpointError(f"{source}: tensor '{bias}' is missing: a T5 encoder's block 0 "
                              "holds the position bias (buckets x heads)")
    buckets, heads = shape(bias, 2)
    inner, q_in = shape(f"{attn.format(0)}.q.weight", 2)
    if q_in != d_model or inner % heads:
        raise CheckpointError(f"{source}: tensor '{attn.format(0)}.q.weight' has shape "
                              f"{[inner, q_in]}: no T5 with d_model {d_model} (from "
                              f"'{embedding}') and {heads} heads (from '{bias}') has it "
                              f"(expected [{heads} x d_kv, {d_model}])")
    with_bias = [i for i in range(layers)
                 if f"{attn.format(i)}.relative_attention_bias.weight" in shapes]
    per_layer = layers > 1 and len(with_bias) == layers
    if len(with_bias) not in (1, layers):
        first = next(i for i in range(layers) if i not in with_bias)
        raise CheckpointError(f"{source}: tensor '{attn.format(first)}.relative_attention_bias."
                              "weight' is missing: some blocks after block 0 have a position "
                              "bias (UMT5: every block has one; T5: only block 0)")
    ff = "encoder.block.0.layer.1.DenseReluDense"
    gated = f"{ff}.wi_0.weight" in shapes
    wi = f"{ff}.wi_0.weight" if gated else f"{ff}.wi.weight"
    if wi not in shapes:
        raise CheckpointError(f"{source}: tensor '{ff}.wi_0.weight' (gated FF) or "
                              f"'{ff}.wi.weight' is missing")
    d_ff = shape(wi, 2)[0]
    decoder = max(blocks["decoder"]) + 1 if blocks["decoder"] else layers
    return dict(
        model_type="umt5" if per_layer else "t5", vocab_size=vocab, d_model=d_model,
        d_kv=inner // heads, num_heads=heads, d_ff=d_ff, num_layers=layers,
        num_decoder_layers=decoder, relative_attention_num_buckets=buckets,
        feed_forward_proj="gated-gelu" if gated else "relu",
        dense_act_fn="gelu_new" if gated else "relu", is_gated_act=gated,
        tie_word_embeddings=not gated, **INFERRED_DEFAULTS)
