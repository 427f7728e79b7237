"""Shared math over an array namespace `xp` (numpy or cupy): products, norms, softmax,
attention, activations.

Functions take the namespace explicitly so one code path serves both backends. Where a function
has an `out=` argument it may write into a caller-owned (arena) buffer, which is how the models
keep their large activations inside the allocator; `out` may be the input itself (in place).
Where it also takes scratch (`work`, `stats`), it allocates nothing at all: that is how device
code stays inside its plan (on a GPU a temporary is arena memory; here, given none, NumPy's
temporaries are ordinary memory). Math runs in the dtype of its input, except that norms and
softmax of half-precision input (CUDA float16) sum in float32: float16 sums of squares overflow
and float16 exponent sums lose the small probabilities.

On the CPU in float32 the fused functions (`add_rms_norm`, `attention` of one query
position, `activate`) run as one compiled call each (minfer/kernels/) instead of a dozen NumPy
calls; with `MINFER_KERNELS=numpy` they run the NumPy code below, which computes the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import kernels
from .errors import ConfigError
from .io.limits import shown
from .kernels.activation_formulas import ERF_A, ERF_P, GELU_TANH_CUBIC, SQRT_2_OVER_PI
from .kernels.attention_layout import WEIGHT_LEVELS, AttentionShape
from .products import (MIN_PART_ROWS, PackedWeight, QuantisedRows, quantise_rows,
                       round_to_bfloat16)

PARALLEL_ATTENTION_WORK = 1 << 16  # (rows * heads * keys * head dim) above which threads help
EVERY_ROW = np.empty(0, np.int64)  # the step attention kernels' kv_rows for "row b reads row b"
LSE_CHUNK_BYTES = 1 << 18          # rows handled together by logsumexp_ (about L2-sized)


def compiled(xp: Any, x: Any) -> Any:
    """The compiled kernels when they apply to x: NumPy float32, kernels selected."""
    if xp is not np or x.dtype != np.float32:
        return None
    return kernels.active()


def linear(xp: Any, x: Any, w: Any, out: Any = None, relu: bool = False) -> Any:
    """x (..., I) @ w.T into `out` (..., O) (allocated when None) as one 2-D product; w is a
    linear slot (O, I), one row per output channel (io/formats.py), or a `PackedWeight`
    (another storage format, or the compiled kernels), which multiplies itself. `relu`:
    max(x @ w.T, 0) (in the int8 products' epilogue where they run it). x may be the
    `QuantisedRows` the norm in front of w made for it (`add_rms_norm(..., into=w)`).

    One 2-D product: NumPy runs a stacked (B, T, I) @ (I, O) as B separate products, each reading
    all of w, so a batch of 16 decoding rows would stream every weight matrix 16 times a step."""
    if isinstance(x, QuantisedRows):
        rows, o2 = x.rows, out.reshape(-1, out.shape[-1])
        w.matmul(xp, rows.reshape(-1, rows.shape[-1]), o2, relu, ready=True)
        return out
    if out is None:
        out = xp.empty((*x.shape[:-1], w.shape[0]), dtype=x.dtype)
    if not out.flags.c_contiguous and (xp is np or out.ndim != 2):
        out[...] = linear(xp, x, w, relu=relu)   # (a device namespace's matmul writes strided
        return out                               # 2-D outputs)
    x2, o2 = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
    if isinstance(w, PackedWeight):
        w.matmul(xp, x2, o2, relu)
        return out
    on_blas_threads(xp, lambda: xp.matmul(x2, w.T, out=o2))
    if relu:
        activate(xp, "relu", o2, o2.shape[-1], False)
    return out


def embed(xp: Any, table: Any, ids: Any, out: Any) -> Any:
    """Rows `ids` (...) of `table` (V, C) into `out` (..., C): a plain array, or a linear slot
    in any weight format (a tied embedding is its head)."""
    if isinstance(table, PackedWeight):
        table.rows(xp, ids.reshape(-1), out.reshape(-1, out.shape[-1]))
        return out
    return xp.take(table, ids, axis=0, out=out)


def take_into(xp: Any, table: Any, index: Any, axis: int, out: Any) -> Any:
    """xp.take(table, index, axis) written into `out` (contiguous). NumPy copies `out` first
    unless told the indices need no range check (mode="clip"; every caller's are in range)."""
    if xp is np:
        return np.take(table, index, axis=axis, out=out, mode="clip")
    return xp.take(table, index, axis=axis, out=out)


def _sum_of_squares(xp: Any, x: Any) -> Any:
    """Sum over the last axis of x*x without an x*x temporary (vecdot where the namespace has
    it: NumPy >= 2; einsum otherwise)."""
    if hasattr(xp, "vecdot"):
        return xp.vecdot(x, x)
    return xp.einsum("...c,...c->...", x, x)


def rms_normalize(xp: Any, x: Any, eps: float, out: Any = None, work: Any = None,
                  inv: Any = None) -> Any:
    """x / sqrt(mean(x^2) + eps) over the last axis (..., C): T5's LayerNorm without its weight.
    `out` may be a caller's buffer; with `work` (float32, x's shape) and `inv` (float32, (..., 1))
    nothing is allocated, and the result is rounded once into `out`'s dtype."""
    if work is not None:
        xp.multiply(x, x, out=work, dtype=np.float32)
        work.sum(axis=-1, keepdims=True, out=inv)
        inv *= 1.0 / x.shape[-1]
        inv += eps
        xp.sqrt(inv, out=inv)
        return xp.divide(x, inv, out=out)
    xf = x if x.dtype.itemsize >= 4 else x.astype("float32")
    inv = _sum_of_squares(xp, xf)[..., None]  # (..., 1)
    inv *= 1.0 / x.shape[-1]
    inv += eps
    xp.sqrt(inv, out=inv)
    if xf is x:
        return xp.divide(x, inv, out=out)
    # half input: normalise in float32 and round once, into the input's dtype (as HF's T5 does);
    # a float32 result would make every following product with half weights widen the weights
    if out is None:
        return (xf / inv).astype(x.dtype)
    xp.divide(xf, inv, out=out)
    return out


def add_rms_norm(xp: Any, x: Any, delta: Any, weight: Any, eps: float, out: Any,
                 work: Any = None, inv: Any = None, into: Any = None) -> Any:
    """x += delta (a sublayer's output; None: nothing to add), then out = rms_norm(x, weight):
    the residual add of one sublayer and the norm in front of the next, as one pass. (..., C).
    `into`: the linear slot the norm feeds; where its product takes input rows already
    quantised (compute="int8" in the compiled kernels: `PackedWeight.norm_work`), the normed
    rows go quantised into that product's scratch instead of into `out`, and the result is
    `QuantisedRows(out)`, which only `linear(.., into)` takes: no float copy of rows that only
    feed that product."""
    k = compiled(xp, x)
    if k is None:
        if delta is not None:
            x += delta
        return rms_norm(xp, x, weight, eps, out, work, inv)
    C = x.shape[-1]
    d = delta.reshape(-1, C) if delta is not None else np.empty((0, C), np.float32)
    rows = x.reshape(-1, C)
    ready = into.norm_work(rows.shape[0]) if isinstance(into, PackedWeight) else None
    if ready is not None:
        k.add_rms_norm_quantised(rows, d, weight, eps, ready, into.groups)
        return QuantisedRows(out)
    k.add_rms_norm(rows, d, weight, eps, out.reshape(-1, C))
    return out


def rms_norm(xp: Any, x: Any, weight: Any, eps: float, out: Any = None, work: Any = None,
             inv: Any = None) -> Any:
    """T5's LayerNorm: w * x / sqrt(mean(x^2) + eps); no mean subtraction, no bias. (..., C)."""
    out = rms_normalize(xp, x, eps, out, work, inv)
    out *= weight
    return out


def layer_norm(xp: Any, x: Any, weight: Any, bias: Any, eps: float, out: Any = None,
               work: Any = None, stats: Any = None) -> Any:
    """Ordinary LayerNorm over the last axis (biased variance, as torch computes it), in float32
    whatever x's dtype: half-precision squares of values beyond 256 overflow. `out` may be x;
    with `work` (float32, x's shape) and `stats` (float32, (..., 2)) nothing is allocated."""
    if out is None:
        out = xp.empty_like(x)
    if work is None:
        work = xp.empty(x.shape, np.float32)
        stats = xp.empty((*x.shape[:-1], 2), np.float32)
    mean, inv = stats[..., 0:1], stats[..., 1:2]
    work[...] = x
    work.mean(axis=-1, keepdims=True, out=mean)
    work -= mean
    xp.multiply(work, work, out=work)
    work.mean(axis=-1, keepdims=True, out=inv)     # the variance
    inv += eps
    xp.sqrt(inv, out=inv)
    xp.subtract(x, mean, out=work)                 # centred again (its square was consumed)
    work /= inv
    work *= weight
    work += bias
    out[...] = work
    return out


def softmax_(xp: Any, x: Any, stats: tuple[Any, Any] | None = None) -> Any:
    """Softmax over the last axis, in place (x is scratch). Max-subtracted, so a row of equal
    (even all-masked, finfo.min) values gives a uniform row, never NaN. `stats`: (row maxima in
    x's dtype, row sums in float32), each (..., 1): then nothing is allocated, and half input
    sums its exponentials in float32 and is divided once."""
    if stats is not None:
        top, total = stats
        x.max(axis=-1, keepdims=True, out=top)
        x -= top
        xp.exp(x, out=x)
        x.sum(axis=-1, keepdims=True, dtype=np.float32, out=total)
        return xp.divide(x, total, out=x)
    if x.dtype.itemsize < 4:
        x[...] = softmax_(xp, x.astype("float32"))
        return x
    x -= x.max(axis=-1, keepdims=True)  # array methods: half the call overhead of xp.max
    xp.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


def log_softmax_(xp: Any, x: Any) -> Any:
    """Log-softmax over the last axis, in place (x is a float32 scratch array)."""
    # NumPy's vectorised exp beats a compiled loop here (numba's exp is a scalar call).
    x -= x.max(axis=-1, keepdims=True)
    x -= xp.log(xp.exp(x).sum(axis=-1, keepdims=True))
    return x


def logsumexp_(xp: Any, x: Any) -> Any:
    """log(sum(exp(x))) over the last axis of x (R, V) -> (R,) float32, with x as scratch (its
    values are destroyed). Max-subtracted. On NumPy the rows are cut into groups of about
    LSE_CHUNK_BYTES, so the max / subtract / exp / sum passes over a group run in cache after
    one read from memory (several times faster than a plain log-softmax), and the groups
    are spread over the threads."""
    R, V = x.shape
    if xp is not np:
        top = x.max(axis=-1, keepdims=True)
        x -= top
        return xp.log(xp.exp(x, out=x).sum(axis=-1)) + top[:, 0]
    out = np.empty(R, np.float32)
    group = max(1, LSE_CHUNK_BYTES // max(V * x.itemsize, 1))

    def rows(part: int, a: int, b: int) -> None:
        for s in range(a, b, group):
            xs = x[s:s + group] if s + group <= b else x[s:b]
            top = xs.max(axis=-1, keepdims=True)
            xs -= top
            np.exp(xs, out=xs)
            out[s:s + len(xs)] = np.log(xs.sum(axis=-1)) + top[:, 0]

    kernels.split(R, rows, kernels.parts(R, 4))
    return out


def attention(xp: Any, q: Any, k: Any, v: Any, bias: Any, scores: Any, ctx: Any,
              keys: int | None = None, stats: tuple[Any, Any] | None = None,
              kv_rows: np.ndarray | None = None) -> None:
    """softmax(q k^T + bias) v into ctx. q (B, H, T, D), k/v (B, H, S, D), bias broadcast to
    (B, H, T, S), scores a (B, H, T, S) scratch, ctx a (B, T, H, D) output. No scaling: callers
    that need 1/sqrt(D) fold it into q (T5 folds it into its initialisation). `keys`: only the
    first `keys` positions of k/v take part (KV caches: pass the whole cache and its filled
    length, so the compiled kernel reads contiguous rows instead of a strided view). `stats`:
    the softmax's row scratch, each (B, H, T, 1) (see softmax_). `kv_rows` (B,) int64 on the
    host: row b of q reads row kv_rows[b] of k and v (decoding's beams and samples share their
    input's cross K/V; rows that read the same one are adjacent); None: row b."""
    B, H, T, D = q.shape
    S = k.shape[2] if keys is None else keys
    kc = compiled(xp, q) if T == 1 else None
    if kc is not None:  # one query position (decoding): one compiled pass over the keys
        bias3 = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)[:, :, 0]   # (Bb, Hb, S)
        run = kc.attend_query_parallel if B * H * S * D > PARALLEL_ATTENTION_WORK else kc.attend_query
        run(np.ascontiguousarray(q[:, :, 0]), np.ascontiguousarray(k), np.ascontiguousarray(v),
            S, bias3, ctx[:, 0],   # (contiguous already, but for views of other arrays: copied)
            EVERY_ROW if kv_rows is None else kv_rows)
        return
    if kv_rows is not None:   # each run of rows reading one k / v row: that row broadcast
        a = 0
        while a < B:
            e, row = a + 1, int(kv_rows[a])
            while e < B and kv_rows[e] == row:
                e += 1
            attention(xp, q[a:e], k[row:row + 1], v[row:row + 1],
                      bias[a:e] if bias.ndim == 4 and bias.shape[0] > 1 else bias, scores[a:e],
                      ctx[a:e], keys, None if stats is None else (stats[0][a:e], stats[1][a:e]))
            a = e
        return
    if S != k.shape[2]:
        k, v = k[:, :, :S], v[:, :, :S]
    ctx4 = ctx.transpose(0, 2, 1, 3)                  # (B, H, T, D) view of the (B, T, H, D) output

    def heads(h0: int, h1: int) -> None:
        s = xp.matmul(q[:, h0:h1], k[:, h0:h1].swapaxes(-1, -2), out=scores[:, h0:h1])  # (B, h, T, S)
        s += head_slice(bias, H, h0, h1)
        softmax_(xp, s, None if stats is None else (stats[0][:, h0:h1], stats[1][:, h0:h1]))
        xp.matmul(s, v[:, h0:h1], out=ctx4[:, h0:h1])

    over_heads(xp, H, heads)


@dataclass(frozen=True)
class DistanceBias:
    """A pass's additive attention bias given by distance, not as a (B, H, T, S) tensor: T5's
    position bias depends only on key - query and the head, and padding only on the key.
    table (H, T + S - 1): the bias of distance j - i at column j - i + T - 1; key_mask (B, S):
    0 for a real key, `mask_value` for padding."""
    table: Any
    key_mask: Any


def toeplitz_view(xp: Any, table: Any, T: int) -> Any:
    """The (h, T, S) bias matrix of a distance table (h, T + S - 1), as a view (no copy): row i
    is table[:, T - 1 - i:][:, :S], a window sliding back one column a row."""
    h, width = table.shape
    S = width - T + 1
    step = table.strides[1]
    windows = xp.lib.stride_tricks.as_strided(table, (h, T, S), (table.strides[0], step, step))
    return windows[:, ::-1]


def distance_attention(xp: Any, q: Any, k: Any, v: Any, bias: DistanceBias, scores: Any,
                       ctx: Any, stats: tuple[Any, Any] | None = None,
                       round_weights: Callable[[Any, Any], None] | None = None) -> None:
    """softmax(q k^T + bias) v into ctx, as `attention`, with the bias given by distance (H
    rows of table), in array ops: what runs where the compiled encoder attention does not
    (`float_distance_attention`, `rounded_distance_attention`, `quantised_distance_attention`).
    q, k, v (B, H, T|S, D); scores a contiguous scratch; ctx (B, T, H, D).

    The (batch row, head) pairs run in rounds, a round's scores in the first half of `scores`
    and its bias, built from the table, in the second: with `distance_scores` elements two
    rounds of half the heads (what the array backends' scratch holds), with fewer as many
    pairs as fit, at least one (T x S scores and bias: what `distance_scratch` adds to the
    kernels' blocks, should they not run after all). `round_weights(xp, weights)`: rounds the
    softmax weights (..., T, S) in place before the value product (`bfloat16_weights`,
    `int8_weights`)."""
    B, H, T, D = q.shape
    S = k.shape[2]
    ctx4 = ctx.transpose(0, 2, 1, 3)                  # (B, H, T, D) view of the (B, T, H, D) output
    flat = scores.reshape(-1)
    pairs = flat.size // (2 * T * S)                  # (batch row, head) pairs a round holds
    if pairs < 1:
        raise ValueError(f"distance_attention: the scratch holds {flat.size} elements, "
                         f"{2 * T * S} needed")
    heads = min((H + 1) // 2, pairs)
    rows = min(B, pairs // heads)
    mask = bias.key_mask.reshape(B, 1, 1, S)
    for b0 in range(0, B, rows):
        b1 = min(B, b0 + rows)
        for h0 in range(0, H, heads):
            h1 = min(H, h0 + heads)
            n = (b1 - b0) * (h1 - h0) * T * S
            s = flat[:n].reshape(b1 - b0, h1 - h0, T, S)
            chunk = flat[n:2 * n].reshape(b1 - b0, h1 - h0, T, S)
            chunk[0] = toeplitz_view(xp, bias.table[h0:h1], T)          # (h, T, S)
            if b1 - b0 > 1:
                chunk[1:] = chunk[0]
            chunk += mask[b0:b1]
            xp.matmul(q[b0:b1, h0:h1], k[b0:b1, h0:h1].swapaxes(-1, -2), out=s)
            s += chunk
            softmax_(xp, s, None if stats is None else
                     (stats[0][b0:b1, h0:h1], stats[1][b0:b1, h0:h1]))
            if round_weights is not None:
                round_weights(xp, s)
            xp.matmul(s, v[b0:b1, h0:h1], out=ctx4[b0:b1, h0:h1])


def float_distance_attention(xp: Any, qkv: Any, bias: DistanceBias, scores: Any, ctx: Any,
                             stats: tuple[Any, Any] | None = None) -> None:
    """The encoder's self-attention of `distance_attention` in float32 over the pass's q|k|v
    (B, T, 3, H, D) (the q|k|v product's output, contiguous): with the compiled kernels one call,
    the scores a block of queries at a time (kernels/pass_attention_float.py: no (B, H, T, T)
    tensor), elsewhere `distance_attention`. scores: the scratch of `distance_scratch`
    elements, ctx (B, T, H, D)."""
    kc = compiled(xp, qkv)
    if kc is not None:
        kc.attend_f32(qkv, bias.table, bias.key_mask, ctx, scores)
        return
    q, k, v = (qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3))    # (B, H, T, D)
    distance_attention(xp, q, k, v, bias, scores, ctx, stats)


def rounded_distance_attention(xp: Any, qkv: Any, bias: DistanceBias, scores: Any, ctx: Any,
                               stats: tuple[Any, Any] | None = None) -> None:
    """The self-attention of `distance_attention` with its products' inputs rounded to bfloat16
    (queries, keys, values and the softmax weights; sums and the softmax in float32): what the
    encoder runs with compute="bfloat16" (backend.ROUNDED_ATTENTION). qkv (B, T, 3,
    H, D) the q|k|v product's output (contiguous; rounded in place without the kernels), scores
    the scratch of `distance_scratch` elements, ctx (B, T, H, D).

    With the compiled kernels one call does it all, on the bfloat16 tiles, without a score
    tensor (kernels/pass_attention.py); elsewhere q|k|v are rounded in place and the weights
    after the softmax, around `distance_attention`'s float32 products, which then multiply
    exactly what the tiles multiply (a bfloat16 pair's product is exact in float32)."""
    kc = compiled(xp, qkv)
    if kc is not None:
        kc.attend_bf16(qkv, bias.table, bias.key_mask, ctx, scores)
        return
    flat = qkv.reshape(-1, qkv.shape[-1])
    flat[...] = round_to_bfloat16(xp, flat)
    q, k, v = (qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3))    # (B, H, T, D)
    distance_attention(xp, q, k, v, bias, scores, ctx, stats, round_weights=bfloat16_weights)


def bfloat16_weights(xp: Any, weights: Any) -> None:
    """Softmax rows as the bfloat16 attention multiplies them: rounded to bfloat16, in place."""
    weights[...] = round_to_bfloat16(xp, weights)


def int8_weights(xp: Any, weights: Any) -> None:
    """Softmax rows (..., S) as the int8 attention multiplies them, in place: codes
    round(WEIGHT_LEVELS w / max w) (w / max w = exp(s - max s), what the kernel quantises),
    divided by their sum."""
    weights *= WEIGHT_LEVELS / weights.max(axis=-1, keepdims=True)
    xp.rint(weights, out=weights)
    weights /= weights.sum(axis=-1, keepdims=True)


def quantised_distance_attention(xp: Any, qkv: Any, bias: DistanceBias, scores: Any, ctx: Any,
                                 stats: tuple[Any, Any] | None = None) -> None:
    """The self-attention of `distance_attention` with int8 products: queries and keys quantised
    per row (a position's D columns of a head), values per column over the positions, the
    softmax weights to 7-bit codes (sums and the softmax in float32): what the encoder runs with
    compute="int8". qkv (B, T, 3, H, D) the q|k|v product's output (contiguous; quantised in
    place without the kernels), scores the scratch of `distance_scratch` elements, ctx (B, T,
    H, D).

    With the compiled kernels one call does it all, on the int8 tiles, without a score tensor
    (kernels/pass_attention_int8.py); elsewhere q|k|v are quantised in place and the weights
    after the softmax, around `distance_attention`'s float32 products (the same function up to
    float rounding, which may flip a code where a value lies on a rounding boundary)."""
    kc = compiled(xp, qkv)
    if kc is not None:
        kc.attend_i8(qkv, bias.table, bias.key_mask, ctx, scores)
        return
    D = qkv.shape[-1]
    qk = qkv[:, :, :2]                                    # q and k: per position and head
    qk[...] = quantise_rows(xp, qk.reshape(-1, D)).reshape(qk.shape)
    v = qkv[:, :, 2].transpose(0, 2, 3, 1)                # v: per head and column, (B, H, D, T)
    v[...] = quantise_rows(xp, v.reshape(-1, v.shape[-1])).reshape(v.shape)
    q, k, v = (qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3))    # (B, H, T, D)
    distance_attention(xp, q, k, v, bias, scores, ctx, stats, round_weights=int8_weights)


def distance_scores(B: int, H: int, T: int, S: int) -> int:
    """Elements of `distance_attention`'s scores scratch: (B, H, T, S) rounded up to two
    equal rounds of heads (its other backends' bias)."""
    return B * 2 * ((H + 1) // 2) * T * S


def distance_scratch(B: int, H: int, T: int, D: int, itemsize: int, kind: str | None) -> int:
    """Elements (of `itemsize` bytes) of an encoder pass's attention scratch: with the compiled
    kernels and a `kind` of compiled attention (backend.encoder_attention_kind), that kernel's
    blocks (attention_layout.py: per thread, one (batch row, head)'s packed q|k|v in bfloat16 or
    int8, its keys in float32, and a block of scores), linear in T where the scores are quadratic
    (T5-XXL's 64 heads over 512 tokens, 2 threads: 0.75 MiB in either against 64 MiB a batch
    row), and at least one (batch row, head)'s scores and bias for `distance_attention`, which
    runs instead where the kernels do not (a process forked after their threads started);
    otherwise `distance_scores`."""
    threads = kernels.max_threads() if kind else 0
    if threads:
        blocks = -(-AttentionShape(B, H, T, T, D, threads, kind).nbytes() // itemsize)
        return max(blocks, 2 * T * T)
    return distance_scores(B, H, T, T)


def mask_value(dtype: Any) -> float:
    """What a blocked attention score becomes: finfo(float32).min, as HF; half the float16
    minimum in float16, so that adding a position bias to it cannot overflow to -inf (and warn):
    its softmax weight is 0 either way."""
    info = np.finfo(dtype)
    return float(info.min) if info.bits >= 32 else float(info.min) / 2


def on_blas_threads(xp: Any, call: Callable[[], Any]) -> None:
    """A single BLAS call, on the kernels' pool with NumPy (kernels.on_pool), for the family math
    that reaches the kernels only through ops."""
    kernels.on_pool(call, xp)


def over_heads(xp: Any, H: int, work: Callable[[int, int], None]) -> None:
    """work(h0, h1) over ranges of the H heads: on NumPy with the compiled kernels, one range per
    thread run side by side on the pool (kernels.split: BLAS at one thread each, and the
    softmax's ufuncs in parallel too); otherwise one call for all heads."""
    if xp is np:   # (BLAS only from the pool's threads: kernels.split's `blas`)
        kernels.split(H, lambda part, h0, h1: work(h0, h1), blas=True)
    else:
        work(0, H)


def head_slice(a: Any, H: int, h0: int, h1: int) -> Any:
    """Heads h0:h1 of an array broadcast against (..., H, T, S): sliced on its head axis (-3)
    where it has H heads there, as it is where it broadcasts (a size-1 or missing head axis)."""
    if getattr(a, "ndim", 0) >= 3 and a.shape[-3] == H:
        return a[..., h0:h1, :, :]
    return a


def activate(xp: Any, name: str, hidden: Any, F: int, gated: bool, work: Any = None,
             into: Any = None) -> Any:
    """The FF's activation in place on hidden (..., F | 2F) -> the (..., F) view to multiply
    by W_out: act(h), or act(h[..., :F]) * h[..., F:] for a gated FF. `work`: float32 scratch
    of (..., F * ACTIVATION_WORK[name]) for activations that need one (then none is allocated).
    `into`: W_out's slot; where its product takes rows already quantised
    (`PackedWeight.norm_work`, compute="int8"), the activated rows go quantised into its scratch
    and the result is `QuantisedRows` of the (..., F) view (hidden then left as it was)."""
    k = compiled(xp, hidden)
    if k is not None and hidden.flags.c_contiguous and name in k.ACTIVATION_KINDS:
        rows, kind = hidden.reshape(-1, hidden.shape[-1]), k.ACTIVATION_KINDS[name]
        ready = into.norm_work(rows.shape[0]) if isinstance(into, PackedWeight) else None
        if ready is not None:
            k.activate_quantised(rows, F, gated, kind, ready, into.groups)
            return QuantisedRows(hidden[..., :F])
        k.activate(rows, F, gated, kind)
        return hidden[..., :F]
    act = activation(name)   # in place: every activation writes into the view it is given
    if work is not None:     # one pass over all rows, through the caller's scratch
        if gated:
            gate = act(xp, hidden[..., :F], work)
            gate *= hidden[..., F:]
        else:
            act(xp, hidden, work)
        return hidden[..., :F]

    def rows(h: Any) -> None:
        if not gated:
            act(xp, h)
            return
        gate = act(xp, h[..., :F])                  # the first half is the activated one
        gate *= h[..., F:]

    if xp is np and hidden.flags.c_contiguous:      # rows side by side (NumPy ufuncs drop the GIL)
        h2 = hidden.reshape(-1, hidden.shape[-1])
        kernels.split(h2.shape[0], lambda part, a, b: rows(h2[a:b]),
                      kernels.parts(h2.shape[0], MIN_PART_ROWS))
    else:
        rows(hidden)
    return hidden[..., :F]


# -- activations (in place on scratch buffers) --------------------------------------------------------
def relu_(xp: Any, x: Any, work: Any = None) -> Any:
    return xp.maximum(x, 0, out=x)


def gelu_tanh_(xp: Any, x: Any, work: Any = None) -> Any:
    """GELU, tanh approximation ('gelu_new'): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    `work`: float32 scratch of x's shape (the inner term, computed in float32)."""
    inner = x * x if work is None else xp.multiply(x, x, out=work, dtype=np.float32)
    inner *= GELU_TANH_CUBIC * SQRT_2_OVER_PI
    inner += SQRT_2_OVER_PI
    inner *= x
    xp.tanh(inner, out=inner)
    inner += 1.0
    x *= inner
    x *= 0.5
    return x


def erf(xp: Any, x: Any) -> Any:
    """erf without scipy: Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7, below float32 noise in GELU)."""
    sign = xp.sign(x)
    a = xp.abs(x)
    t = 1.0 / (1.0 + ERF_P * a)
    poly = ERF_A[-1]
    for c in reversed(ERF_A[:-1]):                  # Horner: poly(t) = t (A1 + t (A2 + ...))
        poly = poly * t + c
    return sign * (1.0 - t * poly * xp.exp(-a * a))


def gelu_erf_(xp: Any, x: Any, work: Any = None) -> Any:
    """Exact GELU ('gelu'): 0.5 x (1 + erf(x / sqrt(2))). `work`: float32 scratch of three times
    x's width (|x|/sqrt 2, then the polynomial; t; exp(-x^2/2)), erf as `erf` computes it."""
    if work is not None:
        n = x.shape[-1]
        a, t, e = work[..., :n], work[..., n:2 * n], work[..., 2 * n:3 * n]
        xp.absolute(x, out=a, dtype=np.float32)
        a *= 1.0 / math.sqrt(2.0)
        xp.multiply(a, a, out=e)
        xp.negative(e, out=e)
        xp.exp(e, out=e)
        xp.multiply(a, ERF_P, out=t)
        t += 1.0
        xp.reciprocal(t, out=t)
        a[...] = ERF_A[-1]
        for c in reversed(ERF_A[:-1]):             # Horner: poly(t) = t (A1 + t (A2 + ...))
            a *= t
            a += c
        a *= t
        a *= e
        xp.subtract(1.0, a, out=a)                  # erf(|x| / sqrt 2)
        xp.copysign(a, x, out=a)
        a += 1.0
        x *= a
        x *= 0.5
        return x
    e = erf(xp, x * (1.0 / math.sqrt(2.0)))
    e += 1.0
    x *= e
    x *= 0.5
    return x


def silu_(xp: Any, x: Any, work: Any = None) -> Any:
    """SiLU / swish: x * sigmoid(x). `work`: float32 scratch of x's shape."""
    s = xp.exp(-x) if work is None else xp.exp(xp.negative(x, out=work, dtype=np.float32),
                                               out=work)
    s += 1.0
    x /= s
    return x


ACTIVATIONS: dict[str, Callable[[Any, Any], Any]] = {
    "relu": relu_,
    "gelu_new": gelu_tanh_,
    "gelu_pytorch_tanh": gelu_tanh_,
    "gelu_fast": gelu_tanh_,
    "gelu": gelu_erf_,
    "silu": silu_,
    "swish": silu_,
}


# float32 scratch an activation needs, in multiples of its input's width (see `activate`)
ACTIVATION_WORK = {"relu": 0, "gelu_new": 1, "gelu_pytorch_tanh": 1, "gelu_fast": 1, "gelu": 3,
                   "silu": 1, "swish": 1}


def activation(name: str) -> Callable[[Any, Any], Any]:
    act = ACTIVATIONS.get(name) if isinstance(name, str) else None
    if act is None:
        raise ConfigError(f"activation {shown(name)} is not supported "
                          f"(supported: {', '.join(sorted(ACTIVATIONS))})")
    return act
