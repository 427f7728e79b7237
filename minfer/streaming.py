"""Weight placement and layer streaming: how a model runs in less memory than its weights.

The idea is BMInf's: a model's layers are the units of placement. A pure planner (`plan_weights`)
takes the bytes of each layer, of the weights every run needs (embedding, head), of the workspace a
run needs (activations, caches) and a memory limit, and decides which layers stay resident; the
others are streamed. Streamed layers live outside the arena (a packed file read with `pread` on
the CPU, pinned host memory on CUDA) and are copied, one ahead, into two alternating arena slots:
while layer i computes from one slot, layer i+1 is arriving in the other.

Model code sees none of this: a stack's layers are a `LayerStack`, and iterating it yields each
layer's parameter dict (`for blk in stack: ...`), resident or just arrived. Weight-only int8
layers (per output channel scales, as BMInf and CTranslate2 quantise) stay int8 when resident and
in transfers; a product with one widens it block by block into a 1 MiB float scratch in the
arena (`ops.Int8Weight`), so no float copy of a layer is ever written.

Transfers go through a `Transfers` object of the backend (a reader thread on the CPU, a copy
stream and events on CUDA, a counting stand-in in tests), so the scheduling below is the same
code on every device and its invariants are tested without a GPU: peak device bytes within the
limit, every layer present before its compute, the copy of layer i+1 issued before layer i's
compute ends.
"""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from .errors import ConfigError, InputError, StreamingError
from .memory import Arena, align_up, format_bytes

SCALE_SUFFIX = ".scale"  # an int8 tensor `w` travels with its float32 per-column scales `w.scale`
INT8_SCRATCH_BYTES = 1 << 20  # float blocks of int8 matrices are widened here: about an L2 cache


# =====================================================================================================
# int8 weight-only quantisation (per output channel)
# =====================================================================================================
def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(in, out) float -> int8 (in, out) and float32 scales (out,): w ~= q * scale.

    Symmetric, one scale per output column (absmax / 127), round to nearest: what BMInf and
    CTranslate2 do for weight-only int8. A zero column gets scale 1 (q is all zero anyway)."""
    w = np.asarray(w, dtype=np.float32)
    scale = np.abs(w).max(axis=0) / 127.0
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def dequantize_int8(xp: Any, q: Any, scale: Any, out: Any) -> Any:
    """int8 q * scale (broadcast: (out,) per column, or (rows, 1) per row) into the float
    buffer `out` of q's shape."""
    # Two simple passes (widen, then scale in place) run several times faster in NumPy than one
    # mixed-type multiply, whose int8 * float32 loop casts element by element.
    out[...] = q
    out *= scale
    return out


# =====================================================================================================
# One layer's packed layout
# =====================================================================================================
@dataclass(frozen=True)
class Entry:
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype


