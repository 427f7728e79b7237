"""What a request runs in its worker thread: the same generate / embed calls a Python user makes,
and how the event loop stops them.

A `Job` is one request's handle: `cancel(why)` may be called from the event loop (the client went
away, the request timed out, the server is shutting down); the job's decoding then ends within a
step, or its wait for arena memory at once, and its memory is given back (Stream.cancel and
generation.run's `cancel`); `why`, if given, is what the job raises then (the answer its client
gets). The job also checks its own deadline between the steps of its set-up, so that setting up
many streams, or embedding many windows, stops as soon as it is past its time.

- `complete`: a non-streamed request, all its prompts and sequences in one `generation.run`
  call (batched by the memory plan; a prompt that cannot run fails the call before anything is
  decoded). Returns per prompt its list of `Result`.
- `stream`: a streamed request, one `model.generate(stream=True)` per prompt and sequence,
  iterated in turn by this one thread (their steps are taken together by the batcher), each
  piece handed to the event loop through `emit` as it is decided. n > 1 sampled sequences of a
  prompt are n streams; with a seed, sequence j draws from seed + j. Cancellation and the
  deadline are checked before each stream is made (a request of 2,048 streams takes seconds to
  set up).
- `embed`: `model.embed` (a window of texts at a time, so that a cancelled request stops
  between windows) and the token count of each text.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..embedding import check_can_embed, token_counts
from ..errors import Cancelled, InputError
from ..generation import Result, run
from ..generation.batcher import batcher_of
from ..generation.options import MAX_SEED
from .. import scoring
from ..tokenizers.select import need_tokenizer
from . import responses
from .schema import EmbeddingRequest, GenerationRequest, RerankRequest, ScoreRequest


class Job:
    """One request's work, stoppable from another thread. `deadline` (time.monotonic()) and
    `late` (what to raise past it) let the worker stop on time by itself."""

    def __init__(self, model: Any, deadline: float | None = None,
                 late: BaseException | None = None):
        self.model = model
        self.deadline, self.late = deadline, late
        self.cancelled = threading.Event()
        self.why: BaseException | None = None   # why it was cancelled, if the canceller said
        self._streams: list[Any] = []
        self._lock = threading.Lock()

    def cancel(self, why: BaseException | None = None) -> None:
        """From any thread: stop the request's decoding within a step; `why` is raised by the
        worker instead of Cancelled (the first reason given wins)."""
        with self._lock:
            if self.why is None and not self.cancelled.is_set():
                self.why = why
            self.cancelled.set()
            streams = list(self._streams)
        for s in streams:
            s.cancel()
        batcher_of(self.model).cancelled(self.cancelled)   # states back, waits end now

    def _track(self, stream: Any) -> Any:
        with self._lock:
            self._streams.append(stream)
        if self.cancelled.is_set():   # cancelled while it was being made
            stream.cancel()
        return stream

    def stopped(self) -> BaseException:
        """What the worker raises once the job is cancelled."""
        return self.why if self.why is not None else Cancelled("cancelled")

    def check(self) -> None:
        """Raise if the job was cancelled or is past its deadline (then it cancels itself)."""
        if not self.cancelled.is_set() and self.deadline is not None \
                and time.monotonic() >= self.deadline:
            self.cancel(self.late)
        if self.cancelled.is_set():
            raise self.stopped()


Count = Callable[[int, int], None]   # (prompt tokens, generated tokens): the metrics


def complete(job: Job, request: GenerationRequest, count: Count,
             chat: bool = False) -> tuple[list[list[Result]], list[list[dict | None]]]:
    """Every prompt's results, and with the logprobs option each one's logprobs object (made
    here, in the worker: it decodes every token)."""
    job.check()
    model = job.model
    model.check_can_generate()
    try:
        _, results = run(model, request.prompts, cancel=job.cancelled, **request.options)
    except Cancelled:
        raise job.stopped() from None
    count(sum(row[0].prompt_tokens for row in results),
          sum(r.new_tokens for row in results for r in row))
    logprobs = [[responses.token_logprobs(model.tokenizer, r, chat, model.is_encoder_decoder)
                 for r in row] for row in results]
    return results, logprobs


# What `stream` emits (the event loop reads them in this order for each choice):
@dataclass
class Started:
    """Every stream was made: the prompts are valid and fit (the response may start)."""


@dataclass
class Piece:
    index: int
    text: str
    logprobs: dict | None = None   # the tokens decided since the last piece (logprobs option)


@dataclass
class Ended:
    index: int
    reason: str
    prompt_tokens: int
    new_tokens: int


@dataclass
class Failed:
    error: BaseException


def stream(job: Job, request: GenerationRequest, emit: Callable[[Any], None], count: Count,
           chat: bool = False) -> None:
    """The request's streams, iterated in turn by this thread; `emit` receives Started, then
    Pieces and an Ended per choice; any failure is a Failed, the last thing emitted. With the
    logprobs option each Piece carries the logprobs of the tokens decided since the last one,
    and a choice's last tokens (held-back text, eos) come in a Piece of "" before its Ended. The tokens
    are counted however it ends, as the usage reports them: each prompt's tokens once (not once
    per sequence), and what every stream generated (one cut short counts what it made)."""
    streams: list[Any] = []
    try:
        job.check()
        job.model.check_can_generate()
        for prompt in request.prompts:
            for j in range(request.n):
                job.check()   # set-up takes ~1 ms a stream: a cancelled request stops here
                options = dict(request.options, num_return_sequences=1)
                if request.n > 1 and options.get("seed") is not None:
                    options["seed"] = (options["seed"] + j) % (MAX_SEED + 1)
                streams.append(job._track(job.model.generate(prompt, stream=True, **options)))
        emit(Started())
        parts = [responses.StreamedLogprobs(job.model.tokenizer, chat) for _ in streams]
        live = list(enumerate(streams))
        while live:
            for item in list(live):
                index, s = item
                piece = next(s, None)
                if piece is not None:
                    emit(Piece(index, piece, _logprobs(s, parts[index])))
                elif s.finish_reason is not None:
                    if s.finish_reason == "cancelled":
                        raise job.stopped()
                    rest = _logprobs(s, parts[index], final=True)
                    if rest is not None:
                        emit(Piece(index, "", rest))
                    emit(Ended(index, s.finish_reason, s.prompt_tokens, s.new_tokens))
                    live.remove(item)
    except BaseException as e:   # reported to the loop, which answers the client
        emit(Failed(e))
    finally:
        for s in streams:
            s.close()   # (a finished one: nothing; an abandoned one gives its memory back)
        count(sum(s.prompt_tokens for s in streams[::request.n]),   # sequence 0 of each prompt
              sum(s.new_tokens for s in streams))


def _logprobs(s: Any, part: responses.StreamedLogprobs, final: bool = False) -> dict | None:
    """A stream's logprobs object for its tokens decided since the last one (None without the
    option, or, unless final, with nothing new)."""
    if s.token_logprobs is None:
        return None
    return part.take(s.decided_ids, s.token_logprobs, s.top_logprobs, final)


def tokenize(job: Job, prompt: str, add_special_tokens: bool) -> list[int]:
    """The ids the model's prompt becomes (`</s>` as the family adds it, when asked)."""
    job.check()
    tok = need_tokenizer(job.model, "tokenize")
    return tok.encode(prompt, add_eos=add_special_tokens and job.model.add_eos_to_prompt)


