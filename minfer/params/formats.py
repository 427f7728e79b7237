"""Weight formats of the linear slots: how a layer's matrices are stored and multiplied.

A family's weight table marks which matrices are *linear slots* (`spec.Linear`); only those take
a format other than the compute dtype. A format says, for one matrix of shape (in, out), which
arrays it is stored as (`stored`), how a float32 matrix becomes them (`encode`), and what object
the math multiplies by (`wrap`: a plain array, or a `PackedWeight` that `ops.linear` calls).

Formats today: "float32" and "float16" (plain arrays; float16 only on CUDA) and "int8" (weight-only,
symmetric, one float32 scale per output channel, as BMInf and CTranslate2 quantise). An int8
matrix `w` is stored with its scales as `w` + SCALE_SUFFIX, in packed layers and in files alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..arena import align_up
from ..errors import ConfigError

SCALE_SUFFIX = "_scale"       # an int8 matrix `w` travels with its float32 scales `w_scale`
INT8_SCRATCH_BYTES = 1 << 20  # column blocks of int8 matrices are widened here: about an L2 cache


# =====================================================================================================
# int8 quantisation (per output channel)
# =====================================================================================================
def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(in, out) float -> int8 (in, out) and float32 scales (out,): w ~= q * scale.

    Symmetric, one scale per output channel (absmax / 127), round to nearest. A zero channel gets
    scale 1 (its q is all zero anyway)."""
    w = np.asarray(w, dtype=np.float32)
    scale = np.abs(w).max(axis=0) / 127.0
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def dequantize_int8(xp: Any, q: Any, scale: Any, out: Any) -> Any:
    """int8 q * scale into the float buffer `out` of q's shape. `scale` broadcasts: (out,) for
    an (in, out) matrix, (rows, 1) for the (out, in) matrices of a file."""
    # Two simple passes (widen, then scale in place) run several times faster in NumPy than one
    # mixed-type multiply, whose int8 * float32 loop casts element by element.
    out[...] = q
    out *= scale
    return out


# =====================================================================================================
# What the math multiplies by
# =====================================================================================================
class PackedWeight:
    """A linear slot stored in a form `xp.matmul` cannot take directly; `ops.linear` calls its
    `matmul(xp, x, out)` instead. `shape` is the logical (in, out)."""

    shape: tuple[int, int]

    def matmul(self, xp: Any, x: Any, out: Any) -> Any:
        raise NotImplementedError


class Int8Weight(PackedWeight):
    """An int8 (in, out) matrix with float32 per-output-channel scales, multiplied in column
    blocks: each block is widened into a small float scratch that stays in cache and fed to BLAS,
    and the product is scaled per output channel afterwards. Only int8 bytes come from memory,
    and no float copy of the whole matrix is ever written."""

    def __init__(self, q: Any, scale: Any, scratch: Any):
        self.q, self.scale, self.scratch = q, scale, scratch  # scratch: flat float buffer
        self.shape, self.dtype = q.shape, scratch.dtype
        K = q.shape[0]
        self.block = max(1, min(q.shape[1], scratch.size // max(K, 1)))

    def matmul(self, xp: Any, x: Any, out: Any) -> Any:
        """x (M, K) @ self -> out (M, N)."""
        K, N = self.shape
        for j in range(0, N, self.block):
            e = min(N, j + self.block)
            w = self.scratch[:K * (e - j)].reshape(K, e - j)
            w[...] = self.q[:, j:e]                       # widen int8 -> float (cached block)
            xp.matmul(x, w, out=out[:, j:e])
        out *= self.scale
        return out


# =====================================================================================================
# The formats
# =====================================================================================================
@dataclass(frozen=True)
class WeightFormat:
    """How one linear slot (in, out) is stored; the base is a plain array of dtype `name`."""
    name: str

    def array_names(self, name: str) -> tuple[str, ...]:
        """The names of the arrays a matrix `name` is stored as."""
        return (name,)

    def stored(self, name: str, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], Any]]:
        """The arrays a matrix `name` of logical `shape` is stored as: {array name: (shape, dtype)}."""
        return {name: (tuple(shape), np.dtype(self.name))}

    def encode(self, name: str, w: np.ndarray) -> dict[str, np.ndarray]:
        """A float32 (in, out) matrix -> its stored arrays (host)."""
        return {name: w.astype(self.name, copy=False)}

    def wrap(self, name: str, arrays: dict[str, Any], scratch: Any) -> Any:
        """The stored arrays (on the device) -> what `ops.linear` multiplies by."""
        return arrays[name]

    def scratch_bytes(self, shape: tuple[int, int], compute_dtype: Any) -> int:
        """Float scratch a product with this matrix needs (shared by all slots of a model)."""
        return 0


@dataclass(frozen=True)
class Int8Format(WeightFormat):
    name: str = "int8"

    def array_names(self, name):
        return (name, name + SCALE_SUFFIX)

    def stored(self, name, shape):
        return {name: (tuple(shape), np.dtype(np.int8)),
                name + SCALE_SUFFIX: ((shape[1],), np.dtype(np.float32))}

    def encode(self, name, w):
        q, scale = quantize_int8(w)
        return {name: q, name + SCALE_SUFFIX: scale}

    def wrap(self, name, arrays, scratch):
        return Int8Weight(arrays[name], arrays[name + SCALE_SUFFIX], scratch)

    def scratch_bytes(self, shape, compute_dtype):
        return align_up(min(INT8_SCRATCH_BYTES, int(np.prod(shape)) * np.dtype(compute_dtype).itemsize))


FORMATS: dict[str, WeightFormat] = {
    "float32": WeightFormat("float32"),
    "float16": WeightFormat("float16"),
    "int8": Int8Format(),
}


def weight_format(name: str) -> WeightFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"weight format {name!r} is not supported "
                          f"(supported: {', '.join(FORMATS)})") from None
