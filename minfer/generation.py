"""Decoding, model-agnostic: options, logits processors, samplers, greedy / sampled / beam loops,
and the text layer (prompts in, streamed text out).

A model provides `start_decoding(ids, mask, max_len)`: a context manager yielding a state with
`step(tokens (b,)) -> logits (b, V)` (one token per live row), `reorder(rows, cross=True)`
(keep / duplicate rows: finished rows leave the batch, beams follow their parents) and optionally
`first_tokens` (what step 0 is fed: T5's decoder start token by default, a decoder-only model's
last prompt token); `generation_ids` (or `config`) with `eos_token_ids`, `pad_token_id` and
`decoder_start_token_id`; a `generation_config` dict; a `tokenizer` (or None); a `backend`.
Hypotheses start with the first token; encoder-decoder results keep it (HF's convention),
decoder-only results drop it (they are the new tokens only).

Semantics follow Hugging Face transformers' generate() (see docs/architecture.md):
- greedy/sampling: float32 logits -> repetition penalty -> no-repeat-ngram -> min-new-tokens eos
  mask -> (sampling) temperature, top-k, top-p -> argmax (first index on ties) or a draw;
- beam search: log_softmax -> the same processors -> add running beam scores -> top 2*num_beams
  over num_beams*V; a candidate that ends (eos, or the length limit) within the top num_beams is
  finalised with score sum_logprobs / generated_len**length_penalty; early_stopping True / False /
  "never" as HF defines them.
Processors are pure (they return new arrays) and vectorised over the batch.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from . import ops
from .errors import InputError, MinferError

# When neither the call nor the checkpoint says how long to decode. Deliberately long: a silent
# 20-token cut (HF's max_length default) truncates real outputs; eos ends most generations sooner.
DEFAULT_MAX_NEW_TOKENS = 256
NEG = np.float32(-1e9)  # HF's "finished / impossible" score offset in beam search


# =====================================================================================================
# Options
# =====================================================================================================
@dataclass(frozen=True)
class GenerationOptions:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50          # HF's default, used only when sampling
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def validate(self) -> "GenerationOptions":
        def integer(name: str, minimum: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
                raise InputError(f"{name} must be an integer >= {minimum}, got {v!r}")

        def number(name: str, low: float, high: float, low_open: bool = False) -> None:
            v = getattr(self, name)
            ok = (isinstance(v, (int, float, np.floating)) and not isinstance(v, bool)
                  and np.isfinite(v) and (v > low if low_open else v >= low) and v <= high)
            if not ok:
                bound = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high != np.inf else "")
                raise InputError(f"{name} must be a number {bound}, got {v!r}")

        integer("max_new_tokens", 1)
        integer("min_new_tokens", 0)
        integer("top_k", 0)
        integer("no_repeat_ngram_size", 0)
        integer("num_beams", 1)
        integer("num_return_sequences", 1)
        number("temperature", 0.0, np.inf, low_open=True)
        number("top_p", 0.0, 1.0, low_open=True)
        number("repetition_penalty", 0.0, np.inf, low_open=True)
        number("length_penalty", -np.inf, np.inf)
        if self.early_stopping not in (True, False, "never"):
            raise InputError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if self.num_return_sequences > self.num_beams and not self.do_sample:
            raise InputError(f"num_return_sequences ({self.num_return_sequences}) must not exceed "
                             f"num_beams ({self.num_beams}) without sampling")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InputError(f"seed must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InputError(f"stop must be a list of non-empty strings, got {list(self.stop)!r}")
        return self


_OPTION_NAMES = {f.name for f in dataclasses.fields(GenerationOptions)}
# HF names that take a different shape here: lengths counted with the decoder start token.
_LENGTH_KEYS = {"max_length": "max_new_tokens", "min_length": "min_new_tokens"}


def _from_hf(params: dict | None, prompt_len: int = 1) -> dict:
    """Generation settings of an HF config dict in minfer's terms (only keys we know)."""
    out: dict[str, Any] = {}
    for key, value in (params or {}).items():
        if key in _LENGTH_KEYS and isinstance(value, int):
            out[_LENGTH_KEYS[key]] = max(value - prompt_len, 0 if key == "min_length" else 1)
        elif key in _OPTION_NAMES and key not in ("stop", "seed") and value is not None:
            out[key] = value
    if "max_new_tokens" in (params or {}) and params["max_new_tokens"] is not None:
        out["max_new_tokens"] = params["max_new_tokens"]
    if "min_new_tokens" in (params or {}) and params["min_new_tokens"] is not None:
        out["min_new_tokens"] = params["min_new_tokens"]
    return out


