"""Batch jobs (OpenAI's Batch API): their states and the background thread that runs them, a job at
a time, each input line through the same plan, checks and workers as the direct request it names.

A batch goes validating (queued) -> in_progress -> finalizing -> completed; a cancel makes it
cancelling -> cancelled (what was answered stays in its output file); a job that cannot run at
all (its input gone, a bug) is failed. request_counts: total lines, completed (a 2xx answer, in
the output file), failed (any other answer, in the error file, with the error body the direct
request gets: one failing line is an error line, not a failed batch).

Interactive requests are not starved: a job keeps at most `in_flight` lines submitted to the
workers at once (a quarter of max_running, at most IN_FLIGHT), and a line refused by a full
queue (429) is retried after a pause; each line has the server's request timeout (504 line).

Nothing is lost or answered twice across a crash: answers are appended in input order, each line
whole with one write, to the output or the error file. A restarted server (same --batch-dir)
finds every unfinished job, cuts a line a kill left half-written, counts the complete lines of
both files (the resume point: minfer.io.lines.complete_lines) and goes on from the input line
after them. On SIGTERM a job starts no more lines; those in flight are written if they end before
the process does (the grace period covers HTTP requests, not them), and the next start runs
the rest. Jobs are not expired (expires_at is only reported).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import Cancelled
from ..io.lines import complete_lines, lines
from .batch_store import Store, is_id, new_id, public
from .errors import APIError, error_response
from .schema import check_model

log = logging.getLogger("minfer.serve")
IN_FLIGHT = 16               # lines of a job submitted at once, at most
RETRY_SECONDS = 0.05         # pause before a line refused by a full queue (429) is tried again
WINDOW = "24h"               # the one completion window OpenAI offers
METADATA_PAIRS = 16          # OpenAI's metadata: at most 16 pairs of strings
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")

# An endpoint's plan (routes.Plan) from a line's body, and the field its errors name
Endpoints = dict[str, tuple[Callable[[Any, dict], Any], str]]


@dataclass
class _Line:
    """One input line on its way: submitted (job, future, answer), or answered already
    (status, body: an error found before it ran), or never run (`stopped`)."""
    number: int
    custom_id: str
    param: str = "prompt"
    job: Any = None
    future: Any = None
    answer: Any = None
    status: int = 0
    body: bytes = b""
    stopped: bool = False


class Batches:
    """The server's batch jobs: created, listed, cancelled from the event loop, run by one
    background thread. `service` is routes.Service; `endpoints` the table of what lines may
    ask for; `error_of(e, param)` the APIError a direct request gets for a failure."""

    def __init__(self, store: Store, service: Any, endpoints: Endpoints,
                 error_of: Callable[[BaseException, str], APIError]):
        self.store, self.service = store, service
        self.endpoints, self.error_of = endpoints, error_of
        self.in_flight = max(1, min(IN_FLIGHT, service.limits.max_running // 4))
        self._lock = threading.Condition()
        self._states = {b["id"]: b for b in store.all_batches()}
        self._queue = collections.deque(i for i, b in self._states.items()
                                        if b["status"] in UNFINISHED)   # oldest first
        for batch_id in self._queue:   # their counts as their files have them (a restart)
            state = self._states[batch_id]
            self._resume_point(state, *(store.content(state[k]) for k in ("_output", "_errors")))
        self._current: str | None = None
        self._pending: collections.deque[_Line] = collections.deque()
        self._cancel = threading.Event()   # the current job's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="minfer-batches", daemon=True)
        self._thread.start()

    # -- from the routes ------------------------------------------------------------------------
    def create(self, input_file_id: Any, endpoint: Any, window: Any, metadata: Any) -> dict:
        """A new job, queued; APIError naming the field for what cannot run."""
        if endpoint not in self.endpoints:
            raise APIError(400, f"endpoint must be one of {', '.join(self.endpoints)}, got "
                           f"{endpoint!r:.60}", param="endpoint")
        if window != WINDOW:
            raise APIError(400, f"completion_window must be {WINDOW!r}, got {window!r:.40}",
                           param="completion_window")
        check_metadata(metadata)
        file = self.store.file(input_file_id) if isinstance(input_file_id, str) else None
        if file is None:
            raise APIError(404, f"no such file: {input_file_id!r:.80}", param="input_file_id")
        if file["purpose"] != "batch":
            raise APIError(400, f"file {input_file_id} has purpose {file['purpose']!r}; a batch "
                           "reads a file uploaded with purpose 'batch'", param="input_file_id")
        other = next((u for u in file["_urls"] if u != endpoint), None)
        if other is not None:
            raise APIError(400, f"file {input_file_id} line {file['_urls'][other]} asks for "
                           f"{other!r:.60}, not this batch's endpoint {endpoint}: a batch's "
                           "lines all name its endpoint", param="input_file_id")
        now = int(time.time())
        state = {"id": new_id("batch"), "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": input_file_id, "completion_window": WINDOW,
                 "status": "validating", "output_file_id": None, "error_file_id": None,
                 "created_at": now, "in_progress_at": None, "expires_at": now + 24 * 3600,
                 "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": file["_lines"], "completed": 0, "failed": 0},
                 "metadata": metadata, "model": self.service.name,
                 # where its answers go: named now, so a restarted job appends to the same
                 "_output": new_id("file"), "_errors": new_id("file")}
        with self._lock:
            self.store.save_batch(state)
            self._states[state["id"]] = state
            self._queue.append(state["id"])
            self._lock.notify_all()
        return public(state)

    def get(self, batch_id: str) -> dict:
        with self._lock:
            return public(self._known(batch_id))

    def page(self, limit: int, after: str | None) -> dict:
        """OpenAI's list: newest first, `limit` of them after the batch `after`."""
        with self._lock:
            ids = sorted(self._states, reverse=True)
            start = 0
            if after is not None:
                if after not in self._states:
                    raise APIError(400, f"after: no such batch {after!r:.80}", param="after")
                start = ids.index(after) + 1
            data = [public(self._states[i]) for i in ids[start:start + limit]]
            more = start + limit < len(ids)
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    def cancel(self, batch_id: str) -> dict:
        """cancelling at once; the running job stops within a step, a queued one ends here."""
        with self._lock:
            state = self._known(batch_id)
            if state["status"] not in ("validating", "in_progress"):
                raise APIError(400, f"batch {batch_id} is {state['status']}: only a validating "
                               "or in-progress batch can be cancelled", param="batch_id")
            self._set(state, "cancelling")
            if batch_id == self._current:
                self._cancel.set()
                for line in list(self._pending):
                    if line.job is not None:
                        line.job.cancel()
            else:
                self._queue.remove(batch_id)
                self._finish(state, "cancelled")
            return public(state)

    def stop(self) -> None:
        """SIGTERM or the app's end: no new lines; the thread ends once those in flight did."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()

    def _known(self, batch_id: str) -> dict:
        state = self._states.get(batch_id) if is_id("batch", batch_id) else None
        if state is None:
            raise APIError(404, f"no such batch: {batch_id!r:.80}", param="batch_id")
        return state

    def _set(self, state: dict, status: str) -> None:
        """A new status, with its time, stored (under the lock)."""
        state["status"] = status
        state[f"{status}_at"] = int(time.time())
        self.store.save_batch(state)

    # -- the thread ---------------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stop.is_set():
                    self._lock.wait()
                if self._stop.is_set():
                    return
                state = self._states[self._queue.popleft()]
                self._current = state["id"]
                self._cancel.clear()
            try:
                self._run(state)
            except Exception as e:   # the job cannot go on (its input gone, a bug): failed
                log.error("batch %s failed", state["id"], exc_info=e)
                with self._lock:
                    state["errors"] = {"object": "list", "data": [
                        {"code": "internal_error", "message": f"{type(e).__name__}: {e}",
                         "param": None, "line": None}]}
                    self._finish(state, "failed")
            finally:
                with self._lock:
                    self._current = None

    def _run(self, state: dict) -> None:
        with self._lock:
            if state["status"] == "cancelling":   # cancelled before a restart
                self._finish(state, "cancelled")
                return
            if state["status"] == "validating":
                self._set(state, "in_progress")
        output, errors = (self.store.content(state[k]) for k in ("_output", "_errors"))
        done = self._resume_point(state, output, errors)
        if done > state["request_counts"]["total"]:
            raise RuntimeError(f"its output files hold {done} answers for "
                               f"{state['request_counts']['total']} lines")
        source = self.store.content(state["input_file_id"])
        with open(source, "rb") as src, open(output, "ab", buffering=0) as out, \
                open(errors, "ab", buffering=0) as err:
            answered = self._lines(state, src, done, out, err)
            if answered:
                for f in (out, err):
                    os.fsync(f.fileno())
        with self._lock:
            if self._cancel.is_set() or state["status"] == "cancelling":
                self._finish(state, "cancelled")
            elif answered:
                self._set(state, "finalizing")
                self._finish(state, "completed")
            else:   # stopped (SIGTERM): left in progress for the next start, its counts kept
                self.store.save_batch(state)

    def _resume_point(self, state: dict, output: Any, errors: Any) -> int:
        """Complete answers already written (a line cut short by a kill is cut off): they are
        the first lines of the input, in order."""
        counts = state["request_counts"]
        for path, key in ((output, "completed"), (errors, "failed")):
            count, end = complete_lines(path)
            if path.exists() and path.stat().st_size > end:
                os.truncate(path, end)
            counts[key] = count
        return counts["completed"] + counts["failed"]

    def _lines(self, state: dict, src: Any, done: int, out: Any, err: Any) -> bool:
        """Run the input lines after the first `done`, at most in_flight at once, and write
        their answers in order; whether every line was answered. Stopped or cancelled, no more
        lines start and those in flight are written as they end (a cancel has stopped them)."""
        pending = self._pending
        try:
            for number, _, raw in lines(src):
                if number <= done:
                    continue
                if self._stop.is_set() or self._cancel.is_set():
                    break
                pending.append(self._start(state, number, raw))
                while len(pending) >= self.in_flight:
                    if not self._write(state, pending.popleft(), out, err):
                        return False
            else:
                number = 0   # every line started
            while pending:
                if not self._write(state, pending.popleft(), out, err):
                    return False
            return number == 0
        finally:   # lines after one that was not answered: stopped, their memory given back
            while pending:
                line = pending.popleft()
                if line.job is not None:
                    line.job.cancel()
                    self.service.finished(line.job)

    def _start(self, state: dict, number: int, raw: bytes) -> _Line:
        """A line checked as its direct request is and submitted to the workers (a 429 waits
        and tries again); a line that fails its checks is answered at once."""
        obj = json.loads(raw)   # checked when the file was uploaded
        plan, param = self.endpoints[state["endpoint"]]
        line = _Line(number, obj["custom_id"], param)
        service, limits = self.service, self.service.limits
        try:
            body = obj["body"]
            size = len(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode())
            if size > limits.max_body_bytes:
                raise APIError(413, f"the request body is {size} bytes, more than this "
                               f"server's limit of {limits.max_body_bytes} (serve "
                               "--max-body-size)")
            check_model(body, service.name)
            work, args, line.answer = plan(service, body)
        except Exception as e:
            line.status, line.body = _error(self.error_of(e, param))
            return line
        line.job = service.job(time.monotonic() + limits.request_timeout)
        while not (self._stop.is_set() or self._cancel.is_set()):
            try:
                line.future = service.workers.submit(work, line.job, *args)
                return line
            except APIError as e:
                if e.status != 429:   # shutting down
                    break
                time.sleep(RETRY_SECONDS)
        line.stopped = True
        return line

    def _write(self, state: dict, line: _Line, out: Any, err: Any) -> bool:
        """Wait for the line's answer and append it to its file; False (nothing written) if
        the job was stopped or cancelled before it was answered."""
        if line.job is not None:
            try:
                if line.stopped:
                    return False
                line.status, line.body = self._outcome(line)
            except _NotAnswered:
                return False
            finally:
                self.service.finished(line.job)
        ok = 200 <= line.status < 300
        record = (b'{"id":' + _dumps(f"batch_req_{state['id'][6:]}{line.number:08d}")
                  + b',"custom_id":' + _dumps(line.custom_id)
                  + b',"response":{"status_code":' + str(line.status).encode()
                  + b',"request_id":' + _dumps(f"req_{uuid.uuid4().hex}")
                  + b',"body":' + line.body + b'},"error":null}\n')
        _write_all(out if ok else err, record)
        with self._lock:
            state["request_counts"]["completed" if ok else "failed"] += 1
        self.service.metrics.batch_line(ok)
        return True

    def _outcome(self, line: _Line) -> tuple[int, bytes]:
        """(status, body) as the direct request would have been answered."""
        job = line.job
        try:
            try:
                got = line.future.result(timeout=max(job.deadline - time.monotonic(), 0))
            except concurrent.futures.TimeoutError:
                job.cancel(self.service.timed_out())
                got = line.future.result()
            response = line.answer(got)
            return response.status_code, bytes(response.body)
        except (Cancelled, concurrent.futures.CancelledError):
            raise _NotAnswered() from None
        except Exception as e:
            if isinstance(e, APIError) and e.code == "shutting_down":
                raise _NotAnswered() from None
            return _error(self.error_of(e, line.param))

    def _finish(self, state: dict, status: str) -> None:
        """The job's end (under the lock): its output and error files published (those that
        hold answers), the counts taken from them, its status stored."""
        output, errors = (self.store.content(state[k]) for k in ("_output", "_errors"))
        self._resume_point(state, output, errors)
        counts = state["request_counts"]
        for key, path, field, count in (("_output", output, "output_file_id", "completed"),
                                        ("_errors", errors, "error_file_id", "failed")):
            if counts[count]:
                kind = "output" if key == "_output" else "error"
                self.store.publish(state[key], f"{state['id']}_{kind}.jsonl", "batch_output")
                state[field] = state[key]
            elif path.exists():
                path.unlink()
        self._set(state, status)
        self.service.metrics.batch_ended(status)


class _NotAnswered(Exception):
    """A line stopped by a cancel or a shutdown: it is not written (a restart runs it)."""


def _error(e: APIError) -> tuple[int, bytes]:
    """An error's status and body, as the direct request's error response has them."""
    response = error_response(e)
    return response.status_code, bytes(response.body)


def _dumps(value: str) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "backslashreplace")


def _write_all(f: Any, data: bytes) -> None:
    """Append one answer with as few writes as the system allows (one, for a regular file)."""
    view = memoryview(data)
    while view:
        view = view[f.write(view):]


def check_metadata(metadata: Any) -> None:
    """OpenAI's metadata: null, or at most 16 string keys (64 characters) and string values
    (512 characters)."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > METADATA_PAIRS or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in metadata.items()):
        raise APIError(400, f"metadata must be an object of at most {METADATA_PAIRS} string "
                       "keys (64 characters) and string values (512 characters)",
                       param="metadata")
