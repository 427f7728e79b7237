"""T5's run buffers: the arena `BufferSet`s a run keeps (the decoder's KV caches in
`DecodeBuffers`), their sizes, and `run_bytes`, the plan of one generation.

LongT5's encoder scratch is linear in the input length (`LongEncoderScratch`, cut as `LongShape`
says; the math is long_attention.py). An encoder-only model's runs plan no decoder state.

Shapes: B batch, T query length, S source length, N decoder positions, H heads, D head dim
(d_kv), I = H*D, C d_model, F d_ff, V vocab, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import ops
from ...arena import BufferSet, BufferSpec, bytes_needed
from ...backend import encoder_attention_kind
from .config import T5Config

# What a memory limit reserves workspace for unless `workspace=` says otherwise: one prompt of up
# to this many tokens generating up to this many; an encoder-only model (the text encoder of a
# diffusion pipeline: Flux, Wan and Chroma encode 512 tokens) one input of this many.
DEFAULT_INPUT_LEN, DEFAULT_NEW_TOKENS = 256, 128
DEFAULT_ENCODER_INPUT_LEN = 512

# LongT5's encoder takes its queries in chunks of whole blocks of about this many positions (a
# chunk's scores and global bias are rows x (3bl + G): bounded rows keep them linear in T), and
# sums the global tokens' members this many global blocks at a time (one small product each).
QUERY_ROWS = 512
AGGREGATE_BLOCKS = 32


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
    """An encoder pass: its bias is given by distance (ops.DistanceBias), never as a (B, H, T,
    T) tensor; the scores scratch has room for what the pass's attention takes
    (`ops.distance_scratch`): the compiled kernel's blocks (backend.encoder_attention_kind), or
    `ops.distance_attention`'s two rounds of scores."""
    distance: Any = None  # (H, 2T - 1) position bias by distance (refilled per layer: UMT5)
    mask: Any = None      # (B, T) the padding mask, additive, uploaded

    @classmethod
    def specs(cls, cfg: T5Config, B: int, T: int, dtype: Any, compute: str = "float32",
              on_host: bool | None = None) -> BufferSpec:
        """(on_host: whether the pass runs in NumPy; None, unknown (a plan): the scratch of
        whichever attention needs more)"""
        H = cfg.num_heads
        kinds = {encoder_attention_kind(compute, dtype, host)
                 for host in ((True, False) if on_host is None else (on_host,))}
        scores = max(ops.distance_scratch(B, H, T, cfg.d_kv, np.dtype(dtype).itemsize, kind)
                     for kind in kinds)
        return {**PassScratch.specs(cfg, B, T, T, dtype), "scores": ((scores,), dtype),
                "distance": ((H, 2 * T - 1), dtype), "mask": ((B, T), dtype)}


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
    def specs(cls, cfg: T5Config, B: int, T: int, dtype: Any, compute: str = "float32") -> BufferSpec:
        """(compute: LongT5's attention is float32 in every compute mode)"""
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
    """The encoder pass's buffers: T5's (its bias by distance, (H, 2T - 1)) or LongT5's (linear
    in T)."""
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
    positions, the cross-attention K/V of each input (a row reads its input's: `cross_rows`,
    so the beams or samples of one input share one copy), the bias tables, and the one-position
    step scratch."""
    self_k: Any = None      # (L, B, H, N, D)
    self_v: Any = None
    cross_k: Any = None     # (L, Bs, H, S, D): one row per input (Bs <= B)
    cross_v: Any = None
    cross_bias: Any = None  # (B, 1, 1, S) the source padding mask
    self_bias: Any = None   # (Lb, H, N) the causal bias by reversed distance (see math.py), one
                            # table per bias table of the decoder (Lb: 1, or L for UMT5)
    logits: Any = None      # (B, 1, V)
    cross_rows: Any = None  # (B,) int64 on the host: the cross K/V row each row reads

    @classmethod
    def specs(cls, cfg: T5Config, B: int, S: int, N: int, dtype: Any,
              sources: int | None = None) -> BufferSpec:
        """(sources: the inputs whose cross K/V the B rows read; None: B, a row each)"""
        H, D, L = cfg.num_heads, cfg.d_kv, cfg.num_decoder_layers
        Bs = B if sources is None else sources
        return {"self_k": ((L, B, H, N, D), dtype), "self_v": ((L, B, H, N, D), dtype),
                "cross_k": ((L, Bs, H, S, D), dtype), "cross_v": ((L, Bs, H, S, D), dtype),
                "cross_bias": ((B, 1, 1, S), dtype),
                "self_bias": ((cfg.bias_tables("decoder"), H, N), dtype),
                **PassScratch.specs(cfg, B, 1, max(N, S), dtype, cross=True),
                "logits": ((B, 1, cfg.vocab_size), dtype)}

    def rows(self, b: int) -> "DecodeBuffers":
        """Views of the first b rows (the live batch after rows finished), built once per size."""
        live = {f: getattr(self, f)[:b] for f in (*self.ROWS, "logits", "cross_bias", "ids",
                                                  "cross_rows")
                if getattr(self, f) is not None}
        live.update({f: getattr(self, f)[:, :b] for f in ("self_k", "self_v")})
        return DecodeBuffers(**{**self.__dict__, **live})


def reorder_elements(self_shape: tuple[int, ...], rows: int) -> int:
    """Elements of the scratch a reorder of `rows` rows moves one layer's self-attention cache
    through (the cross K/V never move: rows follow them through `cross_rows`)."""
    _, _, H, N, D = self_shape
    return rows * H * N * D


def run_bytes(cfg: T5Config, dtype: Any, batch: int, input_len: int | None,
              max_new_tokens: int | None, compute: str = "float32",
              repeat: int = 1) -> dict[str, int]:
    """Arena bytes of one generation: its decode state plus the largest of the encoder pass, the
    cross K/V projection and a beam reorder (the device's library temporaries fit its arena's
    own pool, arena.SCOPE_TEMPORARIES; the model code itself allocates nothing on the device);
    of an encoder-only model, one encoder pass and its output. batch: rows, repeat of them per
    prompt (beams, samples): the encoder and the cross K/V are the prompts' only."""
    S = input_len or (DEFAULT_ENCODER_INPUT_LEN if cfg.encoder_only else DEFAULT_INPUT_LEN)
    prompts = max(1, batch // repeat)
    out = bytes_needed({"out": ((prompts, S, cfg.d_model), dtype)})
    encoder = out + encoder_scratch(cfg).nbytes(cfg, prompts, S, dtype, compute)
    if cfg.encoder_only:
        return {"encoder_scratch": encoder, "peak": encoder}
    N = max_new_tokens or DEFAULT_NEW_TOKENS
    state = DecodeBuffers.nbytes(cfg, batch, S, N, dtype, prompts)
    cross = out + bytes_needed({"raw": ((prompts, S, 2 * cfg.inner), dtype)})
    H, D, L = cfg.num_heads, cfg.d_kv, cfg.num_decoder_layers
    reorder = bytes_needed({"tmp": ((reorder_elements((L, batch, H, N, D), batch),), dtype)})
    return {"decode_state": state, "encoder_scratch": encoder, "cross_kv_scratch": cross,
            "reorder_scratch": reorder, "peak": state + max(encoder, cross, reorder)}
