"""Continuous batching: the decode steps of requests that run at the same time are taken together,
and a request waits for arena memory that requests in flight will give back.

Every greedy or sampled generation is a `search.Decoding` (its state, its sequences, its chooser)
registered with its model's `Batcher`. A caller that needs a request's next tokens and finds
none becomes the leader, one at a time: it runs one step for every registered request whose
consumer has taken all it produced, through `model.step_together` (the families stack the rows
and read each weight once for all of them; rows that do not fit the arena together are stepped
in smaller groups), and hands each request its tokens. There is no thread of our own: callers
take turns leading, so one thread interleaving two streams drives both and eight threads each
sending a prompt share every step. A request with stop strings is stepped only once its consumer
has taken and handled its last tokens (a stop string can end a row); one without runs ahead of
its consumer, so threads that are slow to come back for their tokens do not split the batch.

Memory: a request's decode state (its arena hold) is given back as soon as its decoding ends
(finished, failed, or abandoned by its consumer), not when the consumer has read the last
token. `admit` starts a request; when the arena cannot hold it now but requests in flight will
give memory back, it waits for them (leading their steps when nobody else does) and tries again,
so concurrent requests queue for memory instead of failing. It fails at once only when nothing
in flight can free memory: then the request does not fit beside what stays (the weights,
sessions, and this thread's own open streams, which cannot advance while it waits).

Cleanup never blocks: a consumer that abandons its request (closing the stream, or the garbage
collector finalising it, possibly on the very thread that is leading a step) only marks it gone;
if a step is using its state, the leader gives the state back when the step ends.

Results equal stepping each request alone up to float rounding: a batched product sums in
another order than a one-row one, which can only matter where two tokens' scores tie to ~1e-6.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator, TypeVar

from ..errors import ArenaExhausted, Cancelled
from .protocol import DecodingModel

T = TypeVar("T")

_batchers: "weakref.WeakKeyDictionary[Any, Batcher]" = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def batcher_of(model: DecodingModel) -> "Batcher":
    """The model's batcher (one per model, made on first use)."""
    with _registry_lock:
        batcher = _batchers.get(model)
        if batcher is None:
            batcher = _batchers[model] = Batcher(model)
        return batcher


class Request:
    """What the batcher reads and keeps of a registered request (search.Decoding subclasses it):
    `ready()` (False once no row is left), `feed()` (the tokens the next step reads), `advance
    (scores)` (the event the step produces) and `state` are the decoding's own."""

    def __init__(self, runs_ahead: bool):
        self.events: collections.deque = collections.deque()   # produced, not yet taken
        self.error: Exception | None = None
        self.finished = False
        self.runs_ahead = runs_ahead   # no stop string can end a row from outside
        self.consumed = True           # its consumer has handled every event it took
        self.gone = False              # abandoned by its consumer
        self.owner = threading.get_ident()   # the thread consuming it (the last to ask)
        self.release: Callable[[], None] | None = None   # gives its state back (once)
        self.cancel: threading.Event | None = None       # set from any thread: stop at once

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    @property
    def active(self) -> bool:
        return self.error is None and not self.finished and not self.gone and not self.cancelled


