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

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from .tensors import STORAGE, TensorInfo

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's own limit


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
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._fail(f"malformed safetensors header (not JSON: {e})") from None
        if not isinstance(header, dict):
            raise self._fail("malformed safetensors header (not a JSON object)")
        meta = header.pop("__metadata__", {}) or {}
        if not isinstance(meta, dict):
            raise self._fail("malformed safetensors header (__metadata__ is not an object)")
        self.metadata = {str(k): str(v) for k, v in meta.items()}

        data_start, data_size = 8 + n, size - 8 - n
        spans = []
        for name, entry in header.items():
            info = self._validate_entry(name, entry, data_start, data_size)
            self.tensors[name] = info
            if info.end > info.start:
                spans.append((info.start, info.end, name))
        spans.sort()
        for (s0, e0, a), (s1, e1, b) in zip(spans, spans[1:]):
            if s1 < e0:
                raise self._fail(f"tensors '{a}' and '{b}' overlap in the data section")

    def _validate_entry(self, name: str, entry: Any, data_start: int, data_size: int) -> TensorInfo:
        if not isinstance(entry, dict):
            raise self._fail(f"tensor '{name}': header entry is not an object")
        code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if code not in STORAGE:
            raise self._fail(f"tensor '{name}': unsupported dtype {code!r} "
                             f"(supported: {', '.join(STORAGE)})")
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise self._fail(f"tensor '{name}': malformed shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise self._fail(f"tensor '{name}': malformed data_offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise self._fail(f"tensor '{name}': data_offsets [{begin}, {end}] lie outside the "
                             f"data section ({data_size} bytes): file truncated or header corrupt")
        expected = math.prod(shape) * STORAGE[code].itemsize
        if end - begin != expected:
            raise self._fail(f"tensor '{name}': {end - begin} bytes of data for shape {shape} "
                             f"{code} (expected {expected})")
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
                raise self._fail(f"cannot read tensor '{name}': {e.strerror or e}") from None
            if got != out.nbytes:
                raise self._fail(f"tensor '{name}': file shrank while reading (got {got} of "
                                 f"{out.nbytes} bytes)")
            return out.view(storage).reshape(shape)
        if self._map is None:
            try:
                self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
            except (OSError, ValueError) as e:
                raise self._fail(f"cannot memory-map: {e}") from None
        return self._map[start:end].view(storage).reshape(shape)
