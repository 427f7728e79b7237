"""The text layer's call: prompts in, text (or token ids) out, optionally streamed as decided.

A call (`_Call`) settles its options, task prefix and tokenizer once; its prompts are checked
(prompts.py), tokenized (with the task's prefix), batched (planning.py), decoded by the search
loops, and detokenized per row as tokens arrive, with stop strings cut as soon as they appear and
never emitted (streaming.py). `generate` is what the models' public `generate()` calls.

Batching: any number of prompts is split into batches (`plan_batches`): shortest first within a
window, each batch at most `max_batch_size` prompts and no more than the model's memory plan fits
in the arena's free bytes (`BatchPlanner`); results go back in input order. A prompt that cannot
run is a per-row error (`Result.error`), raised by plain `generate`. `run_iter` does the same
over an iterable of any length, a window at a time, in bounded memory (the CLI's bulk mode).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ..errors import ArenaExhausted, Cancelled, InputError, MinferError
from . import planning
from .options import GenerationOptions, resolve_options, split_batch_options
from .planning import BadRow, BatchPlanner, plan_batches, take_window
from ..tokenizers.select import need_tokenizer
from .prompts import TRUNCATION_CURE, check_prompt, normalise_inputs, row_names
from .protocol import DecodingModel
from .search import Hypothesis, StepLogprobs, beam_search, step_logprobs, token_loop
from .streaming import StopMatcher, Stream, _RowText, row_logprobs, stream_tokens
from .structured import grammar_for


@dataclass
class Result:
    """One generated sequence with what the CLI's --json and callers may want to know."""
    text: str | None             # None for token-id requests without a tokenizer
    token_ids: list[int]         # encoder-decoder: starts with the decoder start token (HF's
                                 # convention); decoder-only: the new tokens only
    finish_reason: str           # "eos", "length" or "stop"
    prompt_tokens: int
    new_tokens: int
    seconds: float = 0.0         # the time of the batch the row ran in
    score: float | None = None   # beam score (length-penalised log-probability)
    # with the logprobs option: each new token's log-probability (the log-softmax of the
    # model's scores before temperature and penalties) and its best alternatives (id, value)
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None     # a row that could not run: why, naming it (then text is None,
                                 # token_ids empty and finish_reason "error")


# A prompt longer than this many characters per token of its limit is tokenized through
# `encode_window` (work bounded by the limit; exact, see tokenizers/window.py); shorter ones in
# one batch call, which is faster for many short prompts.
LONG_PROMPT_CHARS_PER_TOKEN = 16


def _failed(error: BaseException | str) -> list[Result]:
    return [Result(None, [], "error", 0, 0, error=str(error))]