class Batcher:
    def __init__(self, model: DecodingModel):
        self._model = weakref.ref(model)    # the registry is weak: a batcher keeps no model alive
        self.cv = threading.Condition()     # reentrant: a finaliser may run inside a held section
        self.requests: list[Request] = []   # registered
        self.leading = False
        self.stepping: list[Request] = []   # the requests whose states a step is using
        self.holders: list[int] = []        # threads running unbatched requests (beam search)
        self.starting: list[int] = []       # threads taking a request's memory, not yet joined
        self.admitting: set[int] = set()    # threads waiting for memory (they consume nothing)
        self.releasing = 0                  # states being given back right now
        self.released = 0                   # how many times memory was given back
        # one request takes memory at a time: a start that fails then failed for memory others
        # hold, never for what another start held for a moment (two waiters would wake each
        # other in a loop)
        self.admission = threading.Lock()
        self.steps = 0                      # decode steps taken, and the requests they stepped
        self.stepped = 0                    # (summed): stepped / steps is the mean batch

    # -- registration -----------------------------------------------------------------------------
    def join(self, request: Request | None, release: Callable[[], None] | None = None) -> None:
        """Register a request that `admit` started; `release` gives its decode state back (called
        once, when its decoding ends or it is abandoned). None: the request could not be made,
        its state is given back now."""
        with self.cv:
            self._started()
            if request is not None:
                request.release = release
                self.requests.append(request)
                return
            if release is not None:
                self.releasing += 1
        if release is not None:
            self._run_releases([release])

    def leave(self, request: Request) -> None:
        """Unregister a finished or abandoned request. Never waits: when a step is using its
        state, the leader releases the state once the step is over."""
        with self.cv:
            request.gone = True
            if request in self.stepping:
                return
            if request in self.requests:
                self.requests.remove(request)
            releases = self._take_releases([request])
        self._run_releases(releases)

    def _take_releases(self, requests: list[Request]) -> list[Callable[[], None]]:
        """(Under the lock) the releases of these requests, each taken once; until they have run,
        threads waiting for memory know it is coming back."""
        releases = []
        for r in requests:
            release, r.release = r.release, None
            if release is not None:
                releases.append(release)
        self.releasing += len(releases)
        return releases

    def _run_releases(self, releases: list[Callable[[], None]]) -> None:
        if not releases:
            return
        try:
            for release in releases:
                release()
        finally:
            with self.cv:
                self.releasing -= len(releases)
                self.released += 1
                self.cv.notify_all()

    def _started(self) -> None:
        """(Under the lock) this thread's admitted request is registered: it no longer counts as
        one being started."""
        me = threading.get_ident()
        if me in self.starting:
            self.starting.remove(me)

    @contextlib.contextmanager
    def admitted(self, open_state: Callable[[], Any],
                 cancel: threading.Event | None = None) -> Iterator[Any]:
        """The state of an unbatched request (beam search): `open_state()`'s context, entered
        through `admit`; while it is open, requests waiting for memory wait for it too."""
        me = threading.get_ident()
        with contextlib.ExitStack() as stack:
            state = self.admit(lambda: stack.enter_context(open_state()), cancel)
            with self.cv:
                self.holders.append(me)
                self._started()
            try:
                yield state
            finally:
                try:
                    stack.close()      # the memory first, then the news that it is back
                finally:
                    with self.cv:
                        self.holders.remove(me)
                        self.released += 1
                        self.cv.notify_all()

    # -- admission --------------------------------------------------------------------------------
    def cancelled(self, event: threading.Event) -> None:
        """Requests cancelled through `event` give their states back now (one a step is using:
        when the step ends), and every waiting thread wakes (their consumers stop waiting)."""
        with self.cv:
            releases = self._take_releases([r for r in self.requests
                                            if r.cancel is event and r not in self.stepping])
            self.cv.notify_all()
        self._run_releases(releases)

    def admit(self, start: Callable[[], T], cancel: threading.Event | None = None) -> T:
        """`start()` (which takes a request's arena memory, raising ArenaExhausted when it
        cannot), retried while requests in flight will give memory back (see module doc).
        `cancel` set while it waits: `Cancelled`."""
        me = threading.get_ident()
        while True:
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled while waiting for arena memory")
            with self.cv:
                seen = self.released
                self.starting.append(me)   # holds memory from here until it joins (or fails)
            try:
                with self.admission:   # (another start may hold it for a whole encoder pass)
                    if cancel is not None and cancel.is_set():
                        raise Cancelled("cancelled while waiting for arena memory")
                    return start()
            except BaseException as e:
                with self.cv:
                    self.starting.remove(me)
                    self.cv.notify_all()
                if not isinstance(e, ArenaExhausted) or not self._wait_for_memory(seen, cancel):
                    raise

    def _wait_for_memory(self, seen: int, cancel: threading.Event | None = None) -> bool:
        """Wait until memory was given back since `seen` (True), leading steps of other requests
        while nobody else does; False when nothing in flight can give any back."""
        me = threading.get_ident()
        with self.cv:
            self.admitting.add(me)
            self.cv.notify_all()   # threads waiting on this one's requests re-evaluate
        try:
            while True:
                with self.cv:
                    if self.released != seen or (cancel is not None and cancel.is_set()):
                        return True   # (admit then says Cancelled)
                    # requests that advance without this thread: those that run ahead of their
                    # consumers, or whose consumers are other threads not themselves waiting
                    movers = [r for r in self.requests if r.release is not None and (
                        r.cancelled   # its consumer gives its state back on its next call
                        or (r.active and (r.runs_ahead or (r.owner != me
                                                           and r.owner not in self.admitting))))]
                    others = [t for t in self.holders + self.starting if t != me]
                    # (a step in progress may end requests and give their memory back)
                    if not movers and not others and not self.releasing and not self.leading:
                        return False
                    if self.leading or not any(self._eligible(r) for r in movers):
                        self.cv.wait(timeout=1.0)
                        continue
                    self.leading = True
                self._lead()
        finally:
            with self.cv:
                self.admitting.discard(me)

    # -- stepping ---------------------------------------------------------------------------------
    def next_event(self, request: Request) -> Any:
        """The request's next (rows, tokens), or None when it has finished; leads steps while it
        has none."""
        while True:
            with self.cv:
                if request.cancelled:
                    raise Cancelled("cancelled")
                request.owner = threading.get_ident()
                # coming back means every event popped before has been handled (its stop
                # strings checked): the request may be stepped again
                request.consumed = True
                if request.events:
                    request.consumed = False     # being handled until the next call
                    return request.events.popleft()
                if request.error is not None:
                    raise request.error
                if request.finished:
                    return None
                if self.leading:
                    self.cv.wait()
                    continue
                self.leading = True
            self._lead()

    def _lead(self) -> None:
        """One step by this thread, which has just taken the lead (`leading`); then hand it back."""
        try:
            self._step()
        finally:
            with self.cv:
                self.leading = False
                self.cv.notify_all()

    @staticmethod
    def _eligible(r: Request) -> bool:
        # a request whose consumer may still stop rows waits for it to catch up
        return r.active and (r.runs_ahead or (not r.events and r.consumed))

    def _step(self) -> None:
        with self.cv:
            candidates = [r for r in self.requests if self._eligible(r)]
            self.stepping = candidates   # from here on, leave() defers their release to us
        try:
            # (a request abandoned while this list was made has been released: not stepped)
            batch = [r for r in candidates if not r.gone and self._ready(r)]
            if batch:
                self._step_batch(batch)
        finally:
            with self.cv:
                ended = [r for r in self.stepping if not r.active]   # (cancelled ones too)
                for r in ended:
                    if r.gone and r in self.requests:
                        self.requests.remove(r)
                releases = self._take_releases(ended)
                self.stepping = []
            self._run_releases(releases)   # ended decodings give their memory back at once

    @staticmethod
    def _ready(r: Request) -> bool:
        """Whether the request takes this step (rows stopped since its last step leave first);
        a failure there is that request's own, not the leading thread's."""
        try:
            return r.ready()
        except Exception as e:
            r.error = e
            return False

    def _step_batch(self, batch: list[Request]) -> None:
        try:
            scores = self._model().step_together([r.state for r in batch],
                                                 [r.feed() for r in batch])
        except Exception as e:   # the step failed for everyone in it
            for r in batch:
                r.error = e
            return
        self.steps += 1          # (only the leader writes them)
        self.stepped += len(batch)
        for r, s in zip(batch, scores):
            if isinstance(s, BaseException):   # this request's own scores failed (NonFiniteError)
                r.error = s
                continue
            try:
                event = r.advance(s)
            except Exception as e:   # this request's own problem (a non-finite row, ...)
                r.error = e
                continue
            with self.cv:
                r.events.append(event)
