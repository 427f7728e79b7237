"""Layers as the model code sees them: placed per a `WeightPlan`, resident or streamed one ahead.

Streamed layers live outside the arena (a packed file on the CPU, pinned host memory on CUDA) and
are copied, one ahead, into two alternating arena slots: while layer i computes from one slot,
layer i+1 is arriving in the other. Model code sees none of this: a stack's layers are a
`LayerStack`, and iterating it yields each layer's parameter dict (`for blk in stack: ...`),
resident or just arrived, with linear slots wrapped by their format (io/formats.py).

Transfers go through the backend's engine (params/transfers.py on the CPU, cuda.py on a GPU, a
counting stand-in in tests), so the scheduling below is the same code on every device and its
invariants are tested without a GPU: peak device bytes within the limit, every layer present
before its compute, the copy of layer i+1 issued before layer i's compute ends.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from .. import kernels, products
from ..arena import Arena
from ..errors import ConfigError, InputError
from .layout import Layout
from .planner import WeightPlan
from .transfers import HostSource, PackFile


@dataclass
class Unit:
    """One layer's weights: resident (device arrays) or streamed (a host source).

    `params` is what model code receives for a resident layer (linear slots wrapped by their
    format, e.g. int8 as a `formats.PackedWeight`), built once at placement; a streamed layer's
    params for each of the two slots are built on first use and kept in `slot_params` (a layer
    always lands in the same views of a slot), so nothing is rebuilt per step."""
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

    def place_unit(self, name: str, layout: Layout, arrays: dict[str, np.ndarray]) -> Unit:
        """One layer's host arrays (in `layout`'s form) -> a resident or streamed Unit, per the
        plan."""
        planned = self.plan.unit_bytes.get(name)
        if planned is not None and planned != layout.nbytes:  # the plan and the weights disagree
            raise ConfigError(f"layer {name}: {layout.nbytes} bytes of weights, but the plan "
                              f"counted {planned}")
        for key, entry in layout.entries.items():
            a = arrays[key]
            if a.shape != entry.shape or a.dtype != entry.dtype:
                raise ConfigError(f"layer {name}: array '{key}' is {a.dtype}{list(a.shape)}, "
                                  f"its layout says {entry.dtype}{list(entry.shape)}")
        # On the CPU under a limit a layer is packed straight into arena memory (its own hold,
        # or an idle streaming slot on its way to the pack file): a host copy of each layer on
        # top of the arrays just read would raise the peak RSS past the limit while loading
        # (a flan-t5-xxl int4 decoder layer is 115 MB).
        packs_in_arena = self.be.device == "cpu" and self.in_arena
        if name in self.plan.streamed:
            if packs_in_arena:
                if self.pack is None:
                    self.pack = PackFile()
                offset, n = self.pack.append(layout.pack(arrays, out=self.slots[0][:layout.nbytes]))
                return Unit(name, layout, source=HostSource(n, pack=self.pack, offset=offset))
            block = layout.pack(arrays)
            return Unit(name, layout, source=HostSource(block.nbytes,
                                                        array=self.be.host_buffer(block)))
        if not self.in_arena:
            resident = {k: self.be.asarray(v) for k, v in arrays.items()}
        else:
            block = self.be.arena.hold({name: ((layout.nbytes,), np.uint8)}).buffers[name]
            if packs_in_arena:
                layout.pack(arrays, out=block)
            else:
                self.be.upload(block, layout.pack(arrays))
            resident = layout.views(block)
        return Unit(name, layout, resident=resident, params=layout.params(resident, self.wrap))

    @property
    def _kernel_eligible(self) -> bool:
        """The compiled kernels run NumPy float32 math (the CPU, or its stand-ins in tests)."""
        return self.be.xp is np and self.float_dtype == np.float32

    def wrap(self, fmt: Any, name: str, arrays: Any, dtype: Any = None) -> Any:
        """A placed linear slot -> what the math multiplies by (products.wrap): on the CPU
        with the compiled kernels when they are selected; packed forms widen blocks into the
        shared scratch (one product at a time). `dtype`: the slot's product dtype (default:
        the compute dtype)."""
        dtype = self.float_dtype if dtype is None else np.dtype(dtype)
        scratch = None if self.scratch is None else self.scratch.view(dtype)
        return products.wrap(fmt, name, arrays, dtype, scratch,
                             kernels.compiled() if self._kernel_eligible else None,
                             compute=self.be.compute)

    # -- running a stack --------------------------------------------------------------------------
    def _slot_params(self, unit: Unit, slot: int) -> dict[str, Any]:
        if slot not in unit.slot_params:
            views = unit.layout.views(self.slots[slot])
            unit.slot_params[slot] = unit.layout.params(views, self.wrap)
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
