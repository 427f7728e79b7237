"""A model folder in the Hugging Face layout: config.json plus its weight files.

`Checkpoint` is the union of the folder's tensor files: one model.safetensors, a sharded set with
its index, or (only when there are no safetensors) a torch.save'd pytorch_model.bin read by
`torch_pickle.py` without running pickle code. Names are unique across files, the index must
match the shards, and int8 / int4 weights written by `minfer convert` are read back through their
scales. fp8 tensors (F8_E4M3, F8_E5M2) are read as their codes with a scale per row
(`read_fp8`, for the float8 weight formats: one byte a weight) or widened exactly
(`tensors.FP8_BFLOAT16`), and a file in ComfyUI's *scaled fp8* convention (see `_find_fp8`) is
read as fp8 x its scales.
`single_file.py` opens one .safetensors file without a config.json through the same class.

This module does no math beyond dtype widening; the model families say which names and shapes
they need (their weight tables) and `params/loader.py` checks them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from .formats import FP8_FORMAT_BY_FILE_CODE, QUANTISED_BY_FILE_CODE, SCALE_SUFFIX, WeightFormat
from .limits import MAX_NAME_CHARS, MAX_TENSORS, is_regular_file, quoted, read_json_text
from .safetensors import SafetensorsFile
from .tensors import (FLOAT_CODES, FP8_CODES, TensorInfo, bf16_to_float32, fp8_to_bfloat16_bits,
                      fp8_to_float32)
from .torch_pickle import TorchFile

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
LEGACY_WEIGHTS_NAME = "pytorch_model.bin"   # used only when there are no safetensors
# ComfyUI's scaled fp8 (comfy/utils.py convert_old_quants, comfy/ops.py scaled_fp8_ops): a tensor
# named SCALED_FP8_MARKER marks the file (its dtype names the fp8 format; float32 stands for
# F8_E4M3), and every fp8 matrix `L.weight` has a float32 `L.scale_weight` (a 0-d scalar as
# ComfyUI writes it; one per output row is read too): its value is fp8 x scale. `L.scale_input`
# only scales the inputs of an fp8 x fp8 product ComfyUI may run; it is no part of the weight.
SCALED_FP8_MARKER = "scaled_fp8"
FP8_SCALE_SUFFIX, FP8_INPUT_SCALE_SUFFIX = ".scale_weight", ".scale_input"


class Checkpoint:
    """A model folder: its config.json and the union of its safetensors files' tensors."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: not a folder")
        self.config = read_json(self.folder / "config.json", required=True)
        self._open(self._weight_files())

    def _open(self, paths: list[Path]) -> None:
        """Open the weight files and index their tensors (the scales of quantised and fp8 ones
        hidden behind their weights)."""
        self.files: list[SafetensorsFile] = [_open_weights(p) for p in paths]
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.tensors:
                if name in self._where:
                    raise CheckpointError(f"{f.path}: tensor '{quoted(name)}' also appears in "
                                          f"{self._where[name].path.name}")
                self._where[name] = f
        self._check_index()
        # Tensors are read with file I/O into fresh arrays by default: a memory map would keep
        # every page it touched counted as the process's memory next to the converted copies
        # (twice the weights at the peak). True maps instead (tests of the mapped path).
        self.use_mmap = False
        # Every read checks its values (`check_weight_values`): NaN, inf or absurd magnitudes would
        # otherwise load silently and generate garbage. False skips it (a file known good).
        self.check_values = True
        self._scales = self._find_scales()
        self._fp8 = self._find_fp8()
        self._fp8_kept: set[str] = set()   # fp8 tensors read as their codes (read_fp8)

    def _find_scales(self) -> dict[str, tuple[str, WeightFormat]]:
        """Quantised weights written by `minfer convert --dtype int8 | int4`: `W` in the format's
        file dtype and stored shape (int8: I8 (out, in); int4: U8 (out, in / 2)) with `W_scale`
        (F32, the format's scale shape). The scales are hidden from `names()`, `info(W)` gives
        the logical (out, in), and `read(W)` dequantises."""
        scales = {}
        for name, f in self._where.items():
            info = f.tensors[name]
            fmt = QUANTISED_BY_FILE_CODE.get(info.dtype)
            if fmt is None:
                continue
            scale = name + SCALE_SUFFIX
            sf = self._where.get(scale)
            if sf is None:
                continue  # an integer tensor with no scale: read() refuses it by name
            sinfo = sf.tensors[scale]
            want = fmt.scale_shape(fmt.logical_shape(info.shape)) if len(info.shape) == 2 else None
            if want is None or sinfo.dtype != "F32" or sinfo.shape != want:
                raise CheckpointError(f"{sinfo.file}: tensor '{quoted(scale)}' must be F32 of shape "
                                      f"{list(want) if want else '[?]'} to scale the {fmt.name} "
                                      f"weight '{quoted(name)}', got {sinfo.dtype} {list(sinfo.shape)}")
            scales[name] = (scale, fmt)
        for scale, _ in scales.values():
            del self._where[scale]
        self._scale_where = {scale: f for f in self.files for scale, _ in scales.values()
                             if scale in f.tensors}
        return scales

    def quantised_names(self) -> list[str]:
        """Tensors stored quantised (int8 or int4) with their scales."""
        return list(self._scales)

    def quantised_format(self) -> str | None:
        """The weight format of the quantised tensors ("int8", "int4"), None if there are none."""
        found = {fmt.name for _, fmt in self._scales.values()}
        if len(found) > 1:
            raise CheckpointError(f"{self.folder}: holds weights quantised as both "
                                  f"{' and '.join(sorted(found))}; convert it again")
        return found.pop() if found else None

    def _find_fp8(self) -> dict[str, "_Fp8"]:
        """fp8 tensors: each widened exactly on read, and in a scaled file (SCALED_FP8_MARKER)
        multiplied by its scale. What a tensor is presented as (`info(name).dtype`) is what it
        is read as: BF16 (its values are bfloat16s: an unscaled fp8, or one whose scales are
        powers of two in range) or F32 (fp8 x scale is in general no bfloat16: 4 significant
        bits times a float32's 24); so a bfloat16 or float32 model reads them without a
        second rounding. The marker and the scales are hidden from `names()`."""
        marker = self._where.pop(SCALED_FP8_MARKER, None)
        found: dict[str, _Fp8] = {}
        if marker is not None:
            code = marker.tensors[SCALED_FP8_MARKER].dtype
            if code not in (*FP8_CODES, "F32"):
                raise CheckpointError(f"{marker.path}: tensor '{SCALED_FP8_MARKER}' (the mark of "
                                      "a scaled fp8 file) must be F8_E4M3, F8_E5M2 or F32, got "
                                      f"{code}")
            for name in [n for n in self._where if n.endswith(FP8_SCALE_SUFFIX)]:
                found[name[:-len(FP8_SCALE_SUFFIX)] + ".weight"] = self._fp8_scale(name)
            for name in [n for n in self._where if n.endswith(FP8_INPUT_SCALE_SUFFIX)]:
                if name[:-len(FP8_INPUT_SCALE_SUFFIX)] + ".weight" in found:
                    del self._where[name]
        for name, f in self._where.items():
            code = f.tensors[name].dtype
            if code not in FP8_CODES:
                continue
            if name not in found:
                if marker is not None:
                    layer = name[:-len(".weight")] if name.endswith(".weight") else name
                    raise CheckpointError(f"{f.path}: tensor '{quoted(name)}' is {code} without "
                                          f"its scale '{quoted(layer + FP8_SCALE_SUFFIX)}' in a "
                                          f"scaled fp8 file (it holds '{SCALED_FP8_MARKER}')")
                found[name] = _Fp8(code)
            else:
                found[name] = dataclasses.replace(found[name], code=code)
        return found

    def _fp8_scale(self, scale_name: str) -> "_Fp8":
        """A scaled fp8 weight's scale (read now: a few bytes a matrix), checked: a float
        tensor, finite, one value or one per row of its weight, which must be fp8."""
        f = self._where.pop(scale_name)
        info = f.tensors[scale_name]
        weight = scale_name[:-len(FP8_SCALE_SUFFIX)] + ".weight"
        wf = self._where.get(weight)
        what = f"{f.path}: tensor '{quoted(scale_name)}'"
        if wf is None:
            raise CheckpointError(f"{what} scales '{quoted(weight)}', which the file does not hold")
        winfo = wf.tensors[weight]
        if winfo.dtype not in FP8_CODES:
            raise CheckpointError(f"{what} scales '{quoted(weight)}', which is {winfo.dtype}, not "
                                  "fp8 (F8_E4M3 or F8_E5M2)")
        rows = winfo.shape[0] if winfo.shape else 1
        size = int(np.prod(info.shape)) if info.shape else 1
        if info.dtype not in ("F32", "F16", "BF16") or size not in (1, rows) or len(info.shape) > 2:
            raise CheckpointError(f"{what} must be a float32 scale (one value, or one per row of "
                                  f"'{quoted(weight)}' {list(winfo.shape)}), got {info.dtype} "
                                  f"{list(info.shape)}")
        raw = f.raw(scale_name, mmap=False)
        scale = (bf16_to_float32(raw) if info.dtype == "BF16" else raw).astype(np.float32).reshape(-1)
        if not np.isfinite(scale).all():
            raise CheckpointError(f"{what} holds {_number(scale[~np.isfinite(scale)][0])}: a "
                                  "scale must be finite")
        return _Fp8("", scale, scale_name)

    def holds_fp8(self) -> bool:
        return bool(self._fp8)

    def file_dtype(self, name: str) -> str:
        """The dtype code of tensor `name` in its file (fp8 ones as stored, unlike `info`)."""
        return self._where[name].tensors[name].dtype

    def exact_format(self, device_kind: str = "cpu", matrices: Any = None) -> str:
        """The weight format a file with fp8 loads in when dtype is unset: on the CPU its fp8
        codes as they are (`fp8_format`: one byte a weight), else the most compact format that
        holds every matrix exactly (`widened_format`). `matrices`: the names the weight format
        applies to (the model's linear slots' sources; default: every 2-D tensor), as norms and
        position-bias tables stay in the compute dtype."""
        fp8 = self.fp8_format(matrices) if device_kind == "cpu" else None
        return fp8 or self.widened_format(device_kind, matrices)

    def _matrices(self, matrices: Any) -> list[str]:
        """The names of `matrices` this checkpoint holds (None: every 2-D tensor)."""
        return [n for n in self.names()
                if (len(self.info(n).shape) == 2 if matrices is None else n in matrices)]

    def fp8_format(self, matrices: Any = None) -> str | None:
        """The fp8 weight format ("float8_e4m3", "float8_e5m2") of the fp8 code most of the
        `matrices` are stored in, None when none is fp8 (a matrix in another dtype keeps a
        format of its own: params.loader.slot_formats)."""
        counts: dict[str, int] = {}
        for name in self._matrices(matrices):
            if name in self._fp8:
                counts[self._fp8[name].code] = counts.get(self._fp8[name].code, 0) + 1
        if not counts:
            return None
        return FP8_FORMAT_BY_FILE_CODE[max(counts, key=counts.__getitem__)].name

    def widened_format(self, device_kind: str = "cpu", matrices: Any = None) -> str:
        """The most compact float format that holds every one of `matrices` exactly: bfloat16
        on the CPU when every matrix is a bfloat16 (fp8, power-of-two-scaled fp8, BF16), float16
        when every matrix is a float16 (fp8, F16; CUDA's half format), else float32."""
        fits = {"bfloat16", "float16", "float32"}
        for name in self._matrices(matrices):
            fp8 = self._fp8.get(name)
            code = self.info(name).dtype
            fits &= ({"bfloat16", "float16", "float32"} if fp8 is not None and fp8.scale is None
                     else {"bfloat16", "float32"} if code == "BF16"
                     else {"float16", "float32"} if code == "F16" else {"float32"})
        order = ("bfloat16", "float16") if device_kind == "cpu" else ("float16",)
        return next((f for f in order if f in fits), "float32")

    def keeps(self, name: str, fmt: Any) -> bool:
        """Whether tensor `name` is stored in a form the weight format `fmt` holds as it is:
        the fp8 code of a format that keeps a file's codes."""
        return bool(fmt.from_file) and self.fp8_code(name) == fmt.file_code

    def fp8_code(self, name: str) -> str | None:
        """The fp8 code tensor `name` is stored in ("F8_E4M3", "F8_E5M2"), None if not fp8."""
        fp8 = self._fp8.get(name)
        return None if fp8 is None else fp8.code

    def read_fp8(self, name: str, rows: tuple[int, int] | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
        """An fp8 matrix (or rows [a, b)) as the file stores it, for the float8 weight formats:
        its codes (R, K) uint8 and a float32 scale per row (R,): the file's own (one per row, or
        its one value repeated), 1 for an unscaled file. Unless `check_values` is off, the
        values (code x scale, as `read` gives them) are checked a block of rows at a time."""
        f, info = self._located(name, rows)
        codes = f.raw(name, self.use_mmap, rows)
        if self.use_mmap:                 # a private copy, not a view of the mapped file
            codes = np.array(codes)
        fp8 = self._fp8[name]
        self._fp8_kept.add(name)
        R = codes.shape[0]
        if fp8.scale is None or fp8.scale.size == 1:
            scale = np.full(R, 1.0 if fp8.scale is None else fp8.scale[0], np.float32)
        else:
            scale = np.array(fp8.scale[rows[0]:rows[1]] if rows is not None else fp8.scale,
                             np.float32)
        if self.check_values:
            first = rows[0] if rows is not None else 0
            step = max(1, _CHECK_CHUNK // max(1, codes[0].size if R else 1))
            for a in range(0, R, step):
                values = fp8_to_float32(codes[a:a + step], fp8.code)
                values *= scale[a:a + step].reshape((-1,) + (1,) * (codes.ndim - 1))
                check_weight_values(values, f"{info.file}: tensor '{quoted(name)}'", first + a)
        return codes, scale

    def storage_note(self) -> str:
        """What the fp8 tensors were read as, for `minfer info` ("" without fp8): per file
        dtype, how many tensors and what they became (kept as codes: those read by
        `read_fp8`)."""
        if not self._fp8:
            return ""
        groups: dict[str, int] = {}
        for name, fp8 in self._fp8.items():
            scaled = "" if fp8.scale is None else f" x {FP8_SCALE_SUFFIX[1:]}"
            if name in self._fp8_kept:
                key = (f"{fp8.code}{scaled} -> kept as fp8 codes (1 byte a weight, a float32 "
                       "scale per row)")
            elif fp8.scale is None:
                key = f"{fp8.code} -> bfloat16 values (exact)"
            elif self.info(name).dtype == "BF16":
                key = f"{fp8.code}{scaled} -> bfloat16 values (exact: power-of-two scales)"
            else:
                key = f"{fp8.code}{scaled} -> float32 products (scales not powers of two)"
            groups[key] = groups.get(key, 0) + 1
        return "; ".join(f"{key}: {n} tensor{'s' * (n != 1)}" for key, n in groups.items())

    @staticmethod
    def _check_bits(bits: np.ndarray, info: Any, name: str, rows: tuple[int, int] | None) -> None:
        """check_weight_values over bfloat16 bits (uint16), widened a chunk at a time."""
        flat = bits.reshape(-1)
        for a in range(0, flat.size, _CHECK_CHUNK):
            check_weight_values(bf16_to_float32(flat[a:a + _CHECK_CHUNK]),
                                f"{info.file}: tensor '{quoted(name)}'", rows[0] if rows else 0)

    def _fp8_values(self, name: str, raw: np.ndarray, rows: tuple[int, int] | None) -> np.ndarray:
        """fp8 bytes (or rows a..b of them) -> float32 values: widened, times the scale."""
        fp8 = self._fp8[name]
        out = fp8_to_float32(raw, fp8.code)
        if fp8.scale is not None:
            scale = fp8.scale
            if scale.size > 1:
                scale = scale[rows[0]:rows[1]] if rows is not None else scale
                scale = scale.reshape((-1,) + (1,) * (out.ndim - 1))
            out *= scale      # float32 x float32, rounded as torch's float32 product rounds it
        return out

    def _weight_files(self) -> list[Path]:
        """The weight files, in the order of preference (index, single file, pytorch_model.bin).
        A candidate that is there but is no readable file (a folder, a link that loops or leads
        nowhere) is an error naming it, not taken for absent: that would blame the next format."""
        single, index = self.folder / WEIGHTS_NAME, self.folder / INDEX_NAME
        if is_regular_file(index, CheckpointError):
            self.index = read_json(index, required=True)
            weight_map = self.index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: missing or empty 'weight_map'")
            if len(weight_map) > MAX_TENSORS:
                raise CheckpointError(f"{index}: weight_map lists {len(weight_map)} tensors, more "
                                      f"than the {MAX_TENSORS} a checkpoint may hold")
            shards: dict[str, None] = {}     # in order of first use
            for tensor, shard in weight_map.items():
                if len(tensor) > MAX_NAME_CHARS:
                    raise CheckpointError(f"{index}: tensor name '{quoted(tensor)}' of "
                                          f"{len(tensor)} characters (at most {MAX_NAME_CHARS})")
                if not isinstance(shard, str) or shard not in shards:
                    if (not isinstance(shard, str) or Path(shard).name != shard
                            or not shard.endswith(".safetensors") or len(shard) > 255):
                        raise CheckpointError(f"{index}: tensor '{quoted(tensor)}' maps to "
                                              f"{quoted(repr(shard), 80)}, which is not a file "
                                              "name inside the model folder (a .safetensors shard)")
                    shards[shard] = None
            # one listing of the folder, not a stat per claimed shard
            present = {p.name for p in self.folder.iterdir()} if len(shards) > 16 else None
            missing = [s for s in shards if not (s in present if present is not None
                                                 else is_regular_file(self.folder / s,
                                                                      CheckpointError))]
            if missing:
                raise CheckpointError(f"{index}: shard file {quoted(missing[0])} is missing from "
                                      f"{self.folder}")
            return [self.folder / s for s in shards]
        self.index = None
        if is_regular_file(single, CheckpointError):
            return [single]
        # torch.save'd, read by torch_pickle.py
        if is_regular_file(self.folder / LEGACY_WEIGHTS_NAME, CheckpointError):
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
                raise CheckpointError(f"{self.folder / INDEX_NAME}: tensor '{quoted(tensor)}' is "
                                      f"not in its shard {quoted(shard)}")

    # -- access -----------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        """The tensor's file, dtype and shape (a quantised weight's logical (out, in))."""
        info = self._where[name].tensors[name]
        if name in self._scales:
            info = dataclasses.replace(info, shape=self._scales[name][1].logical_shape(info.shape))
        elif name in self._fp8:     # what it is read as (file_dtype: as stored)
            info = dataclasses.replace(info, dtype=self._fp8[name].read_as)
        return info

    def read(self, name: str, dtype: Any = np.float32,
             rows: tuple[int, int] | None = None, check: bool | None = None) -> np.ndarray:
        """The tensor (or rows [a, b) of its first axis) converted to `dtype`: a fresh host
        array, C-contiguous. Reading by rows bounds the memory a large embedding needs. Unless
        `check` (default: `self.check_values`) is False, its values are checked as read
        (`check_weight_values`)."""
        f, info = self._located(name, rows)
        raw = f.raw(name, self.use_mmap, rows)
        if name in self._scales:
            scale_name, fmt = self._scales[name]
            scale = self._scale_where[scale_name].raw(scale_name, self.use_mmap)
            if rows is not None:
                scale = scale[rows[0]:rows[1]]
            out = fmt.decode(raw, scale, fmt.logical_shape(raw.shape)).astype(dtype, copy=False)
        else:
            if name in self._fp8:
                raw = self._fp8_values(name, raw, rows)
            elif info.dtype == "BF16":
                raw = bf16_to_float32(raw)
            if np.dtype(dtype).kind == "f" and np.dtype(dtype).itemsize < raw.dtype.itemsize:
                # narrowing (to float16): a value beyond its range would silently become inf
                check_fits(raw, dtype, f"{info.file}: tensor '{quoted(name)}'",
                           rows[0] if rows else 0)
            try:
                if not self.use_mmap and raw.flags.writeable:  # raw is a private copy
                    out = np.ascontiguousarray(raw, dtype=dtype)
                else:
                    out = np.array(raw, dtype=dtype, order="C")
            except OSError as e:  # a file shrunk under the memory map
                raise CheckpointError(f"{info.file}: cannot read tensor '{quoted(name)}': "
                                      f"{e}") from None
        if self.check_values if check is None else check:
            check_weight_values(out, f"{info.file}: tensor '{quoted(name)}'", rows[0] if rows else 0)
        return out

    def _located(self, name: str, rows: tuple[int, int] | None) -> tuple[Any, TensorInfo]:
        """The file holding tensor `name` and its info; a missing name, rows outside it or an
        integer tensor that is not an int8 weight with scales are one-line errors."""
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"{self.folder}: tensor '{quoted(name)}' is missing")
        info = f.tensors[name]
        if rows is not None and not (len(info.shape) >= 1 and 0 <= rows[0] <= rows[1] <= info.shape[0]):
            raise CheckpointError(f"{info.file}: rows {rows} outside tensor '{quoted(name)}' "
                                  f"{list(info.shape)}")
        if name not in self._scales and info.dtype not in FLOAT_CODES:
            raise CheckpointError(f"{info.file}: tensor '{quoted(name)}' has integer dtype "
                                  f"{info.dtype}, expected a floating-point weight")
        return f, info

    def stored_dtypes(self) -> set[str]:
        return {f.tensors[n].dtype for n, f in self._where.items()}

    def read_stored(self, name: str, rows: tuple[int, int] | None = None
                    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The tensor (or rows [a, b)) exactly as stored, no conversion: its storage dtype (BF16
        as uint16 bits), plus the float32 scales of a quantised weight (else None). What a
        model whose weight format matches the file reads, with no float32 copy."""
        f, info = self._located(name, rows)
        raw = f.raw(name, self.use_mmap, rows)
        fp8 = self._fp8.get(name)
        if fp8 is not None and fp8.scale is None:   # its bfloat16 bits by table: no float32 copy
            bits = fp8_to_bfloat16_bits(raw, fp8.code)
            if self.check_values:
                self._check_bits(bits, info, name, rows)
            return bits, None
        if fp8 is not None:               # scaled: float32 products (bfloat16 bits if exact)
            values = self._fp8_values(name, raw, rows)
            if self.check_values:
                check_weight_values(values, f"{info.file}: tensor '{quoted(name)}'",
                                    rows[0] if rows else 0)
            if self._fp8[name].read_as == "BF16":
                return (values.view(np.uint32) >> 16).astype(np.uint16), None
            return values, None
        if self.use_mmap:                 # a private copy, not a view of the mapped file
            raw = np.array(raw)
        if name not in self._scales:
            if self.check_values:
                if info.dtype == "BF16":
                    self._check_bits(raw, info, name, None)
                else:
                    check_weight_values(raw.reshape(-1), f"{info.file}: tensor '{quoted(name)}'")
            return raw, None
        scale_name, _ = self._scales[name]
        scale = self._scale_where[scale_name].raw(scale_name, self.use_mmap)
        return raw, np.array(scale if rows is None else scale[rows[0]:rows[1]], np.float32)


@dataclasses.dataclass(frozen=True)
class _Fp8:
    """An fp8 tensor: its format and, in a scaled file, its scales (float32, one or per row)."""
    code: str
    scale: np.ndarray | None = None
    scale_name: str = ""

    @functools.cached_property
    def read_as(self) -> str:
        """The dtype code its values are exactly: BF16 unless a scale makes them float32s."""
        return "BF16" if self.scale is None or _bfloat16_scales(self.scale, self.code) else "F32"


# fp8 format -> (exponent of its largest finite value + 1, exponent of its smallest step): a
# power-of-two scale 2^k keeps fp8 x 2^k a bfloat16 (<= 4 significant bits) while the product
# neither overflows (k + top <= 127) nor drops below the smallest normal float (k + step >= -126)
_FP8_EXPONENTS = {"F8_E4M3": (9, -9), "F8_E5M2": (16, -16)}


def _bfloat16_scales(scale: np.ndarray, code: str) -> bool:
    """Whether every scale is a power of two (or 0) for which fp8 x scale stays a bfloat16."""
    bits = scale.astype(np.float32).view(np.uint32)
    top, step = _FP8_EXPONENTS[code]
    exponent = ((bits >> 23) & 0xFF).astype(np.int64) - 127
    zero = (bits & 0x7FFFFFFF) == 0
    power = ((bits & 0x7FFFFF) == 0) & (exponent + top <= 127) & (exponent + step >= -126)
    return bool((power | zero).all())


# Largest magnitude a weight may hold. Real weights stay below ~1e4; float32 read with the wrong
# byte order turns typical values (|x| ~ 1e-3..1e2) into ones of random exponent, and a tensor of
# any size then almost surely holds some above 1e30 (or NaN/inf). A heuristic, documented as such.
MAX_ABS_WEIGHT = 1e30
_CHECK_CHUNK = 1 << 18   # elements: a scratch of 0.5-2 MiB, about the size of a core's cache
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _number(value: float) -> str:
    """A value for a message: NaN spelt so (replacing "nan" in the whole message would also
    change a path or a tensor name that holds those letters)."""
    return "NaN" if np.isnan(value) else f"{float(value):g}"


def check_weight_values(values: np.ndarray, what: str, first_row: int = 0) -> None:
    """Raise a CheckpointError naming `what` and the first bad element (its index in the whole
    tensor, `first_row` being the first row read) if float `values` hold NaN, inf, or magnitudes
    above MAX_ABS_WEIGHT (float16 cannot: there only NaN/inf). One pass over the bits: a float's
    magnitude bits order like unsigned integers, infinities above every finite value and NaNs
    above them, so the largest masked word says it all: ~0.8 ms per 10 MB (memory-bound), no
    allocation beyond a cache-sized scratch. Only a failing tensor is searched for the element."""
    if values.size == 0 or values.dtype.kind != "f":
        return
    limit = min(MAX_ABS_WEIGHT, float(np.finfo(values.dtype).max))
    bound = int(np.array(limit, values.dtype).view(_UINT[values.itemsize]))
    words = values.reshape(-1).view(_UINT[values.itemsize])
    mask = words.dtype.type(np.iinfo(words.dtype).max >> 1)          # all bits but the sign
    scratch = np.empty(min(_CHECK_CHUNK, words.size), words.dtype)
    for i in range(0, words.size, _CHECK_CHUNK):
        chunk = words[i:i + _CHECK_CHUNK]
        magnitude = np.bitwise_and(chunk, mask, out=scratch[:chunk.size])
        if int(magnitude.max()) > bound:
            j = i + int(np.argmax(magnitude > bound))
            index = [int(k) for k in np.unravel_index(j, values.shape)] if values.ndim else []
            if index:
                index[0] += first_row
            value = float(values.reshape(-1)[j])
            note = "" if not np.isfinite(value) else (
                f" (beyond the +-{MAX_ABS_WEIGHT:g} a weight can hold: wrong byte order or corrupt?)")
            raise CheckpointError(f"{what} holds {_number(value)} at {index}{note}")


def check_fits(values: np.ndarray, dtype: Any, what: str, first_row: int = 0) -> None:
    """Raise a CheckpointError naming `what` and the first finite element of float `values`
    beyond what `dtype` can hold (float16: +-65504), before a cast turns it into inf (NaN and
    inf themselves are check_weight_values' to name). A chunk at a time, like that check."""
    limit = float(np.finfo(dtype).max)
    flat = values.reshape(-1)
    for i in range(0, flat.size, _CHECK_CHUNK):
        chunk = flat[i:i + _CHECK_CHUNK]
        over = np.abs(chunk) > limit
        over &= np.isfinite(chunk)
        if over.any():
            j = i + int(np.argmax(over))
            index = [int(k) for k in np.unravel_index(j, values.shape)] if values.ndim else []
            if index:
                index[0] += first_row
            raise CheckpointError(f"{what} holds {float(flat[j]):g} at {index}, beyond "
                                  f"{np.dtype(dtype).name}'s range (+-{limit:g}): keep it "
                                  "float32 or bfloat16 (dtype='float32' or 'bfloat16')")


def _open_weights(path: Path) -> SafetensorsFile:
    """A weights file: safetensors, or a torch pickle file (torch_pickle.TorchFile, same interface).
    Only a regular file: opening a FIFO waits for a writer that never comes (a listing, which
    finds the shards of a large index, does not tell a FIFO, a folder or a looping link from a
    file)."""
    if not is_regular_file(path, CheckpointError):   # gone since the folder was listed
        raise CheckpointError(f"{path}: file is missing")
    if path.name != LEGACY_WEIGHTS_NAME:
        return SafetensorsFile(path)
    return TorchFile(path)


def read_json(path: Path, required: bool = False,
              error: type[Exception] = CheckpointError) -> dict | None:
    """A JSON object from `path`; None when absent and not required. Errors are one-line `error`s
    naming the file: missing, not a readable file (a folder, a link that loops or leads nowhere:
    never taken for absent), too large, nested too deep, not JSON, not an object."""
    if not is_regular_file(path, error):
        if required:
            raise error(f"{path}: file is missing")
        return None
    value, _ = read_json_text(path, error)
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object")
    return value
