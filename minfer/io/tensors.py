"""What every tensor file reader shares: dtype codes, a tensor's location, bfloat16 widening.

Both readers (`safetensors.py` and `torch_pickle.py`) describe a tensor with a `TensorInfo` and
store it in one of the `STORAGE` dtypes; `checkpoint.py` reads through either without knowing which.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# safetensors dtype code -> the numpy dtype its bytes are stored in
STORAGE = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to float32 on read: bf16 is the top half of an fp32
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
FLOAT_CODES = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str               # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    start: int               # absolute byte offsets in `file`
    end: int


def bf16_to_float32(raw: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 bits (uint16) to float32 exactly: they are the high half of an fp32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)
