"""Reading checkpoints in the Hugging Face folder layout: config.json + safetensors (single or sharded).

The safetensors format (https://github.com/huggingface/safetensors, "Format" section): 8 bytes of
little-endian header length N, N bytes of JSON mapping tensor names to {dtype, shape, data_offsets}
(offsets relative to the end of the header), then the raw little-endian data. We parse it ourselves
rather than through the `safetensors` package because (1) NumPy has no bfloat16 and the package's
NumPy reader refuses BF16 files, and (2) we want every inconsistency of a lying header to become a
`CheckpointError` naming file and tensor before anything is allocated. Tensors are read one at a
time with file I/O straight into their arrays (never the whole file into a Python bytes object);
a memory map is optional (`Checkpoint.use_mmap`) because mapped pages count toward the process's
RSS and doubled its peak under a memory limit.

A folder without safetensors may instead hold a torch.save'd `pytorch_model.bin`; legacy.py reads
it (restricted unpickling, no torch) behind the same per-file interface.

This module does no math beyond dtype widening; the model files map names and shapes.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .errors import CheckpointError, ConfigError
from .streaming import dequantize_int8

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's own limit

# safetensors dtype code -> (numpy storage dtype, element size)
_STORAGE = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to float32 on read: bf16 is the top half of an fp32
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
FLOAT_CODES = ("F64", "F32", "F16", "BF16")
SCALE_NAME_SUFFIX = "_scale"  # int8 weight W travels with W_scale (F32, one scale per row)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
LEGACY_WEIGHTS_NAME = "pytorch_model.bin"   # used only when there are no safetensors


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str               # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    start: int               # absolute byte offsets in `file`
    end: int


def bf16_to_float32(raw: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 bits (uint16) to float32 exactly: they are the high half of an fp32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


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
        if code not in _STORAGE:
            raise self._fail(f"tensor '{name}': unsupported dtype {code!r} "
                             f"(supported: {', '.join(_STORAGE)})")
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
        expected = math.prod(shape) * _STORAGE[code].itemsize
        if end - begin != expected:
            raise self._fail(f"tensor '{name}': {end - begin} bytes of data for shape {shape} "
                             f"{code} (expected {expected})")
        return TensorInfo(name, code, tuple(shape), self.path, data_start + begin, data_start + end)

    def raw(self, name: str, mmap: bool = True, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor as stored (BF16 as uint16): a read-only view of the memory-mapped file, or
        with `mmap=False` a fresh array read with plain file I/O (mapped pages would count as the
        process's memory, which a memory-limited load must not touch wholesale)."""
        info = self.tensors[name]
        storage = _STORAGE[info.dtype]
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


