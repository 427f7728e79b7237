"""Transformer-XL's public class: the shared façade plus segment memory, scoring and sessions."""

from __future__ import annotations

import contextlib
import functools
import math
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ...errors import InputError, NonFiniteError
from ...numerics import all_finite, first_bad_layer, non_finite, quiet
from ...generation.options import resolve_options
from ...generation.protocol import DecodeState
from ...generation.streaming import stream_tokens
from ...tokenizers.select import need_tokenizer
from ..base import Model, check_plan_arguments
from . import math as xl
from .buffers import MemoryBuffers, head_temporaries, prompt_call_bytes, prompt_segment, run_bytes
from .family import FAMILY


class SegmentMemory:
    """Each layer's input over the last `mem_len` positions, for `batch` rows, held in the arena
    across calls (an `Arena.hold`, which outlives the scopes of the calls) and updated in place.

    `length` positions are filled: a fresh memory is EMPTY (the paper's semantics; HF would start
    from mem_len zero vectors instead). Beside the states it keeps their key/value projections: a
    memory position's K/V is a function of that position's layer input alone, so it is computed
    once, when the position is new, instead of at every later call (HF recomputes them: mem_len+1
    rows per generated token). `release()` (or garbage collection) hands the block back."""

    def __init__(self, model: "XLModel", batch: int):
        backend, cfg = model.backend, model.config
        self.cfg, self.batch = cfg, batch
        # whose memory it is: its states are that model's layer inputs, its shape that model's
        # (another model's memory of the same width would be read without complaint)
        self._model = weakref.ref(model)
        self.backend = backend
        self._hold = backend.arena.hold(MemoryBuffers.specs(cfg, batch, backend.dtype))
        self.buffers = MemoryBuffers(**self._hold.buffers)
        self.length = 0
        self._finalizer = weakref.finalize(self, self._hold.release)

    def live(self) -> MemoryBuffers:
        """The buffers of the live rows (fewer than allocated once rows have left)."""
        return MemoryBuffers(self.buffers.states[:, :self.batch], self.buffers.kv[:, :self.batch])

    def advance(self, T: int) -> None:
        self.length = min(self.length + T, self.cfg.mem_len)

    def reorder(self, rows: np.ndarray) -> None:
        """Keep / duplicate batch rows (finished rows leave; beams follow their parents)."""
        xl.reorder_memory(self.backend, self.buffers, rows, self.length)  # rows < batch
        self.batch = len(rows)

    def reset(self) -> None:
        self.length = 0

    def release(self) -> None:
        self._finalizer()

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def belongs_to(self, model: "XLModel") -> bool:
        return self._model() is model

    def to_host(self) -> np.ndarray:
        """(L, B, M, C) float32 copy of the filled memory."""
        return np.asarray(self.backend.to_host(
            self.buffers.states[:, :self.batch, :self.length]), dtype=np.float32)


class XLDecodeState(DecodeState):
    """Generation state: the prompt's memory plus the log-probs of its last position.

    Step 0 is fed the prompt's last token (`first_tokens`) and returns the log-probs the prompt
    already produced instead of running the model again; later steps run one token through the
    model with the carried memory."""

    def __init__(self, model: "XLModel", memory: SegmentMemory, first_log_probs: np.ndarray,
                 first_tokens: np.ndarray):
        self.model, self.memory = model, memory
        self.first_tokens = first_tokens
        self._pending: np.ndarray | None = first_log_probs
        self.batch = len(first_tokens)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        if self._pending is not None:
            out, self._pending = self._pending, None
            return out
        return self.model._run(np.asarray(tokens, np.int64).reshape(self.batch, 1), self.memory,
                               head="last")

    def reorder(self, rows: Sequence[int] | np.ndarray, cross: bool = True) -> None:
        rows = np.asarray(rows, np.int64)
        if self._pending is not None:
            self._pending = self._pending[rows]
        with self.model.lock:
            self.memory.reorder(rows)
        self.batch = len(rows)


