"""GGUF's block quantisations: each type's bytes -> the integers q and per group of 16 or 32 values
a float32 scale and offset (value = q * scale + offset, as GGUF's own float32 dequantisation
gives it; see gguf.py's module docstring for each type's rule and why it rounds once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

QK_K = 256                              # values per K-quant super-block


# =====================================================================================================
# Block types: their bytes -> (q, scale, offset)
# =====================================================================================================
def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block, as float32 (n, 1)."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view("<f2").astype(np.float32)


def _split(b: np.ndarray, widths: tuple[int, ...]) -> np.ndarray:
    """Bytes (n, k) -> fields (n, len(widths), k): field i the `widths[i]` bits above the
    previous ones (low bits first)."""
    out, shift = [], 0
    for w in widths:
        out.append((b >> shift) & ((1 << w) - 1))
        shift += w
    return np.stack(out, axis=1)


def _nibbles(b: np.ndarray) -> np.ndarray:       # (n, k) -> (n, 2, k): low nibbles, then high
    return _split(b, (4, 4))


def _bits(b: np.ndarray, width: int) -> np.ndarray:   # (n, k) -> (n, 8 / width, k)
    return _split(b, (width,) * (8 // width))


def _flat(*parts: np.ndarray) -> np.ndarray:
    """Block-wise fields -> one (n, values) array, in the order of their axes."""
    return np.concatenate([p.reshape(p.shape[0], -1) for p in parts], axis=1)


def _no_offset(scale: np.ndarray) -> np.ndarray:
    return np.zeros_like(scale)


def _q8_0(b):     # d (f16), 32 x int8
    d = _half(b, 0)
    return b[:, 2:34].view(np.int8), d, _no_offset(d)


def _q4_0(b):     # d, 16 bytes: value i in the low nibble of byte i, value 16 + i in its high one:
    d = _half(b, 0)   # d * (q - 8), kept as q * d - 8d (exact: both are whole multiples of d)
    return _flat(_nibbles(b[:, 2:18])).astype(np.int8), d, -8 * d


def _q4_1(b):     # d, m, 16 bytes of nibbles as Q4_0's: d * q + m
    return _flat(_nibbles(b[:, 4:20])).astype(np.int8), _half(b, 0), _half(b, 2)


def _five_bits(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Q5's values: Q4_0's nibbles, bit i of the 32-bit `high` (little-endian) the fifth of value i."""
    fifth = _flat(_bits(high, 1).transpose(0, 2, 1))      # byte j bit k -> value 8j + k
    return (_flat(_nibbles(low)) | (fifth << 4)).astype(np.int8)


def _q5_0(b):     # d, 4 bytes of fifth bits, 16 bytes of nibbles: d * (q - 16)
    d = _half(b, 0)
    return _five_bits(b[:, 6:22], b[:, 2:6]) - 16, d, _no_offset(d)


def _q5_1(b):     # d, m, fifth bits, nibbles: d * q + m
    return _five_bits(b[:, 8:24], b[:, 4:8]), _half(b, 0), _half(b, 2)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """2-bit values of a K-quant super-block: 64 bytes in two halves of 32; half h, shift 2s,
    byte i is value 128h + 32s + i."""
    n = qs.shape[0]
    return _flat(_bits(qs.reshape(n * 2, 32), 2).reshape(n, 2, 4, 32))


def _q2_k(b):     # 16 scale bytes (sc low nibble, m high), 64 bytes of 2-bit q, d, dmin
    sc = b[:, 0:16]
    d, dmin = _half(b, 80), _half(b, 82)
    scale = d * (sc & 15).astype(np.float32)
    offset = -(dmin * (sc >> 4).astype(np.float32))
    return _crumbs(b[:, 16:80]).astype(np.int8), scale, offset


