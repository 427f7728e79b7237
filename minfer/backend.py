"""The compute backend: which array namespace runs the math, and the device's arena.

Model code never imports numpy or cupy for math; it receives a `Backend` and uses `be.xp`. The CPU
backend is NumPy. This is the only module that may import CuPy (the CUDA backend arrives with the
low-memory issue; asking for it now is a clear error, not an ImportError).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ConfigError
from .memory import Arena, parse_bytes

DEFAULT_WORKSPACE = "1GiB"  # virtual until touched: NumPy's large allocations are lazily paged in

_COMPUTE_DTYPES = {"cpu": ("float32",)}


@dataclass
class Backend:
    xp: Any            # the array namespace: numpy (or cupy)
    device: str        # "cpu"
    arena: Arena       # every large activation / cache buffer comes from here
    dtype: Any         # compute dtype of weights and activations

    def asarray(self, host: np.ndarray, dtype: Any = None) -> Any:
        """A device copy of a host array (on the CPU: the array itself when no cast is needed)."""
        return self.xp.asarray(host, dtype=dtype)

    def to_host(self, array: Any) -> np.ndarray:
        return np.asarray(array)


def make_backend(device: str = "cpu", dtype: Any = None, workspace: int | str | None = None) -> Backend:
    """Build the backend for `device` ('cpu'), compute `dtype` and an arena of `workspace` bytes."""
    name = (device or "cpu").strip().lower()
    if name == "auto":
        name = "cpu"
    if name != "cpu":
        if name == "cuda" or name.startswith("cuda:"):
            raise ConfigError(f"device {device!r}: the CUDA backend is not available in this build "
                              "of minfer yet; use device='cpu'")
        raise ConfigError(f"device {device!r}: expected 'cpu', 'cuda', 'cuda:N' or 'auto'")
    dtype_name = "float32" if dtype is None else str(np.dtype(dtype) if not isinstance(dtype, str)
                                                     else dtype).lower()
    if dtype_name not in _COMPUTE_DTYPES[name]:
        raise ConfigError(f"dtype {dtype!r} is not supported on device 'cpu' "
                          f"(supported: {', '.join(_COMPUTE_DTYPES[name])})")
    capacity = parse_bytes(workspace if workspace is not None else DEFAULT_WORKSPACE, "workspace")
    return Backend(xp=np, device=name, arena=Arena(capacity, np, name="cpu"),
                   dtype=np.dtype(dtype_name))
