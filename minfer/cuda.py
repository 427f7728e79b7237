"""Everything that touches CuPy: the device arena, pinned host memory, the copy stream.

The only module that imports `cupy` (lazily, from `backend.make_backend`). Model code runs
unchanged over `cupy` as its array namespace; what differs on a GPU lives here:

- `CudaArena`: the budget is one device allocation carved into aligned views, like the CPU arena.
  While an arena scope is open (and model code runs only inside scopes), CuPy's allocator is
  routed to the arena (`cupy.cuda.using_allocator`), so even the temporaries CuPy creates inside
  an expression come out of the budget and are given back when the scope closes.
- `CudaTransfers`: streamed layers are copied host -> device on a separate non-blocking stream
  from pinned memory; each copy records an event the compute stream waits on (no host sync), and
  a slot is refilled only after the compute that read it has been queued and an event recorded.
- `CudaBackend`: `asarray` / `to_host` / `upload` / `host_buffer` over CuPy.

No machine this project is developed on has a GPU: this module is exercised by the GPU tests
(`tests/test_cuda.py`), which run where CuPy finds a device and are skipped elsewhere. The
scheduling logic it plugs into is tested on the CPU through a counting stand-in device.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import cupy  # noqa: F401  (ImportError here means: no CUDA backend, said by backend.py)
import numpy as np

from .backend import Backend
from .errors import ConfigError
from .arena import Arena, align_up, format_bytes

DEVICE_HEADROOM = 0.9  # without a limit, take this share of the free device memory


def device_count() -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


class CudaArena(Arena):
    """The CPU arena's bump allocator over one device buffer, which also serves CuPy's own
    allocations while a scope is open."""

    def __init__(self, capacity: int, device: int):
        with cupy.cuda.Device(device):
            super().__init__(capacity, cupy, name=f"cuda:{device}")

    def _cupy_alloc(self, nbytes: int) -> Any:
        block = self.alloc((align_up(max(nbytes, 1)),), np.uint8, "CuPy temporary")
        return block.data  # a MemoryPointer into the arena's buffer (keeps it alive)

    @contextlib.contextmanager
    def scope(self) -> Iterator["CudaArena"]:
        with super().scope(), cupy.cuda.using_allocator(self._cupy_alloc):
            yield self


class CudaTransfers:
    """Host (pinned) -> device copies on their own stream, ordered by events (see module doc)."""

    def __init__(self) -> None:
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._slot_free: dict[int, Any] = {}

    def issue(self, source: Any, slot: Any, unit: str, slot_index: int = 0) -> Any:
        free = self._slot_free.pop(slot_index, None)
        if free is not None:
            self.stream.wait_event(free)  # don't overwrite weights a queued kernel still reads
        slot[:source.nbytes].set(source.array, stream=self.stream)
        return self.stream.record()

    def wait(self, ticket: Any) -> None:
        cupy.cuda.get_current_stream().wait_event(ticket)  # the compute stream waits, not the host

    def slot_released(self, slot_index: int) -> None:
        self._slot_free[slot_index] = cupy.cuda.get_current_stream().record()

    def close(self) -> None:
        self.stream.synchronize()


class CudaBackend(Backend):
    def asarray(self, host: Any, dtype: Any = None) -> Any:
        return cupy.asarray(host, dtype=dtype)

    def to_host(self, array: Any) -> np.ndarray:
        return cupy.asnumpy(array)

    def upload(self, dst: Any, host: np.ndarray) -> None:
        if dst.flags.c_contiguous:
            dst.set(np.ascontiguousarray(host, dtype=dst.dtype))
        else:  # a strided view (a block of columns): go through a device temporary
            dst[...] = cupy.asarray(np.ascontiguousarray(host), dtype=dst.dtype)

    def host_buffer(self, block: np.ndarray) -> np.ndarray:
        """A pinned (page-locked) copy of `block`, so copies to the device can be asynchronous."""
        pinned = cupy.cuda.alloc_pinned_memory(block.nbytes)
        out = np.frombuffer(pinned, np.uint8, block.nbytes)  # keeps `pinned` alive
        out[...] = block.reshape(-1).view(np.uint8)
        return out

    def make_transfers(self) -> CudaTransfers:
        return CudaTransfers()


def make_cuda_backend(index: int, compute: np.dtype, weight_format: str, limit: int | None,
                      reserve: int | None) -> CudaBackend:
    count = device_count()
    if count == 0:
        raise ConfigError("device 'cuda': CuPy finds no CUDA device; use device='cpu' or 'auto'")
    if index >= count:
        raise ConfigError(f"device 'cuda:{index}': only {count} CUDA device(s) found")
    with cupy.cuda.Device(index):
        free, _total = cupy.cuda.runtime.memGetInfo()
    if limit is not None and limit > free:
        raise ConfigError(f"memory_limit {format_bytes(limit)} exceeds the free memory of cuda:{index} "
                          f"({format_bytes(free)})")
    capacity = limit if limit is not None else int(free * DEVICE_HEADROOM)
    if reserve is not None and reserve > capacity:
        raise ConfigError(f"workspace {format_bytes(reserve)} exceeds the device budget "
                          f"{format_bytes(capacity)}")
    cupy.cuda.Device(index).use()
    # On the GPU the arena is always the budget: weights, slots and workspace all live in it.
    return CudaBackend(xp=cupy, device=f"cuda:{index}", arena=CudaArena(capacity, index),
                       dtype=compute, weight_format=weight_format, memory_limit=capacity, workspace=reserve)
