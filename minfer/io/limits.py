"""Bounds every reader checks before it trusts a file, and a guarded JSON parser.

A file states numbers (header lengths, tensor counts, shapes) and structures (nesting) that the
reader would otherwise turn into allocations and recursion. The limits here are far above what any
real checkpoint, config or tokenizer file uses and far below what costs noticeable time or memory;
each is checked with cheap arithmetic on the raw bytes *before* the expensive step (json.loads,
per-tensor objects, a pickle's hash of a nested tuple) it protects.
"""

from __future__ import annotations

import errno
import json
import os
import stat
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
# Lengths, vocabulary sizes and n-gram sizes read from files or options: int32-sized, as token
# ids are everywhere else (the arena refuses real runs long before).
MAX_LENGTH = 2**31 - 1

_JSON_CHUNK = 1 << 18   # bytes per vectorised step of json_nesting: ~6 MiB of scratch


def is_int(value: Any) -> bool:
    """An integer as JSON and pickles hold them: int but not bool (bool is an int subclass)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    """An int or NumPy integer, not a bool (np.bool_ is not an np.integer)."""
    return is_int(value) or isinstance(value, np.integer)


def quoted(text: str, limit: int = 120) -> str:
    """A name from a file, safe to put in a one-line message (escaped, cut to `limit`)."""
    text = text[:limit * 2].encode("unicode_escape").decode("ascii")
    return text if len(text) <= limit else text[:limit] + "..."


def shown(value: Any, limit: int = 60) -> str:
    """A value read from a file or given as an argument, for a one-line message: a string quoted
    (escaped, cut), a container by its kind and size (its repr could be megabytes), an integer
    too long to print by its bit length, anything else its repr cut."""
    if isinstance(value, str):
        return f"'{quoted(value, limit)}'"
    if isinstance(value, (list, dict)):
        kind, n = "list" if isinstance(value, list) else "object", len(value)
        return f"a JSON {kind} of {n} item{'s' * (n != 1)}"
    if isinstance(value, (tuple, set, frozenset, bytes, bytearray)) and len(value) > limit:
        return f"a {type(value).__name__} of length {len(value)}"   # an argument, not from JSON
    if is_int(value) and value.bit_length() > 64:
        return f"a {value.bit_length()}-bit integer"
    return quoted(repr(value), limit)


def short_repr(value: Any, limit: int = 60) -> str:
    """An argument given in Python, for a one-line message: its repr cut to `limit` (an integer
    too long to print by its bit length: a 5000-digit integer cannot even be repr'd). Values
    read from files go through `shown`, which also sizes containers."""
    if is_int(value) and value.bit_length() > 64:
        return f"<{value.bit_length()}-bit integer>"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def is_regular_file(path: str | os.PathLike, error: type[Exception]) -> bool:
    """True when `path` is a regular file (a link to one counts), False when nothing is there.
    Anything else by that name (a folder, a FIFO or device, a link to nothing or to itself, a
    path that cannot be looked up) is a one-line `error`: the folder meant it to be that file,
    and taking it for absent would send the reader to a wrong conclusion (another weights
    format, "missing", a fallback file)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not os.path.islink(path):
            return False
        kind = "a link to nothing"
    except NotADirectoryError:   # a file where a parent folder should be: nothing by this name
        return False
    except ValueError:           # a NUL in the name: no file can have it
        return False
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise error(f"{path}: cannot read: {e.strerror or e}") from None
        kind = "a link that loops back on itself"
    else:
        if stat.S_ISREG(mode):
            return True
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device or socket")
    raise error(f"{path}: not a readable file ({kind})")


def json_nesting(raw: bytes, limit: int = MAX_NESTING) -> int:
    """The deepest bracket nesting of a JSON text, counting no further than the first chunk
    that passes `limit`. Vectorised over bounded chunks (a few MiB of scratch whatever the
    input; no object per string or bracket, which a regex pass would build): a quote preceded by
    an odd run of backslashes is escaped, a bracket after an odd number of unescaped quotes is
    inside a string, and the rest add +1 / -1 to a running depth."""
    data = np.frombuffer(raw, np.uint8)
    deepest = depth = quotes = run = 0       # carried across chunks: depth, quote parity, "\\" run
    for i in range(0, data.size, _JSON_CHUNK):
        a = data[i:i + _JSON_CHUNK]
        quote = a == ord('"')
        backslash = a == ord("\\")
        if run or backslash.any():
            at = np.arange(a.size, dtype=np.int32)
            last_other = np.maximum.accumulate(np.where(backslash, -1, at))
            before = np.empty(a.size, np.int32)          # backslashes right before each byte
            before[0] = run
            before[1:] = at[:-1] - last_other[:-1] + np.where(last_other[:-1] < 0, run, 0)
            quote &= before % 2 == 0
            run = int(before[-1] + 1) if backslash[-1] else 0
        outside = (np.cumsum(quote, dtype=np.int32) & 1) == quotes % 2
        quotes += int(quote.sum())
        step = ((a == ord("[")) | (a == ord("{"))).astype(np.int8)
        step -= (a == ord("]")) | (a == ord("}"))
        step[~outside] = 0
        running = np.cumsum(step, dtype=np.int64) + depth
        if running.size:
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
            raw = f.read(size + 1 if size else max_bytes + 1)   # read(n) allocates n up front
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
