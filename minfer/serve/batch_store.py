"""The batch folder (`minfer serve --batch-dir DIR`): the files clients upload, the files batch jobs
write, and each job's state, kept on disk so that a restarted server finds them all.

    DIR/files/<file id>.jsonl    a file's bytes (an input file, or a job's output or error file)
    DIR/files/<file id>.json     its file object (OpenAI's shape; the private fields start "_")
    DIR/batches/<batch id>.json  a batch object (OpenAI's shape) and its private fields

A file exists once its object does: an upload is written and checked under a temporary name, then
renamed, then its object written; a job's output and error files are appended while it runs and
get their objects when it ends. Objects are replaced whole (written aside, then renamed), so a
crash leaves the old one or the new one, never half of either. Ids are made here and checked
against their pattern before they name a path.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, BinaryIO

try:
    import fcntl
except ImportError:   # (not on Windows: the folder is then not locked)
    fcntl = None  # type: ignore[assignment]

from ..errors import InputError
from ..io.lines import MAX_LINE_BYTES, lines
from ..io.limits import MAX_NESTING, first_line, json_nesting, parse_json

# OpenAI's limits for a batch's input file
MAX_FILE_LINES = 50_000
MAX_FILE_BYTES = 200 << 20
# A file name is only kept for the file object: at most this many characters
_NAME_CHARS = 255
_IDS = {"file": re.compile(r"file-[0-9a-f]{32}"), "batch": re.compile(r"batch_[0-9a-f]{32}")}
_PRIVATE = "_"


def new_id(kind: str) -> str:
    """A new file ("file-...") or batch ("batch_...") id; ids sort by creation time (the
    nanosecond clock first), which the batch list's order relies on."""
    return f"{kind}{'-' if kind == 'file' else '_'}{time.time_ns():016x}{uuid.uuid4().hex[:16]}"


def is_id(kind: str, value: Any) -> bool:
    return isinstance(value, str) and _IDS[kind].fullmatch(value) is not None


def public(obj: dict) -> dict:
    """What a client sees of a stored object: its fields but the private ones."""
    return {k: v for k, v in obj.items() if not k.startswith(_PRIVATE)}


