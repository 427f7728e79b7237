"""The vocabulary of a family's weight table: what a checkpoint holds, and how each of minfer's
parameters is built from it.

A family declares one `WeightTable` per config (models/*/weights.py): the checkpoint's tensor names
and shapes, and for every parameter the math reads, an entry saying where it comes from:

- `Linear`: a linear slot (out, in), one row per output channel, used as `x @ w.T` (and, for
  embedding tables, by row). Built from Hugging Face (out, in) tensors fused along `out` (q|k|v,
  or a gated FF's wi_0|wi_1), optionally a range of the first source's rows, optionally from a
  source stored (in, out) (transposed once). Only linear slots take a compressed weight format
  (io/formats.py); a slot holds exactly its sources' values, so a checkpoint already stored
  in the format loads as its own bytes.
- `Tensor`: any other array (vectors, biases, norm weights, position tables): a checkpoint tensor
  as stored, optionally a range of its rows, with tensors appended along axis 0.
- `Derived`: an array computed at load from checkpoint tensors (Transformer-XL's projected
  sinusoid tables).
- `View`: another fixed parameter, the same object under a second name (a tied embedding is its
  head's rows).

Everything generic is then written once over this table: the name and shape checks, the fusing
and folding, the formats, the memory plan and the placement (params/loader.py), and `convert`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Union

import numpy as np

Shape = tuple[int, ...]
Read = Callable[[str], np.ndarray]  # checkpoint name -> float32 host array


@dataclass(frozen=True)
class Linear:
    sources: tuple[str, ...]       # HF (out_i, in) tensors, fused along out in this order
    rows: tuple[int, int] | None = None   # only rows [a, b) of the first source
    transpose: bool = False        # the (single) source is stored (in, out)
    float32: bool = False          # computed in float32 when the compute dtype is half (T5's FF
                                   # output: transformers keeps `wo` float32, whose output
                                   # outgrows float16), stored so unless the format is int8


@dataclass(frozen=True)
class Tensor:
    source: str
    rows: tuple[int, int] | None = None   # only rows [a, b) of the source
    append: tuple[str, ...] = ()          # tensors concatenated after it along axis 0
    host: bool = False                    # stays a float32 host array (gathered on the host)


@dataclass(frozen=True)
class Derived:
    shape: Shape
    build: Callable[[Read], np.ndarray]   # float32 host array of `shape`


@dataclass(frozen=True)
class View:
    of: str                               # the same object as this fixed parameter


Entry = Union[Linear, Tensor, Derived, View]
Unit = dict[str, Union[Linear, Tensor]]   # one layer: the unit of placement and streaming


@dataclass
class WeightTable:
    tensors: dict[str, Shape]                        # every tensor a checkpoint must hold
    fixed: dict[str, Entry]                          # parameters every run needs, always resident
    stacks: dict[str, list[Unit]]                    # layer stacks, layers in execution order
    optional: dict[str, Shape] = field(default_factory=dict)  # may also be there; unused
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # may stand in for a tensor
    priority: dict[str, int] = field(default_factory=dict)    # stacks kept resident first
    buffers: tuple[str, ...] = ()                    # tensors that are not parameters (counting)

    def shape(self, entry: Entry) -> Shape:
        """The shape of a parameter as the math sees it."""
        if isinstance(entry, Linear):
            first = self.tensors[entry.sources[0]]
            if entry.transpose:
                first = tuple(reversed(first))
            out = entry.rows[1] - entry.rows[0] if entry.rows is not None else first[0]
            return (out + sum(self.tensors[s][0] for s in entry.sources[1:]), first[1])
        if isinstance(entry, Derived):
            return entry.shape
        if isinstance(entry, View):
            return self.shape(self.fixed[entry.of])
        shape = self.tensors[entry.source]
        if entry.rows is not None:
            shape = (entry.rows[1] - entry.rows[0], *shape[1:])
        if entry.append:
            shape = (shape[0] + sum(self.tensors[s][0] for s in entry.append), *shape[1:])
        return shape

    def units(self) -> list[tuple[str, Unit]]:
        """("stack.i", layer) for every layer of every stack, in execution order."""
        return [(f"{stack}.{i}", unit) for stack, layers in self.stacks.items()
                for i, unit in enumerate(layers)]

    def linear_sources(self) -> set[str]:
        """Every checkpoint tensor that feeds a linear slot (layers, heads, embeddings). Sources
        stored (in, out) are left out: a file keeps per-row scales, and their rows are not output
        channels."""
        entries = [*self.fixed.values(), *(e for _, unit in self.units() for e in unit.values())]
        return {s for e in entries if isinstance(e, Linear) and not e.transpose for s in e.sources}

    def parameter_count(self) -> int:
        return sum(math.prod(s) for n, s in self.tensors.items() if n not in self.buffers)