class Layout:
    """Where each tensor of a layer sits in one packed, aligned byte block.

    int8 tensors are followed by their `name.scale` entry (float32 scales per output column)."""

    def __init__(self, tensors: Mapping[str, tuple[tuple[int, ...], Any]]):
        self.entries: dict[str, Entry] = {}
        offset = 0
        for name, (shape, dtype) in tensors.items():
            dtype = np.dtype(dtype)
            self.entries[name] = Entry(offset, tuple(shape), dtype)
            offset = align_up(offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        self.nbytes = offset
        self.quantized = [n for n, e in self.entries.items() if e.dtype == np.int8]

    @classmethod
    def of(cls, arrays: Mapping[str, np.ndarray]) -> "Layout":
        return cls({n: (a.shape, a.dtype) for n, a in arrays.items()})

    def int8_scratch_bytes(self, dtype: Any) -> int:
        """Scratch an int8 product needs: INT8_SCRATCH_BYTES, or less for small matrices."""
        largest = max((int(np.prod(self.entries[n].shape)) * np.dtype(dtype).itemsize
                       for n in self.quantized), default=0)
        return align_up(min(INT8_SCRATCH_BYTES, largest))

    def pack(self, arrays: Mapping[str, np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """The layer as one uint8 block (host)."""
        out = np.zeros(self.nbytes, np.uint8) if out is None else out
        for name, a in arrays.items():
            self.view(out, name)[...] = a
        return out

    def view(self, block: Any, name: str) -> Any:
        e = self.entries[name]
        n = int(np.prod(e.shape, dtype=np.int64)) * e.dtype.itemsize
        return block[e.offset:e.offset + n].view(e.dtype).reshape(e.shape)

    def views(self, block: Any) -> dict[str, Any]:
        return {name: self.view(block, name) for name in self.entries}


def unit_layout(shapes: Mapping[str, tuple[int, ...]], dtype: Any, quantize: bool,
                matrices: Sequence[str] | None = None) -> Layout:
    """The packed layout of one layer from its (in, out) shapes: `dtype` tensors, or, with
    `quantize`, int8 `matrices` (default: every tensor) each followed by its float32 scales."""
    spec: dict[str, tuple[tuple[int, ...], Any]] = {}
    for name, shape in shapes.items():
        if quantize and (matrices is None or name in matrices):
            spec[name] = (tuple(shape), np.int8)
            spec[name + SCALE_SUFFIX] = ((shape[1],), np.float32)
        else:
            spec[name] = (tuple(shape), dtype)
    return Layout(spec)


def unit_arrays(arrays: Mapping[str, np.ndarray], dtype: Any, quantize: bool,
                matrices: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """A layer's float32 host arrays in `unit_layout`'s form: cast to `dtype`, or `matrices`
    quantised straight from float32 (never from an already rounded half copy)."""
    out: dict[str, np.ndarray] = {}
    for name, a in arrays.items():
        if quantize and (matrices is None or name in matrices):
            out[name], out[name + SCALE_SUFFIX] = quantize_int8(a)
        else:
            out[name] = a.astype(dtype, copy=False)
    return out


# =====================================================================================================
# The planner (pure)
# =====================================================================================================
@dataclass
class WeightPlan:
    """Which layers stay resident, and the bytes of every part of the budget."""
    limit: int | None
    fixed: int                     # always-resident weights (embedding, head, norms)
    workspace: int                 # activations and caches reserved for runs
    unit_bytes: dict[str, int]     # every layer's packed bytes, in execution order
    resident: list[str]            # layers kept in device memory
    streamed: list[str]            # layers copied in as they are needed
    slot_bytes: int                # size of each of the two streaming slots
    scratch_bytes: int             # int8 dequantisation scratch

    @property
    def device_bytes(self) -> int:
        """Device bytes for weights + slots + scratch + workspace (what the limit must cover)."""
        return (self.fixed + sum(self.unit_bytes[u] for u in self.resident) + 2 * self.slot_bytes
                + self.scratch_bytes + self.workspace)

    def summary(self) -> list[tuple[str, str]]:
        total = sum(self.unit_bytes.values())
        rows = [("memory limit", format_bytes(self.limit) if self.limit else "none"),
                ("fixed weights", format_bytes(self.fixed)),
                ("layer weights", f"{format_bytes(total)} in {len(self.unit_bytes)} layers"),
                ("resident layers", f"{len(self.resident)} ({format_bytes(sum(self.unit_bytes[u] for u in self.resident))})"),
                ("streamed layers", f"{len(self.streamed)}"
                 + (f" through 2 slots of {format_bytes(self.slot_bytes)}" if self.streamed else "")),
                ("workspace", format_bytes(self.workspace))]
        if self.scratch_bytes:
            rows.append(("int8 dequant scratch", format_bytes(self.scratch_bytes)))
        rows.append(("planned device bytes", format_bytes(self.device_bytes)))
        return rows


def plan_weights(unit_bytes: Mapping[str, int], fixed: int, workspace: int, limit: int | None,
                 scratch: int = 0, priority: Callable[[str], int] | None = None) -> WeightPlan:
    """Decide which layers stay resident under `limit` bytes (None: all of them).

    unit_bytes: each layer's packed size in execution order. fixed: weights every run needs.
    workspace: bytes reserved for activations and caches. scratch: int8 dequantisation scratch.
    priority: higher keeps a layer resident first (e.g. decoder layers, used at every step, over
    encoder layers, used once per input); ties keep the earlier layer.
    Raises ConfigError with the smallest limit that would work when even streaming cannot fit.
    """
    units = dict(unit_bytes)
    everything = fixed + sum(units.values()) + scratch + workspace
    if limit is None or everything <= limit:
        return WeightPlan(limit, fixed, workspace, units, list(units), [], 0, scratch)
    slot = max(units.values(), default=0)
    floor = fixed + 2 * slot + scratch + workspace
    if floor > limit:
        need = min(floor, everything)  # a model smaller than two slots is best kept whole
        raise ConfigError(
            f"memory limit {format_bytes(limit)} is too small for this model: it needs at least "
            f"{format_bytes(need)} ("
            + (f"{format_bytes(fixed)} fixed weights + 2 x {format_bytes(slot)} streaming slots"
               if need == floor else f"{format_bytes(fixed + sum(units.values()))} of weights")
            + f" + {format_bytes(scratch)} int8 scratch + {format_bytes(workspace)} workspace); "
            f"raise the limit to at least {need} bytes or reserve less workspace")
    room = limit - floor
    names = list(units)
    prio = priority or (lambda _: 0)
    rank = sorted(range(len(names)), key=lambda i: (-prio(names[i]), i))
    keep: set[str] = set()
    for i in rank:
        if units[names[i]] <= room:
            keep.add(names[i])
            room -= units[names[i]]
    resident = [n for n in names if n in keep]
    streamed = [n for n in names if n not in keep]
    return WeightPlan(limit, fixed, workspace, units, resident, streamed,
                      max((units[n] for n in streamed), default=0), scratch)


# =====================================================================================================
# Where a streamed layer's bytes live, and how they are copied in
# =====================================================================================================
class PackFile:
    """Streamed layers of a CPU run, packed in an unlinked temporary file and read back with
    `pread` straight into an arena slot: no memory map, so the page cache, not the process,
    holds them (`TMPDIR` chooses the disk; on a tmpfs they would sit in RAM after all)."""

    def __init__(self) -> None:
        self.where = os.environ.get("TMPDIR") or tempfile.tempdir or "the temporary directory"
        try:
            self.where = tempfile.gettempdir()
            self._file = tempfile.TemporaryFile(prefix="minfer-layers-")
        except OSError as e:
            raise self._error("cannot create", e) from None
        self.size = 0

    def _error(self, what: str, e: Exception) -> StreamingError:
        return StreamingError(f"{what} the file of streamed layers in {self.where} (set TMPDIR "
                              f"to a disk with room): {e}")

    def append(self, block: np.ndarray) -> tuple[int, int]:
        offset = self.size
        try:
            self._file.seek(offset)
            self._file.write(memoryview(block))
            self._file.flush()
        except OSError as e:
            raise self._error("cannot write", e) from None
        self.size = offset + block.nbytes
        return offset, block.nbytes

    def read_into(self, dst: np.ndarray, offset: int, nbytes: int) -> None:
        view = memoryview(dst)[:nbytes]
        done = 0
        try:
            fd = self._file.fileno()
            while done < nbytes:
                got = os.preadv(fd, [view[done:]], offset + done)
                if got <= 0:
                    raise OSError(f"short read at byte {offset + done}")
                done += got
        except (OSError, ValueError) as e:  # ValueError: the file was closed (model closed)
            raise self._error("cannot read", e) from None

    def close(self) -> None:
        self._file.close()


@dataclass
class HostSource:
    """A streamed layer's packed bytes: an array in host memory, or a region of a PackFile."""
    nbytes: int
    array: np.ndarray | None = None
    pack: PackFile | None = None
    offset: int = 0

    def copy_into(self, dst: np.ndarray) -> None:
        if self.array is not None:
            np.copyto(dst[:self.nbytes], self.array)
        else:
            self.pack.read_into(dst, self.offset, self.nbytes)


class Transfers:
    """Host -> arena copies on a background thread (the CPU backend's transfer engine).

    `issue` starts a copy and returns a ticket; `wait` blocks until it is done. NumPy copies and
    `pread` release the GIL, so the next layer's bytes arrive while this layer's BLAS calls run."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minfer-prefetch")

    def issue(self, source: HostSource, slot: Any, unit: str, slot_index: int = 0) -> Any:
        return self._pool.submit(source.copy_into, slot)

    def wait(self, ticket: Any) -> None:
        ticket.result()

    def slot_released(self, slot_index: int) -> None:
        """The compute that read a slot has been queued (CUDA records an event here)."""

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# =====================================================================================================
# Layers as the model code sees them
# =====================================================================================================
@dataclass
class Unit:
    """One layer's weights: resident (device arrays) or streamed (a host source).

    `params` is what model code receives for a resident layer (int8 matrices wrapped as
    `ops.Int8Weight`), built once at placement; a streamed layer's params for each of the two
    slots are built on first use and kept in `slot_params` (a layer always lands in the same
    views of a slot), so nothing is rebuilt per step."""
    name: str
    layout: Layout
    resident: dict[str, Any] | None = None
    source: HostSource | None = None
    params: dict[str, Any] | None = None
    slot_params: dict[int, dict[str, Any]] = field(default_factory=dict)


class LayerStack:
    """A stack's layers in execution order; iterating yields each layer's float parameter dict."""

    def __init__(self, runtime: "WeightRuntime", units: list[Unit]):
        self.runtime, self.units = runtime, units

    def __len__(self) -> int:
        return len(self.units)

    def __getitem__(self, i: int) -> Unit:  # the units themselves (for inspection and tests)
        return self.units[i]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.runtime.simple:
            return iter([u.params for u in self.units])  # all resident: no machinery
        return self.runtime.run(self.units)


@dataclass
class Recorder:
    """Scheduling events ("issue", "ready", "start", "end", unit) for tests and debugging."""
    events: list[tuple[str, str]] = field(default_factory=list)

    def __call__(self, kind: str, unit: str) -> None:
        self.events.append((kind, unit))


class WeightRuntime:
    """Places a model's weights per a `WeightPlan` and runs its layer stacks (see module doc)."""

    def __init__(self, be: Any, plan: WeightPlan, recorder: Recorder | None = None):
        self.be, self.plan, self.float_dtype = be, plan, np.dtype(be.dtype)
        self.recorder = recorder
        self.transfers = be.make_transfers() if plan.streamed else None
        self.in_arena = plan.limit is not None  # weights live in the arena only under a limit
        self.pack: PackFile | None = None
        self.slots: list[Any] = []
        self.scratch = None
        self._pending: list[Any] = []
        self.closed = False
        arena: Arena = be.arena
        if plan.streamed:
            hold = arena.hold({"slot0": ((plan.slot_bytes,), np.uint8),
                               "slot1": ((plan.slot_bytes,), np.uint8)})
            self.slots = [hold.buffers["slot0"], hold.buffers["slot1"]]
        if plan.scratch_bytes:
            self.scratch = arena.hold({"scratch": ((plan.scratch_bytes,), np.uint8)}).buffers["scratch"]

    @property
    def simple(self) -> bool:
        return not self.plan.streamed and self.recorder is None

    # -- placement --------------------------------------------------------------------------------
    def place_fixed(self, host: np.ndarray, what: str) -> Any:
        """An always-resident weight on the device (in the arena under a limit)."""
        out = self.alloc_fixed(host.shape, host.dtype, what)
        self.be.upload(out, host)
        return out

    def alloc_fixed(self, shape: tuple[int, ...], dtype: Any, what: str) -> Any:
        """Room for an always-resident weight, to be filled piecewise with `be.upload`."""
        if not self.in_arena:
            return np.empty(shape, dtype) if self.be.device == "cpu" else self.be.xp.empty(shape, dtype)
        return self.be.arena.hold({what: (tuple(shape), dtype)}).buffers[what]

    def place_unit(self, name: str, arrays: dict[str, np.ndarray]) -> Unit:
        """One layer's host arrays -> a resident or streamed Unit, per the plan."""
        layout = Layout.of(arrays)
        planned = self.plan.unit_bytes.get(name)
        if planned is not None and planned != layout.nbytes:  # the plan and the weights disagree
            raise ConfigError(f"layer {name}: {layout.nbytes} bytes of weights, but the plan "
                              f"counted {planned}")
        if name in self.plan.streamed:
            block = layout.pack(arrays)
            if self.be.device == "cpu" and self.in_arena:
                if self.pack is None:
                    self.pack = PackFile()
                offset, n = self.pack.append(block)
                return Unit(name, layout, source=HostSource(n, pack=self.pack, offset=offset))
            return Unit(name, layout, source=HostSource(block.nbytes,
                                                        array=self.be.host_buffer(block)))
        if not self.in_arena:
            resident = {k: self.be.asarray(v) for k, v in arrays.items()}
        else:
            block = self.be.arena.hold({name: ((layout.nbytes,), np.uint8)}).buffers[name]
            self.be.upload(block, layout.pack(arrays))
            resident = layout.views(block)
        return Unit(name, layout, resident=resident, params=self._dequantized(layout, resident))

    # -- running a stack --------------------------------------------------------------------------
    def _dequantized(self, layout: Layout, params: dict[str, Any]) -> dict[str, Any]:
        """int8 matrices -> `ops.Int8Weight`s that widen column blocks into the scratch as they
        multiply (the scratch is shared: one product runs at a time)."""
        if not layout.quantized:
            return params
        from .ops import Int8Weight
        scratch = self.scratch.view(self.float_dtype)
        return {name: (Int8Weight(value, params[name + SCALE_SUFFIX], scratch)
                       if name in layout.quantized else value)
                for name, value in params.items() if not name.endswith(SCALE_SUFFIX)}

    def _slot_params(self, unit: Unit, slot: int) -> dict[str, Any]:
        if slot not in unit.slot_params:
            views = unit.layout.views(self.slots[slot])
            unit.slot_params[slot] = self._dequantized(unit.layout, views)
        return unit.slot_params[slot]

    def run(self, units: list[Unit]) -> Iterator[dict[str, Any]]:
        """Yield each unit's float params in order, streaming the non-resident ones one ahead."""
        if self.closed:
            raise InputError("this model was closed, which released its streamed layers; "
                             "load it again")
        record = self.recorder or (lambda kind, unit: None)
        self.drain()
        streamed = [i for i, u in enumerate(units) if u.resident is None]
        slot_of = {i: k % 2 for k, i in enumerate(streamed)}
        tickets: dict[int, Any] = {}
        queue = list(streamed)

        def issue_next() -> None:
            i = queue.pop(0)
            record("issue", units[i].name)
            tickets[i] = self.transfers.issue(units[i].source, self.slots[slot_of[i]], units[i].name,
                                              slot_of[i])
            self._pending.append(tickets[i])

        try:
            for _ in range(min(2, len(queue))):
                issue_next()
            for i, unit in enumerate(units):
                if unit.resident is not None:
                    params = unit.params
                else:
                    self.transfers.wait(tickets.pop(i))
                    record("ready", unit.name)
                    params = self._slot_params(unit, slot_of[i])
                record("start", unit.name)
                yield params
                record("end", unit.name)
                if unit.resident is None:
                    self.transfers.slot_released(slot_of[i])
                    if queue:
                        issue_next()  # the slot this layer used takes the next streamed layer
        finally:
            self.drain(quiet=True)  # a failed copy has already raised where it was needed

    def drain(self, quiet: bool = False) -> None:
        """Wait for every copy still in flight (a stack abandoned midway leaves some); with
        `quiet`, a copy that failed is not raised again."""
        pending, self._pending = self._pending, []
        for ticket in pending:
            try:
                self.transfers.wait(ticket)
            except Exception:
                if not quiet:
                    raise

    def close(self) -> None:
        self.drain(quiet=True)
        self.closed = True
        if self.transfers is not None:
            self.transfers.close()
        if self.pack is not None:
            self.pack.close()


class OwnsWeights:
    """What a loaded model shares about its weights: the plan, the runtime, and `close()`.

    A streaming runtime holds a prefetch thread and an open pack file; `close()` (or leaving a
    `with` block, or the model being garbage-collected) releases them. A closed model that
    streams cannot run again."""

    weight_plan: WeightPlan
    runtime: WeightRuntime

    def attach_runtime(self, plan: WeightPlan, runtime: WeightRuntime) -> None:
        self.weight_plan, self.runtime = plan, runtime
        self._release = weakref.finalize(self, runtime.close)

    def close(self) -> None:
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