def write_object(path: Path, obj: dict) -> None:
    """Replace `path` by `obj` as JSON, whole or not at all (written aside, synced, renamed)."""
    aside = path.with_suffix(".tmp")
    with open(aside, "wb") as f:
        f.write(json.dumps(obj, ensure_ascii=False).encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(aside, path)


def read_object(path: Path) -> dict | None:
    """A stored object, or None when there is none (a crash before its rename)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    return parse_json(raw, path, InputError)


def _locked(path: Path) -> int | None:
    """An open descriptor holding an exclusive lock on `path` for as long as it is open: two
    servers on one folder would resume the same jobs and both append their answers (and the
    second's start would delete the first's uploads in progress). None where the system has no
    flock."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise InputError(f"batch folder {path.parent} is in use by another server (it holds "
                         f"{path.name}); give each server its own --batch-dir") from None
    return fd


class Store:
    """The batch folder: file bytes and objects, batch objects."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.files, self.batches = self.folder / "files", self.folder / "batches"
        self._lock: int | None = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._lock = _locked(self.folder / ".lock")
            for sub in (self.files, self.batches):
                sub.mkdir(parents=True, exist_ok=True)
                for aside in sub.glob("*.tmp"):   # a write a crash interrupted: never renamed
                    aside.unlink()
            probe = self.folder / ".writable.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            self.close()
            raise InputError(f"batch folder {self.folder}: {e.strerror or e}") from None

    def close(self) -> None:
        """Let go of the folder (its lock): another server may take it."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    # -- files --------------------------------------------------------------------------------------
    def content(self, file_id: str) -> Path:
        """Where a file's bytes are (whether or not it exists yet)."""
        return self.files / f"{file_id}.jsonl"

    def file(self, file_id: str) -> dict | None:
        """A file's stored object (private fields too), or None for an unknown id."""
        if not is_id("file", file_id):
            return None
        return read_object(self.files / f"{file_id}.json")

    def publish(self, file_id: str, filename: str, purpose: str, **private: Any) -> dict:
        """Give the bytes at content(file_id) their file object: from now on the file exists."""
        obj = {"id": file_id, "object": "file", "bytes": self.content(file_id).stat().st_size,
               "created_at": int(time.time()), "filename": filename, "purpose": purpose,
               "status": "processed", "status_details": None,
               **{_PRIVATE + k: v for k, v in private.items()}}
        write_object(self.files / f"{file_id}.json", obj)
        return obj

    def upload(self, source: BinaryIO, filename: str | None,
               max_lines: int = MAX_FILE_LINES) -> dict:
        """A batch input file from `source` (read in pieces), checked line by line
        (check_input), stored, and its file object; InputError naming the line otherwise."""
        name = (filename or "upload.jsonl")[:_NAME_CHARS]
        file_id = new_id("file")
        aside = self.content(file_id).with_suffix(".tmp")
        try:
            with open(aside, "wb") as f:
                while chunk := source.read(1 << 20):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            with open(aside, "rb") as f:
                count, urls = check_input(f, name, max_lines)
            os.replace(aside, self.content(file_id))
        finally:
            aside.unlink(missing_ok=True)
        return self.publish(file_id, name, "batch", lines=count, urls=urls)

    # -- batches ------------------------------------------------------------------------------------
    def save_batch(self, state: dict) -> None:
        write_object(self.batches / f"{state['id']}.json", state)

    def all_batches(self) -> list[dict]:
        """Every stored batch (private fields too), oldest first."""
        found = (read_object(p) for p in sorted(self.batches.glob("batch_*.json"))
                 if is_id("batch", p.stem))
        return [b for b in found if b is not None]


def strict_json(raw: bytes, where: str) -> Any:
    """A line's JSON as a request body is read (schema.parse_body): nesting bounded first, no
    NaN or Infinity (JSON has neither); InputError naming `where` otherwise."""
    if json_nesting(raw, MAX_NESTING) > MAX_NESTING:
        raise InputError(f"{where}: JSON nested deeper than {MAX_NESTING} levels")

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=refuse)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InputError(f"{where}: not valid JSON ({first_line(e)})") from None


def check_input(f: BinaryIO, name: str, max_lines: int) -> tuple[int, dict[str, int]]:
    """A batch input file's lines, each a JSON object {"custom_id": a string unique in the file,
    "method": "POST", "url": a string, "body": an object}: their count and the first line of each of the first two urls (a
    batch checks them against its endpoint). InputError naming the line otherwise."""
    seen: set[str] = set()
    urls: dict[str, int] = {}
    count = 0
    for number, _, raw in lines(f):
        where = f"{name} line {number}"
        if number > max_lines:
            raise InputError(f"{name}: more than {max_lines} requests (one per line) in a batch")
        if raw is None:
            raise InputError(f"{where}: longer than {MAX_LINE_BYTES} bytes")
        if not raw.strip():
            raise InputError(f"{where}: empty, expected a JSON object (one request per line)")
        obj = strict_json(raw, where)
        if not isinstance(obj, dict):
            raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        custom_id, method, url = obj.get("custom_id"), obj.get("method"), obj.get("url")
        if not isinstance(custom_id, str) or not custom_id:
            raise InputError(f"{where}: custom_id must be a non-empty string")
        if custom_id in seen:
            raise InputError(f"{where}: custom_id {custom_id!r:.80} is used twice: each request's "
                             "must be unique in its file")
        if method != "POST":
            raise InputError(f"{where}: method must be \"POST\", got {method!r:.40}")
        if not isinstance(url, str):
            raise InputError(f"{where}: url must be a string, such as \"/v1/completions\"")
        if not isinstance(obj.get("body"), dict):
            raise InputError(f"{where}: body must be a JSON object (the request's body)")
        seen.add(custom_id)
        if url not in urls and len(urls) < 2:   # one url is all a batch takes: two tell a mix
            urls[url] = number
        count = number
    if count == 0:
        raise InputError(f"{name} holds no requests (one JSON object per line)")
    return count, urls
