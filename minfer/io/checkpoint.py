"""A model folder in the Hugging Face layout: config.json plus its weight files.

`Checkpoint` is the union of the folder's tensor files: one model.safetensors, a sharded set with
its index, or (only when there are no safetensors) a torch.save'd pytorch_model.bin read by
`torch_pickle.py` without running pickle code. Names are unique across files, the index must
match the shards, and int8 weights written by `minfer convert` are read back through their scales.

This module does no math beyond dtype widening; the model families say which names and shapes
they need (their weight tables) and `params/loader.py` checks them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..params.formats import SCALE_SUFFIX, dequantize_int8
from .safetensors import SafetensorsFile
from .tensors import FLOAT_CODES, TensorInfo, bf16_to_float32
from .torch_pickle import TorchFile

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
LEGACY_WEIGHTS_NAME = "pytorch_model.bin"   # used only when there are no safetensors


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
            scale = name + SCALE_SUFFIX
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
        if (self.folder / LEGACY_WEIGHTS_NAME).is_file():   # torch.save'd, read by torch_pickle.py
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
            return dequantize_int8(np, raw, scale, np.empty(raw.shape, np.float32)
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

    def read_stored(self, name: str, rows: tuple[int, int] | None = None
                    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The tensor (or rows [a, b)) exactly as stored, no conversion: its storage dtype (BF16
        as uint16 bits), plus the float32 per-row scales of an int8 weight (else None). What a
        model whose weight format matches the file reads, with no float32 copy."""
        self.read(name, np.float32, (0, 0) if rows is None else (rows[0], rows[0]))  # the checks
        f = self._where[name]
        raw = f.raw(name, self.use_mmap, rows)
        if self.use_mmap:                 # a private copy, not a view of the mapped file
            raw = np.array(raw)
        if name not in self._scales:
            return raw, None
        scale_name = self._scales[name]
        scale = self._scale_where[scale_name].raw(scale_name, self.use_mmap)
        return raw, np.array(scale if rows is None else scale[rows[0]:rows[1]], np.float32)


def _open_weights(path: Path) -> SafetensorsFile:
    """A weights file: safetensors, or a torch pickle file (torch_pickle.TorchFile, same interface)."""
    if path.name != LEGACY_WEIGHTS_NAME:
        return SafetensorsFile(path)
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
