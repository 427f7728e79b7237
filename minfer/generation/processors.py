"""Logits processors and the sampler: pure, vectorised over the batch, never mutating inputs.

scores (b, V) float32; seqs (b, t) the ids so far, start token included. The order and semantics
are Hugging Face transformers' (repetition penalty -> no-repeat-ngram -> min-new-tokens eos mask;
when sampling: temperature -> top-k -> top-p), so the same options give the same tokens.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import ops
from .options import GenerationOptions


def repetition_penalty(scores: np.ndarray, seqs: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL-style penalty on every token already in the sequence: divide positive scores, multiply
    negative ones."""
    picked = np.take_along_axis(scores, seqs, axis=1)
    picked = np.where(picked < 0, picked * np.float32(penalty), picked / np.float32(penalty))
    out = scores.copy()
    np.put_along_axis(out, seqs, picked.astype(scores.dtype), axis=1)
    return out


def no_repeat_ngram(scores: np.ndarray, seqs: np.ndarray, n: int) -> np.ndarray:
    """Ban every token that would complete an n-gram already present in the row."""
    b, t = seqs.shape
    if t < n:  # no complete n-gram yet
        return scores
    windows = np.lib.stride_tricks.sliding_window_view(seqs, n, axis=1)  # (b, t-n+1, n)
    prefix = seqs[:, t - (n - 1):]                                        # (b, n-1)
    match = (windows[:, :, :n - 1] == prefix[:, None, :]).all(axis=2)     # (b, t-n+1)
    rows, cols = np.nonzero(match)
    if rows.size == 0:
        return scores
    out = scores.copy()
    out[rows, windows[rows, cols, n - 1]] = -np.inf
    return out


def suppress_tokens(scores: np.ndarray, token_ids: Sequence[int]) -> np.ndarray:
    out = scores.copy()
    out[:, list(token_ids)] = -np.inf
    return out


def temperature(scores: np.ndarray, value: float) -> np.ndarray:
    return scores / np.float32(value)


def top_k_filter(scores: np.ndarray, k: int) -> np.ndarray:
    """Keep the k best scores per row (ties with the k-th are kept), -inf elsewhere."""
    if k <= 0 or k >= scores.shape[1]:
        return scores
    kth = -np.partition(-scores, k - 1, axis=1)[:, k - 1:k]  # (b, 1) the k-th largest
    return np.where(scores < kth, np.float32(-np.inf), scores)


def top_p_filter(scores: np.ndarray, p: float) -> np.ndarray:
    """Nucleus filter: drop the least likely tokens whose total probability is <= 1 - p (sorted
    cumulative sum), always keeping the most likely one."""
    if p >= 1.0:
        return scores
    order = np.argsort(scores, axis=1, kind="stable")                   # ascending
    sorted_scores = np.take_along_axis(scores, order, axis=1)
    probs = np.exp(sorted_scores - sorted_scores[:, -1:])
    cumulative = np.cumsum(probs / probs.sum(axis=1, keepdims=True), axis=1)
    remove_sorted = cumulative <= (1 - p)
    remove_sorted[:, -1] = False
    remove = np.empty_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=1)
    return np.where(remove, np.float32(-np.inf), scores)


def log_softmax(scores: np.ndarray) -> np.ndarray:
    return ops.log_softmax_(np, np.array(scores, np.float32))


def top_k_indices(a: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores of each row of a (R, N), best first. Compiled: one pass
    per row, ties in index order (as a stable descending sort); NumPy: a partition, then a stable
    sort of the k (ties at the partition's edge fall either way)."""
    kc = ops.compiled(np, a)
    if kc is not None:
        idx = np.empty((a.shape[0], k), np.int64)
        kc.top_k(np.ascontiguousarray(a), k, idx, np.empty((a.shape[0], k), np.float32))
        return idx
    part = np.argpartition(-a, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(a, part, axis=1), axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1)


def process(scores: np.ndarray, seqs: np.ndarray, opts: GenerationOptions, new_len: int,
            eos_ids: Sequence[int]) -> np.ndarray:
    """The processors every decoding mode applies, in HF's order."""
    if opts.repetition_penalty != 1.0:
        scores = repetition_penalty(scores, seqs, opts.repetition_penalty)
    if opts.no_repeat_ngram_size > 0:
        scores = no_repeat_ngram(scores, seqs, opts.no_repeat_ngram_size)
    if new_len < opts.min_new_tokens:
        scores = suppress_tokens(scores, eos_ids)
    return scores


def warp(scores: np.ndarray, opts: GenerationOptions) -> np.ndarray:
    """Sampling-only warpers: temperature, top-k, top-p."""
    if opts.temperature != 1.0:
        scores = temperature(scores, opts.temperature)
    if opts.top_k > 0:
        scores = top_k_filter(scores, opts.top_k)
    return top_p_filter(scores, opts.top_p)


def sample(scores: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row from softmax(scores), by inverse CDF on a uniform from `rng`."""
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    cdf = np.cumsum(probs, axis=1)
    u = rng.random((scores.shape[0], 1)) * cdf[:, -1:]
    return np.minimum((cdf <= u).sum(axis=1), scores.shape[1] - 1).astype(np.int64)


