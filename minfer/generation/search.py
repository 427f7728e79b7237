"""The search loops: greedy and sampled decoding, and beam search, over any `DecodingModel`.

Semantics follow Hugging Face transformers' generate() (see docs/architecture.md): rows that end
(eos, or a stop string the caller reports) leave the batch so they cost nothing more; beam search
is transformers 4.57's vectorised form: top 2*num_beams candidates over num_beams*V, candidates
that end within the top num_beams are finalised with score sum_logprobs / new_len**length_penalty,
and early_stopping True / False / "never" behave as HF defines them.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from ..errors import Cancelled, InputError
from .batcher import Request, batcher_of
from .options import GenerationOptions
from .processors import log_softmax, process, sample, top_k_indices, warp
from .protocol import DecodingModel
from .structured import RowGrammars, grammar_for

NEG = np.float32(-1e9)  # HF's "finished / impossible" score offset in beam search


@dataclass
class Hypothesis:
    tokens: list[int]                  # decoder ids, starting with the start token
    score: float = 0.0
    finish_reason: str = "length"      # "eos", "length" or "stop"
    # with the logprobs option: per new token its log-probability and the best alternatives
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class StepLogprobs:
    """One step's log-probabilities of the live rows, in the order of the step's tokens."""
    chosen: np.ndarray                 # (b,) float32: each row's token
    top_ids: np.ndarray                # (b, k) int64: the k likeliest tokens, best first
    top_values: np.ndarray             # (b, k) float32: their log-probabilities


def step_logprobs(logits: np.ndarray, tokens: np.ndarray, k: int) -> StepLogprobs:
    """Rows of raw scores (b, V) and the tokens chosen from them (b,) -> their log-softmax at
    those tokens and the k best, a chunk of rows at a time (the copies stay a few MiB)."""
    b = len(tokens)
    chosen = np.empty(b, np.float32)
    top_ids, top_values = np.empty((b, k), np.int64), np.empty((b, k), np.float32)
    for a, e in row_chunks(*logits.shape):
        lp = log_softmax(logits[a:e])                                      # (r, V)
        chosen[a:e] = lp[np.arange(e - a), tokens[a:e]]
        if k:
            top_ids[a:e] = top_k_indices(lp, k)
            top_values[a:e] = np.take_along_axis(lp, top_ids[a:e], axis=1)
    return StepLogprobs(chosen, top_ids, top_values)


class Decoding(Request):
    """One request's greedy or sampled decoding, a step at a time, so that the batcher can take
    the steps of concurrent requests together: `feed()` gives the tokens the next step reads,
    `advance(scores)` chooses each live row's token and returns (rows, tokens). Rows that emit
    eos, or that the consumer adds to `stopped` (stop strings) after seeing their token, leave
    the state before the next step, so they cost nothing more."""

    def __init__(self, model: DecodingModel, state: Any, opts: GenerationOptions,
                 rng: np.random.Generator | None, stopped: set[int]):
        super().__init__(runs_ahead=not opts.stop)   # no stop string can end a row from outside
        self.state, self.opts, self.rng, self.stopped = state, opts, rng, stopped
        self.eos_ids = model.token_ids.eos
        self.eos = np.asarray(self.eos_ids, np.int64)
        B = state.batch
        self.rows = np.arange(B)                                   # original row of each live row
        self.seqs = np.empty((B, opts.max_new_tokens + 1), np.int64)  # (b, 1+N)
        self.seqs[:, 0] = state.first_tokens
        self.t = 0
        self.logprobs: collections.deque[StepLogprobs] = collections.deque()  # one per event
        # structured output: one grammar state per row, reordered with the rows
        self.grammars = (RowGrammars(grammar_for(model.tokenizer, opts.response_format), B,
                                     self.eos_ids)
                         if opts.response_format is not None else None)

    def ready(self) -> bool:
        """Drop the rows that ended at the last step (eos, or a stop string the consumer found);
        False when none is left."""
        if self.t == 0:
            return True
        done = (self.seqs[:, self.t, None] == self.eos).any(axis=1)  # np.isin costs ~30 us a call
        if self.stopped:
            done |= np.isin(self.rows, list(self.stopped))
        if done.all():
            self.finished = True
            return False
        if done.any():
            keep = np.flatnonzero(~done)
            self.state.reorder(keep)
            self.rows, self.seqs = self.rows[keep], self.seqs[keep]
            if self.grammars is not None:
                self.grammars.keep(keep)
        return True

    def feed(self) -> np.ndarray:
        return self.seqs[:, self.t]

    def advance(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t, opts = self.t, self.opts
        tokens = np.empty(len(logits), np.int64)
        ok = (self.grammars.allowed(logits.shape[1], opts.max_new_tokens - t, first=t == 0)
              if self.grammars is not None else None)               # (b, V) bools
        for a, b in row_chunks(*logits.shape):   # the processors' copies stay a few MiB
            tokens[a:b] = self._choose(logits[a:b], self.seqs[a:b, :t + 1],
                                       None if ok is None else ok[a:b])
        if self.grammars is not None:
            self.grammars.advance(tokens, t)
        self.seqs[:, t + 1] = tokens
        if opts.logprobs is not None:
            self.logprobs.append(step_logprobs(logits, tokens, opts.logprobs))
        self.t = t + 1
        if self.t == opts.max_new_tokens or (tokens[:, None] == self.eos).any(axis=1).all():
            self.finished = True
        return self.rows, tokens

    def _choose(self, logits: np.ndarray, seqs: np.ndarray,
                allowed: np.ndarray | None = None) -> np.ndarray:
        """Rows of logits (r, V) and their sequences so far -> each row's token (r,); `allowed`
        (r, V): what a response format's grammar lets each row choose."""
        t, opts = self.t, self.opts
        scores = process(logits, seqs, opts, t, self.eos_ids)
        if allowed is not None:
            scores = np.where(allowed, scores, np.float32(-np.inf))
        if opts.do_sample:
            best = scores.max(axis=1, keepdims=True)                        # (r, 1)
        else:
            tokens = np.argmax(scores, axis=1).astype(np.int64)
            best = np.take_along_axis(scores, tokens[:, None], axis=1)      # (r, 1)
        if not np.isfinite(best).all():
            # argmax would pick id 0 and the sampler's cdf would be NaN: a silent wrong token
            raise InputError(f"step {t}: no token has a finite score (no_repeat_ngram_size "
                             f"{opts.no_repeat_ngram_size} can ban the whole vocabulary, "
                             f"min_new_tokens can ban the eos a response_format needs, or "
                             f"the model's logits overflowed)")
        if opts.do_sample:
            # shifted so the best score is 0 first: softmax and the warpers are shift-invariant,
            # and (x - best) / temperature <= 0 cannot overflow however small the temperature
            # (it goes to -inf: a tiny temperature is greedy decoding, not NaN); that
            # overflow is intended, so NumPy need not warn about it. Chunks draw in row order:
            # the same draws as one call over every row.
            with np.errstate(over="ignore"):
                tokens = sample(warp(scores - best, opts), self.rng)
        return tokens


