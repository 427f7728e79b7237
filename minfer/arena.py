"""The explicit allocator: one preallocated byte buffer per arena, carved into aligned typed views.

Why an arena: the engine owns its memory in the spirit of BMInf. Every large buffer (KV caches,
cross-attention K/V, position-bias tables, activation scratch) is a view into one buffer whose size
is fixed up front, so the peak is known before a run starts and a request that cannot fit fails
with a clear error instead of an out-of-memory kill halfway through a generation.

Two kinds of block share the buffer. Scratch is a stack (a bump pointer): `alloc` hands out the
next aligned block, `mark` / `release` (or the `scope()` context manager) give back everything
allocated after a mark; views handed out before a release must not be used after it, and the
model code keeps each view inside the scope that allocated it (one compute call at a time per
model: the model's lock). Holds are long-lived blocks a request owns for its lifetime (a decode
state, Transformer-XL's segment memory) and release in any order: a released hold's span becomes
a gap that later holds reuse, and the stack top comes down over gaps once no scope is open.

Buffers are described declaratively as `{name: (shape, dtype)}` specs, so the same description
drives the allocation (`alloc_many`) and the up-front plan (`bytes_needed`) without two copies of
the shape arithmetic. A `BufferSet` gives such a spec named, typed fields (llama2.c's RunState):
the model families declare their per-request run states this way.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np

from .errors import ArenaExhausted, ConfigError

ALIGNMENT = 256  # bytes; matches CUDA's allocation granularity and any CPU cache line / SIMD width
# The least a device compute scope keeps for library temporaries (the workspace CuPy's CUB
# reductions allocate by themselves): see TempPool and cuda.CudaArena; the plans count it.
SCOPE_TEMPORARIES = 64 << 10


def scope_bytes(temporaries: int) -> int:
    """Arena bytes a compute scope takes for library temporaries of `temporaries` bytes beyond
    the device arena's own pool of SCOPE_TEMPORARIES (held for good: steps and most passes take
    nothing at run time): a plan counts these."""
    return align_up(int(temporaries)) if temporaries > SCOPE_TEMPORARIES else 0

BufferSpec = Mapping[str, tuple[tuple[int, ...], Any]]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_bytes(value: int | str, option: str = "memory size") -> int:
    """'2GiB', '512MB', '1.5g' or an int -> bytes. Raises ConfigError naming `option`."""
    if isinstance(value, bool):
        raise ConfigError(f"{option}: expected a size such as '2GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{option}: size must not be negative, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{option}: expected a size such as '2GiB' or '512MB', got {value!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: int) -> str:
    for unit, size in (("EiB", 1024**6), ("PiB", 1024**5), ("TiB", 1024**4), ("GiB", 1024**3),
                       ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def describe_names(names: list[str], limit: int = 100) -> str:
    """'a, b and 3 more': whole names, as many as fit in about `limit` characters (a name is
    never cut in the middle, so no stray separator is left at the cut)."""
    shown: list[str] = []
    for name in names:
        if shown and sum(len(n) + 2 for n in shown) + len(name) > limit:
            break
        shown.append(name if len(name) <= limit else name[:limit] + "...")
    rest = len(names) - len(shown)
    return ", ".join(shown) + (f" and {rest} more" if rest else "")


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def block_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    return int(math.prod(shape)) * np.dtype(dtype).itemsize


def bytes_needed(specs: BufferSpec, alignment: int = ALIGNMENT) -> int:
    """Bytes an arena needs to hand out every buffer of `specs` (worst case alignment padding)."""
    return sum(align_up(block_bytes(shape, dtype), alignment) for shape, dtype in specs.values())


def _address(array: Any) -> int:
    iface = getattr(array, "__array_interface__", None) or array.__cuda_array_interface__
    return int(iface["data"][0])


@dataclass(frozen=True)
class ArenaStats:
    used: int
    peak: int
    capacity: int


class Arena:
    """A bounded bump allocator over one byte buffer of the array namespace `xp`.

    `capacity` is the number of usable bytes. The backing buffer is over-allocated by one alignment
    unit so the first block starts on an aligned address whatever the base allocator returns.
    """

    def __init__(self, capacity: int | str, xp: Any = np, name: str = "host",
                 alignment: int = ALIGNMENT):
        self.capacity = parse_bytes(capacity, f"arena '{name}' capacity")
        self.name = name
        self.alignment = alignment
        try:
            self._raw = xp.empty(self.capacity + alignment, dtype=xp.uint8)
        except MemoryError:  # NumPy's (or CuPy's OutOfMemoryError) multi-line message, as one line
            raise ConfigError(f"arena '{name}': cannot reserve {format_bytes(self.capacity)} "
                              f"({self.capacity} bytes): out of memory (lower the workspace or "
                              "memory_limit)") from None
        skip = (-_address(self._raw)) % alignment
        self._buf = self._raw[skip: skip + self.capacity]
        self._top = 0
        self._peak = 0
        self._holds: list[Hold] = []              # live holds
        self._gaps: list[tuple[int, int]] = []    # released holds' spans below the top, sorted
        self._scopes = 0                          # scopes open (the top may not come down)
        self._lock = threading.RLock()            # holds are released from any thread

    # -- allocation -------------------------------------------------------------------------------
    def alloc(self, shape: tuple[int, ...] | int, dtype: Any, what: str = "") -> Any:
        """A fresh (uninitialised) array view of `shape` and `dtype`, aligned to `alignment`."""
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in shape {shape} for {what or 'arena block'}")
        dtype = np.dtype(dtype)
        nbytes = block_bytes(shape, dtype)
        start = align_up(self._top, self.alignment)
        end = start + nbytes
        if end > self.capacity:
            raise ArenaExhausted(self.name, nbytes, max(0, self.capacity - start), self.capacity, what)
        self._top = end
        self._peak = max(self._peak, end)
        return self._buf[start:end].view(dtype).reshape(shape)

    def zeros(self, shape: tuple[int, ...] | int, dtype: Any, what: str = "") -> Any:
        out = self.alloc(shape, dtype, what)
        out[...] = 0
        return out

    def alloc_many(self, specs: BufferSpec) -> dict[str, Any]:
        """Allocate every buffer of a `{name: (shape, dtype)}` spec; fails before allocating any
        if the whole set does not fit, naming the total."""
        need = bytes_needed(specs, self.alignment)
        available = self.capacity - align_up(self._top, self.alignment)
        if need > available:
            raise ArenaExhausted(self.name, need, max(0, available), self.capacity,
                                 describe_names(list(specs)))
        return {name: self.alloc(shape, dtype, name) for name, (shape, dtype) in specs.items()}

    def _carve(self, start: int, specs: BufferSpec) -> dict[str, Any]:
        """Views of `specs` laid out from byte `start` (inside a gap), aligned like `alloc`."""
        out = {}
        at = start
        for name, (shape, dtype) in specs.items():
            at = align_up(at, self.alignment)
            shape = tuple(int(s) for s in shape)
            n = block_bytes(shape, dtype)
            out[name] = self._buf[at:at + n].view(np.dtype(dtype)).reshape(shape)
            at += n
        return out

    # -- release ----------------------------------------------------------------------------------
    def mark(self) -> int:
        return self._top

    def release(self, mark: int) -> None:
        """Give back every scratch block allocated since `mark` (stack order)."""
        with self._lock:
            if not 0 <= mark <= self._top:
                raise ValueError(f"arena '{self.name}': release to {mark} outside 0..{self._top}")
            if any(h.start >= mark for h in self._holds):
                raise ValueError(f"arena '{self.name}': a hold allocated inside a scope outlives "
                                 "it")
            self._top = mark
            self._gaps = [(a, min(b, mark)) for a, b in self._gaps if a < mark]
            self._settle()

    def scope_overhead(self, temporaries: int = 0) -> int:
        """Bytes a scope opened now takes before its first allocation: none here (a device arena
        may carve a pool for its temporaries: cuda.py)."""
        return 0

    @contextlib.contextmanager
    def scope(self, temporaries: int = 0) -> Iterator["Arena"]:
        """Everything allocated inside the `with` block is released when it exits.

        `temporaries`: bytes of library temporaries the block's device work may have alive at
        once (the plan's "temporaries"). Here (NumPy) they are ordinary memory, outside the arena;
        a device arena (cuda.py) carves a recycled pool of that size for them."""
        with self._lock:
            mark = self.mark()
            self._scopes += 1
        try:
            yield self
        finally:
            with self._lock:
                self._scopes -= 1
                self.release(mark)

    def reset(self) -> None:
        with self._lock:
            self._top = 0
            self._holds.clear()
            self._gaps.clear()

    # -- long-lived blocks ------------------------------------------------------------------------
    def hold(self, specs: BufferSpec) -> "Hold":
        """Allocate `specs` as a block a request keeps for its lifetime (a decode state,
        Transformer-XL's segment memory), whatever scopes open and close meanwhile.
        `Hold.release()` gives it back, in any order: its span is reused by later holds, and the
        top of the stack comes down over released spans once no scope is open."""
        need = bytes_needed(specs, self.alignment)
        with self._lock:
            for k, (a, b) in enumerate(self._gaps):   # first fit among released spans
                start = align_up(a, self.alignment)
                if start + need <= b:
                    end = start + need
                    self._gaps[k:k + 1] = [g for g in ((a, start), (end, b)) if g[1] > g[0]]
                    held = Hold(self, start, end, self._carve(start, specs))
                    self._holds.append(held)
                    return held
            start = self._top
            buffers = self.alloc_many(specs)
            held = Hold(self, start, self._top, buffers)
            self._holds.append(held)
            return held

    def _release_hold(self, held: "Hold") -> None:
        with self._lock:
            self._holds.remove(held)
            self._gaps.append((held.start, held.end))
            self._gaps.sort()
            merged: list[tuple[int, int]] = []
            for a, b in self._gaps:                   # coalesce touching spans
                if merged and a <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
                else:
                    merged.append((a, b))
            self._gaps = merged
            self._settle()

    def _settle(self) -> None:
        """With no scope open, bring the top down over a released span that ends at it."""
        while self._scopes == 0 and self._gaps and self._gaps[-1][1] >= self._top:
            self._top = min(self._top, self._gaps.pop()[0])

    # -- accounting -------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        """Bytes in use: the stack top less the released spans below it."""
        return self._top - sum(b - a for a, b in self._gaps)

    @property
    def available(self) -> int:
        return self.capacity - self._top

    def stats(self) -> ArenaStats:
        return ArenaStats(used=self.used, peak=self._peak, capacity=self.capacity)

    def reset_peak(self) -> None:
        self._peak = self._top

    def __repr__(self) -> str:
        return (f"Arena({self.name!r}, used={format_bytes(self.used)}, "
                f"peak={format_bytes(self._peak)}, capacity={format_bytes(self.capacity)})")


class TempPool:
    """First-fit allocator over a fixed span of an arena (offsets within it), for the temporaries
    a GPU library allocates by itself (CuPy's reductions, index copies): a block comes back as
    soon as its array is freed, so an expression's temporaries are reused by the next one and the
    pool's size bounds them (the bump allocator would keep every one until its scope ends).
    Thread-safe: an array may be freed by any thread."""

    def __init__(self, size: int, name: str, alignment: int = ALIGNMENT):
        self.size, self.name, self.alignment = size, name, alignment
        self._free: list[tuple[int, int]] = [(0, size)] if size else []   # sorted spans
        self._live: dict[int, int] = {}                                   # offset -> bytes
        self.used = self.peak = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> int:
        need = align_up(max(nbytes, 1), self.alignment)
        with self._lock:
            for k, (a, b) in enumerate(self._free):
                if b - a >= need:
                    self._free[k:k + 1] = [(a + need, b)] if b - a > need else []
                    self._live[a] = need
                    self.used += need
                    self.peak = max(self.peak, self.used)
                    return a
            largest = max((b - a for a, b in self._free), default=0)
        raise ArenaExhausted(self.name, need, largest, self.size,
                             "library temporaries (the plan's 'temporaries' pool)")

    def give(self, offset: int) -> None:
        with self._lock:
            need = self._live.pop(offset)
            self.used -= need
            spans = sorted([*self._free, (offset, offset + need)])
            merged: list[tuple[int, int]] = []
            for a, b in spans:                       # coalesce touching spans
                if merged and a <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
                else:
                    merged.append((a, b))
            self._free = merged

    @property
    def live(self) -> int:
        return len(self._live)


class Hold:
    """A long-lived arena block (see `Arena.hold`): named buffers plus its span."""

    def __init__(self, arena: Arena, start: int, end: int, buffers: dict[str, Any]):
        self.arena, self.start, self.end, self.buffers = arena, start, end, buffers
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.buffers = {}
            self.arena._release_hold(self)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class BufferSet:
    """A typed set of arena buffers: subclass it as a dataclass whose fields are the buffers, and
    declare each field's (shape, dtype) in `specs(...)`. `allocate` and `nbytes` both read that one
    declaration, so what a plan counts is exactly what a run allocates."""

    @classmethod
    def specs(cls, *shape_args: Any) -> BufferSpec:
        raise NotImplementedError

    @classmethod
    def allocate(cls, arena: Arena, *shape_args: Any) -> Any:
        """Every buffer of the set from the arena's current scope (uninitialised)."""
        return cls(**arena.alloc_many(cls.specs(*shape_args)))

    @classmethod
    def hold(cls, arena: Arena, *shape_args: Any) -> tuple[Any, Hold]:
        """Every buffer of the set as one long-lived `Hold` (a request's state): the set and the
        hold to release when the request ends."""
        held = arena.hold(cls.specs(*shape_args))
        return cls(**held.buffers), held

    @classmethod
    def nbytes(cls, *shape_args: Any) -> int:
        return bytes_needed(cls.specs(*shape_args))
