"""The one loader every family goes through: check -> fuse -> format -> plan -> place.

Given a family's `WeightTable` (params/table.py) and a `Checkpoint`:
1. `check` rejects missing, unexpected and mis-shaped tensors by name before anything is read;
2. `plan_placement` sizes every layer in its weight format and decides, under a memory limit,
   which layers stay resident (pure: `minfer info` prints it without reading weights);
3. `load_params` reads the fixed parameters and then one layer at a time (so host memory stays
   bounded by a layer), fuses and formats each layer, and hands it to the runtime, which keeps
   it resident or streams it. A slot whose sources the file already stores in the weight format
   (an int8 file loaded as int8, a bfloat16 one as bfloat16, fp8 as float8_e4m3 / e5m2) is read
   as its own bytes: no float32 copy, no second rounding. The fp8 formats hold only a file's own
   codes, so a slot the file stores otherwise (ComfyUI's 16-bit embedding beside fp8 layers)
   keeps a format of its own (`slot_formats`).
The result is the parameter dict the family's math reads: fixed arrays by name, and each stack as
a `LayerStack` to iterate.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..arena import align_up
from ..errors import CheckpointError, ConfigError
from ..io.checkpoint import Checkpoint
from ..io.formats import FORMATS, SCALE_SUFFIX, WeightFormat
from ..products import scratch_bytes
from .layout import Layout
from .planner import WeightPlan, plan_weights
from .runtime import LayerStack, WeightRuntime
from .table import Derived, Linear, Tensor, Unit, View, WeightTable

BLOCK_BYTES = 16 << 20  # large fixed matrices are read and placed in row blocks of this size
# the file dtype whose bytes a weight format keeps as they are (int8: with its per-row scales)


# =====================================================================================================
# Names and shapes
# =====================================================================================================
def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def check(table: WeightTable, ckpt: Checkpoint) -> dict[str, str]:
    """Every name and shape of `ckpt` against `table`, before anything is read. Returns the
    aliases in use: {tensor the table names: the checkpoint name that stands in for it}."""
    present = set(ckpt.names())
    stand_in = {}
    for name, alternatives in table.aliases.items():
        if name not in present:
            found = next((a for a in alternatives if a in present), None)
            if found is not None:
                stand_in[name] = found
    missing = sorted(n for n in table.tensors if n not in present and n not in stand_in)
    if missing:
        raise CheckpointError(f"{ckpt.folder}: tensor '{missing[0]}' is missing{_more(missing)}")
    unexpected = sorted(present - set(table.tensors) - set(table.optional))
    if unexpected:
        where = ckpt.info(unexpected[0]).file.name
        raise CheckpointError(f"{ckpt.folder / where}: unexpected tensor "
                              f"'{unexpected[0]}'{_more(unexpected)}")
    want = {**table.optional, **table.tensors,
            **{alias: table.tensors[name] for name, alias in stand_in.items()}}
    for name in dict.fromkeys([*table.tensors, *table.optional, *stand_in.values()]):
        if name not in present:
            continue
        got = ckpt.info(name).shape
        if got != want[name]:
            raise CheckpointError(f"{ckpt.info(name).file}: tensor '{name}' has shape {list(got)}, "
                                  f"config implies {list(want[name])}")
    return stand_in


# =====================================================================================================
# Formats per slot: a format that only keeps a file's own codes (fp8)
# =====================================================================================================
# {a linear slot's sources: its format} where it is not the model's weight format
SlotFormats = dict[tuple[str, ...], WeightFormat]


def _linear_entries(table: WeightTable) -> list[Linear]:
    """Every linear slot of the table: the fixed ones, then each layer's."""
    entries = [*table.fixed.values(), *(e for _, unit in table.units() for e in unit.values())]
    return [e for e in entries if isinstance(e, Linear)]


