"""Building a backend from the user's options: device name, dtype, workspace and memory limit.

Kept apart from `backend.py` (the base class) so that `cuda.py` can subclass the base while this
factory imports `cuda.py`, lazily, only when a CUDA device is asked for: no import cycle.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .arena import Arena, parse_bytes
from .backend import Backend, resolve_dtype
from .errors import ConfigError

log = logging.getLogger("minfer")

DEFAULT_WORKSPACE = "1GiB"  # virtual until touched: NumPy's large allocations are lazily paged in


def cuda_available() -> bool:
    try:
        from . import cuda
    except ImportError:
        return False
    return cuda.device_count() > 0


def make_backend(device: str = "cpu", dtype: Any = None, workspace: int | str | None = None,
                 memory_limit: int | str | None = None) -> Backend:
    """Build the backend for `device` ('cpu', 'cuda', 'cuda:N', 'auto'), `dtype` ('float32',
    'float16' on CUDA, 'int8') and a memory budget.

    Without `memory_limit` the arena holds `workspace` bytes (default 1GiB, touched lazily) of
    activations and caches. With it, the arena holds the whole limit and `workspace` is the part
    reserved for runs (default: planned per model for one 256-token prompt and 128 new tokens)."""
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
        compute, weight_format = resolve_dtype("cuda", dtype)
        try:
            from . import cuda
        except ImportError:
            raise ConfigError(f"device {device!r}: CuPy is not installed "
                              "(pip install 'minfer[cuda12]')") from None
        return cuda.make_cuda_backend(int(index), compute, weight_format, limit, reserve)
    if name != "cpu":
        raise ConfigError(f"device {device!r}: expected 'cpu', 'cuda', 'cuda:N' or 'auto'")
    compute, weight_format = resolve_dtype("cpu", dtype)
    if limit is not None and reserve is not None and reserve > limit:
        raise ConfigError(f"workspace {reserve} bytes exceeds memory_limit {limit} bytes")
    capacity = limit if limit is not None else (reserve if reserve is not None
                                                else parse_bytes(DEFAULT_WORKSPACE))
    return Backend(xp=np, device=name, arena=Arena(capacity, np, name="cpu"), dtype=compute,
                   weight_format=weight_format, memory_limit=limit,
                   workspace=reserve if limit is not None else None)