def _q3_k(b):     # 32 bytes of high bits, 64 of 2-bit q, 12 of 6-bit scales, d
    n = b.shape[0]
    packed = b[:, 96:108]
    low = _flat(_nibbles(packed[:, 0:8]))                 # scale j < 8: byte j's low nibble
    high = _flat(_bits(packed[:, 8:12], 2))               # scale j: bits 2(j // 4) of byte 8 + j % 4
    sc = (low | (high << 4)).astype(np.int8) - 32
    scale = _half(b, 108) * sc.astype(np.float32)
    # bit k of high-bit byte i belongs to value 32k + i; a clear bit takes 4 off: q - 4 with
    # q = crumb + 4 x bit in 0..7, kept as q * scale - 4 x scale (exact, as Q4_0's)
    hbit = _flat(_bits(b[:, 0:32], 1).reshape(n, 8, 32))
    q = _crumbs(b[:, 32:96]).astype(np.int8) + (hbit.astype(np.int8) << 2)
    return q, scale, -4 * scale


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins. Bytes 0-3 hold scales 0-3 in
    their low 6 bits, 4-7 the mins 0-3; bytes 8-11 hold the low 4 bits of scales 4-7 (low nibble)
    and mins 4-7 (high), whose top 2 bits are the top bits of bytes 0-3 / 4-7."""
    a, m, both = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 63, (both & 15) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([m & 63, (both >> 4) | ((m >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 128 bytes of nibbles: byte 32c + i holds value 64c + i (low) and 64c + 32 + i."""
    n = qs.shape[0]
    return _flat(_nibbles(qs.reshape(n * 4, 32)).reshape(n, 4, 2, 32))


def _q4_k(b):     # d, dmin, 12 bytes of scales / mins, 128 bytes of nibbles: (d sc) q - dmin m
    sc, mn = _k_scales(b[:, 4:16])
    return _k_nibbles(b[:, 16:144]).astype(np.int8), _half(b, 0) * sc, -(_half(b, 2) * mn)


def _q5_k(b):     # as Q4_K, with 32 bytes of fifth bits: bit k of byte i belongs to value 32k + i
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    fifth = _flat(_bits(b[:, 16:48], 1).reshape(n, 8, 32))
    q = (_k_nibbles(b[:, 48:176]) | (fifth << 4)).astype(np.int8)
    return q, _half(b, 0) * sc, -(_half(b, 2) * mn)


def _q6_k(b):     # 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, d
    n = b.shape[0]
    # each half h of 128 values: low nibbles from bytes 64h + 32c + i (shift 4s: value
    # 128h + 32(2s + c) + i), high bits from bytes 32h + i (shift 2k: value 128h + 32k + i)
    low = _nibbles(b[:, 0:128].reshape(n * 2, 64)).reshape(n, 2, 2, 2, 32)
    high = _bits(b[:, 128:192].reshape(n * 2, 32), 2).reshape(n, 2, 4, 32)
    q = (_flat(low) | (_flat(high) << 4)).astype(np.int8) - 32
    scale = _half(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)
    return q, scale, _no_offset(scale)


@dataclass(frozen=True)
class BlockType:
    """A GGUF block quantisation: values per block, bytes per block, values per (scale, offset)
    group, its decoder: blocks (n, nbytes) uint8 -> q (n, values) int8, scale and offset
    (n, values / group) float32, and `nibbles`: whether every q it decodes is in 0..15 (the
    grouped int4 formats hold it; the grouped int8 ones hold every type)."""
    values: int
    nbytes: int
    group: int
    decode: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
    nibbles: bool = False


BLOCK_TYPES = {
    "Q8_0": BlockType(32, 34, 32, _q8_0), "Q4_0": BlockType(32, 18, 32, _q4_0, True),
    "Q4_1": BlockType(32, 20, 32, _q4_1, True), "Q5_0": BlockType(32, 22, 32, _q5_0),
    "Q5_1": BlockType(32, 24, 32, _q5_1), "Q2_K": BlockType(QK_K, 84, 16, _q2_k, True),
    "Q3_K": BlockType(QK_K, 110, 16, _q3_k, True), "Q4_K": BlockType(QK_K, 144, 32, _q4_k, True),
    "Q5_K": BlockType(QK_K, 176, 32, _q5_k), "Q6_K": BlockType(QK_K, 210, 16, _q6_k),
}
FLOAT_TYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
SUPPORTED = (*FLOAT_TYPES, *BLOCK_TYPES)


def decode_rows(kind: str, raw: np.ndarray, K: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows (R, bytes per row) of block type `kind` with K values each -> q (R, K) int8 and
    params (R, K / group, 2) float32 (scale, offset): group the type's own, or a divisor of it
    (each pair repeated)."""
    t = BLOCK_TYPES[kind]
    R = raw.shape[0]
    with np.errstate(invalid="ignore", over="ignore"):   # a NaN or inf d: the reads' checks name it
        q, scale, offset = t.decode(raw.reshape(R * (K // t.values), t.nbytes))
    params = np.empty((R, K // t.group, 2), np.float32)
    params[..., 0] = scale.reshape(R, -1)
    params[..., 1] = offset.reshape(R, -1)
    if group != t.group:
        params = np.repeat(params, t.group // group, axis=1)
    return np.ascontiguousarray(q.reshape(R, K)), params