# The searches' host work over (rows, V) scores runs this many bytes of float32 rows at a time:
# their copies (log-softmax, the processors', the sampler's cumulative sums, Gumbel noise) stay
# a bounded few MiB outside the arena whatever the number of rows (640 sampled beams of t5-small
# had 1.3 GB of them: twice a 600 MiB memory limit).
SEARCH_CHUNK_BYTES = 4 << 20


def row_chunks(rows: int, width: int) -> Iterator[tuple[int, int]]:
    """[a, b) ranges covering `rows` rows of `width` float32 scores, SEARCH_CHUNK_BYTES each."""
    step = max(1, SEARCH_CHUNK_BYTES // max(4 * width, 1))
    for a in range(0, rows, step):
        yield a, min(rows, a + step)


def beam_candidates(logits: np.ndarray, seqs: np.ndarray, run_scores: np.ndarray,
                    opts: GenerationOptions, step: int, eos_ids: Any, K: int, keep_n: int,
                    rng: np.random.Generator | None,
                    allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Beam search's candidates of one step: logits (b*K, V) of b inputs' K beams, their
    sequences (b*K, t) and running scores (b, K) -> per input the `keep_n` best (scores (b,
    keep_n), flat indices beam * V + token into its K*V candidates), best first, ties in index
    order. Sampling: drawn without replacement, keep_n ~ softmax(scores) by Gumbel top-k.
    `allowed` (b*K, V): what a response format's grammar lets each beam choose (else -inf).

    The beams' rows are scored a chunk at a time, each row keeping its own keep_n best: the
    input's keep_n best are among those (a candidate beaten by keep_n of its own row's cannot be
    in the input's best keep_n), so the result equals one top-k over (b, K*V) scores that never
    exist whole. (With the compiled kernels ties fall in index order, as a stable sort's; the
    NumPy fallback's top-k may break ties at its partition's edge either way, as it always did.)"""
    R, V = logits.shape
    b = R // K
    k = min(keep_n, V)                           # a row has only V candidates
    vals = np.empty((R, k), np.float32)          # each row's k best: scores (sampled: noisy)
    keys = np.empty((R, k), np.float32)          # ... and the scores they carry
    idx = np.empty((R, k), np.int64)
    flat_scores = run_scores.reshape(R)
    for a, e in row_chunks(R, V):
        logp = log_softmax(logits[a:e])
        logp = process(logp, seqs[a:e], opts, step, eos_ids)
        if allowed is not None:
            logp = np.where(allowed[a:e], logp, np.float32(-np.inf))
        if opts.do_sample:
            logp = warp(logp, opts)
        acc = logp + flat_scores[a:e, None]                                  # (r, V)
        if opts.do_sample:   # Gumbel noise, drawn in (row, token) order as over the whole
            noisy = acc + rng.gumbel(size=acc.shape).astype(np.float32)
            top = top_k_indices(noisy, k)
            vals[a:e] = np.take_along_axis(noisy, top, axis=1)
        else:
            top = top_k_indices(acc, k)
            vals[a:e] = np.take_along_axis(acc, top, axis=1)
        keys[a:e] = np.take_along_axis(acc, top, axis=1)
        idx[a:e] = top
    # Laid out (b, K * k), beam by beam, each beam's best first with ties in token order:
    # among equal values that is the order of their flat indices beam * V + token, so a top-k
    # that breaks ties by position breaks them by flat index, as one over K*V would.
    pick = top_k_indices(vals.reshape(b, K * k), keep_n)                    # (b, keep_n)
    beam, rank = pick // k, pick % k
    rows = np.arange(b)[:, None] * K + beam                                 # rows of idx / keys
    return keys[rows, rank], beam * V + idx[rows, rank]


def token_loop(model: DecodingModel, input_ids: np.ndarray, attention_mask: np.ndarray,
               opts: GenerationOptions, rng: np.random.Generator | None = None,
               stopped: set[int] | None = None, start_decoding: Any = None,
               info: dict | None = None, repeat: int = 1,
               cancel: Any = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Greedy or sampled decoding of a padded batch. Yields (rows, tokens) each step: the batch row
    indices still running and the token each chose. Rows that emit eos, or that the consumer adds to
    `stopped` (stop strings), leave the batch: the state drops them so they cost nothing more.
    `info`, if given, receives "first": the (B,) tokens fed at step 0, before the first yield,
    and with the logprobs option "logprobs": the StepLogprobs of the step just yielded.
    `repeat`: each input decodes as that many consecutive rows (num_return_sequences).
    Steps are taken together with the other requests decoding on the model at the same time
    (batcher.py). Closing the generator releases the decode state. `cancel` (a threading.Event)
    set from another thread ends it with `Cancelled` within a step (or a wait for memory)."""
    if opts.do_sample and rng is None:
        rng = np.random.default_rng(opts.seed)
    start = start_decoding or model.start_decoding
    batcher = batcher_of(model)
    # the state's context is closed by the batcher (`release`), as soon as the decoding ends or
    # its consumer abandons it, even while another thread's step is using it
    stack = contextlib.ExitStack()
    state = batcher.admit(lambda: stack.enter_context(
        start(input_ids, attention_mask, opts.max_new_tokens, repeat=repeat)), cancel)
    try:
        decoding = Decoding(model, state, opts, rng, stopped if stopped is not None else set())
    except BaseException:
        batcher.join(None, release=stack.close)   # (gives the state back at once)
        raise
    decoding.cancel = cancel
    if info is not None:   # (before joining: another thread's step may drop rows right after)
        info["first"] = decoding.seqs[:, 0].copy()  # what each row started from
    batcher.join(decoding, release=stack.close)
    try:
        while (event := batcher.next_event(decoding)) is not None:
            if opts.logprobs is not None:   # (advance adds one an event)
                entry = decoding.logprobs.popleft()
                if info is not None:
                    info["logprobs"] = entry
            yield event
    finally:
        batcher.leave(decoding)


def beam_search(model: DecodingModel, input_ids: np.ndarray, attention_mask: np.ndarray,
                opts: GenerationOptions, rng: np.random.Generator | None = None,
                cancel: Any = None) -> list[list[Hypothesis]]:
    """Beam search as HF transformers (4.x, vectorised form) runs it; returns per batch row the
    `num_return_sequences` best hypotheses, best first. With do_sample the 2*num_beams candidates
    are drawn without replacement (Gumbel top-k) instead of taken greedily."""
    token_ids = model.token_ids
    B, K, N = input_ids.shape[0], opts.num_beams, opts.max_new_tokens
    V = None
    L = N + 1                                      # decoder length limit incl. the start token
    eos = np.asarray(token_ids.eos, np.int64)
    keep_n = max(2, 1 + len(eos)) * K              # candidates per row (HF: enough to refill K)
    in_top_k = np.arange(keep_n) < K
    lp, es = opts.length_penalty, opts.early_stopping
    if opts.do_sample and rng is None:
        rng = np.random.default_rng(opts.seed)

    with batcher_of(model).admitted(lambda: model.start_decoding(input_ids, attention_mask, N,
                                                                  repeat=K), cancel) as state:
        fill = token_ids.eos[0] if len(eos) else token_ids.pad   # HF pads with eos
        running = np.full((B, K, L), fill, np.int64)
        running[:, :, 0] = np.asarray(state.first_tokens).reshape(B, K)
        run_scores = np.zeros((B, K), np.float32)
        run_scores[:, 1:] = NEG
        fin_seqs, fin_scores = running.copy(), np.full((B, K), NEG, np.float32)
        fin_len = np.ones((B, K), np.int64)
        fin_done = np.zeros((B, K), bool)
        improvable = np.ones(B, bool)              # HF's "early stop heuristic unsatisfied"
        live = np.arange(B)                        # batch rows still computed
        # structured output: one grammar state per running beam (b*K, in the running order)
        grammars = (RowGrammars(grammar_for(model.tokenizer, opts.response_format), B * K,
                                token_ids.eos) if opts.response_format is not None else None)
        for cur in range(1, L):                    # cur: decoder tokens so far
            if cancel is not None and cancel.is_set():   # (another thread: see token_loop)
                raise Cancelled("cancelled")
            b = len(live)
            logits = state.step(running[live, :, cur - 1].reshape(-1))          # (b*K, V)
            V = logits.shape[1]
            # (else every beam sinks to "impossible", unnamed; max and min see NaN and inf
            # without a (rows, V) mask)
            if not (np.isfinite(logits.max()) and np.isfinite(logits.min())):
                raise InputError(f"step {cur - 1}: the model's logits are not finite (its "
                                 "weights or activations overflowed)")
            top_scores, top = beam_candidates(
                logits, running[live, :, :cur].reshape(b * K, cur), run_scores[live], opts,
                cur - 1, token_ids.eos, K, keep_n, rng,   # (b, keep_n) each
                None if grammars is None else grammars.allowed(V, L - cur, first=cur == 1))
            parent, token = top // V, top % V
            cand = np.take_along_axis(running[live], parent[:, :, None], axis=1)  # (b, keep_n, L)
            cand[:, :, cur] = token
            ends = np.isin(token, eos) | (cur + 1 >= L)

            # running beams for the next step: the best K candidates that did not end
            run_pick = np.argsort(-(top_scores + ends * NEG), axis=1, kind="stable")[:, :K]
            new_running = np.take_along_axis(cand, run_pick[:, :, None], axis=1)
            new_run_scores = np.take_along_axis(top_scores + ends * NEG, run_pick, axis=1)
            origin = np.take_along_axis(parent, run_pick, axis=1)               # (b, K)
            if grammars is not None:   # beams follow their parents' grammar states (forked)
                grammars.keep((np.arange(b)[:, None] * K + origin).reshape(-1))
                # a beam at -inf took a token its grammar forbids: it can never win, so it
                # keeps no state (and is allowed nothing) rather than consume that token
                grammars.drop(np.flatnonzero(~np.isfinite(new_run_scores.reshape(-1))))
                grammars.advance(new_running[:, :, cur].reshape(-1), cur - 1)

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
            if grammars is not None:
                grammars.keep((keep_rows[:, None] * K + np.arange(K)).reshape(-1))

    # A slot that never finished still holds the -1e9 placeholder: every real score of that row
    # sank below HF's "impossible" offset (a strongly negative length_penalty multiplies scores
    # by up to length**-length_penalty). Returning the placeholder would be an empty result with
    # score -1e9, silently; refuse instead.
    unfinished = ~fin_done[:, :opts.num_return_sequences].all(axis=1)
    if unfinished.any():
        why = (f"length_penalty {lp:g} scales scores by up to {L}**{-lp:g}: use one nearer 0"
               if lp < 0 else f"no_repeat_ngram_size {opts.no_repeat_ngram_size} can ban every "
               "token, and a low temperature scales sampled beam scores by 1/temperature")
        raise InputError(f"beam search: row {int(np.argmax(unfinished))} has no hypothesis scored "
                         f"above -1e9, the search's 'impossible' offset ({why})")
    results = []
    for r in range(B):
        hyps = []
        for j in range(opts.num_return_sequences):
            n = int(fin_len[r, j])
            tokens = [int(t) for t in fin_seqs[r, j, :n]]
            reason = "eos" if n > 1 and tokens[-1] in token_ids.eos else "length"
            hyps.append(Hypothesis(tokens, float(fin_scores[r, j]), reason))
        results.append(hyps)
    return results
