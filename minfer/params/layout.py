"""One layer's packed layout: where each of its arrays sits in one aligned byte block.

A layer is the unit of placement (resident in the arena, or streamed into a slot), so its arrays
travel as one block: `pack` writes them on the host, `views` reads them back out of any copy of
the block (an arena hold, a streaming slot) without copying.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from ..arena import BufferSpec, align_up
from ..io.formats import WeightFormat
from ..products import scratch_bytes

@dataclass(frozen=True)
class Entry:
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype


class Layout:
    """Aligned offsets of a layer's arrays, and which logical params are linear slots (by format)."""

    def __init__(self, arrays: BufferSpec, linear: Mapping[str, WeightFormat] | None = None,
                 product: Mapping[str, Any] | None = None):
        self.entries: dict[str, Entry] = {}
        offset = 0
        for name, (shape, dtype) in arrays.items():
            dtype = np.dtype(dtype)
            self.entries[name] = Entry(offset, tuple(shape), dtype)
            offset = align_up(offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        self.nbytes = offset
        self.linear: dict[str, WeightFormat] = dict(linear or {})  # param -> its format
        self.product: dict[str, Any] = dict(product or {})         # param -> its product's dtype

    @classmethod
    def of(cls, arrays: Mapping[str, np.ndarray],
           linear: Mapping[str, WeightFormat] | None = None) -> "Layout":
        return cls({n: (a.shape, a.dtype) for n, a in arrays.items()}, linear)

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

    def params(self, arrays: Mapping[str, Any],
               wrap: Callable[..., Any]) -> dict[str, Any]:
        """The stored arrays -> what the math receives: each linear slot wrapped by its format
        (`wrap(fmt, name, arrays)`, e.g. int8 + scales -> one `PackedWeight`), the rest as they
        are."""
        packed = {a for p, f in self.linear.items() for a in f.array_names(p)}
        out = {name: value for name, value in arrays.items() if name not in packed}
        for name, fmt in self.linear.items():
            out[name] = wrap(fmt, name, arrays, self.product.get(name))
        return out

    def scratch_bytes(self, compute_dtype: Any) -> int:
        """Float scratch the layer's products need (0 for plain float layers)."""
        return max((scratch_bytes(f, self.entries[p].shape, self.product.get(p, compute_dtype))
                    for p, f in self.linear.items()), default=0)
