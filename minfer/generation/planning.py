"""Batch planning: which prompts share a batch (`plan_batches`: shortest first, each batch as many
rows as `BatchPlanner` lets the model's memory plan fit in the arena) and the windows a stream of
prompts is read in (`take_window`; `BadRow`, a row its reader could not use).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Iterator

from ..errors import ArenaExhausted
from .protocol import DecodingModel


# Prompts read and sorted by length together (`run_iter`): this many batches' worth (CTranslate2
# reads max_batch_size * 16 examples before it sorts and rebatches), but never more than
# WINDOW_ROWS prompts nor (past the first) WINDOW_CHARS characters of them, whatever the batch
# size: the bounds on the memory a stream of millions of prompts holds and on how long the first
# output waits (a batch size of 65536 read a million prompts ahead; an endless source never
# yielded).
SORT_WINDOW_BATCHES = 16
WINDOW_ROWS = 4096
WINDOW_CHARS = 32 << 20


class BadRow:
    """An input row its reader already found unusable (invalid JSON, a missing field, bad UTF-8),
    with the one-line reason naming it. `run_iter` returns it in its place as a failed Result, so
    that there is still one output per input row."""
    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error

    def __repr__(self) -> str:
        return f"BadRow({self.error!r})"


def plan_batches(lengths: Sequence[int], max_rows: Callable[[int], int],
                 exact_length: bool = False) -> list[list[int]]:
    """Row indices grouped into batches (pure). Rows are taken shortest first (a stable sort), so
    a batch pads its rows to similar lengths; a batch grows while `max_rows(its longest length)`
    allows (>= 1 for every length given) and, when `exact_length` (a decoder-only model cannot
    pad), only over one length. Each batch lists its rows in input order, so a call that fits in
    one batch runs exactly as it was given."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        n = lengths[i]
        if current and (len(current) + 1 > max_rows(n)
                        or (exact_length and lengths[current[0]] != n)):
            batches.append(sorted(current))
            current = []
        current.append(i)
    if current:
        batches.append(sorted(current))
    return batches


def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with fits(n), for a fits that turns false once and stays so as
    n grows (a memory plan against free bytes): a binary search; lo when nothing above it fits."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


class BatchPlanner:
    """How many prompts of a given token length may share a batch: `max_batch_size` at most, and
    no more than the model's memory plan (`model.plan(rows, input_len, max_new_tokens, repeat)
    ["peak"]`, every row's decode state sized for max_new_tokens, rows = prompts times beams or
    samples per prompt) lets fit
    in what the arena has free when the planner is made, but always one prompt that fits in what
    the arena has free when no request runs (`model.free_when_idle`): that one waits for memory
    (batcher.admit) rather than fail. Models without `plan` (test doubles of the decoding
    protocol) are bounded by max_batch_size alone."""

    def __init__(self, model: DecodingModel, max_new_tokens: int, repeat: int, max_batch_size: int):
        self.plan = getattr(model, "plan", None)
        self.arena = getattr(getattr(model, "backend", None), "arena", None)
        self.available = (self.arena.available if self.arena is not None and self.plan is not None
                          else None)
        self.idle = max(getattr(model, "free_when_idle", 0), self.available or 0)
        self.enc_dec = bool(model.is_encoder_decoder)
        self.max_new_tokens, self.repeat, self.max_batch_size = max_new_tokens, repeat, max_batch_size
        self._rows: dict[int, int] = {}

    def peak(self, batch: int, length: int) -> int:
        # a model's plan knows how it runs a prompt of this length (Transformer-XL: in segments)
        return int(self.plan(batch * self.repeat, length, self.max_new_tokens,
                             repeat=self.repeat)["peak"])

    def max_rows(self, length: int) -> int:
        """The most prompts of this length in one batch (0: not even one ever fits)."""
        if self.available is None:
            return self.max_batch_size
        if length not in self._rows:   # the peak grows with the batch: binary search, once
            lo = largest_fitting(lambda n: self.peak(n, length) <= self.available, 0,
                                 self.max_batch_size)
            if lo == 0 and self.peak(1, length) <= self.idle:
                lo = 1      # fits once other requests are done: it will wait for them
            self._rows[length] = lo
        return self._rows[length]

    def longest(self, cap: int = 1 << 20) -> int | None:
        """The most prompt tokens one prompt may have and still fit an idle arena; None when no
        bound is known (no plan) or `cap` tokens fit (a model that runs prompts in segments)."""
        if self.available is None or self.peak(1, cap) <= self.idle:
            return None
        return largest_fitting(lambda n: self.peak(1, n) <= self.idle, 0, cap)

    def too_big(self, length: int, where: str, more: bool = False) -> ArenaExhausted | None:
        """The error of a prompt of `length` tokens (`more`: of more than length - 1) that cannot
        run even alone, naming the bytes; else None."""
        if self.max_rows(length) > 0:
            return None
        tokens = f"more than {length - 1}" if more else f"{length}"
        return ArenaExhausted(getattr(self.arena, "name", "arena"), self.peak(1, length),
                              self.idle, self.arena.capacity,
                              f"{where} ({tokens} prompt tokens, up to {self.max_new_tokens} new "
                              f"tokens{f' x {self.repeat} rows' if self.repeat > 1 else ''}; the "
                              "bytes available are those left when no other request runs)")


def take_window(items: Iterator[Any], rows: int, chars: int = WINDOW_CHARS,
                text: Callable[[Any], Any] = lambda item: item) -> list[Any]:
    """The next items: up to `rows` of them, and no more once they hold `chars` characters of
    text (`text(item)`: the prompt an item carries; at least one item)."""
    out: list[Any] = []
    held = 0
    for item in items:
        out.append(item)
        value = text(item)
        held += len(value) if isinstance(value, str) else 0
        if len(out) >= rows or held >= chars:
            break
    return out
