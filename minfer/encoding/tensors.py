"""Encoder outputs handed to torch without a copy: `return_tensors="pt"` wraps the host arrays
through DLPack (torch.from_dlpack), so the tensor and the array share their memory.

torch stays optional: asked for without it installed, a one-line InputError says so. The states
`encode` returns are host float32 arrays (the same copy the encode cache keeps), so the tensor
is a CPU tensor; `.to(device, dtype)` moves it where a pipeline runs (integrations/diffusers.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InputError

TENSOR_KINDS = ("np", "pt")


def check_tensors_option(kind: Any, what: str = "encode()") -> None:
    """return_tensors is None, "np" or "pt" (torch importable), else a one-line InputError."""
    if kind is None or kind == "np":
        return
    if kind != "pt":
        shown = repr(kind)[:40] if isinstance(kind, str) else type(kind).__name__
        raise InputError(f"{what}: return_tensors {shown} is not 'np' or 'pt'")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise InputError(f"{what}: return_tensors='pt' needs torch, which is not installed "
                         "(pip install torch)") from None


def as_tensors(array: np.ndarray, kind: str | None) -> Any:
    """The array itself ("np" / None), or a torch tensor over the same memory ("pt")."""
    if kind != "pt":
        return array
    import torch
    return torch.from_dlpack(np.ascontiguousarray(array))
