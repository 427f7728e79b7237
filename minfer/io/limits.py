"""Bounds every reader checks before it trusts a file, and a guarded JSON parser.

A file states numbers (header lengths, tensor counts, shapes) and structures (nesting) that the
reader would otherwise turn into allocations and recursion. The limits here are far above what any
real checkpoint, config or tokenizer file uses and far below what costs noticeable time or memory;
each is checked with cheap arithmetic on the raw bytes *before* the expensive step (json.loads,
per-tensor objects, a pickle's hash of a nested tuple) it protects.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

# JSON objects/arrays and pickled containers nest at most this deep. Real files: a safetensors
# header 3, config.json ~4, tokenizer.json ~6, a state dict ~5. Python's json recurses in C and
# raises RecursionError near 1000 levels; consumers that walk the result recurse too.
MAX_NESTING = 100
# A JSON file read whole (config.json, an index, generation_config.json). The largest real ones
# (a sharded index of ~100k tensors) are a few MiB; json.loads costs ~10x its input in memory.
MAX_JSON_BYTES = 64 * 1024 * 1024
# Tensor names: real ones are < 200 characters.
MAX_NAME_CHARS = 1024
# Dimensions of one tensor: NumPy 1.x cannot build more than 32.
MAX_RANK = 32
# Elements x itemsize of any shape, even an empty one: NumPy refuses larger arrays (a ValueError
# at np.empty), so a shape like [0, 10**30] would fail at read time, not when the file is opened.
MAX_ARRAY_BYTES = 1 << 62
# Tensors in one file or one sharded index. The largest real checkpoints hold ~100k tensors in
# all (DeepSeek-V3: 91k over 163 shards); parsing a header costs ~3 us and ~800 bytes per entry.
MAX_TENSORS = 1 << 18

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')     # linear: the classes are disjoint
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_CHUNK = 1 << 20


def quoted(text: str, limit: int = 120) -> str:
    """A name from a file, safe to put in a one-line message (escaped, cut to `limit`)."""
    text = text[:limit * 2].encode("unicode_escape").decode("ascii")
    return text if len(text) <= limit else text[:limit] + "..."


def json_nesting(raw: bytes, limit: int = MAX_NESTING) -> int:
    """The deepest bracket nesting of a JSON text, counting no further than `limit` + 1: strings
    are cut out with one regex pass, the brackets left are summed in bounded NumPy chunks, so a
    '[' * 10**8 costs milliseconds and a few MiB, never a recursion."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if len(brackets) <= limit:                       # cannot nest deeper than it has brackets
        return len(brackets)
    deepest = depth = 0
    for i in range(0, len(brackets), _BRACKET_CHUNK):
        chunk = np.frombuffer(brackets, np.uint8, min(_BRACKET_CHUNK, len(brackets) - i), i)
        running = np.cumsum(np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1),
                            dtype=np.int64) + depth
        deepest, depth = max(deepest, int(running.max())), int(running[-1])
        if deepest > limit:
            break
    return deepest


def parse_json(raw: bytes, where: str | os.PathLike, error: type[Exception],
               limit: int = MAX_NESTING) -> Any:
    """json.loads of UTF-8 bytes, every failure a one-line `error` naming `where`: nesting deeper
    than `limit` (checked before parsing), bad UTF-8, bad JSON, integers too long to convert."""
    return _loads(raw, where, error, limit)[0]


def read_json_text(path: str | os.PathLike, error: type[Exception],
                   max_bytes: int = MAX_JSON_BYTES) -> tuple[Any, str]:
    """A JSON file, parsed as `parse_json` does, and its text; its size is checked before it is
    read. Also for readers outside io/ (tokenizer.json, tokenizer_config.json, vocab.json)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise error(f"{path}: {size} bytes is larger than the {max_bytes}-byte limit "
                            "for a JSON file")
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    if len(raw) > max_bytes:  # grew while we read, or a file that reports no size
        raise error(f"{path}: larger than the {max_bytes}-byte limit for a JSON file")
    return _loads(raw, path, error, MAX_NESTING)


def _loads(raw: bytes, where: Any, error: type[Exception], limit: int) -> tuple[Any, str]:
    if json_nesting(raw, limit) > limit:
        raise error(f"{where}: JSON nested deeper than {limit} levels")
    try:
        text = raw.decode("utf-8")
        return json.loads(text), text
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError: a ValueError
        raise error(f"{where}: not valid JSON ({first_line(e)})") from None


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return quoted(lines[0], 160) if lines else type(exc).__name__