def detokenize(job: Job, tokens: list[int]) -> str:
    """The text of token ids, special tokens skipped (a tokenize round trip gives the text)."""
    job.check()
    return need_tokenizer(job.model, "detokenize").decode(tokens, skip_special_tokens=True)


def score(job: Job, request: ScoreRequest, max_input_tokens: int) -> tuple[list[float], int]:
    """Each pair's score and the tokens read: a seq2seq model's log-likelihood of text_2 given
    text_1 (summed, or per token with `normalize`), else the cosine similarity of the two
    embeddings; a text over max_input_tokens is refused before anything runs."""
    job.check()
    model = job.model
    first = _counts(model, "text_1", request.texts_1, max_input_tokens)
    second = _counts(model, "text_2", request.texts_2, max_input_tokens)
    pairs = max(len(first), len(second))          # a single text is read once per pair
    tokens = sum(first) * (pairs // len(first)) + sum(second) * (pairs // len(second))
    try:
        if not scoring.has_decoder(model):
            if request.normalize:
                raise InputError("normalize applies to a seq2seq model's log-likelihoods; this "
                                 "model scores pairs by cosine similarity")
            return [float(s) for s in scoring.similarities(
                model, request.texts_1, request.texts_2, cancel=job.cancelled)], tokens
        scored = scoring.score_pairs(model, request.texts_1, request.texts_2,
                                     cancel=job.cancelled)
    except Cancelled:
        raise job.stopped() from None
    return [p.mean if request.normalize else p.total for p in scored], tokens


def rerank(job: Job, request: RerankRequest, max_input_tokens: int) -> tuple[list, int]:
    """(index, relevance) best first (model.rerank) and the tokens read."""
    job.check()
    model = job.model
    if scoring.has_decoder(model):   # each document inside monoT5's template (cut, if asked)
        inputs = scoring.monot5_inputs(model, request.query, request.documents, request.truncate)
        tokens = sum(_within("documents", [len(ids) for ids in inputs], max_input_tokens))
    else:
        if request.truncate is not None:
            raise InputError("truncate_prompt_tokens cuts a seq2seq reranker's inputs; this "
                             "embedding model cuts every text at its own max_seq_length")
        tokens = (sum(_counts(model, "query", [request.query], max_input_tokens))
                  + sum(_counts(model, "documents", request.documents, max_input_tokens)))
    try:
        return scoring.rerank(model, request.query, request.documents, top_n=request.top_n,
                              max_input_tokens=request.truncate, cancel=job.cancelled), tokens
    except Cancelled:
        raise job.stopped() from None


def _counts(model: Any, field: str, texts: list[str], max_input_tokens: int) -> list[int]:
    """Each text's token count as the model reads it (an embedding model: as embed cuts it),
    or an InputError naming the first over max_input_tokens as the request sent it."""
    if scoring.has_decoder(model):
        tok = need_tokenizer(model, "scoring")
        counts = [len(tok.encode(text, add_eos=model.add_eos_to_prompt)) for text in texts]
    else:
        counts = token_counts(model, texts)
    return _within(field, counts, max_input_tokens)


def _within(field: str, counts: list[int], max_input_tokens: int) -> list[int]:
    """The counts, or an InputError naming the first text over max_input_tokens."""
    for i, n in enumerate(counts):
        if n > max_input_tokens:
            raise InputError(f"{field}[{i}]: {n} tokens, more than this server's limit of "
                             f"{max_input_tokens} (serve --max-input-tokens)")
    return counts


# Texts embedded per model.embed call: a cancelled request stops between windows (embed sorts
# and batches within a call, so a request of up to this many texts gets exactly model.embed's
# vectors for the whole list)
EMBED_WINDOW = 256


def embed(job: Job, request: EmbeddingRequest, max_input_tokens: int) -> tuple[np.ndarray, int]:
    """The texts' embeddings and their token count; a text over max_input_tokens is refused
    before anything is encoded (so is a model with no encoder: token_counts' check_can_embed,
    an InputError, the client's 400)."""
    job.check()
    model = job.model
    texts = request.texts
    check_can_embed(model)
    counts = [_token_count(model, text, i) for i, text in enumerate(texts)]
    for i, n in enumerate(counts):
        if n > max_input_tokens:
            raise InputError(f"input[{i}]: {n} tokens, more than this server's limit of "
                             f"{max_input_tokens} (serve --max-input-tokens)")
    windows = []
    for start in range(0, len(texts), EMBED_WINDOW):
        job.check()
        windows.append(model.embed(texts[start:start + EMBED_WINDOW],
                                   dimensions=request.dimensions))
    return np.concatenate(windows), sum(counts)


def _token_count(model: Any, text: str, i: int) -> int:
    """One input's token count; a text the tokenizer refuses (a lone surrogate, a word not in
    its vocabulary) is an InputError naming the input, in the request's words (not the
    library call's, "encode():")."""
    try:
        return token_counts(model, [text])[0]
    except InputError as e:
        reason = re.sub(r"^[a-z_]+\(\)(: | )", "", str(e))
        raise InputError(f"input[{i}]: {reason}") from None