class _Call:
    """What one call settles before any row runs (options, task prefix, tokenizer, one random
    generator for all its batches) and how its rows are prepared and decoded."""

    def __init__(self, model: DecodingModel, task: str | None, options: dict,
                 cancel: Any = None):
        self.batching, options = split_batch_options(options)
        self.cancel = cancel   # a threading.Event another thread may set: see run()
        self.opts, self.prefix = resolve_options(model, task, **options)
        self.model = model
        self.kind = "texts"
        self.tok = model.tokenizer
        o = self.opts
        self.repeat = o.num_beams if o.num_beams > 1 else o.num_return_sequences
        # one generator for the whole call: batches continue its stream instead of each
        # restarting from the seed (which would give rows of different batches the same draws)
        self.rng = np.random.default_rng(o.seed) if o.do_sample else None
        self.eos = set(model.token_ids.eos)

    def set_kind(self, kind: str) -> None:
        """The input's kind ("text", "texts" or "ids"), once its shape has been checked: text,
        and stop strings, need the tokenizer."""
        self.kind = kind
        if self.kind != "ids" or self.opts.stop or self.opts.response_format is not None:
            self.tok = need_tokenizer(self.model, "text input" if self.kind != "ids" else
                                      "stop strings" if self.opts.stop else "response_format")
        if self.opts.response_format is not None:   # a bad format is named before any row runs
            grammar_for(self.tok, self.opts.response_format)
        # token-id rows get the task's prefix as ids (text rows as text, before tokenizing)
        self.prefix_ids = (self.tok.encode(self.prefix, add_eos=False)
                           if kind == "ids" and self.prefix and self.tok is not None else [])

    def planner(self) -> BatchPlanner:
        return BatchPlanner(self.model, self.opts.max_new_tokens, self.repeat,
                            self.batching.max_batch_size)

    # -- rows -> token ids, or why not ---------------------------------------------------------------
    def prepare(self, items: Sequence, name: Callable[[int], str],
                planner: BatchPlanner) -> list[list[int] | MinferError]:
        """Each row's prompt token ids (task prefix, `</s>` as the family declares, truncated
        when asked), or the error that keeps it from running, naming it."""
        rows: list[Any] = [self._check(item, i, name(i)) for i, item in enumerate(items)]
        if self.kind != "ids":
            limit = self._token_limit(planner)
            todo = [i for i, r in enumerate(rows) if isinstance(r, str)]
            # a prompt far longer than the limit is tokenized only as far as the limit reaches
            # (a 10 MB prompt took 20 s and 2.9 GB before its error, even truncated to 64)
            long = {i for i in todo if limit is not None and
                    len(self.prefix) + len(rows[i]) > LONG_PROMPT_CHARS_PER_TOKEN * limit + 4096}
            for i in long:
                rows[i] = self._encode_long(self.prefix + rows[i], limit, name(i), planner)
            todo = [i for i in todo if i not in long]
            texts = [self.prefix + rows[i] for i in todo]   # one tokenizer call for the rest
            encoded = self.tok.encode_batch(texts, add_eos=self.model.add_eos_to_prompt) if texts else []
            for i, ids in zip(todo, encoded):
                rows[i] = ids
        for i, row in enumerate(rows):
            if isinstance(row, list):
                rows[i] = self._fit(row, name(i), planner)
        return rows

    def _token_limit(self, planner: BatchPlanner) -> int | None:
        """The most prompt tokens a row may have and run: max_input_tokens, else the longest
        prompt the arena holds alone (None: no bound, e.g. Transformer-XL's segments)."""
        given = self.batching.max_input_tokens
        return given if given is not None else planner.longest()

    def _encode_long(self, text: str, limit: int, where: str,
                     planner: BatchPlanner) -> list[int] | MinferError:
        """A long prompt's ids as `_fit` would leave them, the work bounded by `limit` (the
        tokenizer's encode_cut): the start (encoder-decoder) or the end (decoder-only) when it
        is cut; its error when it cannot run."""
        side = "start" if self.model.is_encoder_decoder else "end"
        ids, cut = self.tok.encode_cut(text, limit, side, add_eos=self.model.add_eos_to_prompt)
        if not cut:
            return ids
        if self.batching.max_input_tokens is None:   # the arena's bound
            return planner.too_big(limit + 1, where, more=True)
        if not self.batching.truncation:
            return InputError(f"{where}: more than {limit} tokens, more than max_input_tokens "
                              f"{limit} ({TRUNCATION_CURE})")
        return ids

    def _check(self, item: Any, i: int, where: str) -> Any:
        """A prompt string (texts), checked token ids (ids), or the row's error."""
        if isinstance(item, BadRow):
            return InputError(item.error)
        if self.kind != "ids":
            try:
                return check_prompt(item, where)
            except InputError as e:
                return e
        try:
            self.model.batch([item])   # validated alone; as_batch names it "row 0": renamed
        except InputError as e:
            return InputError(re.sub(r"\brow 0\b", f"row {i}", str(e), count=1))
        return self.prefix_ids + list(item)

    def _fit(self, ids: list[int], where: str, planner: BatchPlanner) -> list[int] | MinferError:
        limit = self.batching.max_input_tokens
        if limit is not None and len(ids) > limit:
            if not self.batching.truncation:
                return InputError(f"{where}: {len(ids)} tokens, more than max_input_tokens {limit} "
                                  f"({TRUNCATION_CURE})")
            ids = self._truncate(ids, limit)
        return planner.too_big(len(ids), where) or ids

    def _truncate(self, ids: list[int], limit: int) -> list[int]:
        """Encoder-decoder: keep the start (HF's truncation side), and the closing `</s>` the
        family appends; decoder-only: keep the end, which the generated text continues."""
        if not self.model.is_encoder_decoder:
            return ids[len(ids) - limit:]
        if self.model.add_eos_to_prompt and ids[-1] in self.eos and limit > 1:
            return ids[:limit - 1] + ids[-1:]
        return ids[:limit]

    # -- token ids -> results ------------------------------------------------------------------------
    def decode(self, rows: list, name: Callable[[int], str], planner: BatchPlanner, *,
               isolate: bool, batch_of: Callable[[list[int]], tuple] | None = None,
               on_batch: Callable[[int, int], None] | None = None) -> list[list[Result]]:
        """Results of prepared rows in their order: a failed row is one Result with `error`.
        Rows are batched by `plan_batches` (by length, bounded by the planner);
        `batch_of(row indices)` makes a batch (default: pad the rows' ids)."""
        batch_of = batch_of or (lambda sel: self.model.batch([rows[i] for i in sel]))
        out: list[Any] = [None] * len(rows)
        good = []
        for i, row in enumerate(rows):
            if isinstance(row, BaseException):
                out[i] = _failed(row)
            else:
                good.append(i)
        if on_batch is not None and len(good) < len(rows):
            on_batch(len(rows) - len(good), 0)   # rows that failed before running count as done
        lengths = [len(rows[i]) for i in good]
        for batch in plan_batches(lengths, planner.max_rows, not self.model.is_encoder_decoder):
            sel = [good[j] for j in batch]
            results = self._decode(sel, batch_of, name, isolate)
            for i, res in zip(sel, results):
                out[i] = res
            if on_batch is not None:
                on_batch(len(sel), sum(r.new_tokens for res in results for r in res))
        return out

    def _decode(self, sel: list[int], batch_of: Callable, name: Callable[[int], str],
                isolate: bool) -> list[list[Result]]:
        """One batch. The plan bounds what a batch needs, but the arena can have less by now
        (another user of it) or a family more than it plans: a batch that runs out is halved.
        With `isolate`, a batch that fails otherwise is halved too, until only the row that
        fails is an error; without, the error propagates (as it always did)."""
        try:
            ids, mask = batch_of(sel)
            t0 = time.perf_counter()
            results = _run_batch(self.model, ids, mask, self.opts, self.tok, self.rng, self.cancel)
        except MinferError as e:
            if isinstance(e, Cancelled):   # the whole call stops: no row is tried again
                raise
            if len(sel) > 1 and (isolate or isinstance(e, ArenaExhausted)):
                half = len(sel) // 2
                return (self._decode(sel[:half], batch_of, name, isolate)
                        + self._decode(sel[half:], batch_of, name, isolate))
            if isolate:
                return [_failed(f"{name(sel[0])}: {e}")]
            raise
        seconds = time.perf_counter() - t0
        for row in results:
            for r in row:
                r.seconds = seconds
        return results


