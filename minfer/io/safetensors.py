"""One .safetensors file: a validated header, tensors read with bounded file I/O.

The format (https://github.com/huggingface/safetensors, "Format" section): 8 bytes of little-endian
header length N, N bytes of JSON mapping tensor names to {dtype, shape, data_offsets} (offsets
relative to the end of the header), then the raw little-endian data.

We parse it ourselves rather than through the `safetensors` package for two reasons: every
inconsistency of a lying header becomes a `CheckpointError` naming the file and tensor before
anything is allocated (sizes, offsets, overlaps, all checked against the file's real size), and a
tensor (or a range of its rows) is read with plain file I/O straight into its array, never the
whole file and never a memory map by default: mapped pages count as the process's memory, which
doubled the peak under a memory limit.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from .limits import (MAX_ARRAY_BYTES, MAX_NAME_CHARS, MAX_RANK, MAX_TENSORS, parse_json,
                     quoted)
from .tensors import FILE_STORAGE as STORAGE, TensorInfo

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's own limit
# What a header may take beyond its entries (metadata, padding), and per entry: a name of
# MAX_NAME_CHARS characters escaped as \uXXXX, a dtype, a full-rank shape and two offsets.
HEADER_SLACK = 4 * 1024 * 1024
MAX_ENTRY_BYTES = 6 * MAX_NAME_CHARS + 2048
# Tensors with no elements need no data bytes; real files have none or a handful.
MAX_EMPTY_TENSORS = 1024


class SafetensorsFile:
    """One .safetensors file: a validated header; tensors read with file I/O or a memory map."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        self._map: np.memmap | None = None
        self._parse_header()

    def _fail(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {message}")

    def _parse_header(self) -> None:
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise self._fail(f"truncated safetensors file ({size} bytes, no header length)")
                n = int.from_bytes(prefix, "little")
                if n > MAX_HEADER_BYTES:
                    raise self._fail(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit "
                                     "(not a safetensors file?)")
                if 8 + n > size:
                    raise self._fail(f"header length {n} runs past the end of the file ({size} bytes): "
                                     "truncated or not a safetensors file")
                raw = f.read(n)
        except OSError as e:
            raise self._fail(f"cannot read: {e.strerror or e}") from None
        data_start, data_size = 8 + n, size - 8 - n
        self._check_plausible(raw, data_size)
        header = parse_json(raw, self.path, CheckpointError)
        if not isinstance(header, dict):
            raise self._fail("malformed safetensors header (not a JSON object)")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise self._fail("malformed safetensors header (__metadata__ is not an object of "
                             "strings)")
        self.metadata = meta
        if len(header) > MAX_TENSORS:  # keys spelled with escapes evade the count in the pre-check
            raise self._fail(f"header lists {len(header)} tensors, more than the {MAX_TENSORS} "
                             "a file may hold")

        spans = []
        for name, entry in header.items():
            info = self._validate_entry(name, entry, data_start, data_size)
            self.tensors[name] = info
            if info.end > info.start:
                spans.append((info.start, info.end, name))
        spans.sort()
        for (s0, e0, a), (s1, e1, b) in zip(spans, spans[1:]):
            if s1 < e0:
                raise self._fail(f"tensors '{quoted(a)}' and '{quoted(b)}' overlap in the data "
                                 "section")

    def _check_plausible(self, raw: bytes, data_size: int) -> None:
        """Before json.loads (~3 us and ~800 bytes per entry): the tensor count the raw header
        implies (one "data_offsets" key per entry; a key spelled with escapes is caught after
        parsing, and the header's size bounds what it can cost) against the limit and the data
        it must point into (every non-empty tensor needs a byte of its own), and the header's size
        against what that many entries plus metadata can take."""
        count = raw.count(b'"data_offsets"')
        if count > MAX_TENSORS:
            raise self._fail(f"header lists about {count} tensors, more than the {MAX_TENSORS} "
                             "a file may hold")
        if count > data_size + MAX_EMPTY_TENSORS:
            raise self._fail(f"header lists about {count} tensors but the data section holds "
                             f"only {data_size} bytes (each non-empty tensor needs its own bytes)")
        most = HEADER_SLACK + count * MAX_ENTRY_BYTES
        if len(raw) > most:
            raise self._fail(f"header of {len(raw)} bytes for {count} tensors (at most {most} "
                             "expected): padded or not a safetensors file")

    def _validate_entry(self, name: str, entry: Any, data_start: int, data_size: int) -> TensorInfo:
        if len(name) > MAX_NAME_CHARS:
            raise self._fail(f"tensor '{quoted(name)}': name of {len(name)} characters (at most "
                             f"{MAX_NAME_CHARS})")
        if not isinstance(entry, dict):
            raise self._fail(f"tensor '{quoted(name)}': header entry is not an object")
        code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(code, str) or code not in STORAGE:
            raise self._fail(f"tensor '{quoted(name)}': unsupported dtype {quoted(repr(code), 40)} "
                             f"(supported: {', '.join(STORAGE)})")
        if (not isinstance(shape, list) or len(shape) > MAX_RANK
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise self._fail(f"tensor '{quoted(name)}': malformed shape {quoted(repr(shape), 80)} "
                             f"(at most {MAX_RANK} dimensions, each a non-negative integer)")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise self._fail(f"tensor '{quoted(name)}': malformed data_offsets "
                             f"{quoted(repr(offsets), 80)}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise self._fail(f"tensor '{quoted(name)}': data_offsets [{begin}, {end}] lie outside "
                             f"the data section ({data_size} bytes): file truncated or header corrupt")
        itemsize = STORAGE[code].itemsize
        if math.prod(max(d, 1) for d in shape) * itemsize > MAX_ARRAY_BYTES:
            raise self._fail(f"tensor '{quoted(name)}': shape {quoted(repr(shape), 80)} is too "
                             "large for an array")
        expected = math.prod(shape) * itemsize
        if end - begin != expected:
            raise self._fail(f"tensor '{quoted(name)}': {end - begin} bytes of data for shape "
                             f"{shape} {code} (expected {expected})")
        return TensorInfo(name, code, tuple(shape), self.path, data_start + begin, data_start + end)

    def raw(self, name: str, mmap: bool = True, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor as stored (BF16 as uint16): a read-only view of the memory-mapped file, or
        with `mmap=False` a fresh array read with plain file I/O (mapped pages would count as the
        process's memory, which a memory-limited load must not touch wholesale)."""
        info = self.tensors[name]
        storage = STORAGE[info.dtype]
        shape, start, end = info.shape, info.start, info.end
        if rows is not None:  # a range of the first axis only
            a, b = rows
            row_bytes = math.prod(shape[1:]) * storage.itemsize
            shape = (b - a, *shape[1:])
            start, end = info.start + a * row_bytes, info.start + b * row_bytes
        if end == start:
            return np.empty(shape, dtype=storage)
        if not mmap:
            out = np.empty(end - start, np.uint8)
            try:
                with open(self.path, "rb") as f:
                    f.seek(start)
                    got = f.readinto(memoryview(out))
            except OSError as e:
                raise self._fail(f"cannot read tensor '{quoted(name)}': {e.strerror or e}") from None
            if got != out.nbytes:
                raise self._fail(f"tensor '{quoted(name)}': file shrank while reading (got {got} of "
                                 f"{out.nbytes} bytes)")
            return out.view(storage).reshape(shape)
        if self._map is None:
            try:
                self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
            except (OSError, ValueError) as e:
                raise self._fail(f"cannot memory-map: {e}") from None
        return self._map[start:end].view(storage).reshape(shape)
