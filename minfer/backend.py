"""The compute backend: which array namespace runs the math, the device's arena, and transfers.

Model code never imports numpy or cupy for math; it receives a `Backend` and uses `be.xp`. This
module holds the base class (the CPU backend is this class over NumPy) and the dtype policy;
`devices.make_backend` builds one, and `cuda.CudaBackend` subclasses it over CuPy (CuPy is imported
only there, lazily, so a CPU install never needs it).

A backend also carries the weight dtype policy (`dtype` is the compute dtype of activations;
`weight_format` names how linear layers are stored, see `params/formats.py`) and the memory budget:
without a limit the arena is a workspace for activations and caches and weights are ordinary
arrays; with `memory_limit` the arena *is* the budget, and weights, streaming slots and workspace
are all carved from it (see `params/runtime.py`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arena import Arena
from .errors import ConfigError
from .params.transfers import Transfers

# dtype option -> (compute dtype, weight format of the linear layers) per device kind
_DTYPES = {
    # on the CPU every format computes in float32: only the stored weights shrink
    "cpu": {"float32": ("float32", "float32"), "float16": ("float32", "float16"),
            "bfloat16": ("float32", "bfloat16"), "int8": ("float32", "int8")},
    "cuda": {"float16": ("float16", "float16"), "float32": ("float32", "float32"),
             "int8": ("float16", "int8")},
}
_DEFAULT_DTYPE = {"cpu": "float32", "cuda": "float16"}


@dataclass
class Backend:
    xp: Any                       # the array namespace: numpy (or cupy)
    device: str                   # "cpu" or "cuda:N"
    arena: Arena                  # every large activation / cache buffer comes from here
    dtype: Any                    # compute dtype of activations (and of non-linear weights)
    weight_format: str = "float32"    # how linear layers are stored (params/formats.py)
    memory_limit: int | None = None   # the whole budget (weights + workspace), or None
    workspace: int | None = None      # bytes reserved for runs under a limit (None: planned)
    num_threads: int | None = None    # threads of the CPU kernels and BLAS (None: every core)

    def on_device(self) -> Any:
        """A context in which the calling thread's device work goes to this backend's device
        (CUDA: `Device(index)`, which is per thread; nothing on the CPU)."""
        return contextlib.nullcontext()

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
        return Transfers()

    def workspace_reserve(self, planned: int) -> int:
        """Bytes a memory limit keeps free for runs: `workspace=` if given, else `planned`."""
        return self.workspace if self.workspace is not None else planned


def resolve_dtype(device_kind: str, dtype: Any) -> tuple[np.dtype, str]:
    """The `dtype` option -> (compute dtype, weight format) for a device kind, or a clear error."""
    if dtype is None:
        name = _DEFAULT_DTYPE[device_kind]
    elif isinstance(dtype, str):
        name = dtype.strip().lower()
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    name = {"fp32": "float32", "fp16": "float16", "half": "float16", "float": "float32",
            "bf16": "bfloat16"}.get(name, name)
    table = _DTYPES[device_kind]
    if name not in table:
        raise ConfigError(f"dtype {dtype!r} is not supported on device '{device_kind}' "
                          f"(supported: {', '.join(table)})")
    compute, weight_format = table[name]
    return np.dtype(compute), weight_format
