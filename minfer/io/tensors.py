"""What every tensor file reader shares: dtype codes, a tensor's location, bfloat16 and fp8
widening.

Both readers (`safetensors.py` and `torch_pickle.py`) describe a tensor with a `TensorInfo` and
store it in one of the `STORAGE` dtypes; `checkpoint.py` reads through either without knowing which.

fp8: safetensors' F8_E4M3 (torch's float8_e4m3fn: 4 exponent bits, bias 7, 3 mantissa bits, no
infinities, S.1111.111 is NaN, largest 448) and F8_E5M2 (IEEE-style: 5 exponent bits, bias 15,
2 mantissa bits, infinities and NaNs). Every fp8 value has at most 4 significant bits and an
exponent well inside bfloat16's (and float16's) range, so it is exactly a bfloat16: the 256
codes of each format are tabulated once (`FP8_BFLOAT16`, bfloat16 bits; NaN codes map to NaN,
infinities to infinity) and widening is one table look-up per byte, exact.
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
# fp8 codes, stored as their bytes and widened on read. Apart from STORAGE, whose dtypes name
# their codes one to one (convert.py writes a uint8 array as U8)
FP8_CODES = ("F8_E4M3", "F8_E5M2")
FILE_STORAGE = {**STORAGE, **{code: np.dtype("u1") for code in FP8_CODES}}   # what a file may hold
FLOAT_CODES = ("F64", "F32", "F16", "BF16", *FP8_CODES)


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


# fp8 format -> (exponent bits, mantissa bits, whether it keeps IEEE infinities / NaNs in its top
# exponent (E5M2) or uses only S.1111.111 for NaN and the rest of the top exponent for values
# (E4M3, "fn": finite))
_FP8_LAYOUT = {"F8_E4M3": (4, 3, False), "F8_E5M2": (5, 2, True)}


def _fp8_table(code: str) -> np.ndarray:
    """The bfloat16 bits (uint16) of each of the 256 codes of fp8 format `code`: the value
    computed from its fields in float64 (exact: at most 4 significant bits), then its float32
    bits' top half (exact: the low 16 bits are zero)."""
    e_bits, m_bits, ieee = _FP8_LAYOUT[code]
    bias, top = (1 << (e_bits - 1)) - 1, (1 << e_bits) - 1
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exponent = (codes >> m_bits) & top
    mantissa = (codes & ((1 << m_bits) - 1)).astype(np.float64)
    normal = (1.0 + mantissa / (1 << m_bits)) * np.exp2(exponent - bias)
    subnormal = mantissa / (1 << m_bits) * np.exp2(1 - bias)
    values = sign * np.where(exponent == 0, subnormal, normal)
    if ieee:   # the top exponent: infinity (mantissa 0) or NaN
        values = np.where(exponent == top, np.where(mantissa == 0, sign * np.inf, np.nan), values)
    else:      # only all ones is NaN
        values = np.where((codes & 0x7F) == 0x7F, np.nan, values)
    bits = values.astype(np.float32).view(np.uint32)
    assert not (bits[~np.isnan(values)] & 0xFFFF).any()   # every value is a bfloat16
    out = (bits >> 16).astype(np.uint16)
    out[np.isnan(values)] = 0x7FC0 | (codes[np.isnan(values)] >> 7 << 15).astype(np.uint16)
    return out


FP8_BFLOAT16 = {code: _fp8_table(code) for code in FP8_CODES}


def fp8_to_bfloat16_bits(raw: np.ndarray, code: str) -> np.ndarray:
    """fp8 bytes (uint8) of format `code` -> their exact bfloat16 bits (uint16)."""
    return FP8_BFLOAT16[code][raw]


def fp8_to_float32(raw: np.ndarray, code: str) -> np.ndarray:
    """fp8 bytes (uint8) of format `code` -> float32, exactly."""
    return bf16_to_float32(fp8_to_bfloat16_bits(raw, code))
