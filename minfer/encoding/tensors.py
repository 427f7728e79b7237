"""Encoder outputs handed to torch without a copy: `return_tensors="pt"` wraps the arrays through
DLPack (torch.from_dlpack), so the tensor and the array share their memory.

On the CPU the states are host float32 arrays (the same copy the encode cache keeps), so the
tensor is a CPU tensor; `.to(device, dtype)` moves it where a pipeline runs (integrations/
diffusers.py). On a CUDA model "pt" (and "cupy": the device array itself) keep the states in
device memory: a CuPy array the caller owns (outside the model's arena, so the next call cannot
overwrite it), which DLPack hands to torch as a tensor on the model's device, never copied through
the host. torch stays optional: asked for without it installed, a one-line InputError says so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InputError

TENSOR_KINDS = ("np", "pt", "cupy")
DEVICE_KINDS = ("pt", "cupy")     # the kinds whose states stay on a GPU model's device


def check_tensors_option(kind: Any, what: str = "encode()", on_gpu: bool = False) -> None:
    """return_tensors is None, "np", "pt" (torch importable) or "cupy" (a model on a CUDA
    device), else a one-line InputError."""
    if kind is None or kind == "np":
        return
    if kind not in DEVICE_KINDS:
        shown = repr(kind)[:40] if isinstance(kind, str) else type(kind).__name__
        raise InputError(f"{what}: return_tensors {shown} is not 'np', 'pt' or 'cupy'")
    if kind == "cupy":
        if not on_gpu:
            raise InputError(f"{what}: return_tensors='cupy' needs a model on a CUDA device "
                             "(this one runs on the CPU: use 'np' or 'pt')")
        return
    try:
        import torch  # noqa: F401
    except ImportError:
        raise InputError(f"{what}: return_tensors='pt' needs torch, which is not installed "
                         "(pip install torch)") from None


def stays_on_device(kind: Any, on_gpu: bool) -> bool:
    """Whether encode's states stay in device memory: a GPU model asked for "pt" or "cupy"."""
    return on_gpu and kind in DEVICE_KINDS


def as_tensors(array: Any, kind: str | None) -> Any:
    """The array itself ("np", "cupy", None), or a torch tensor over the same memory ("pt"): a
    CPU tensor over a host array, a CUDA tensor on the array's device over a device array."""
    if kind != "pt":
        return array
    import torch
    if isinstance(array, np.ndarray):
        array = np.ascontiguousarray(array)
    return torch.from_dlpack(array)