def slot_formats(table: WeightTable, ckpt: Checkpoint, fmt: WeightFormat,
                 device_kind: str = "cpu") -> SlotFormats:
    """The slots that cannot take `fmt` and the format each takes instead. Only a format that
    holds a file's own bytes has such slots — fp8 codes (`fmt.from_file`), or a GGUF file's
    blocks as grouped int8 / int4 (`fmt.group`): a slot whose sources are not all stored in
    that form (`ckpt.keeps`: a BF16 embedding beside fp8 layers, as in ComfyUI's scaled files;
    an F16 embedding beside Q8_0 blocks; a Q6_K matrix fused with Q4_K ones under int4) keeps
    the most compact format that holds its sources exactly (`widened_format`; a GGUF file's
    `slot_format`: blocks of several types in the grouped format holding them all). A
    checkpoint with no fp8 matrix of the asked code is a one-line error: nothing would be kept;
    a grouped format over a checkpoint without blocks quantises every slot (what
    `dtype="int8g32"` asks of a float checkpoint)."""
    if not (fmt.from_file or fmt.group):
        return {}
    linear = _linear_entries(table)
    names = {s: _Reader.name_in(ckpt, table, s) for e in linear for s in e.sources}
    own = {e.sources for e in linear
           if not e.transpose and all(ckpt.keeps(names[s], fmt) for s in e.sources)}
    if not own:
        if fmt.group:
            return {}
        raise ConfigError(f"dtype {fmt.name!r} keeps a file's {fmt.file_code} weights as they are, "
                          f"and {ckpt.folder} holds no {fmt.file_code} matrix: leave dtype unset "
                          "or name a float or quantised format")
    exact = ckpt.slot_format if fmt.group else ckpt.widened_format   # (grouped: GGUF files)
    return {e.sources: FORMATS[exact(device_kind, {names[s] for s in e.sources})]
            for e in linear if e.sources not in own}


def describe_formats(table: WeightTable, dtype: Any, fmt: WeightFormat,
                     formats: SlotFormats | None = None) -> str:
    """What each kind of tensor is stored as, for `minfer info`: the linear slots per format
    (their matrices, and which when only a few), then the other parameters' dtype."""
    by: dict[str, list[str]] = {}
    for entry in _linear_entries(table):
        slot = (formats or {}).get(entry.sources, fmt).slot(entry.float32, dtype)[0]
        by.setdefault(slot.name, []).extend(entry.sources)
    parts = []
    for name, sources in by.items():
        note = " (codes, a float32 scale per row)" if FORMATS[name].from_file else ""
        which = f": {', '.join(sources)}" if len(sources) <= 2 else ""
        parts.append(f"{name}{note} {len(sources)} matri{'ces' if len(sources) != 1 else 'x'}"
                     f"{which}")
    return "; ".join(parts) + f"; other parameters {np.dtype(dtype).name}"


# =====================================================================================================
# Sizes and the plan (pure)
# =====================================================================================================
def unit_layout(table: WeightTable, unit: Unit, dtype: Any, fmt: WeightFormat,
                formats: SlotFormats | None = None) -> Layout:
    """A layer's packed layout: linear slots (out, in) in `fmt` (or their own, `formats`),
    everything else in the compute `dtype`."""
    arrays: dict[str, tuple[tuple[int, ...], Any]] = {}
    linear, product = {}, {}
    for name, entry in unit.items():
        if isinstance(entry, Linear):
            own = (formats or {}).get(entry.sources, fmt)
            linear[name], product[name] = own.slot(entry.float32, dtype)
            arrays.update(linear[name].stored(name, table.shape(entry)))
        else:
            arrays[name] = (table.shape(entry), dtype)
    return Layout(arrays, linear, product)


def _fixed_arrays(table: WeightTable, dtype: Any, fmt: WeightFormat,
                  formats: SlotFormats | None = None) -> list[tuple[tuple, Any]]:
    """(shape, dtype) of every device array the fixed parameters are placed as."""
    arrays = []
    for name, entry in table.fixed.items():
        if isinstance(entry, Linear):
            arrays += (formats or {}).get(entry.sources, fmt).stored(name, table.shape(entry)).values()
        elif not isinstance(entry, View) and not (isinstance(entry, Tensor) and entry.host):
            arrays.append((table.shape(entry), dtype))
    return arrays


