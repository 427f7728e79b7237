"""T5's weight table: every tensor a checkpoint holds and the parameters minfer builds from them.

The table maps Hugging Face's tensor names onto minfer's parameters: per layer, q|k|v
fused into one (3I, C) slot, a gated FF's wi_0|wi_1 into one (2F, C) slot, the RMS norms' weights
beside them (applied inside the fused norm, so every slot holds exactly the checkpoint's values),
and each decoder layer's cross-attention k|v as a unit of its own ("cross"): it runs once per
input, not at every step, so it is planned and streamed apart. LongT5's encoder layers have their
own module names, a second bias table and a norm per layer for the global tokens. Of an
encoder-only model the decoder's tensors, when the file has them, are optional names that are
checked but never read or placed.

Shapes: I = H*D attention width, C d_model, F d_ff, V vocab.
"""

from __future__ import annotations

from typing import Any

from ...params.table import Linear, Tensor, View, WeightTable
from .config import T5Config

# config.json's encoder_attention_type -> the module name of the encoder's self-attention
ENCODER_ATTENTION = {"full": "SelfAttention", "local": "LocalSelfAttention",
                     "transient-global": "TransientGlobalSelfAttention"}


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