class Checkpoint:
    """A model folder: its config.json and the union of its safetensors files' tensors."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: not a folder")
        self.config = read_json(self.folder / "config.json", required=True)
        self.files: list[SafetensorsFile] = [_open_weights(p) for p in self._weight_files()]
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.tensors:
                if name in self._where:
                    raise CheckpointError(f"{f.path}: tensor '{name}' also appears in "
                                          f"{self._where[name].path.name}")
                self._where[name] = f
        self._check_index()
        # Tensors are read with file I/O into fresh arrays by default: a memory map would keep
        # every page it touched counted as the process's memory next to the converted copies
        # (twice the weights at the peak). True maps instead (tests of the mapped path).
        self.use_mmap = False
        self._scales = self._find_int8_scales()

    def _find_int8_scales(self) -> dict[str, str]:
        """int8 weights written by `minfer convert --dtype int8`: `W` (I8, (out, in)) with
        `W_scale` (F32, (out,)). The scales are hidden from `names()`; `read(W)` dequantises."""
        scales = {}
        for name, f in self._where.items():
            info = f.tensors[name]
            if info.dtype != "I8":
                continue
            scale = name + SCALE_NAME_SUFFIX
            sf = self._where.get(scale)
            if sf is None:
                continue  # an integer tensor with no scale: read() refuses it by name
            sinfo = sf.tensors[scale]
            if len(info.shape) != 2 or sinfo.dtype != "F32" or sinfo.shape != info.shape[:1]:
                raise CheckpointError(f"{sinfo.file}: tensor '{scale}' must be F32 of shape "
                                      f"[{info.shape[0] if info.shape else '?'}] to scale the "
                                      f"int8 weight '{name}', got {sinfo.dtype} {list(sinfo.shape)}")
            scales[name] = scale
        for scale in scales.values():
            del self._where[scale]
        self._scale_where = {scale: f for f in self.files for scale in scales.values()
                             if scale in f.tensors}
        return scales

    def quantized_names(self) -> list[str]:
        """Tensors stored as int8 with per-row scales."""
        return list(self._scales)

    def _weight_files(self) -> list[Path]:
        single, index = self.folder / WEIGHTS_NAME, self.folder / INDEX_NAME
        if index.is_file():
            self.index = read_json(index, required=True)
            weight_map = self.index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: missing or empty 'weight_map'")
            shards = []
            for tensor, shard in weight_map.items():
                if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                    raise CheckpointError(f"{index}: tensor '{tensor}' maps to {shard!r}, "
                                          "which is not a file name inside the model folder")
                if shard not in shards:
                    shards.append(shard)
            missing = [s for s in shards if not (self.folder / s).is_file()]
            if missing:
                raise CheckpointError(f"{index}: shard file {missing[0]} is missing from {self.folder}")
            return [self.folder / s for s in shards]
        self.index = None
        if single.is_file():
            return [single]
        if (self.folder / LEGACY_WEIGHTS_NAME).is_file():   # torch.save'd, read by legacy.py
            return [self.folder / LEGACY_WEIGHTS_NAME]
        legacy = [p.name for p in self.folder.glob("*.bin")] + [p.name for p in self.folder.glob("*.pt")]
        hint = (f" (found {legacy[0]}: only safetensors and {LEGACY_WEIGHTS_NAME} are read)"
                if legacy else "")
        raise CheckpointError(f"{self.folder}: no {WEIGHTS_NAME} or {INDEX_NAME}{hint}")

    def _check_index(self) -> None:
        if self.index is None:
            return
        for tensor, shard in self.index["weight_map"].items():
            owner = self._where.get(tensor)
            if owner is None or owner.path.name != shard:
                raise CheckpointError(f"{self.folder / INDEX_NAME}: tensor '{tensor}' is not in "
                                      f"its shard {shard}")

    # -- access -----------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        return self._where[name].tensors[name]

    def read(self, name: str, dtype: Any = np.float32,
             rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor (or rows [a, b) of its first axis) converted to `dtype`: a fresh host
        array, C-contiguous. Reading by rows bounds the memory a large embedding needs."""
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"{self.folder}: tensor '{name}' is missing")
        info = f.tensors[name]
        if rows is not None and not (len(info.shape) >= 1 and 0 <= rows[0] <= rows[1] <= info.shape[0]):
            raise CheckpointError(f"{info.file}: rows {rows} outside tensor '{name}' {list(info.shape)}")
        raw = f.raw(name, self.use_mmap, rows)
        if name in self._scales:
            scale_name = self._scales[name]
            scale = self._scale_where[scale_name].raw(scale_name, self.use_mmap)
            if rows is not None:
                scale = scale[rows[0]:rows[1]]
            # widen, then scale in place: several times faster than a mixed int8 * float32 multiply
            return dequantize_int8(np, raw, scale[:, None], np.empty(raw.shape, np.float32)
                                   ).astype(dtype, copy=False)
        if info.dtype == "BF16":
            raw = bf16_to_float32(raw)
        elif info.dtype not in FLOAT_CODES:
            raise CheckpointError(f"{info.file}: tensor '{name}' has integer dtype {info.dtype}, "
                                  "expected a floating-point weight")
        try:
            if not self.use_mmap and raw.flags.writeable:  # raw is a private copy
                return np.ascontiguousarray(raw, dtype=dtype)
            return np.array(raw, dtype=dtype, order="C")
        except OSError as e:  # a file shrunk under the memory map
            raise CheckpointError(f"{info.file}: cannot read tensor '{name}': {e}") from None

    def stored_dtypes(self) -> set[str]:
        return {f.tensors[n].dtype for n, f in self._where.items()}

    def total_bytes(self) -> int:
        return sum(i.end - i.start for f in self.files for i in f.tensors.values())


def _open_weights(path: Path) -> SafetensorsFile:
    """A weights file: safetensors, or a legacy torch pickle (legacy.TorchFile, same interface)."""
    if path.name != LEGACY_WEIGHTS_NAME:
        return SafetensorsFile(path)
    from .legacy import TorchFile   # not at the top: legacy.py imports this module
    return TorchFile(path)


def read_json(path: Path, required: bool = False) -> dict | None:
    """A JSON object from `path`; None when absent and not required. Errors name the file."""
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path}: file is missing")
        return None
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def check_names(checkpoint: Checkpoint, expected: Iterable[str], ignorable: Iterable[str] = ()) -> None:
    """Reject missing or unexpected tensors, naming the first of each."""
    expected = set(expected)
    ignorable = set(ignorable)
    present = set(checkpoint.names())
    missing = sorted(expected - present)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{checkpoint.folder}: tensor '{missing[0]}' is missing{more}")
    unexpected = sorted(present - expected - ignorable)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        where = checkpoint.info(unexpected[0]).file.name
        raise CheckpointError(f"{checkpoint.folder / where}: unexpected tensor '{unexpected[0]}'{more}")


class ConfigReader:
    """Typed reads of config.json values with one-line errors naming the file and key (shared by
    the model families' config parsers)."""

    def __init__(self, cfg: dict, source: str):
        self.cfg, self.source = cfg, source

    def get_int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{self.source}: '{key}' must be an integer >= {minimum}, got {value!r}")
        return value

    def get_eps(self, key: str, default: float) -> float:
        value = self.cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ConfigError(f"{self.source}: '{key}' must be a small number, got {value!r}")
        return float(value)