def fixed_bytes(table: WeightTable, dtype: Any, fmt: WeightFormat,
                formats: SlotFormats | None = None) -> int:
    """Device bytes of the always-resident parameters, as the runtime allocates them."""
    return sum(align_up(int(np.prod(shape)) * np.dtype(dt).itemsize)
               for shape, dt in _fixed_arrays(table, dtype, fmt, formats))


def plan_placement(table: WeightTable, dtype: Any, fmt: WeightFormat, limit: int | None,
                   workspace: int, formats: SlotFormats | None = None) -> WeightPlan:
    """Which layers stay resident under `limit` (nothing is read or allocated); `formats`: the
    slots stored in a format of their own (`slot_formats`)."""
    units = {}
    scratch = max((scratch_bytes((formats or {}).get(e.sources, fmt), table.shape(e), dtype)
                   for e in table.fixed.values() if isinstance(e, Linear)), default=0)
    for name, unit in table.units():
        layout = unit_layout(table, unit, dtype, fmt, formats)
        units[name] = layout.nbytes
        scratch = max(scratch, layout.scratch_bytes(dtype))
    return plan_weights(units, fixed_bytes(table, dtype, fmt, formats), workspace, limit, scratch,
                        priority=lambda name: table.priority.get(name.partition(".")[0], 0))


