"""The weight planner (pure): which layers stay resident under a memory limit, which are streamed.

The idea is BMInf's: a model's layers are the units of placement. Given the bytes of each layer,
of the weights every run needs (embedding, head), of the workspace a run needs (activations,
caches) and a limit, keep everything when it fits; otherwise reserve two streaming slots of the
largest layer and keep layers resident by priority while room lasts. Nothing is read or allocated
here: `minfer info` shows the plan before loading a byte of weights.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping

from ..arena import format_bytes
from ..errors import ConfigError


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
    scratch_bytes: int             # the widening scratch (2-byte, int8, int4 weights; int8 inputs)

    @property
    def device_bytes(self) -> int:
        """Device bytes for weights + slots + scratch + workspace (what the limit must cover)."""
        return (self.fixed + sum(self.unit_bytes[u] for u in self.resident) + 2 * self.slot_bytes
                + self.scratch_bytes + self.workspace)

    def summary(self) -> "PlanSummary":
        """(what, how much) rows for `minfer info`; printed, aligned lines. Layers are counted
        per stack as the table places them ("encoder 6, cross 6, decoder 6": T5's cross stack
        is each decoder layer's cross-attention k|v, placed apart from its layer)."""
        total = sum(self.unit_bytes.values())
        resident = sum(self.unit_bytes[u] for u in self.resident)
        rows = [("memory limit", format_bytes(self.limit) if self.limit else "none"),
                ("fixed weights", format_bytes(self.fixed)),
                ("layer weights", f"{format_bytes(total)} in " + _units(list(self.unit_bytes))),
                ("resident layers", _units(self.resident, f" ({format_bytes(resident)})")),
                ("streamed layers", _units(self.streamed, f" through 2 slots of "
                                                          f"{format_bytes(self.slot_bytes)}")),
                ("workspace", format_bytes(self.workspace))]
        if self.scratch_bytes:
            rows.append(("widening scratch", format_bytes(self.scratch_bytes)))
        rows.append(("planned device bytes", format_bytes(self.device_bytes)))
        return PlanSummary(rows)


class PlanSummary(list):
    """The plan's (what, how much) rows; as text, one aligned line each (what print shows)."""

    def __str__(self) -> str:
        width = max((len(k) for k, _ in self), default=0)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in self)


def _units(names: list[str], note: str = "") -> str:
    """'6 units<note>: encoder 2, cross 2, decoder 2' (units are "stack.i"), or 'none'."""
    if not names:
        return "none"
    stacks = Counter(name.rpartition(".")[0] or name for name in names)
    return (f"{len(names)} unit{'s' * (len(names) != 1)}{note}: "
            + ", ".join(f"{stack} {n}" for stack, n in stacks.items()))


def plan_weights(unit_bytes: Mapping[str, int], fixed: int, workspace: int, limit: int | None,
                 scratch: int = 0, priority: Callable[[str], int] | None = None) -> WeightPlan:
    """Decide which layers stay resident under `limit` bytes (None: all of them).

    unit_bytes: each layer's packed size in execution order. fixed: weights every run needs.
    workspace: bytes reserved for activations and caches. scratch: the widening scratch.
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
            + f" + {format_bytes(scratch)} widening scratch + {format_bytes(workspace)} workspace); "
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
