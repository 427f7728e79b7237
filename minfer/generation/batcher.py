"""Continuous batching: the decode steps of requests that run at the same time are taken together.

Every greedy or sampled generation is a `search.Decoding` (its state, its sequences, its chooser)
registered with its model's `Batcher`. A caller that needs a request's next tokens and finds
none becomes the leader, one at a time: it runs one step for every registered request whose
consumer has taken all it produced, through `model.step_together` (the families stack the rows
and read each weight once for all of them), and hands each request its tokens. There is no
thread of our own: callers take turns leading, so one thread interleaving two streams drives
both and eight threads each sending a prompt share every step. A request with stop strings is
stepped only once its consumer has taken and handled its last tokens (a stop string can end a
row); one without runs ahead of its consumer, so threads that are slow to come back for their tokens do
not split the batch.

Results equal stepping each request alone up to float rounding: a batched product sums in
another order than a one-row one, which can only matter where two tokens' scores tie to ~1e-6.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .protocol import DecodingModel

_batchers: "weakref.WeakKeyDictionary[Any, Batcher]" = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def batcher_of(model: DecodingModel) -> "Batcher":
    """The model's batcher (one per model, made on first use)."""
    with _registry_lock:
        batcher = _batchers.get(model)
        if batcher is None:
            batcher = _batchers[model] = Batcher(model)
        return batcher


class Batcher:
    def __init__(self, model: DecodingModel):
        self._model = weakref.ref(model)    # the registry is weak: a batcher keeps no model alive
        self.cv = threading.Condition()
        self.requests: list[Any] = []       # registered Decodings
        self.leading = False

    def join(self, decoding: Any) -> None:
        with self.cv:
            self.requests.append(decoding)

    def leave(self, decoding: Any) -> None:
        """Unregister (a finished or abandoned request); waits for a step using it to end."""
        with self.cv:
            while self.leading and decoding in self.requests:
                self.cv.wait()
            if decoding in self.requests:
                self.requests.remove(decoding)
            self.cv.notify_all()

    def next_event(self, decoding: Any) -> Any:
        """The request's next (rows, tokens), or None when it has finished; leads steps while it
        has none."""
        while True:
            with self.cv:
                # coming back means every event popped before has been handled (its stop
                # strings checked): the request may be stepped again
                decoding.consumed = True
                if decoding.events:
                    decoding.consumed = False     # being handled until the next call
                    return decoding.events.popleft()
                if decoding.error is not None:
                    raise decoding.error
                if decoding.finished:
                    return None
                if self.leading:
                    self.cv.wait()
                    continue
                self.leading = True
            try:
                self._step()
            finally:
                with self.cv:
                    self.leading = False
                    self.cv.notify_all()

    def _step(self) -> None:
        with self.cv:   # a request whose consumer may still stop rows waits for it to catch up
            waiting = [r for r in self.requests if r.error is None and not r.finished
                       and (r.runs_ahead or (not r.events and r.consumed))]
        batch = [r for r in waiting if r.ready()]   # rows stopped since their last step leave
        if not batch:
            return
        try:
            scores = self._model().step_together([r.state for r in batch],
                                                 [r.feed() for r in batch])
        except Exception as e:   # the step failed for everyone in it (exhausted arena, ...)
            for r in batch:
                r.error = e
            return
        for r, s in zip(batch, scores):
            try:
                event = r.advance(s)
            except Exception as e:   # this request's own problem (a non-finite row, ...)
                r.error = e
                continue
            with self.cv:
                r.events.append(event)
