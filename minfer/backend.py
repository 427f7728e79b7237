"""The compute backend: which array namespace runs the math, the device's arena, and transfers.

Model code never imports numpy or cupy for math; it receives a `Backend` and uses `be.xp`. This
module holds the base class (the CPU backend is this class over NumPy) and the dtype policy;
`devices.make_backend` builds one, and `cuda.CudaBackend` subclasses it over CuPy (CuPy is imported
only there, lazily, so a CPU install never needs it).

A backend also carries the weight dtype policy (`dtype` is the dtype of activations;
`weight_format` names how linear layers are stored, see `io/formats.py`; `compute` what the
products compute in, float32 / float16 or, on the CPU, int8 x int8 or bfloat16 x bfloat16) and
the memory budget: without a limit the arena is a workspace for activations and caches and weights are ordinary
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

# dtype option -> how the linear layers are stored, per device kind
# (float8_e4m3 / float8_e5m2: a file's fp8 codes kept, CPU only; on CUDA an fp8 file widens to
# float16, which holds every fp8 value; int8g32 / int8g16, int4g32 / int4g16: GGUF blocks held
# exactly, CPU only)
_FORMATS = {"cpu": ("float32", "float16", "bfloat16", "int8", "int4", "float8_e4m3", "float8_e5m2",
                    "int8g32", "int8g16", "int4g32", "int4g16"),
            "cuda": ("float16", "float32", "int8")}
_DEFAULT_DTYPE = {"cpu": "float32", "cuda": "float16"}
# compute option -> the dtype activations are in. On the CPU "int8" and "bfloat16" keep float32
# activations between the products and round each product's inputs to int8 steps per row /
# to bfloat16; on CUDA the products run in the compute dtype.
_COMPUTE = {"cpu": {"float32": "float32", "int8": "float32", "bfloat16": "float32"},
            "cuda": {"float16": "float16", "float32": "float32"}}
# the CPU compute modes whose encoder attention rounds its products' inputs as their linear
# products do, and the attention each takes: compute="bfloat16" on the bfloat16 tiles
# (ops.rounded_distance_attention), compute="int8" on the int8 tiles
# (ops.quantised_distance_attention: its accuracy in benchmarks/README.md, "int8 attention")
ROUNDED_ATTENTION = {"bfloat16": "bfloat16", "int8": "int8"}


def rounds_attention(compute: str, dtype: Any) -> bool:
    """Whether an encoder pass of this compute mode and activation dtype takes a rounding
    attention (ROUNDED_ATTENTION, on the CPU's float32 activations)."""
    return compute in ROUNDED_ATTENTION and np.dtype(dtype) == np.float32


def encoder_attention_kind(compute: str, dtype: Any, on_host: bool | None) -> str | None:
    """Which compiled encoder attention a pass of this compute mode and activation dtype takes
    where the kernels are selected (their scratch: kernels/attention_layout.py): "bfloat16" or
    "int8" (`rounds_attention`: the CPU's compute modes), "float32" (float32 compute in NumPy:
    `on_host`), or None (the array ops: CUDA; and a plan that does not know where it runs,
    which then keeps room for them)."""
    if rounds_attention(compute, dtype):
        return ROUNDED_ATTENTION[compute]
    if on_host and compute == "float32" and np.dtype(dtype) == np.float32:
        return "float32"
    return None


QUANTISED_FORMATS = ("int8", "int4")     # what compute="int8" multiplies
FP8_FORMATS = ("float8_e4m3", "float8_e5m2")   # a file's fp8 codes: compute="bfloat16" multiplies
                                               # their values (each a bfloat16) as they are
# the CPU compute modes that multiply only some weight formats, and what to say otherwise
_COMPUTE_FORMATS = {
    "int8": ((*QUANTISED_FORMATS, "int8g32", "int8g16"),   # (and GGUF's blocks as they are)
             "compute='int8' multiplies int8 or int4 weights, not dtype {name!r}: use "
             "dtype='int8' or 'int4' (or leave dtype unset; GGUF's int8g blocks multiply as "
             "they are)"),
    "bfloat16": (("bfloat16", *FP8_FORMATS),
                 "compute='bfloat16' multiplies bfloat16 or fp8 weights, not dtype {name!r}: use "
                 "dtype='bfloat16' (or leave dtype unset)"),
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "float": "float32",
            "bf16": "bfloat16"}


@dataclass
class Backend:
    xp: Any                       # the array namespace: numpy (or cupy)
    device: str                   # "cpu" or "cuda:N"
    arena: Arena                  # every large activation / cache buffer comes from here
    dtype: Any                    # compute dtype of activations (and of non-linear weights)
    weight_format: str = "float32"    # how linear layers are stored (io/formats.py)
    compute: str = "float32"          # what the products compute in (CPU: also "int8", "bfloat16")
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

    def owned_empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """An uninitialised array in this backend's memory that the caller owns: never a view of
        the arena (whose bytes the next call reuses). Host memory here."""
        return np.empty(shape, dtype)

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


def option_name(value: Any) -> str:
    """A dtype or compute option as its canonical name ("fp16" -> "float16")."""
    if isinstance(value, str):
        name = value.strip().lower()
    else:
        try:
            name = np.dtype(value).name
        except TypeError:
            name = str(value)
    return _ALIASES.get(name, name)


def resolve_dtype(device_kind: str, dtype: Any, compute: Any = None,
                  bfloat16_products: bool = False) -> tuple[np.dtype, str, str]:
    """The `dtype` and `compute` options -> (the activations' dtype, weight format, compute
    name) for a device kind, or a clear error. compute=None: the device's default for that
    format (CPU float32, or bfloat16 for bfloat16 weights where `bfloat16_products`: the CPU
    multiplies bfloat16 itself; CUDA float16, or float32 for float32 weights)."""
    name = _DEFAULT_DTYPE[device_kind] if dtype is None else option_name(dtype)
    if name not in _FORMATS[device_kind]:
        raise ConfigError(f"dtype {dtype!r} is not supported on device '{device_kind}' "
                          f"(supported: {', '.join(_FORMATS[device_kind])})")
    table = _COMPUTE[device_kind]
    if compute is None and device_kind == "cpu":
        mode = "bfloat16" if name == "bfloat16" and bfloat16_products else "float32"
    elif compute is None:
        mode = "float32" if name == "float32" else "float16"
    else:
        mode = option_name(compute)
        if mode not in table:
            raise ConfigError(f"compute {compute!r} is not supported on device '{device_kind}' "
                              f"(supported: {', '.join(table)})")
    formats, refusal = _COMPUTE_FORMATS.get(mode, (None, ""))
    if formats is not None and name not in formats:
        raise ConfigError(refusal.format(name=name))
    return np.dtype(table[mode]), name, mode