def resolve_options(model: Any, task: str | None = None, **overrides: Any) -> tuple[GenerationOptions, str]:
    """Options from (lowest first) minfer's defaults, config.json's generation keys, the checkpoint's
    generation_config.json, the task's task_specific_params, then explicit arguments (None = unset).
    Returns the options and the task's prompt prefix."""
    unknown = sorted(set(overrides) - _OPTION_NAMES)
    if unknown:
        raise InputError(f"unknown generation option {unknown[0]!r}")
    raw_config = getattr(model, "hf_config", {}) or {}
    settings: dict[str, Any] = {}
    settings.update(_from_hf({k: v for k, v in raw_config.items()
                              if k in _OPTION_NAMES or k in _LENGTH_KEYS}))
    generation_config = dict(model.generation_config or {})
    if generation_config.get("max_length") == 20 and "max_new_tokens" not in generation_config:
        generation_config.pop("max_length")  # HF's default cap copied into old files: not a choice
    settings.update(_from_hf(generation_config))
    prefix = ""
    if task is not None:
        tasks = raw_config.get("task_specific_params") or {}
        if task not in tasks:
            known = ", ".join(sorted(tasks)) or "none"
            raise InputError(f"task {task!r} is not defined by this checkpoint (known: {known})")
        params = dict(tasks[task])
        prefix = str(params.pop("prefix", "") or "")
        settings.update(_from_hf(params))
    settings.update({k: v for k, v in overrides.items() if v is not None})
    if isinstance(settings.get("stop"), str):
        settings["stop"] = (settings["stop"],)
    settings["stop"] = tuple(settings.get("stop", ()))
    if settings.get("min_new_tokens", 0) > settings.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS):
        if "min_new_tokens" not in overrides or overrides.get("min_new_tokens") is None:
            settings["min_new_tokens"] = settings.get("max_new_tokens")  # a task minimum vs user max
    options = GenerationOptions(**settings).validate()
    if options.min_new_tokens > options.max_new_tokens:
        raise InputError(f"min_new_tokens ({options.min_new_tokens}) exceeds max_new_tokens "
                         f"({options.max_new_tokens})")
    return options, prefix


def resolve_max_new_tokens(model: Any, max_new_tokens: int | None) -> int:
    return resolve_options(model, max_new_tokens=max_new_tokens)[0].max_new_tokens


# =====================================================================================================
# Logits processors (pure, vectorised): scores (b, V) float32, seqs (b, t) ids incl. the start token
# =====================================================================================================
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


# =====================================================================================================
# Token loops
# =====================================================================================================
def ids_of(model: Any) -> Any:
    """The token-id facts generation needs (eos, pad, start) of a model."""
    return getattr(model, "generation_ids", None) or model.config


def first_tokens(state: Any, cfg: Any, n: int) -> np.ndarray:
    first = getattr(state, "first_tokens", None)
    if first is None:
        return np.full(n, cfg.decoder_start_token_id, np.int64)
    return np.asarray(first, np.int64)


@dataclass
class Hypothesis:
    tokens: list[int]                  # decoder ids, starting with the start token
    score: float = 0.0
    finish_reason: str = "length"      # "eos", "length" or "stop"


