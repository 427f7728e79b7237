"""Streaming and stop strings: a row's text as its tokens are decided, cut at the first stop
string and never taken back (`StopMatcher`, `_RowText`), and one prompt's pieces as an iterator
(`stream_tokens`, `Stream`: finish reason, counts, cancel()). tokenizers/streaming.py's
`IncrementalDecoder` turns ids into text pieces and knows nothing of generation; this module
decides what a generation call emits (stop strings, eos, how the stream ended).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Callable, Iterator

import numpy as np

from ..errors import Cancelled
from ..tokenizers import IncrementalDecoder
from .batcher import batcher_of
from .options import GenerationOptions
from .protocol import DecodingModel
from .search import StepLogprobs, token_loop


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


class _RowText:
    """Per-row streaming detokeniser plus stop-string matcher."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], eos: set[int]):
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


class Stream:
    """One prompt's pieces as they are decided (text, or token ids for token-id input): iterate
    it. `close()` (the consumer) stops decoding and gives its arena memory back; `cancel()` may
    be called from any other thread (a server whose client went away): the consumer's next
    piece, or its wait for a step or for memory, then ends the stream within a step, with
    finish_reason "cancelled". Once it has ended: `finish_reason` ("eos", "length", "stop",
    "cancelled"), `prompt_tokens`, `new_tokens` and `token_ids` (the new ids)."""

    def __init__(self, model: DecodingModel, pieces: Callable[[dict, Any], Iterator[Any]],
                 prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []
        self._model = model
        self._cancel = threading.Event()
        self._info: dict = {}
        self._pieces = pieces(self._info, self._cancel)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decided_ids(self) -> list[int]:
        return self._info.get("tokens", [])

    @property
    def token_logprobs(self) -> list[float] | None:
        return self._info.get("token_logprobs")

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None:
        return self._info.get("top_logprobs")

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Any:
        if self.finish_reason is not None:
            raise StopIteration
        try:
            return next(self._pieces)
        except StopIteration:
            self._end(self._info.get("reason", "length"))
            raise
        except Cancelled:
            self._end("cancelled")
            raise StopIteration from None

    def _end(self, reason: str) -> None:
        self._pieces.close()
        self.finish_reason = reason
        self.token_ids = list(self._info.get("tokens", []))

    def close(self) -> None:
        if self.finish_reason is None:
            self._end("cancelled" if self._cancel.is_set() else "closed")

    def cancel(self) -> None:
        """Stop it from another thread (thread-safe): see the class doc."""
        self._cancel.set()
        batcher_of(self._model).cancelled(self._cancel)


def row_logprobs(step: StepLogprobs, j: int) -> tuple[float, list[tuple[int, float]]]:
    """Row j of a step's log-probabilities: its token's, and the best (id, value) pairs."""
    return (float(step.chosen[j]),
            [(int(i), float(v)) for i, v in zip(step.top_ids[j], step.top_values[j])])


def stream_tokens(model: DecodingModel, ids: np.ndarray, mask: np.ndarray, kind: str,
                  opts: GenerationOptions, tok: Any, start_decoding: Any = None,
                  on_done: Any = None, info: dict | None = None,
                  cancel: Any = None) -> Iterator[Any]:
    """Text pieces (kind "text") or token ids (kind "ids") of one row as they are decided.
    `start_decoding` replaces the model's (a session continuing its memory); `on_done(tokens)`
    receives the generated ids when the stream ends, however it ends; `info` receives "tokens"
    (as they come), with the logprobs option "token_logprobs" and "top_logprobs" (one entry per
    token, appended before it), and "reason" (how it ended); `cancel`: see token_loop."""
    eos = set(model.token_ids.eos)
    text = _RowText(tok, opts.stop, eos) if kind != "ids" or opts.stop else None
    info = {} if info is None else info
    generated: list[int] = info.setdefault("tokens", [])
    step: dict = {}   # token_loop's: each step's StepLogprobs
    if opts.logprobs is not None:
        chosen: list[float] = info.setdefault("token_logprobs", [])
        best: list[list[tuple[int, float]]] = info.setdefault("top_logprobs", [])
    loop = token_loop(model, ids, mask, opts, start_decoding=start_decoding, info=step,
                      cancel=cancel)
    try:
        for _, tokens in loop:
            t = int(tokens[0])
            if opts.logprobs is not None:
                value, top = row_logprobs(step["logprobs"], 0)
                chosen.append(value)
                best.append(top)
            generated.append(t)
            if t in eos:
                info["reason"] = "eos"
            if text is not None:
                piece = text.push(t)
                if kind != "ids" and piece:
                    yield piece
                if text.stopped:
                    info["reason"] = "stop"
                    return
            if kind == "ids":
                yield t
        info.setdefault("reason", "length")
        if kind != "ids":
            tail = text.finish()
            if text.stopped:
                info["reason"] = "stop"
            if tail:
                yield tail
    finally:
        loop.close()
        if on_done is not None:
            on_done(generated)
