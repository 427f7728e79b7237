"""Transformer-XL's config: `XLConfig`, read from config.json (model_type transfo-xl).

Dai et al. 2019, "Transformer-XL: Attentive Language Models Beyond a Fixed-Length Context"; the
checkpoint layout is Hugging Face's TransfoXL (transfo-xl-wt103).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ...generation.protocol import TokenIds
from ..config import MAX_COUNT, MAX_LENGTH, MAX_VOCAB, MAX_WIDTH, ConfigReader, short_repr


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
            raise ConfigError(f"{source}: model_type {short_repr(model_type)} is not transfo-xl")
        attn_type = read.get_int("attn_type", 0, minimum=0, maximum=3)
        if attn_type != 0:
            raise ConfigError(f"{source}: attn_type {attn_type!r} is not supported "
                              "(only 0, relative attention, as in every released checkpoint)")
        vocab = read.get_int("vocab_size", 267735, maximum=MAX_VOCAB)
        cutoffs = read.get_int_list("cutoffs", [20000, 40000, 200000])
        if cutoffs != sorted(set(cutoffs)) or any(not 0 < c < vocab for c in cutoffs):
            raise ConfigError(f"{source}: 'cutoffs' must be increasing ids inside the vocabulary "
                              f"(vocab_size {vocab}), got {short_repr(cutoffs)}")
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