def _finish(model: DecodingModel, h: Hypothesis, text: str | None, reason: str, prompt_len: int,
            score: float | None = None) -> Result:
    ids = h.tokens if model.is_encoder_decoder else h.tokens[1:]
    return Result(text, ids, reason, prompt_len, len(h.tokens) - 1, score=score,
                  token_logprobs=h.token_logprobs, top_logprobs=h.top_logprobs)


def _keep_logprobs(hyps: list[Hypothesis], rows: np.ndarray, step: StepLogprobs) -> None:
    """One step's log-probabilities onto the hypotheses of its rows."""
    for j, r in enumerate(rows):
        value, top = row_logprobs(step, j)
        hyps[r].token_logprobs.append(value)
        hyps[r].top_logprobs.append(top)


def _beam_logprobs(model: DecodingModel, prompt: np.ndarray, h: Hypothesis, k: int) -> None:
    """A finished beam's per-token log-probabilities from one teacher-forced pass over its
    tokens (the values the search saw at each of its steps, up to float32 rounding)."""
    logits = model.teacher_forced_logits(prompt, np.asarray([h.tokens[:-1]], np.int64))[0]   # (n, V)
    step = step_logprobs(logits, np.asarray(h.tokens[1:], np.int64), k)
    h.token_logprobs = [float(v) for v in step.chosen]
    h.top_logprobs = [[(int(i), float(v)) for i, v in zip(ids, vals)]
                      for ids, vals in zip(step.top_ids, step.top_values)]


def _run_batch(model: DecodingModel, ids: np.ndarray, mask: np.ndarray, opts: GenerationOptions,
               tok: Any, rng: np.random.Generator | None = None,
               cancel: Any = None) -> list[list[Result]]:
    eos = set(model.token_ids.eos)
    n = opts.num_return_sequences
    prompt_lens = mask.sum(axis=1)
    enc_dec = model.is_encoder_decoder
    if opts.num_beams > 1:
        if opts.logprobs is not None and not hasattr(model, "teacher_forced_logits"):
            raise InputError("logprobs with beam search needs an encoder-decoder model "
                             "(the beams' tokens are scored by one teacher-forced pass)")
        results = []
        beams = beam_search(model, ids, mask, opts, rng, cancel)
        if opts.logprobs is not None:
            for i, hyps in enumerate(beams):
                for h in hyps:
                    _beam_logprobs(model, ids[i:i + 1, :int(prompt_lens[i])], h, opts.logprobs)
        for i, hyps in enumerate(beams):
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
    hyps = [Hypothesis([]) for _ in range(ids.shape[0] * n)]
    texts = [_RowText(tok, opts.stop, eos) for _ in hyps] if tok is not None else None
    stopped: set[int] = set()
    info: dict = {}
    if opts.logprobs is not None:
        for h in hyps:
            h.token_logprobs, h.top_logprobs = [], []
    for step, (rows, tokens) in enumerate(token_loop(model, ids, mask, opts, rng, stopped=stopped,
                                                     info=info, repeat=n, cancel=cancel)):
        if step == 0:
            for h, first in zip(hyps, info["first"]):
                h.tokens.append(int(first))
        if opts.logprobs is not None:
            _keep_logprobs(hyps, rows, info["logprobs"])
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


