"""LongT5's encoder self-attention: local, and transient-global, beside T5's full attention.

Guo et al. 2022, "LongT5: Efficient Text-To-Text Transformer for Long Sequences". The numerics
are transformers 4.57's (models/longt5/modeling_longt5.py); the rest of the block (norms, the
feed-forward, the decoder) is T5's, in math.py, which calls this file for the encoder.

- Local: a query attends to the keys at most `local_radius` positions away. The reference cuts
  the sequence into blocks of bl = local_radius + 1 and lets each block's queries score the
  keys of three blocks (its own and its neighbours), with a locality mask; so does this file,
  the three blocks being an overlapping strided view of one key buffer with a zero block at
  each end (no copies). Position bias: block 0's relative_attention_bias at the bidirectional
  bucket of (key - query), shared by all layers. Padding keys and keys outside the sequence
  are masked with the reference's -1e10 (not finfo.min).
- Transient-global: besides, every `global_block_size` tokens make one global token. In each
  layer the attention's (normed) input of a block's tokens is summed, RMS-normed with the
  layer's own global_input_layer_norm and projected by the layer's own k and v: G = T //
  global_block_size more keys that every query scores, with block 0's
  global_relative_attention_bias at the bucket of (global index - the query's global block) and
  a mask for global tokens past a row's last complete block. The block of each token follows
  the reference's float arithmetic (a float32 cumulative sum of 1/global_block_size, which
  torch's CPU cumsum accumulates in float64): for some block sizes (25, 47, ...) a token lands
  in the block before position // global_block_size. The tokens after the last complete block
  join it; padding joins none.

Memory stays linear in T: queries are taken in chunks of whole blocks (buffers.QUERY_ROWS), so
the scores that exist at once are (B, H, rows, 3bl + G), and the global bias is gathered per
chunk from a (H, 2G) table by distance (the reference materialises (B, H, T, G) and copies the
global keys into every block). Cost: the local part is linear in T, the global part T * G =
T^2 / global_block_size products (the paper's).

Padded queries: the reference masks every key of a padded query's row; here a padded query
attends like a real one (its own key is masked as padding). Its state differs from the
reference's and nothing reads it (the decoder masks padded positions), but no row is ever
all masked, so half precision never turns a row into NaN.

Shapes: B batch, T positions, H heads, D head dim, C d_model, bl block length, nb blocks,
G global tokens, rows = queries per chunk.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from ... import ops
from ...errors import InputError
from .buffers import LongEncoderScratch, LongShape
from .config import T5Config

REFERENCE_MASK = -1e10  # the reference's additive mask value for LongT5's attention


def mask_value(dtype: Any) -> float:
    """The additive mask in the compute dtype: the reference's -1e10, or, where that is not
    finite (float16), a quarter of the dtype's range: still exp(mask - max) == 0 in a row with
    one key unmasked, and three masks added stay finite."""
    return max(REFERENCE_MASK, -float(np.finfo(dtype).max) / 4)


# =====================================================================================================
# Host-side tables (integer work, once per pass)
# =====================================================================================================
def global_blocks(attention_mask: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference's global block of each token and the valid global tokens of each row:
    attention_mask (B, T) -> (block ids (B, T) int64, -1 for padding; valid (B, T // block_size)).

    Computed as transformers does: positions / block_size as a float32 cumulative sum (torch
    accumulates it in float64 on the CPU, then rounds to float32), floored after adding and
    removing 1; padding -1; the tokens past the last complete block of real tokens join it; a
    global token is valid up to the row's largest block id."""
    B, T = attention_mask.shape
    real = attention_mask != 0
    step = np.float32(1) / np.float32(block_size)
    offset = np.cumsum(np.full(T, step, np.float64)).astype(np.float32) - step      # (T,)
    start = np.where(real, np.float32(1), np.float32(-1000))
    ids = np.floor((start + offset) - np.float32(1)).astype(np.int64)
    ids = np.where(real, np.maximum(ids, -1), -1)
    ends = (np.arange(T) % block_size) == block_size - 1
    full = (ends & (ids >= 0)).sum(axis=1, keepdims=True) - 1                         # (B, 1)
    ids = np.minimum(ids, full)
    valid = np.arange(T // block_size)[None, :] <= ids.max(axis=1, keepdims=True)
    return ids, valid


def membership(ids: np.ndarray, shape: LongShape, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Which global token each token joins, per group of `group * block_size` tokens:
    ids (B, T) -> (one-hot (groups, B, group + 2, width) float32, first global of each group's
    rows (groups, B)). A group's real tokens span at most group + 1 consecutive block ids
    (ids are non-decreasing and off position // block_size by at most one), so its sums are one
    (group + 2, width) @ (width, C) product per row."""
    B, T = ids.shape
    width, K = shape.group * block_size, shape.group + 2
    padded = np.full((B, shape.groups * width), -1, np.int64)
    padded[:, :T] = ids
    chunks = padded.reshape(B, shape.groups, width)
    real = chunks >= 0
    base = np.where(real, chunks, np.iinfo(np.int64).max).min(axis=2)
    base = np.where(real.any(axis=2), base, 0)                                       # (B, groups)
    rel = chunks - base[:, :, None]
    if (rel[real] >= K).any():   # cannot happen below ~1e7 positions (float32 rounding)
        raise InputError(f"input of {T} positions: the global blocks of size {block_size} "
                         "are out of order")
    onehot = np.zeros((shape.groups, B, K, width), np.float32)
    b, g, t = np.nonzero(real)
    onehot[g, b, rel[b, g, t], t] = 1
    return onehot, base.T


def local_bias(rel_bias: np.ndarray, bucket: Callable[[np.ndarray], np.ndarray], bl: int,
               mask: float) -> np.ndarray:
    """(H, bl, 3bl) bias of a block's queries over its three blocks' keys: the position bias of
    (key - query), and the mask where the key is more than local_radius = bl - 1 away."""
    rel = np.arange(3 * bl)[None, :] - bl - np.arange(bl)[:, None]                  # (bl, 3bl)
    bias = rel_bias[bucket(rel)].transpose(2, 0, 1)                                  # (H, bl, 3bl)
    return bias + np.where(np.abs(rel) < bl, 0.0, mask).astype(np.float32)


def global_table(global_rel_bias: np.ndarray, bucket: Callable[[np.ndarray], np.ndarray],
                 G: int) -> np.ndarray:
    """(H, 2G) global bias by distance: column j holds distance j - (G - 1), so a query of
    global block b scores global token g with column g + (G - 1 - b) (b = -1 for padding)."""
    return np.ascontiguousarray(global_rel_bias[bucket(np.arange(2 * G) - (G - 1))].T)


# =====================================================================================================
# The attention
# =====================================================================================================
def windows(xp: Any, a: Any, axis: int, bl: int, blocks: int) -> Any:
    """Block n's three-block window of `a` along `axis` ((blocks + 2) * bl long: a zero block
    each side) as an overlapping view: axis -> (blocks, 3 * bl). No copy."""
    step = a.strides[axis]
    shape = a.shape[:axis] + (blocks, 3 * bl) + a.shape[axis + 1:]
    strides = a.strides[:axis] + (bl * step, step) + a.strides[axis + 1:]
    return xp.lib.stride_tricks.as_strided(a, shape=shape, strides=strides)


def _first(flat: Any, *shape: int) -> Any:
    """The start of a flat scratch buffer viewed as `shape` (contiguous)."""
    return flat[:int(np.prod(shape))].reshape(shape)


class LongAttention:
    """One encoder pass's local or transient-global attention: the masks and bias tables, built
    once per pass in the pass's `LongEncoderScratch`; `layer(blk)` gives a layer's attention for
    math.block (the global tokens need the layer's weights)."""

    def __init__(self, be: Any, cfg: T5Config, ws: LongEncoderScratch,
                 attention_mask: np.ndarray, bucket: Callable[[np.ndarray], np.ndarray],
                 rel_bias: np.ndarray, global_rel_bias: np.ndarray | None):
        self.be, self.cfg, self.ws = be, cfg, ws
        B, T = attention_mask.shape
        self.shape = shape = LongShape.of(cfg, T)
        bl, nb, G = shape.block, shape.blocks, shape.globals
        mask = mask_value(be.dtype)
        ws.local_bias[...] = be.asarray(local_bias(rel_bias, bucket, bl, mask), be.dtype)
        keys = np.full((B, (nb + 2) * bl), mask, np.float32)
        keys[:, bl:bl + T] = np.where(attention_mask != 0, 0.0, mask)
        ws.key_mask[...] = be.asarray(keys, be.dtype)
        # arena memory is uninitialised: the padding a layer never writes must hold zeros
        # (a masked key's weight is 0, and 0 * NaN would be NaN)
        ws.q_blocks[:, :, T:] = 0
        for kv in (ws.k_blocks, ws.v_blocks):
            kv[:, :, :bl] = 0
            kv[:, :, bl + T:] = 0
        self.bases = None
        if G:
            ids, valid = global_blocks(attention_mask, cfg.global_block_size)
            onehot, self.bases = membership(ids, shape, cfg.global_block_size)
            ws.membership[...] = be.asarray(onehot, be.dtype)
            ws.global_mask[...] = be.asarray(np.where(valid, 0.0, mask), be.dtype)
            ws.global_table[...] = be.asarray(global_table(global_rel_bias, bucket, G), be.dtype)
            offset = np.full((B, nb * bl), G, np.int64)   # rows past T: any index in range
            offset[:, :T] = (G - 1) - ids
            ws.global_offset[...] = be.asarray(offset)
            ws.global_range[...] = be.xp.arange(G)

    def layer(self, blk: dict) -> "LayerAttention":
        return LayerAttention(self, blk)

    def global_kv(self, blk: dict) -> tuple[Any, Any]:
        """The layer's global keys and values (B, H, G, D), from its normed input ws.h."""
        xp, cfg, ws, shape = self.be.xp, self.cfg, self.ws, self.shape
        B, T, _ = ws.h.shape
        width = shape.group * cfg.global_block_size
        G, K = shape.globals, shape.group + 2
        ws.global_h[...] = 0
        for j in range(shape.groups):            # each group's members: one product per row
            a = j * width
            e = min(T, a + width)
            part = ws.global_part
            ops.on_blas_threads(xp, functools.partial(xp.matmul, ws.membership[j, :, :, :e - a],
                                                      ws.h[:, a:e], out=part))
            for b in range(B):                   # (B, K, C) into each row's own global range
                lo = int(self.bases[j, b])
                n = min(K, G - lo)
                members = ws.global_h[b, lo:lo + n]
                members += part[b, :n]
        ops.rms_norm(xp, ws.global_h, blk["ln_global"], cfg.eps, out=ws.global_h)
        qkv = ops.linear(xp, ws.global_h, blk["w_qkv"], out=ws.global_qkv)
        # the global tokens' queries are computed with k and v (one fused slot) and not used
        qkv = qkv.reshape(B, G, 3, cfg.num_heads, cfg.d_kv)
        return qkv[:, :, 1].transpose(0, 2, 1, 3), qkv[:, :, 2].transpose(0, 2, 1, 3)

    def attend(self, blk: dict, q: Any, k: Any, v: Any) -> None:
        """q, k, v (B, H, T, D) of one layer -> its context in ws.ctx (B, T, H*D)."""
        xp, ws, shape = self.be.xp, self.ws, self.shape
        B, H, T, D = q.shape
        bl, nb = shape.block, shape.blocks
        ws.q_blocks[:, :, :T] = q
        ws.k_blocks[:, :, bl:bl + T] = k
        ws.v_blocks[:, :, bl:bl + T] = v
        local = (windows(xp, ws.k_blocks, 2, bl, nb),         # (B, H, nb, 3bl, D)
                 windows(xp, ws.v_blocks, 2, bl, nb),
                 windows(xp, ws.key_mask, 1, bl, nb))         # (B, nb, 3bl)
        side = self.global_kv(blk) if shape.globals else None  # (B, H, G, D) each
        for n0 in range(0, nb, shape.chunk):
            self.attend_chunk(n0, min(nb, n0 + shape.chunk), local, side)
        ws.ctx.reshape(B, T, H, D)[...] = ws.q_blocks[:, :, :T].transpose(0, 2, 1, 3)

    def attend_chunk(self, n0: int, n1: int, local: tuple[Any, Any, Any],
                     side: tuple[Any, Any] | None) -> None:
        """Blocks n0..n1-1's queries over their windows (`local`: the key, value and mask
        windows) and the global tokens (`side`: their keys and values); the context replaces
        the queries in ws.q_blocks."""
        xp, ws, shape = self.be.xp, self.ws, self.shape
        B, H, _, D = ws.q_blocks.shape
        bl, G, L = shape.block, shape.globals, 3 * shape.block
        c, rows = n1 - n0, (n1 - n0) * bl
        k_win, v_win, mask_win = local
        q = ws.q_blocks[:, :, n0 * bl:n1 * bl].reshape(B, H, c, bl, D)
        scores = _first(ws.scores, B, H, c, bl, shape.keys)      # (B, H, c, bl, 3bl + G)
        key_mask = mask_win[:, None, n0:n1, None, :]             # (B, 1, c, 1, 3bl)
        if G:
            index = _first(ws.global_index, B, rows, G)          # into global_table
            xp.add(ws.global_offset[:, n0 * bl:n1 * bl, None], ws.global_range, out=index)
            g_bias = _first(ws.global_bias, H, B, rows, G)
            g_ctx = _first(ws.global_ctx, B, H, c, bl, D)

        def heads(h0: int, h1: int) -> None:
            s = scores[:, h0:h1]
            near = s[..., :L]
            xp.matmul(q[:, h0:h1], k_win[:, h0:h1, n0:n1].swapaxes(-1, -2), out=near)
            near += ws.local_bias[None, h0:h1, None]
            near += key_mask
            if G:
                far, (g_k, g_v) = s[..., L:], side
                xp.matmul(q[:, h0:h1], g_k[:, h0:h1, None].swapaxes(-1, -2), out=far)
                ops.take_into(xp, ws.global_table[h0:h1], index, 1, g_bias[h0:h1])
                far += g_bias[h0:h1].reshape(h1 - h0, B, c, bl, G).transpose(1, 0, 2, 3, 4)
                far += ws.global_mask[:, None, None, None, :]
            ops.softmax_(xp, s)
            out = q[:, h0:h1]                # these queries are spent: the context goes here
            xp.matmul(near, v_win[:, h0:h1, n0:n1], out=out)
            if G:
                xp.matmul(far, g_v[:, h0:h1, None], out=g_ctx[:, h0:h1])
                out += g_ctx[:, h0:h1]

        ops.over_heads(xp, H, heads)


class LayerAttention:
    """A layer's view of the pass's LongAttention, in math.block's attention interface."""

    def __init__(self, attention: LongAttention, blk: dict):
        self.attention, self.blk = attention, blk

    def self_attend(self, i: int, q: Any, k: Any, v: Any, ws: Any) -> None:
        """q, k, v (B, H, T, D) -> ws.ctx. math.block calls this with the layer's normed input
        still in ws.h, where the global tokens are summed from."""
        self.attention.attend(self.blk, q, k, v)