# =====================================================================================================
# Reading and placing
# =====================================================================================================
class _Reader:
    """Checkpoint reads under the table's names (aliases resolved)."""

    def __init__(self, ckpt: Checkpoint, stand_in: dict[str, str]):
        self.ckpt, self.stand_in = ckpt, stand_in

    def __call__(self, name: str, dtype: Any = np.float32, rows: tuple[int, int] | None = None):
        return self.ckpt.read(self.stand_in.get(name, name), dtype, rows)

    @staticmethod
    def name_in(ckpt: Checkpoint, table: WeightTable, name: str) -> str:
        """The checkpoint's name for a table name: itself, or the alias standing in for it."""
        if name in ckpt:
            return name
        return next((a for a in table.aliases.get(name, ()) if a in ckpt), name)

    def _source_rows(self, entry: Linear, rows: tuple[int, int] | None) -> list[tuple[str, Any]]:
        """(source, row range) of each part of a slot; `rows` (a block of a single-source slot)
        overrides the entry's own range."""
        return [(s, rows if rows is not None else (entry.rows if i == 0 else None))
                for i, s in enumerate(entry.sources[:1] if rows is not None else entry.sources)]

    def linear(self, entry: Linear, rows: tuple[int, int] | None = None,
               dtype: Any = np.float32) -> np.ndarray:
        """(out, in) in `dtype` (float32, or float16 for a float16 slot: each source checked as
        it narrows, named), C-contiguous: the sources fused along out (of a source stored
        (in, out): transposed). `rows`: only these rows of a single-source slot (reading a large
        one in blocks)."""
        parts = [self(s, dtype, r) for s, r in self._source_rows(entry, rows)]
        w = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        return np.ascontiguousarray(w.T) if entry.transpose else w

    def encoded(self, name: str, entry: Linear, fmt: WeightFormat,
                rows: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
        """The slot's arrays in `fmt`: the stored bytes themselves when every source is stored
        in that format (fp8: its codes and row scales), else encoded from float32."""
        code = fmt.file_code
        if fmt.from_file:   # (slot_formats gave every other slot a format of its own)
            return _fused(name, [self.ckpt.read_fp8(self.stand_in.get(s, s), r)
                                 for s, r in self._source_rows(entry, rows)])
        if fmt.group and not entry.transpose and all(
                self.ckpt.keeps(self.stand_in.get(s, s), fmt) for s in entry.sources):
            # a GGUF file's blocks in the slot's own grouped format (several per file: a fused
            # slot with a Q6_K source is int8 beside int4 slots)
            return _fused(name, [self.ckpt.read_blocks(self.stand_in.get(s, s), fmt, r)
                                 for s, r in self._source_rows(entry, rows)])
        if not entry.transpose and all(self.ckpt.info(self.stand_in.get(s, s)).dtype == code
                                       for s in entry.sources):
            parts = [self.ckpt.read_stored(self.stand_in.get(s, s), r)
                     for s, r in self._source_rows(entry, rows)]
            w = np.concatenate([p for p, _ in parts]) if len(parts) > 1 else parts[0][0]
            out = {name: w}
            if fmt.scaled:
                out[name + SCALE_SUFFIX] = np.concatenate([s for _, s in parts])
            return out
        narrow = np.float16 if np.dtype(fmt.storage) == np.float16 else np.float32
        return fmt.encode(name, self.linear(entry, rows, narrow))

    def tensor(self, entry: Tensor, dtype: Any) -> np.ndarray:
        a = self(entry.source, dtype, entry.rows)
        if entry.append:
            a = np.concatenate([a, *(self(s, dtype) for s in entry.append)], axis=0)
        return a


def _fused(name: str, parts: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """Each source's stored matrix and scales -> the slot's arrays (fused along out)."""
    return {name: np.concatenate([p for p, _ in parts]) if len(parts) > 1 else parts[0][0],
            name + SCALE_SUFFIX: np.concatenate([s for _, s in parts])}


def _place_linear(runtime: WeightRuntime, read: _Reader, name: str, entry: Linear,
                  shape: tuple[int, int], fmt: WeightFormat) -> Any:
    """A fixed linear slot (a head, an embedding table) in the weight format, wrapped."""
    whole_rows = len(entry.sources) == 1 and entry.rows is None and not entry.transpose
    if not whole_rows or int(np.prod(shape)) * 4 <= BLOCK_BYTES:
        placed = {k: runtime.place_fixed(v, k) for k, v in read.encoded(name, entry, fmt).items()}
        return runtime.wrap(fmt, name, placed)
    # a large matrix (an mT5 embedding is 1 GB in float32) in blocks of rows: loading never
    # holds a second whole copy, and every format encodes row by row
    placed = {k: runtime.alloc_fixed(s, dt, k) for k, (s, dt) in fmt.stored(name, shape).items()}
    step = max(1, BLOCK_BYTES // (shape[1] * 4))
    for a in range(0, shape[0], step):
        b = min(shape[0], a + step)
        for k, block in read.encoded(name, entry, fmt, (a, b)).items():
            runtime.be.upload(placed[k][a:b], block)
    return runtime.wrap(fmt, name, placed)


def load_params(table: WeightTable, ckpt: Checkpoint, dtype: Any, fmt: WeightFormat,
                runtime: WeightRuntime, formats: SlotFormats | None = None) -> dict[str, Any]:
    """Check the checkpoint, then place every parameter per the runtime's plan: fixed ones
    resident, each layer resident or streamed, read one layer at a time; `formats`: the slots
    stored in a format of their own (`slot_formats`)."""
    read = _Reader(ckpt, check(table, ckpt))
    formats = formats or {}
    params: dict[str, Any] = {}
    for name, entry in table.fixed.items():
        if isinstance(entry, View):
            params[name] = params[entry.of]
        elif isinstance(entry, Linear):
            params[name] = _place_linear(runtime, read, name, entry, table.shape(entry),
                                         formats.get(entry.sources, fmt))
        elif isinstance(entry, Derived):
            params[name] = runtime.place_fixed(entry.build(read).astype(dtype, copy=False), name)
        elif entry.host:
            params[name] = read.tensor(entry, np.float32)
        else:
            params[name] = runtime.place_fixed(read.tensor(entry, dtype), name)
    for stack, layers in table.stacks.items():
        units = []
        for i, unit in enumerate(layers):
            layout = unit_layout(table, unit, dtype, fmt, formats)
            arrays: dict[str, np.ndarray] = {}
            for name, entry in unit.items():
                if isinstance(entry, Linear):
                    arrays.update(read.encoded(name, entry, layout.linear[name]))
                else:
                    arrays[name] = read.tensor(entry, dtype)
            units.append(runtime.place_unit(f"{stack}.{i}", layout, arrays))
        params[stack] = LayerStack(runtime, units)
    return params