def run(model: DecodingModel, inputs: Any, *, task: str | None = None, attention_mask: Any = None,
        row_errors: bool = False, cancel: Any = None,
        **options: Any) -> tuple[str, list[list[Result]]]:
    """Decode every prompt; returns the input kind and per prompt its list of results.

    Prompts run in batches of at most `max_batch_size` that the memory plan lets fit, grouped by
    token length, and come back in input order. A row that cannot run (not a string, blank,
    longer than max_input_tokens without truncation, too big for the arena even alone): with
    `row_errors`, one Result with `error` set in its place, the other rows decoded; without, the
    first such row's error is raised before anything is decoded.

    `cancel`: a threading.Event that another thread may set (a server whose client went away):
    the call then ends within a step of greedy or sampled decoding, or in its wait for arena
    memory, raising `Cancelled`, with every decode state given back. Then also call
    `batcher.batcher_of(model).cancelled(event)`, as `Stream.cancel` does: the states are given
    back at once and the waits end now, not at their next check."""
    call = _Call(model, task, options, cancel)
    kind, prompts = normalise_inputs(inputs)
    name = row_names(kind)
    if not row_errors and kind != "ids":   # a bad prompt is named before anything else is asked
        for i, p in enumerate(prompts):
            check_prompt(p, name(i))
    batch_of = None
    if attention_mask is not None:
        if kind != "ids":
            raise InputError("attention_mask: pass it only with token ids (text prompts make their own)")
        if call.batching.truncation:
            raise InputError("truncation does not combine with attention_mask: cut the ids and "
                             "the mask together first")
        if call.prefix:   # the prefix's ids would need mask columns the caller did not give
            raise InputError("task: its prompt prefix does not combine with attention_mask")
        # the rows' ids are checked as lists first (errors name the row and position; a ragged
        # or out-of-range list never reaches NumPy), then paired with the mask
        ids, _ = model.batch(prompts)
        if len({len(r) for r in prompts}) > 1:  # padding them would put a token under the mask
            raise InputError("attention_mask: the token-id rows must have equal lengths "
                             f"(got {sorted({len(r) for r in prompts})})")
        ids, mask = model.batch(ids, attention_mask)
        batch_of = lambda sel: (ids[sel], mask[sel])   # noqa: E731
    call.set_kind(kind)
    planner = call.planner()
    rows = call.prepare(prompts, name, planner)
    if not row_errors:
        bad = next((r for r in rows if isinstance(r, BaseException)), None)
        if bad is not None:
            raise bad
    return kind, call.decode(rows, name, planner, isolate=row_errors, batch_of=batch_of)


def run_iter(model: DecodingModel, prompts: Iterable[Any], *, task: str | None = None,
             name_row: Callable[[int], str] | None = None,
             on_batch: Callable[[int, int], None] | None = None,
             **options: Any) -> Iterator[list[Result]]:
    """Decode any number of prompts in bounded memory: per prompt, in input order, its list of
    Results; a row that cannot run (a `BadRow` from the reader, a non-string, a blank or
    over-long prompt, a batch failure isolated to it) is one Result with `error` set, and the
    rest carry on. Prompts are read a window at a time (`max_batch_size * SORT_WINDOW_BATCHES`,
    at most WINDOW_ROWS prompts and WINDOW_CHARS characters), grouped by length within it, and
    the window's results are yielded before the next is read.
    `name_row(i)` names row i in errors (default "inputs: prompt i"); `on_batch(prompts,
    new_tokens)` is called after each batch (progress). Options and the tokenizer are checked
    now, not at the first `next()`."""
    call = _Call(model, task, options)
    call.set_kind("texts")
    name_row = name_row or (lambda i: f"inputs: prompt {i}")
    return _run_windows(call, iter(prompts), name_row, on_batch)


