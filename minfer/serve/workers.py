"""The bounded pool of worker threads that requests run in, and the admission rule (backpressure).

At most `max_running` requests run at once, each in its own thread (a generator is iterated by
one thread; the continuous batcher takes the decode steps of all of them together). At most
`max_waiting` more wait for a thread; a request beyond that is refused at once with 429 and
`Retry-After`, never queued without bound.

Running and waiting, as /metrics reports them: a request in a thread that waits for arena memory
(the batcher's `admitting`: requests in flight must give memory back first) counts as waiting.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from ..generation.batcher import batcher_of
from .errors import APIError, shutting_down

RETRY_AFTER_SECONDS = 1
log = logging.getLogger("minfer.serve")


class Workers:
    def __init__(self, model: Any, max_running: int, max_waiting: int):
        self.max_running, self.max_waiting = max_running, max_waiting
        self._pool = ThreadPoolExecutor(max_workers=max_running, thread_name_prefix="minfer-serve")
        self._batcher = batcher_of(model)
        self._lock = threading.Lock()
        self._accepted = 0   # running or waiting for a thread
        self._active = 0     # in a thread
        self._closed = False

    def running(self) -> int:
        return max(self._active - len(self._batcher.admitting), 0)

    def waiting(self) -> int:
        return self._accepted - self.running()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run fn(*args) in a worker thread, or raise 429 at once when the queue is full (503
        once the pool is shut down, or when no worker thread could be started)."""
        with self._lock:
            if self._closed:
                raise shutting_down()
            if self._accepted >= self.max_running + self.max_waiting:
                raise APIError(429, f"the server is busy: {self.max_running} requests running "
                               f"and {self.max_waiting} waiting (serve --max-running, "
                               "--max-waiting); retry later",
                               headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
            self._accepted += 1
        refused = threading.Event()
        try:
            future = self._pool.submit(self._run, refused, fn, *args)
        except BaseException as e:   # not accepted after all: its place is given back
            # (a thread that failed to start leaves the work queued in the pool, for the
            # next free thread: it must not run for a client that was refused)
            refused.set()
            self._finished(None)
            if not isinstance(e, Exception):   # KeyboardInterrupt and the like go on
                raise
            raise self._refusal(e) from None
        future.add_done_callback(self._finished)   # also when cancelled before it ran
        return future

    def _refusal(self, e: Exception) -> APIError:
        """Why the pool would not take accepted work: it was shut down meanwhile (503
        shutting_down), or it could not start a thread (the process's thread or memory limit:
        503 worker_unavailable, logged, as the server is out of capacity for now)."""
        if self._closed:
            return shutting_down()
        log.error("could not start a worker thread: %s: %s", type(e).__name__, e)
        return APIError(503, f"the server could not start a worker ({type(e).__name__}: {e}); "
                        "retry later", code="worker_unavailable",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    def _run(self, refused: threading.Event, fn: Callable[..., Any], *args: Any) -> Any:
        if refused.is_set():
            return None
        with self._lock:
            self._active += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._active -= 1

    def _finished(self, _: Future | None) -> None:
        with self._lock:
            self._accepted -= 1

    def shutdown(self) -> None:
        """No new work (503); queued work is dropped (its futures cancelled), running work
        finishes (cancelled by its owner)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
