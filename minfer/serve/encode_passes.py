"""Continuous batching for POST /v1/encode: the rows of concurrent requests share encoder passes.

Each request's worker hands its token-id rows and their pass rule (the preset and its padded
length T, or for no preset the request's longest row) to `EncodePasses.encode` and waits. A
waiting thread that finds nobody leading becomes the leader, one at a time (as the decode
batcher's callers take turns: no thread of our own): it takes the oldest waiting request and
every other waiting one with the same rule, up to `max_rows` rows (the oldest is always taken
whole), runs them as one model.encode call, and hands each request its own rows. Requests that
arrive meanwhile wait for the next pass, which the first of them to wake up leads.

Only requests with the same rule share a pass, so every row is padded exactly as it would be
alone: T is the same, only the batch grows. The encoder treats the rows of a batch
independently, but its products (B x T rows of activations times a weight) take other paths for
few rows, whose sums run in another order: minfer's kernels up to 64 rows (products.py), the int8
products' 4-row tiles below 256 rows, BLAS's matrix-vector and small-matrix code. So only a
request of at least SHARE_MIN_POSITIONS rows x T shares a pass (every preset's 256 or 512
tokens, or no preset and long enough); above that a row's states do not depend on the other
rows of its pass, and an answer is the bytes its request gets alone. A smaller request runs its
own pass at once (short prompts without a preset are not batched: exact answers first).

A request that is cancelled (client gone, deadline) while it waits leaves the queue; once its
rows are in a pass the pass runs for the others and its rows are dropped. A leader whose own
request is cancelled still finishes the pass it leads. When a shared pass fails (the states of
one row are not finite, say), each request in it runs alone, so each gets its own answer or
its own error.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

ROWS_PER_PASS = 64   # rows one shared pass takes at most (a request bigger than this runs alone)
SHARE_MIN_POSITIONS = 256   # rows x T of a request that may share a pass: the products of every
# pass it can be in then take the path they take for it alone (module docstring)
POLL_SECONDS = 0.05  # how often a waiting request looks at its job's cancel / deadline


@dataclass(frozen=True)
class PassRule:
    """How a request's rows are padded and encoded: a preset padded to `length` tokens, or
    (preset None) each row's own tokens with the mask, padded to `length`, the longest row."""
    preset: str | None
    length: int


def encode_rows(model: Any, rule: PassRule, rows: list[list[int]]) -> list[tuple]:
    """One model.encode call -> per row (states (T, C) float32, mask (T,)): the preset's T and
    mask, or (no preset) the row's own tokens' states and a mask of ones."""
    if rule.preset is not None:
        states, mask = model.encode(rows, preset=rule.preset, max_length=rule.length,
                                    return_mask=True)
        return list(zip(states, mask))
    states, mask = model.encode(rows, return_mask=True, padding_states=False)
    return [(s[:len(r)], k[:len(r)]) for s, k, r in zip(states, mask, rows)]


class _Waiting:
    """One request in the queue: its rule and rows, then its rows' results or its error."""

    def __init__(self, rule: PassRule, rows: list[list[int]]):
        self.rule, self.rows = rule, rows
        self.done = False
        self.result: list[tuple] | None = None
        self.error: BaseException | None = None


class EncodePasses:
    """The /v1/encode queue of one model; `passes` and `requests` count the model.encode calls
    it completed and the requests they answered (requests / passes: the mean sharing)."""

    def __init__(self, model: Any, max_rows: int = ROWS_PER_PASS):
        self.model, self.max_rows = model, max_rows
        self.cv = threading.Condition()
        self.waiting: list[_Waiting] = []   # not yet in a pass, oldest first
        self.leading = False
        self.passes = 0
        self.requests = 0

    def encode(self, job: Any, rule: PassRule, rows: list[list[int]]) -> list[tuple]:
        """The request's rows encoded (as encode_rows returns them), in a pass shared with the
        requests waiting beside it; raises what `job.check()` raises once its job is cancelled
        or late, or the pass's error."""
        if len(rows) * rule.length < SHARE_MIN_POSITIONS:   # its own pass, now
            job.check()
            return self._pass(rule, rows, 1)
        mine = _Waiting(rule, rows)
        with self.cv:
            self.waiting.append(mine)
        try:
            while True:
                with self.cv:
                    while not mine.done and self.leading:
                        job.check()   # cancelled or late: leave (finally: out of the queue)
                        self.cv.wait(POLL_SECONDS)
                    if mine.done:
                        break
                    job.check()
                    self.leading = True
                    group = self._take()
                try:
                    self._run(group)
                finally:
                    with self.cv:
                        self.leading = False
                        self.cv.notify_all()
        finally:
            with self.cv:
                if mine in self.waiting:
                    self.waiting.remove(mine)
        if mine.error is not None:
            raise mine.error
        assert mine.result is not None
        return mine.result

    def _take(self) -> list[_Waiting]:
        """(Under the lock.) The oldest waiting request and those with its rule, at most
        max_rows rows in all (the oldest whole), out of the queue."""
        first = self.waiting[0]
        group, rows = [first], len(first.rows)
        for other in self.waiting[1:]:
            if other.rule == first.rule and rows + len(other.rows) <= self.max_rows:
                group.append(other)
                rows += len(other.rows)
        self.waiting = [w for w in self.waiting if w not in group]
        return group

    def _run(self, group: list[_Waiting]) -> None:
        """One pass for the group; if it fails and holds several requests, each alone."""
        try:
            got = self._pass(group[0].rule, [row for w in group for row in w.rows], len(group))
        except Exception as e:
            if len(group) == 1:
                group[0].error = e
            else:
                for w in group:
                    self._run([w])
                return
        except BaseException as e:   # (KeyboardInterrupt): nobody waits for ever
            for w in group:
                w.error = e
            raise
        else:
            start = 0
            for w in group:
                w.result = got[start:start + len(w.rows)]
                start += len(w.rows)
        finally:
            with self.cv:
                for w in group:
                    w.done = w.done or w.result is not None or w.error is not None
                self.cv.notify_all()

    def _pass(self, rule: PassRule, rows: list[list[int]], requests: int) -> list[tuple]:
        got = encode_rows(self.model, rule, rows)
        with self.cv:
            self.passes += 1
            self.requests += requests
        return got