class XLModel(Model):
    """A loaded Transformer-XL: forward with explicit memory, scoring, generation, sessions."""

    family = FAMILY

    def plan(self, batch: int = 1, input_len: int | None = None,
             max_new_tokens: int | None = None, repeat: int = 1) -> dict[str, int]:
        """Arena bytes of a run (see Model.plan), with its prompt in the segments
        `start_decoding` will take: one call when that call and the memory fit the arena's
        free bytes when nothing else runs, else tgt_len segments (a busy arena may make
        `start_decoding` take segments where the plan counted one call: less, never more).
        (repeat: every row keeps its own segment memory, so it changes nothing here.)"""
        check_plan_arguments(batch, input_len, max_new_tokens, repeat)
        cfg, dtype = self.config, self.backend.dtype
        whole = input_len is not None and (
            MemoryBuffers.nbytes(cfg, batch, dtype) + prompt_call_bytes(cfg, dtype, batch, input_len)
            <= self.free_when_idle)
        return run_bytes(cfg, dtype, batch, input_len, max_new_tokens, whole)

    def check_batch(self, ids: np.ndarray, mask: np.ndarray) -> None:
        if not mask.all():
            raise InputError("input_ids: Transformer-XL batches need rows of equal length "
                             "(no padding); run different lengths one at a time")

    def new_memory(self, batch: int = 1) -> SegmentMemory:
        """An empty segment memory for `batch` rows (an arena hold: `release()` when done)."""
        with self.lock:   # a hold, not inside another thread's scratch scope
            return SegmentMemory(self, batch)

    def _run(self, ids: np.ndarray, memory: SegmentMemory, head: str = "all") -> Any:
        """One forward call over (B, T) ids with `memory` (advanced). Returns on the host the
        log-probs of every position (B*T, V) (`head="all"`), of the last one (B, V) ("last"),
        or nothing ("none": the call only extends the memory)."""
        B, T = ids.shape
        self._check_memory(memory, B)   # (a closed session's stream must not write a freed block)
        rows = 0 if head == "none" else B if head == "last" else B * T
        temporaries = head_temporaries(self.config, rows, self.backend.dtype)
        with self.lock, quiet(), self.backend.arena.scope(temporaries):
            h = xl.forward_hidden(self.backend, self.config, self.params, ids, memory.live(),
                                  memory.length)
            memory.advance(T)
            if head == "none":   # (a session's feed: the call that reads its output checks it)
                return None
            h = h[:, -1] if head == "last" else h.reshape(B * T, -1)
            out = np.asarray(self.backend.to_host(
                xl.log_probs(self.backend, self.config, self.params, h)), np.float32)
            if not all_finite(np, out):
                raise self._non_finite(memory, T, "log-probs")
            return out

    def _non_finite(self, memory: SegmentMemory, T: int, outputs: str) -> NonFiniteError:
        """The error of a call whose host `outputs` hold NaN or infinity, naming the layer where
        they began: the memory has just taken each layer's input over the call's last T
        positions, so the first layer whose memory there is not finite was fed by the layer
        before it (every finite: the last layer or the adaptive softmax). The memory is emptied:
        what it took is not finite, and a session goes on from nothing rather than fail again."""
        xp, L, n = self.backend.xp, self.config.n_layer, memory.length
        new = slice(max(0, n - T), n)
        where = first_bad_layer(xp, [memory.live().states[i][:, new] for i in range(L)], L) \
            if n else None
        memory.reset()
        return non_finite(self, outputs, where)

    def _check_memory(self, memory: Any, batch: int) -> None:
        """A memory this model made, not yet released, for `batch` rows; else a one-line error."""
        if not isinstance(memory, SegmentMemory):
            raise InputError(f"memory: expected a SegmentMemory (model.new_memory()), got "
                             f"{type(memory).__name__}")
        if not memory.belongs_to(self):
            raise InputError(f"memory: made by another model ({memory.cfg.n_layer} layers, "
                             f"mem_len {memory.cfg.mem_len}, d_model {memory.cfg.d_model}), not "
                             f"by this one ({self.folder}): use this model's new_memory()")
        if memory.released:
            raise InputError("memory: it was released (a closed session, or release() called): "
                             "start a new one")
        if memory.batch != batch:
            raise InputError(f"memory: holds {memory.batch} rows, input_ids has {batch}")

    # -- the public surface ---------------------------------------------------------------------------
    def forward(self, input_ids: Any, memory: SegmentMemory | None = None) -> tuple[np.ndarray, SegmentMemory]:
        """(B, T) ids -> (log-probs (B, T, V) float32 numpy, memory). `memory=None` starts from an
        empty memory; a given memory is read and updated in place (and returned)."""
        ids, _ = self.batch(input_ids)
        if memory is None:
            memory = self.new_memory(ids.shape[0])
        self._check_memory(memory, ids.shape[0])
        B, T = ids.shape
        return self._run(ids, memory).reshape(B, T, -1), memory

    def text_ids(self, text: str) -> list[int]:
        """The ids score() reads a text as: each WT103 line with <eos> after it (a last empty
        line, the text's final newline, is no line)."""
        if self.tokenizer is None:
            raise InputError(f"text input requires a tokenizer, and {self.folder} has none")
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return [t for line in lines for t in self.tokenizer.encode(line, add_eos=True)]

    def score(self, inputs: Any, segment_len: int | None = None, memory: SegmentMemory | None = None,
              progress: Callable[[int, int], None] | None = None) -> dict:
        """Log-likelihood of a text (str; one WT103 line per line, <eos> after each) or id list,
        processed in segments of `segment_len` (default tgt_len) with memory carried.
        Returns {"log_likelihood", "tokens" (predicted tokens = ids - 1), "perplexity", "seconds"}."""
        if isinstance(inputs, str):
            ids = self.text_ids(inputs)
        else:
            ids = self.batch([list(inputs)])[0][0].tolist()  # one row of ids, each checked
        if len(ids) < 2:
            raise InputError("score: need at least 2 tokens (the first one is only context)")
        arr, _ = self.batch([ids])
        T = self.config.tgt_len if segment_len is None else segment_len
        if isinstance(T, bool) or not isinstance(T, (int, np.integer)) or T < 1:
            raise InputError(f"segment_len must be a positive integer, got {segment_len!r}")
        T = int(T)
        own = memory is None
        if not own:
            self._check_memory(memory, 1)
        memory = self.new_memory(1) if own else memory
        be, cfg, params = self.backend, self.config, self.params
        total, n = 0.0, arr.shape[1] - 1
        t0 = time.perf_counter()
        try:
            for start in range(0, n, T):
                seg = arr[:, start:min(start + T, n)]
                targets = arr[0, start + 1:start + 1 + seg.shape[1]]
                temporaries = head_temporaries(cfg, seg.shape[1], be.dtype, scoring=True)
                with self.lock, quiet(), be.arena.scope(temporaries):
                    h = xl.forward_hidden(be, cfg, params, seg, memory.live(), memory.length)
                    memory.advance(seg.shape[1])
                    total += float(xl.target_log_probs(be, cfg, params, h.reshape(seg.shape[1], -1),
                                                       targets).sum())
                    if not math.isfinite(total):
                        raise self._non_finite(memory, seg.shape[1], "log-likelihoods")
                if progress is not None:
                    progress(start + seg.shape[1], n)
        finally:
            if own:
                memory.release()
        return {"log_likelihood": total, "tokens": n, "perplexity": math.exp(-total / n),
                "seconds": time.perf_counter() - t0}

    @contextlib.contextmanager
    def start_decoding(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                       max_len: int, repeat: int = 1,
                       memory: SegmentMemory | None = None) -> Iterator[XLDecodeState]:
        """Run the prompt (in `prompt_segment` segments, each
        segment's scratch given back before the next) and yield the state the generation loops
        step, B * repeat rows (row i * repeat + j continues prompt i). A memory passed in (a
        session's) is continued."""
        ids, _ = self.batch(input_ids, attention_mask)
        B = ids.shape[0]
        own = memory is None
        if own:
            memory = self.new_memory(B * repeat)
            memory.batch = B              # the prompt runs once per input, then rows spread
        elif repeat != 1:
            raise InputError("a session continues one row: repeat must be 1")
        else:
            self._check_memory(memory, B)
        try:
            P = ids.shape[1]
            be, cfg, params = self.backend, self.config, self.params
            with self.lock:   # one call when its scratch fits now; else tgt_len segments
                whole = prompt_call_bytes(cfg, be.dtype, B, P) <= be.arena.available
                chunk = prompt_segment(cfg, P, whole)
            for start in range(0, P, chunk):
                # each segment's scratch goes back before the next one (as in `score`): a prompt
                # of any length runs in one segment's arena plus the memory
                with self.lock, quiet(), be.arena.scope(head_temporaries(cfg, B, be.dtype)):
                    part = ids[:, start:start + chunk]
                    h = xl.forward_hidden(be, cfg, params, part, memory.live(), memory.length)
                    memory.advance(part.shape[1])
                    if start + chunk >= P:  # the last segment: its last position's log-probs
                        first = np.array(be.to_host(xl.log_probs(be, cfg, params, h[:, -1])),
                                         np.float32)                             # (B, V)
                        if not all_finite(np, first):
                            raise self._non_finite(memory, P, "log-probs")
            spread = np.repeat(np.arange(B), repeat)
            if repeat > 1:
                with self.lock:
                    memory.reorder(spread)
            yield XLDecodeState(self, memory, first[spread], ids[spread, -1])
        finally:
            if own:
                memory.release()

    def session(self) -> "XLSession":
        """Keep memory between successive generate / score calls (a chat, a long document)."""
        return XLSession(self)