def token_loop(model: Any, input_ids: np.ndarray, attention_mask: np.ndarray,
               opts: GenerationOptions, rng: np.random.Generator | None = None,
               stopped: set[int] | None = None, start_decoding: Any = None,
               info: dict | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Greedy or sampled decoding of a padded batch. Yields (rows, tokens) each step: the batch row
    indices still running and the token each chose. Rows that emit eos, or that the consumer adds to
    `stopped` (stop strings), leave the batch: the state drops them so they cost nothing more.
    `info`, if given, receives "first": the (B,) tokens fed at step 0, before the first yield.
    Closing the generator releases the decode state."""
    cfg = ids_of(model)
    eos = np.asarray(cfg.eos_token_ids, np.int64)
    B = input_ids.shape[0]
    rows = np.arange(B)
    stopped = stopped if stopped is not None else set()
    if opts.do_sample and rng is None:
        rng = np.random.default_rng(opts.seed)
    start = start_decoding or model.start_decoding
    with start(input_ids, attention_mask, opts.max_new_tokens) as state:
        seqs = np.empty((B, opts.max_new_tokens + 1), np.int64)                # (B, 1+N)
        seqs[:, 0] = first_tokens(state, cfg, B)
        if info is not None:
            info["first"] = seqs[:, 0].copy()  # what each row started from
        for t in range(opts.max_new_tokens):
            logits = np.asarray(model.backend.to_host(state.step(seqs[:, t])), np.float32)  # (b, V)
            scores = process(logits, seqs[:, :t + 1], opts, t, cfg.eos_token_ids)
            if opts.do_sample:
                tokens = sample(warp(scores, opts), rng)
            else:
                tokens = np.argmax(scores, axis=1).astype(np.int64)
            seqs[:, t + 1] = tokens
            yield rows, tokens
            done = (tokens[:, None] == eos).any(axis=1)  # (b,); np.isin costs ~30 us a call
            if stopped:
                done |= np.isin(rows, list(stopped))
            if done.all() or t + 1 == opts.max_new_tokens:
                return
            if done.any():
                keep = np.flatnonzero(~done)
                state.reorder(keep)
                rows, seqs = rows[keep], seqs[keep]


def beam_search(model: Any, input_ids: np.ndarray, attention_mask: np.ndarray,
                opts: GenerationOptions, rng: np.random.Generator | None = None) -> list[list[Hypothesis]]:
    """Beam search as HF transformers (4.x, vectorised form) runs it; returns per batch row the
    `num_return_sequences` best hypotheses, best first. With do_sample the 2*num_beams candidates
    are drawn without replacement (Gumbel top-k) instead of taken greedily."""
    cfg = ids_of(model)
    B, K, N = input_ids.shape[0], opts.num_beams, opts.max_new_tokens
    V = None
    L = N + 1                                      # decoder length limit incl. the start token
    eos = np.asarray(cfg.eos_token_ids, np.int64)
    keep_n = max(2, 1 + len(eos)) * K              # candidates per row (HF: enough to refill K)
    in_top_k = np.arange(keep_n) < K
    lp, es = opts.length_penalty, opts.early_stopping
    if opts.do_sample and rng is None:
        rng = np.random.default_rng(opts.seed)

    ids = np.repeat(input_ids, K, axis=0)
    mask = np.repeat(attention_mask, K, axis=0)
    with model.start_decoding(ids, mask, N) as state:
        fill = cfg.eos_token_ids[0] if len(eos) else cfg.pad_token_id   # HF pads with eos
        running = np.full((B, K, L), fill, np.int64)
        running[:, :, 0] = first_tokens(state, cfg, B * K).reshape(B, K)
        run_scores = np.zeros((B, K), np.float32)
        run_scores[:, 1:] = NEG
        fin_seqs, fin_scores = running.copy(), np.full((B, K), NEG, np.float32)
        fin_len = np.ones((B, K), np.int64)
        fin_done = np.zeros((B, K), bool)
        improvable = np.ones(B, bool)              # HF's "early stop heuristic unsatisfied"
        live = np.arange(B)                        # batch rows still computed
        for cur in range(1, L):                    # cur: decoder tokens so far
            b = len(live)
            logits = np.asarray(model.backend.to_host(
                state.step(running[live, :, cur - 1].reshape(-1))), np.float32)  # (b*K, V)
            V = logits.shape[1]
            logp = log_softmax(logits)
            logp = process(logp, running[live, :, :cur].reshape(b * K, cur), opts, cur - 1,
                           cfg.eos_token_ids)
            if opts.do_sample:
                logp = warp(logp, opts)
            acc = (logp.reshape(b, K, V) + run_scores[live, :, None]).reshape(b, K * V)
            if opts.do_sample:   # sample keep_n distinct candidates ~ softmax(acc): Gumbel top-k
                noisy = acc + rng.gumbel(size=acc.shape).astype(np.float32)
                top = np.argsort(-noisy, axis=1, kind="stable")[:, :keep_n]
            else:
                part = np.argpartition(-acc, keep_n - 1, axis=1)[:, :keep_n]
                order = np.argsort(-np.take_along_axis(acc, part, axis=1), axis=1, kind="stable")
                top = np.take_along_axis(part, order, axis=1)          # (b, keep_n) best first
            top_scores = np.take_along_axis(acc, top, axis=1)
            parent, token = top // V, top % V
            cand = np.take_along_axis(running[live], parent[:, :, None], axis=1)  # (b, keep_n, L)
            cand[:, :, cur] = token
            ends = np.isin(token, eos) | (cur + 1 >= L)

            # running beams for the next step: the best K candidates that did not end
            run_pick = np.argsort(-(top_scores + ends * NEG), axis=1, kind="stable")[:, :K]
            new_running = np.take_along_axis(cand, run_pick[:, :, None], axis=1)
            new_run_scores = np.take_along_axis(top_scores + ends * NEG, run_pick, axis=1)
            origin = np.take_along_axis(parent, run_pick, axis=1)               # (b, K)

            # finished hypotheses: merge candidates that just ended (within the top K) with the kept
            fscores = top_scores / np.float32((cur + 1 - 1) ** lp)
            full = fin_done[live].all(axis=1) & (es is True)
            fscores = fscores + (full[:, None] * NEG) + ((~improvable[live])[:, None] * NEG)
            just = ends & in_top_k[None, :]
            fscores = fscores + (~just) * NEG
            m_seqs = np.concatenate([fin_seqs[live], cand], axis=1)
            m_scores = np.concatenate([fin_scores[live], fscores], axis=1)
            m_len = np.concatenate([fin_len[live], np.full(cand.shape[:2], cur + 1)], axis=1)
            m_done = np.concatenate([fin_done[live], just], axis=1)
            pick = np.argsort(-m_scores, axis=1, kind="stable")[:, :K]
            fin_seqs[live] = np.take_along_axis(m_seqs, pick[:, :, None], axis=1)
            fin_scores[live] = np.take_along_axis(m_scores, pick, axis=1)
            fin_len[live] = np.take_along_axis(m_len, pick, axis=1)
            fin_done[live] = np.take_along_axis(m_done, pick, axis=1)

            running[live], run_scores[live] = new_running, new_run_scores
            cur_next = cur + 1
            hyp_len = (L - 1) if (es == "never" and lp > 0) else (cur_next - 1)
            best_running = run_scores[live, 0] / np.float32(hyp_len ** lp)
            worst = np.where(fin_done[live], fin_scores[live].min(axis=1, keepdims=True), NEG)
            improvable[live] &= (best_running[:, None] > worst).any(axis=1)
            row_open = improvable[live] & ~(fin_done[live].all(axis=1) & (es is True)) \
                & ~ends.all(axis=1)
            if not row_open.any() or cur_next >= L:
                break
            # beams follow their parents; rows that can no longer change leave the batch
            flat = (np.arange(b)[:, None] * K + origin)
            keep_rows = np.flatnonzero(row_open)
            state.reorder(flat[keep_rows].reshape(-1), cross=len(keep_rows) != b)
            live = live[keep_rows]

    results = []
    for r in range(B):
        hyps = []
        for j in range(opts.num_return_sequences):
            n = int(fin_len[r, j])
            tokens = [int(t) for t in fin_seqs[r, j, :n]]
            reason = "eos" if n > 1 and tokens[-1] in cfg.eos_token_ids else "length"
            hyps.append(Hypothesis(tokens, float(fin_scores[r, j]), reason))
        results.append(hyps)
    return results


def greedy_generate(model: Any, input_ids: np.ndarray, attention_mask: np.ndarray,
                    max_new_tokens: int | None = None, min_new_tokens: int = 0) -> list[list[int]]:
    """Greedy decoding of token ids: per row [start, tok, ..., eos?]."""
    opts, _ = resolve_options(model, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens)
    return [h[0].tokens for h in decode_ids(model, input_ids, attention_mask, opts)]


def decode_ids(model: Any, input_ids: np.ndarray, attention_mask: np.ndarray,
               opts: GenerationOptions) -> list[list[Hypothesis]]:
    """Any decoding mode over token ids, without text: per row a list of hypotheses."""
    if opts.num_beams > 1:
        return beam_search(model, input_ids, attention_mask, opts)
    n = opts.num_return_sequences
    ids, mask = np.repeat(input_ids, n, axis=0), np.repeat(attention_mask, n, axis=0)
    hyps = [Hypothesis([]) for _ in range(ids.shape[0])]
    eos = set(ids_of(model).eos_token_ids)
    info: dict = {}
    for step, (rows, tokens) in enumerate(token_loop(model, ids, mask, opts, info=info)):
        if step == 0:
            for r, first in enumerate(info["first"]):
                hyps[r].tokens.append(int(first))
        for r, tok in zip(rows, tokens):
            hyps[r].tokens.append(int(tok))
            if tok in eos:
                hyps[r].finish_reason = "eos"
    return [hyps[i * n:(i + 1) * n] for i in range(input_ids.shape[0])]


# =====================================================================================================
# The text layer: prompts in, text (or ids) out, optionally streamed
# =====================================================================================================
class StopMatcher:
    """Cuts streamed text at the first stop string, holding back any tail that could still become
    one, so what is emitted never has to be taken back."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """New text in -> (text safe to emit, whether a stop string was hit)."""
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[:min(hits)], True
        hold = 0
        for s in self.stops:  # longest suffix of buf that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Result:
    """One generated sequence with what the CLI's --json and callers may want to know."""
    text: str | None             # None for token-id requests without a tokenizer
    token_ids: list[int]         # encoder-decoder: starts with the decoder start token (HF's
                                 # convention); decoder-only: the new tokens only
    finish_reason: str           # "eos", "length" or "stop"
    prompt_tokens: int
    new_tokens: int
    seconds: float = 0.0
    score: float | None = None   # beam score (length-penalised log-probability)


class _RowText:
    """Per-row streaming detokeniser plus stop-string matcher."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], eos: set[int]):
        from .tokenizer import IncrementalDecoder
        self.decoder = IncrementalDecoder(tokenizer)
        self.matcher = StopMatcher(stops)
        self.eos = eos
        self.text: list[str] = []
        self.stopped = False

    def push(self, token: int) -> str:
        """A new token -> the text it makes safe to emit ("" while held back)."""
        if self.stopped or token in self.eos:
            return ""
        out, self.stopped = self.matcher.feed(self.decoder.push(int(token)))
        self.text.append(out)
        return out

    def finish(self) -> str:
        if self.stopped:
            return ""
        out, self.stopped = self.matcher.feed(self.decoder.flush())
        if not self.stopped:
            out += self.matcher.flush()
        self.text.append(out)
        return out


def _normalise_inputs(inputs: Any) -> tuple[str, list]:
    """-> ("text", [str]) | ("texts", [str, ...]) | ("ids", [[int, ...], ...])."""
    if isinstance(inputs, str):
        return "text", [inputs]
    if isinstance(inputs, np.ndarray) or (hasattr(inputs, "shape") and hasattr(inputs, "dtype")):
        arr = np.asarray(inputs)
        return "ids", [list(r) for r in (arr[None] if arr.ndim == 1 else arr)]
    if isinstance(inputs, (list, tuple)) and inputs:
        if all(isinstance(p, str) for p in inputs):
            return "texts", list(inputs)
        if all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in inputs):
            return "ids", [list(inputs)]
        return "ids", list(inputs)
    raise InputError("inputs: expected a prompt string, a list of prompts or token-id lists, "
                     f"got {type(inputs).__name__ if inputs is not None else 'None'}"
                     + (" (empty)" if isinstance(inputs, (list, tuple)) else ""))


def _need_tokenizer(model: Any, why: str) -> Any:
    if getattr(model, "tokenizer", None) is None:
        raise InputError(f"{why} requires a tokenizer, and {model.folder} has none "
                         "(tokenizer.json or spiece.model): pass token ids instead")
    return model.tokenizer


def _prompt_ids(model: Any, kind: str, prompts: list, prefix: str, tok: Any) -> list[list[int]]:
    if kind == "ids":
        pre = tok.encode(prefix, add_eos=False) if prefix and tok is not None else []
        return [pre + list(p) for p in prompts]
    if any(not p.strip() for p in prompts):
        raise InputError("inputs: empty prompt")
    add_eos = getattr(model, "add_eos_to_prompt", True)
    return [tok.encode(prefix + p, add_eos=add_eos) for p in prompts]


def _batches(model: Any, rows: list, attention_mask: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """One padded batch, or (decoder-only models, which cannot pad) one batch per length."""
    if attention_mask is not None:
        return [model.batch(np.asarray(rows), attention_mask)]
    if getattr(model, "is_encoder_decoder", True) or len({len(r) for r in rows}) <= 1:
        return [model.batch(rows)]
    return [model.batch([r]) for r in rows]


def _finish(model: Any, h: Hypothesis, text: str | None, reason: str, prompt_len: int,
            score: float | None = None) -> Result:
    ids = h.tokens if getattr(model, "is_encoder_decoder", True) else h.tokens[1:]
    return Result(text, ids, reason, prompt_len, len(h.tokens) - 1, score=score)


def _run_batch(model: Any, ids: np.ndarray, mask: np.ndarray, opts: GenerationOptions,
               tok: Any) -> list[list[Result]]:
    eos = set(ids_of(model).eos_token_ids)
    n = opts.num_return_sequences
    prompt_lens = mask.sum(axis=1)
    enc_dec = getattr(model, "is_encoder_decoder", True)
    if opts.num_beams > 1:
        results = []
        for i, hyps in enumerate(beam_search(model, ids, mask, opts)):
            row = []
            for h in hyps:
                text, reason = None, h.finish_reason
                if tok is not None:
                    text, hit = StopMatcher(opts.stop).feed(
                        tok.decode(h.tokens if enc_dec else h.tokens[1:]))
                    reason = "stop" if hit else reason
                row.append(_finish(model, h, text, reason, int(prompt_lens[i]), h.score))
            results.append(row)
        return results
    rep_ids, rep_mask = np.repeat(ids, n, axis=0), np.repeat(mask, n, axis=0)
    hyps = [Hypothesis([]) for _ in range(rep_ids.shape[0])]
    texts = [_RowText(tok, opts.stop, eos) for _ in hyps] if tok is not None else None
    stopped: set[int] = set()
    info: dict = {}
    for step, (rows, tokens) in enumerate(token_loop(model, rep_ids, rep_mask, opts,
                                                     stopped=stopped, info=info)):
        if step == 0:
            for h, first in zip(hyps, info["first"]):
                h.tokens.append(int(first))
        for r, t in zip(rows, tokens):
            hyps[r].tokens.append(int(t))
            if t in eos:
                hyps[r].finish_reason = "eos"
            elif texts is not None:
                texts[r].push(t)
                if texts[r].stopped:
                    stopped.add(int(r))
                    hyps[r].finish_reason = "stop"
    results = []
    for i in range(ids.shape[0]):
        row = []
        for j in range(i * n, (i + 1) * n):
            text = None
            if texts is not None:
                texts[j].finish()
                text = "".join(texts[j].text)
            row.append(_finish(model, hyps[j], text, hyps[j].finish_reason, int(prompt_lens[i])))
        results.append(row)
    return results


def run(model: Any, inputs: Any, *, task: str | None = None, attention_mask: Any = None,
        **options: Any) -> tuple[str, list[list[Result]]]:
    """Decode every prompt; returns the input kind and per prompt its list of results."""
    opts, prefix = resolve_options(model, task, **options)
    kind, prompts = _normalise_inputs(inputs)
    tok = getattr(model, "tokenizer", None)
    if kind != "ids" or opts.stop:
        tok = _need_tokenizer(model, "text input" if kind != "ids" else "stop strings")
    rows = _prompt_ids(model, kind, prompts, prefix, tok)
    results: list[list[Result]] = []
    for ids, mask in _batches(model, rows, attention_mask):
        t0 = time.perf_counter()
        batch_results = _run_batch(model, ids, mask, opts, tok)
        seconds = time.perf_counter() - t0
        for row in batch_results:
            for r in row:
                r.seconds = seconds
        results += batch_results
    return kind, results


def stream(model: Any, inputs: Any, *, task: str | None = None, start_decoding: Any = None,
           on_done: Any = None, **options: Any) -> Iterator[Any]:
    """Text pieces (or token ids, for token-id input) as they are decided, for one prompt.
    Beam search cannot know its result before the end: it yields the final text once.
    Closing the iterator stops decoding and releases its arena memory. Inputs are checked now,
    not at the first `next()`. `on_done(tokens)` receives the generated ids when the stream ends."""
    opts, prefix = resolve_options(model, task, **options)
    kind, prompts = _normalise_inputs(inputs)
    if len(prompts) != 1:
        raise InputError(f"stream=True takes one prompt, got {len(prompts)}")
    if opts.num_return_sequences != 1:
        raise InputError("stream=True returns one sequence: num_return_sequences must be 1")
    tok = getattr(model, "tokenizer", None)
    if kind != "ids" or opts.stop:
        tok = _need_tokenizer(model, "text input" if kind != "ids" else "stop strings")
    rows = _prompt_ids(model, kind, prompts, prefix, tok)
    if opts.num_beams > 1:
        if start_decoding is not None:
            raise InputError("beam search cannot continue a session: use num_beams=1")
        return _stream_beam(model, rows, kind, opts, tok)
    ids, mask = model.batch(rows)
    return _stream_tokens(model, ids, mask, kind, opts, tok, start_decoding, on_done)


def _stream_beam(model: Any, rows: list, kind: str, opts: GenerationOptions, tok: Any) -> Iterator[Any]:
    ids, mask = model.batch(rows)
    r = _run_batch(model, ids, mask, opts, tok)[0][0]
    if kind != "ids":
        yield r.text
    else:
        yield from r.token_ids[len(r.token_ids) - r.new_tokens:]


def _stream_tokens(model: Any, ids: np.ndarray, mask: np.ndarray, kind: str,
                   opts: GenerationOptions, tok: Any, start_decoding: Any,
                   on_done: Any) -> Iterator[Any]:
    eos = set(ids_of(model).eos_token_ids)
    text = _RowText(tok, opts.stop, eos) if kind != "ids" or opts.stop else None
    generated: list[int] = []
    loop = token_loop(model, ids, mask, opts, start_decoding=start_decoding)
    try:
        for _, tokens in loop:
            t = int(tokens[0])
            generated.append(t)
            if text is not None:
                piece = text.push(t)
                if kind != "ids" and piece:
                    yield piece
                if text.stopped:
                    return
            if kind == "ids":
                yield t
        if kind != "ids":
            tail = text.finish()
            if tail:
                yield tail
    finally:
        loop.close()
        if on_done is not None:
            on_done(generated)


def session_generate(session: Any, prompt: Any, *, stream: bool = False, **options: Any) -> Any:
    """Generate inside a decoder-only model's session: the prompt continues what the session has
    seen (memory), and what is generated is remembered for the next call."""
    import functools
    model = session.model
    opts, _ = resolve_options(model, **options)
    if opts.num_beams != 1 or opts.num_return_sequences != 1:
        raise InputError("a session continues one sequence: num_beams and num_return_sequences "
                         "must be 1")
    kind = "ids" if not isinstance(prompt, str) else "text"
    if kind == "text":
        new = (_need_tokenizer(model, "text input").encode(prompt, add_eos=False)
               if prompt.strip() else [])
    else:
        new = [int(t) for t in prompt]
    ids = ([session.last_token] if session.last_token is not None else []) + new
    if not ids:
        raise InputError("session: nothing to continue from: give a prompt")
    session.last_token = None

    def remember(tokens: list[int]) -> None:
        session.last_token = tokens[-1] if tokens else ids[-1]

    start = functools.partial(model.start_decoding, memory=session.memory)
    tok = _need_tokenizer(model, "stop strings") if (kind == "text" or opts.stop) else None
    batch, mask = model.batch([ids])
    pieces = _stream_tokens(model, batch, mask, kind, opts, tok, start, remember)
    if stream:
        return pieces
    out = list(pieces)
    return "".join(out) if kind == "text" else out


def generate(model: Any, inputs: Any, *, stream_output: bool = False, task: str | None = None,
             return_details: bool = False, attention_mask: Any = None, **options: Any) -> Any:
    """The public generate(): see `T5Model.generate`."""
    if stream_output:
        if return_details or attention_mask is not None:
            raise InputError("stream=True does not combine with return_details or attention_mask")
        return stream(model, inputs, task=task, **options)
    kind, results = run(model, inputs, task=task, attention_mask=attention_mask, **options)
    if return_details:
        return results
    if kind == "ids":
        return [r.token_ids for row in results for r in row]
    texts = [[r.text for r in row] for row in results]
    shaped = [t[0] if len(t) == 1 else t for t in texts]
    return shaped[0] if kind == "text" else shaped
