"""Building a backend from the user's options: device name, dtype, workspace and memory limit.

Kept apart from `backend.py` (the base class) so that `cuda.py` can subclass the base while this
factory imports `cuda.py`, lazily, only when a CUDA device is asked for: no import cycle.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

import numpy as np

from . import kernels
from .arena import Arena, format_bytes, parse_bytes
from .backend import Backend, resolve_dtype
from .errors import ConfigError

log = logging.getLogger("minfer")

DEFAULT_WORKSPACE = "1GiB"  # virtual until touched: NumPy's large allocations are lazily paged in


def available_memory() -> tuple[int, str] | None:
    """Bytes this process can still fill, and where that figure comes from; None if unknown.

    Linux: MemAvailable of /proc/meminfo (free memory plus what the kernel can reclaim), lowered
    to the room left under a cgroup v2 limit (containers); elsewhere the free physical pages."""
    found = None
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    found = (int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max", "rb") as f:
            limit = f.read().strip()
        if limit != b"max":
            with open("/sys/fs/cgroup/memory.current", "rb") as f:
                room = int(limit) - int(f.read())
            if found is None or room < found[0]:
                found = (max(room, 0), "room under the cgroup's memory.max")
    except (OSError, ValueError):
        pass
    if found is None:
        try:
            found = (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages")
        except (OSError, ValueError, AttributeError):
            return None
    return found


def _check_fits(option: str, size: int) -> None:
    """A host arena of `size` bytes, asked for by `option`, must fit in the machine's available
    memory. NumPy reserves it virtually and the pages arrive as they are first touched, so an
    arena larger than what is available is not refused at creation (unless larger than RAM plus
    swap) but ends in an out-of-memory kill mid-run: that is what the budget exists to prevent.
    Checked up front instead, without touching the pages (which would cost the whole size)."""
    avail = available_memory()
    if avail is not None and size > avail[0]:
        raise ConfigError(f"{option} {format_bytes(size)} ({size} bytes) exceeds the memory "
                          f"available on this machine: {format_bytes(avail[0])} ({avail[1]})")


MALLOC_ARENAS = 2   # glibc's per-thread heaps under a memory limit (its default: 8 per core)
MMAP_THRESHOLD = 1 << 20   # under a memory limit: host blocks from 1 MiB are mapped on their own
_M_ARENA_MAX, _M_MMAP_THRESHOLD = -8, -3   # mallopt's parameter numbers (malloc.h)


def cap_malloc_arenas() -> bool:
    """Under a memory limit, at most MALLOC_ARENAS glibc heaps for the whole process. glibc gives
    a thread that allocates while another does a heap of its own, and keeps what was freed
    there for later: every request thread (a server's 32 workers) held its own few MiB of
    freed host temporaries (token lists, logits copies), outside the arena and the limit
    (`minfer serve --memory-limit 400MiB`, 32 concurrent 480-token prompts: +191 MiB over the
    limit, +164 with two heaps). Process-wide and only ever lowered: a MALLOC_ARENA_MAX set in
    the environment is kept. False where there is no glibc (musl, macOS: nothing to do)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_ARENA_MAX, MALLOC_ARENAS))
    except (OSError, AttributeError):
        return False


def fix_mmap_threshold() -> bool:
    """Under a memory limit, host blocks of MMAP_THRESHOLD bytes and more get a mapping of their
    own, given back to the system when freed. glibc's threshold is otherwise dynamic: freeing a
    mapped block raises it to that block's size (up to 32 MiB), so later temporaries of a few MiB
    (a decoder pass's bias rows, an encoder pass's (B, T, C) result) come from the heap and stay
    there once freed: on a T5-XXL encoder under 2 GiB ~10 MiB of the peak outside the arena. Fixing it stops
    the adjustment. Process-wide; a MALLOC_MMAP_THRESHOLD_ set in the environment is kept. False
    where there is no glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def cuda_available() -> bool:
    try:
        from . import cuda
    except ImportError:
        return False
    try:
        return cuda.device_count() > 0
    except ConfigError as e:   # a driver that cannot start: 'auto' runs on the CPU, and says why
        log.warning("%s; using the CPU", e)
        return False


def make_backend(device: str = "cpu", dtype: Any = None, workspace: int | str | None = None,
                 memory_limit: int | str | None = None, compute: Any = None) -> Backend:
    """Build the backend for `device` ('cpu', 'cuda', 'cuda:N', 'auto'), `dtype` (how weights
    are stored: 'float32', 'float16', 'bfloat16', 'int8', 'int4' on the CPU), `compute` (what
    products compute in: CPU 'float32' or 'int8'; CUDA 'float16' or 'float32') and a memory
    budget.

    Without `memory_limit` the arena holds `workspace` bytes (default 1GiB, touched lazily) of
    activations and caches. With it, the arena holds the whole limit and `workspace` is the part
    reserved for runs (default: planned per model for one 256-token prompt and 128 new tokens; an
    encoder-only model: one 512-token input)."""
    name = (device or "cpu").strip().lower()
    if name == "auto":
        name = "cuda" if cuda_available() else "cpu"
        log.info("device 'auto' -> %s", name)
    limit = parse_bytes(memory_limit, "memory_limit") if memory_limit is not None else None
    if limit is not None and limit <= 0:
        raise ConfigError(f"memory_limit must be positive, got {memory_limit!r}")
    reserve = parse_bytes(workspace, "workspace") if workspace is not None else None
    if name == "cuda" or name.startswith("cuda:"):
        index = name.partition(":")[2] or "0"
        if not index.isdigit():
            raise ConfigError(f"device {device!r}: expected 'cuda:N' with N a device number")
        activations, weight_format, _ = resolve_dtype("cuda", dtype, compute)
        try:
            from . import cuda
        except ImportError:
            raise ConfigError(f"device {device!r}: CuPy is not installed "
                              "(pip install 'minfer[cuda12]')") from None
        return cuda.make_cuda_backend(int(index), activations, weight_format, limit, reserve)
    if name != "cpu":
        raise ConfigError(f"device {device!r}: expected 'cpu', 'cuda', 'cuda:N' or 'auto'")
    activations, weight_format, mode = resolve_dtype("cpu", dtype, compute,
                                                     kernels.bfloat16_native())
    if limit is not None and reserve is not None and reserve > limit:
        raise ConfigError(f"workspace {reserve} bytes exceeds memory_limit {limit} bytes")
    if limit is not None:
        _check_fits("memory_limit", limit)
        cap_malloc_arenas()
        fix_mmap_threshold()
        kernels.keep_blas_on_pool()
    elif reserve is not None:
        _check_fits("workspace", reserve)
    # (the default workspace is not checked: it is only address space until a run touches it)
    capacity = limit if limit is not None else (reserve if reserve is not None
                                                else parse_bytes(DEFAULT_WORKSPACE))
    return Backend(xp=np, device=name, arena=Arena(capacity, np, name="cpu"), dtype=activations,
                   weight_format=weight_format, compute=mode, memory_limit=limit,
                   workspace=reserve if limit is not None else None)