def _run_windows(call: _Call, prompts: Iterator[Any], name_row: Callable[[int], str],
                 on_batch: Callable[[int, int], None] | None) -> Iterator[list[Result]]:
    size = min(call.batching.max_batch_size * planning.SORT_WINDOW_BATCHES, planning.WINDOW_ROWS)
    start = 0
    while True:
        items = take_window(prompts, size, planning.WINDOW_CHARS)
        if not items:
            return
        name = (lambda base: lambda i: name_row(base + i))(start)
        planner = call.planner()   # what the arena has free now
        rows = call.prepare(items, name, planner)
        yield from call.decode(rows, name, planner, isolate=True, on_batch=on_batch)
        start += len(items)


def stream(model: DecodingModel, inputs: Any, *, task: str | None = None, **options: Any) -> "Stream":
    """Text pieces (or token ids, for token-id input) as they are decided, for one prompt.
    Beam search cannot know its result before the end: it yields the final text once.
    Closing the iterator stops decoding and releases its arena memory. Inputs are checked now,
    not at the first `next()`: a prompt longer than max_input_tokens (without truncation) or
    too big for the arena is refused before anything runs."""
    call = _Call(model, task, options)
    kind, prompts = normalise_inputs(inputs)
    if len(prompts) != 1:
        raise InputError(f"stream=True takes one prompt, got {len(prompts)}")
    if call.opts.num_return_sequences != 1:
        raise InputError("stream=True returns one sequence: num_return_sequences must be 1")
    if kind != "ids":
        check_prompt(prompts[0], row_names(kind)(0))
    call.set_kind(kind)
    [row] = call.prepare(prompts, row_names(kind), call.planner())
    if isinstance(row, BaseException):
        raise row
    if call.opts.num_beams > 1:
        return Stream(model, lambda info, cancel: _stream_beam(
            model, [row], kind, call.opts, call.tok, call.rng, info, cancel), len(row))
    ids, mask = model.batch([row])
    return Stream(model, lambda info, cancel: stream_tokens(
        model, ids, mask, kind, call.opts, call.tok, info=info, cancel=cancel), len(row))


def _stream_beam(model: DecodingModel, rows: list, kind: str, opts: GenerationOptions, tok: Any,
                 rng: np.random.Generator | None, info: dict, cancel: Any = None) -> Iterator[Any]:
    ids, mask = model.batch(rows)
    r = _run_batch(model, ids, mask, opts, tok, rng, cancel)[0][0]
    info.update(reason=r.finish_reason, tokens=r.token_ids[len(r.token_ids) - r.new_tokens:])
    if r.token_logprobs is not None:
        info.update(token_logprobs=r.token_logprobs, top_logprobs=r.top_logprobs)
    if kind != "ids":
        yield r.text
    else:
        yield from info["tokens"]


def generate(model: DecodingModel, inputs: Any, *, stream_output: bool = False, task: str | None = None,
             return_details: bool = False, attention_mask: Any = None, **options: Any) -> Any:
    """The public generate(): see `Model.generate` (models/base.py). Besides the generation
    options it takes the batching ones (options.BatchOptions): `max_batch_size` (prompts per
    batch, default 32; the memory plan may allow fewer), `max_input_tokens` and `truncation`.
    A list of any length runs in batches grouped by token length and comes back in input order.
    A row that cannot run (not a string, blank, over max_input_tokens without truncation, too
    big for the arena even alone) makes plain generate raise, naming the row, before anything
    is decoded (as HF pipelines raise); with return_details=True it is a Result whose `error`
    says why (text None, finish_reason "error") and the other rows are decoded."""
    for name, value in (("stream", stream_output), ("return_details", return_details)):
        if not isinstance(value, (bool, np.bool_)):  # "no" would be truthy: a silent stream
            raise InputError(f"{name} must be true or false (a bool), got {value!r:.40}")
    if stream_output:
        if return_details or attention_mask is not None:
            raise InputError("stream=True does not combine with return_details or attention_mask")
        return stream(model, inputs, task=task, **options)
    # per-row errors: plain generate raises the first (naming its row) before decoding anything,
    # as HF pipelines raise; with return_details a failed row is a Result with `error` set
    kind, results = run(model, inputs, task=task, attention_mask=attention_mask,
                        row_errors=return_details, **options)
    if return_details:   # a string in: that prompt's own list (one Result per returned sequence)
        return results[0] if kind == "text" else results
    if kind == "ids":
        return [r.token_ids for row in results for r in row]
    texts = [[r.text for r in row] for row in results]
    shaped = [t[0] if len(t) == 1 else t for t in texts]
    return shaped[0] if kind == "text" else shaped