class XLSession:
    """A memory carried across calls: `score` and `generate` continue where the last call ended
    (one row). Use as a context manager, or call `close()`, to give the memory back."""

    def __init__(self, model: XLModel):
        self.model = model
        self.memory = model.new_memory(1)
        self.last_token: int | None = None  # the last token seen, not yet run through the model

    def _check_open(self) -> None:
        if self.memory.released:
            raise InputError("session: it was closed (its memory was given back): open a new "
                             "one with model.session()")

    def _feed_pending(self) -> None:
        if self.last_token is not None:
            self.model._run(np.array([[self.last_token]]), self.memory, head="none")
            self.last_token = None

    def score(self, inputs: Any, segment_len: int | None = None) -> dict:
        self._check_open()
        self._feed_pending()
        return self.model.score(inputs, segment_len, memory=self.memory)

    def generate(self, prompt: Any, *, stream: bool = False, **options: Any) -> Any:
        """Continue the session: the prompt (may be empty "" to just continue) goes after what
        the session has seen; the generated tokens are remembered for the next call."""
        model = self.model
        self._check_open()
        opts, _ = resolve_options(model, **options)
        if opts.num_beams != 1 or opts.num_return_sequences != 1:
            raise InputError("a session continues one sequence: num_beams and "
                             "num_return_sequences must be 1")
        kind = "ids" if not isinstance(prompt, str) else "text"
        if kind == "text":
            new = (need_tokenizer(model, "text input").encode(prompt, add_eos=False)
                   if prompt.strip() else [])
        else:
            new = model.batch([list(prompt)])[0][0].tolist() if len(prompt) else []  # checked
        ids = ([self.last_token] if self.last_token is not None else []) + new
        if not ids:
            raise InputError("session: nothing to continue from: give a prompt")
        self.last_token = None

        def remember(tokens: list[int]) -> None:
            self.last_token = tokens[-1] if tokens else ids[-1]

        start = functools.partial(model.start_decoding, memory=self.memory)
        tok = need_tokenizer(model, "stop strings") if (kind == "text" or opts.stop) else None
        batch, mask = model.batch([ids])
        pieces = stream_tokens(model, batch, mask, kind, opts, tok, start, remember)
        if stream:
            return pieces
        out = list(pieces)
        return "".join(out) if kind == "text" else out

    def close(self) -> None:
        self.memory.release()

    def __enter__(self) -> "XLSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
