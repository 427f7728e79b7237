"""The compute backend: which array namespace runs the math, the device's arena, and transfers.

Model code never imports numpy or cupy for math; it receives a `Backend` and uses `be.xp`. The CPU
backend is NumPy. CuPy lives in `cuda.py` (the only module that imports it), imported lazily when
a CUDA device is asked for, so a CPU install never needs it.

A backend also carries the weight dtype policy (`dtype` is the compute dtype; `quantize` means
the linear layers are held as int8 with per-column scales) and the memory budget: without a limit
the arena is a workspace for activations and caches and weights are ordinary arrays; with
`memory_limit` the arena *is* the budget, and weights, streaming slots and workspace are all carved
from it (see streaming.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ConfigError
from .memory import Arena, parse_bytes

log = logging.getLogger("minfer")

DEFAULT_WORKSPACE = "1GiB"  # virtual until touched: NumPy's large allocations are lazily paged in

# dtype option -> (compute dtype, int8 weights) per device kind
_DTYPES = {
    "cpu": {"float32": ("float32", False), "int8": ("float32", True)},
    "cuda": {"float16": ("float16", False), "float32": ("float32", False),
             "int8": ("float16", True)},
}
_DEFAULT_DTYPE = {"cpu": "float32", "cuda": "float16"}


@dataclass
class Backend:
    xp: Any                       # the array namespace: numpy (or cupy)
    device: str                   # "cpu" or "cuda:N"
    arena: Arena                  # every large activation / cache buffer comes from here
    dtype: Any                    # compute dtype of activations (and of float weights)
    quantize: bool = False        # linear layers held as int8 + per-column scales
    memory_limit: int | None = None   # the whole budget (weights + workspace), or None
    workspace: int | None = None      # bytes reserved for runs under a limit (None: planned)

    def asarray(self, host: np.ndarray, dtype: Any = None) -> Any:
        """A device copy of a host array (on the CPU: the array itself when no cast is needed)."""
        return self.xp.asarray(host, dtype=dtype)

    def to_host(self, array: Any) -> np.ndarray:
        return np.asarray(array)

    def upload(self, dst: Any, host: np.ndarray) -> None:
        """Copy a host array into an existing device buffer (an arena view)."""
        dst[...] = host

    def host_buffer(self, block: np.ndarray) -> np.ndarray:
        """Host memory for a streamed layer's bytes (pinned on CUDA; plain memory here)."""
        return block

    def make_transfers(self) -> Any:
        from .streaming import Transfers
        return Transfers()

    def workspace_reserve(self, planned: int) -> int:
        """Bytes a memory limit keeps free for runs: `workspace=` if given, else `planned`."""
        return self.workspace if self.workspace is not None else planned

    @property
    def weight_dtype_name(self) -> str:
        return "int8" if self.quantize else np.dtype(self.dtype).name


def cuda_available() -> bool:
    try:
        from . import cuda
    except ImportError:
        return False
    return cuda.device_count() > 0


def resolve_dtype(device_kind: str, dtype: Any) -> tuple[np.dtype, bool]:
    """The `dtype` option -> (compute dtype, int8 weights) for a device kind, or a clear error."""
    if dtype is None:
        name = _DEFAULT_DTYPE[device_kind]
    elif isinstance(dtype, str):
        name = dtype.strip().lower()
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    name = {"fp32": "float32", "fp16": "float16", "half": "float16", "float": "float32"}.get(name, name)
    table = _DTYPES[device_kind]
    if name not in table:
        raise ConfigError(f"dtype {dtype!r} is not supported on device '{device_kind}' "
                          f"(supported: {', '.join(table)})")
    compute, quantize = table[name]
    return np.dtype(compute), quantize


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
        compute, quantize = resolve_dtype("cuda", dtype)
        try:
            from . import cuda
        except ImportError:
            raise ConfigError(f"device {device!r}: CuPy is not installed "
                              "(pip install 'minfer[cuda12]')") from None
        return cuda.make_cuda_backend(int(index), compute, quantize, limit, reserve)
    if name != "cpu":
        raise ConfigError(f"device {device!r}: expected 'cpu', 'cuda', 'cuda:N' or 'auto'")
    compute, quantize = resolve_dtype("cpu", dtype)
    if limit is not None and reserve is not None and reserve > limit:
        raise ConfigError(f"workspace {reserve} bytes exceeds memory_limit {limit} bytes")
    capacity = limit if limit is not None else (reserve if reserve is not None
                                                else parse_bytes(DEFAULT_WORKSPACE))
    return Backend(xp=np, device=name, arena=Arena(capacity, np, name="cpu"), dtype=compute,
                   quantize=quantize, memory_limit=limit,
                   workspace=reserve if limit is not None else None)
