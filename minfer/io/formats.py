"""Weight formats of the linear slots: how a matrix is stored, encoded and decoded (the format
table and its codecs, below every layer that multiplies: the checkpoint reader dequantises
with them, the loader packs with them, `products.py` multiplies what they store).

A family's weight table marks which matrices are *linear slots* (`params.table.Linear`): every layer
matrix, the output heads and the embedding tables. Only those take a format other than the
compute dtype, and every format stores a slot the same way round: (out, in), one row per output
channel, as Hugging Face stores it and as a dot-product kernel reads it fastest (one contiguous
row per output).

Formats: "float32" and "float16" (on CUDA float16 is also the compute dtype), "bfloat16" (the
top half of a float32, stored as its uint16 bits: NumPy has no bfloat16), "int8" (symmetric, one
float32 scale per output channel, as BMInf and CTranslate2 quantise) and "int4" (symmetric, one
float32 scale per group of `int4_group(in)` input channels, two values a byte: see `quantise_int4`
for the layout) and "int8g32" / "int8g16" (grouped int8: one float32 scale *and offset* per group
of 32 / 16 input channels, value = q * scale + offset: GGUF's block quantisations, which all have
that form, held exactly; see `quantise_grouped_int8`) and "int4g32" / "int4g16" (the same with
unsigned 4-bit codes two a byte, in int4's layout: GGUF's blocks whose codes fit 4 bits; see
`quantise_grouped_int4`). A quantised matrix `w` is stored as `w` plus its scales `w` +
SCALE_SUFFIX, in packed layers and in files.

"float8_e4m3" and "float8_e5m2" keep an fp8 file's own codes (one byte a weight) with a float32
scale per output channel (ComfyUI's scaled fp8: its scale, one per tensor or per row; a plain fp8
file: 1). They only ever hold a file's codes (`from_file`): rounding float weights to fp8 is no
part of minfer, so `encode` refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError

SCALE_SUFFIX = "_scale"         # a quantised matrix `w` travels with its float32 scales `w_scale`
# int4: input channels per scale. 128, as GPTQ and AWQ default to: on weights/tiny-t5-dates 64,
# 128 and 256 keep every held-out output and give the same logit error (within 4%,
# benchmarks/accuracy_modes.py: its weights are near-Gaussian; real checkpoints with outlier channels favour smaller groups), while the compute="int8" products do
# per group 3 vector instructions for each input row and weight row (the offset, a conversion,
# a scaled add) beside one vpdpbusd per 64 columns: 3 per vpdpbusd at 64, 1.5 at 128 (benchmark
# them with benchmarks/bench_step_overhead.py). Inner sizes that are not a multiple of it take
# the largest multiple of 64 that divides them (one group per row when none does).
INT4_GROUP = 128


# =====================================================================================================
# int8 and int4 quantisation and the widening of stored bits
# =====================================================================================================
def quantise_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(out, in) float -> int8 (out, in) and float32 scales (out,): w ~= q * scale[:, None].

    Symmetric, one scale per output channel (absmax / 127), round to nearest. A zero channel gets
    scale 1 (its q is all zero anyway)."""
    w = np.asarray(w, dtype=np.float32)
    scale = np.abs(w).max(axis=1) / 127.0 if w.shape[1] else np.ones(w.shape[0], np.float32)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def int4_group(K: int) -> int:
    """Input channels per scale of an int4 matrix with inner size K (K is even)."""
    g = INT4_GROUP
    while g >= 64:
        if K % g == 0:
            return g
        g //= 2
    return K


def quantise_int4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(out, in) float -> packed int4 (out, in / 2) uint8 and float32 scales (out, in / G).

    Per group of G = `int4_group(in)` input channels: scale d = m / -8 where m is the group's
    value of largest magnitude, q = clip(round(w / d), -8, 7) (so m itself is exact: -8), stored
    as the unsigned nibble q + 8 (llama.cpp's q4_0 uses the same rule). Layout: columns in blocks
    of 64, block b being 32 bytes, byte i holding column 64b + i in its low nibble and column
    64b + 32 + i in its high one (what the kernels unpack with one mask and one shift); a last
    partial block of r columns pairs column i with column i + r / 2. A zero group gets scale 1."""
    w = np.asarray(w, dtype=np.float32)
    N, K = w.shape
    if K % 2:
        raise ConfigError(f"int4 needs an even number of input channels, got a matrix of {K}")
    G = int4_group(K) if K else 2
    groups = w.reshape(N, K // G, G)
    at = np.abs(groups).argmax(axis=2)[..., None]
    scale = (np.take_along_axis(groups, at, axis=2)[..., 0] / -8.0).astype(np.float32)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(groups / scale[..., None]), -8, 7).astype(np.int16).reshape(N, K) + 8
    return pack_nibbles(q), scale


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes (R, K) in 0..15 -> (R, K / 2) uint8 in the int4 layouts' order (`quantise_int4`):
    blocks of 64 columns, byte i of a block holding column i low and 32 + i high; a last
    partial block of r columns pairs column i with i + r / 2."""
    R, K = q.shape
    q = q.astype(np.uint8, copy=False)
    packed = np.empty((R, K // 2), np.uint8)
    full = K // 64 * 64
    blocks = q[:, :full].reshape(R, -1, 2, 32)
    packed[:, :full // 2] = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(R, -1)
    half = (K - full) // 2
    packed[:, full // 2:] = q[:, full:full + half] | (q[:, full + half:] << 4)
    return packed


def quantise_grouped_int8(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(out, in) float -> int8 (out, in) and float32 (out, in / G, 2): per group of G input
    channels its scale d = absmax / 127 and offset 0 (the offsets are there for GGUF's
    asymmetric blocks, whose values the GGUF reader stores directly: io/gguf.py), q =
    round(w / d). A zero group gets scale 1."""
    w = np.asarray(w, dtype=np.float32)
    N, K = w.shape
    groups = w.reshape(N, K // group, group)
    scale = np.abs(groups).max(axis=2) / np.float32(127.0)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(groups / scale[..., None]), -127, 127).astype(np.int8).reshape(N, K)
    params = np.zeros((N, K // group, 2), np.float32)
    params[..., 0] = scale
    return q, params


def quantise_grouped_int4(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(out, in) float -> packed codes (out, in / 2) uint8 and float32 (out, in / G, 2): per
    group of G input channels offset o = its least value and scale d = (greatest - least) / 15,
    q = round((w - o) / d) in 0..15 (so the least value is exact). The format holds GGUF's 4-bit
    blocks as they are (io/gguf.py); this is what `dtype="int4g32"` asks of float weights. A
    constant group gets scale 1."""
    w = np.asarray(w, dtype=np.float32)
    N, K = w.shape
    groups = w.reshape(N, K // group, group)
    low = groups.min(axis=2)
    scale = (groups.max(axis=2) - low) / np.float32(15.0)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint((groups - low[..., None]) / scale[..., None]), 0, 15).reshape(N, K)
    params = np.empty((N, K // group, 2), np.float32)
    params[..., 0], params[..., 1] = scale, low
    return pack_nibbles(q.astype(np.uint8)), params


def _widen_nibbles(src: Any, dst: Any) -> None:
    """Packed rows (R, K / 2) -> their codes 0..15 (R, K) as floats (any array namespace; the
    layout is `pack_nibbles`'): the grouped int4 formats' q, which their offsets shift."""
    R, K = dst.shape
    full = K // 64 * 64
    if full:
        blocks = src[:, :full // 2].reshape(R, -1, 32)
        out = dst[:, :full].reshape(R, -1, 2, 32)
        out[:, :, 0] = blocks & 15
        out[:, :, 1] = blocks >> 4
    half = (K - full) // 2
    if half:
        tail = src[:, full // 2:]
        dst[:, full:full + half] = tail & 15
        dst[:, full + half:] = tail >> 4


def _widen_int4(src: Any, dst: Any) -> None:
    """Packed int4 rows (R, K / 2) -> their values q (R, K) as floats, unscaled (the nibbles
    hold q + 8)."""
    _widen_nibbles(src, dst)
    dst -= 8


def apply_scale(w: Any, scale: Any) -> Any:
    """Rows of widened values w (R, K) times their scales: one per row (R,), or one per group of
    input channels (R, K / G), or per group a scale and an offset (R, K / G, 2): q * scale +
    offset, rounded once as GGUF's own float32 dequantisation rounds it (q * scale is exact)."""
    if scale.ndim == 1:
        w *= scale[:, None]
        return w
    R, groups = scale.shape[:2]
    view = w.reshape(R, groups, -1)
    if scale.ndim == 2:
        view[...] *= scale[:, :, None]
    else:
        view[...] *= scale[:, :, 0:1]
        view[...] += scale[:, :, 1:2]
    return w


def to_bfloat16_bits(w: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(w)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def widen_cast(src: Any, dst: Any) -> None:     # float16 / int8 / float32 -> float
    dst[...] = src


def _widen_bfloat16(src: Any, dst: Any) -> None:  # the bits are the high half of a float32
    bits = dst.view(np.uint32)
    bits[...] = src
    bits <<= 16


# =====================================================================================================
# fp8: the file's codes widened (any array namespace: NumPy, or CuPy on a GPU)
# =====================================================================================================
# Both widen through float16, whose bits hold every fp8 value: E5M2 is the top byte of a float16
# (same exponent bias 15, infinities and NaNs included); E4M3's 7 magnitude bits placed at bit 7
# of a float16 read as the value / 2^8 (bias 15 instead of 7: normals and subnormals alike, as
# float16's subnormal step 2^-24 is E4M3's 2^-9 / 2^8), so one exact multiply by 256 restores it.
# E4M3 has no infinities: S.1111.111 is NaN, which that float16 (1.875 / 2^8 x 256) is not.
def _widen_fp8_e5m2(src: Any, dst: Any) -> None:
    dst[...] = (src.astype(np.uint16) << 8).view(np.float16)


def _widen_fp8_e4m3(src: Any, dst: Any) -> None:
    wide = src.astype(np.uint16)
    dst[...] = (((wide & 0x7F) << 7) | ((wide & 0x80) << 8)).view(np.float16)
    dst *= 256
    dst[(wide & 0x7F) == 0x7F] = np.nan


# =====================================================================================================
# The formats
# =====================================================================================================
@dataclass(frozen=True)
class WeightFormat:
    """How a linear slot (out, in) is stored: as a plain array of `storage` dtype, or quantised
    (`scaled`: with float32 scales per output channel, or per group of input channels when
    `grouped`, with an offset beside each scale when `offsets`; `packed`: two values a byte)."""
    name: str
    storage: Any                               # numpy dtype of the stored array
    file_code: str                             # its safetensors dtype (the matrix's, if scaled)
    scaled: bool = False                       # int8 / int4: scales beside the matrix
    grouped: bool = False                      # int4, grouped int8: scales per group of inputs
    packed: bool = False                       # int4: two values a byte, (out, in / 2)
    group: int = 0                             # grouped int8 / int4: inputs per group (else
                                               # per row, or int4_group(in))
    offsets: bool = False                      # grouped: a (scale, offset) pair per group
    widen: Callable[[Any, Any], None] = widen_cast   # the NumPy widening of its rows
    quantisation: str = ""                     # how a file written in it says so (metadata)
    from_file: bool = False                    # fp8: holds only a file's own codes (no encode)
    # (its compiled kernels: kernels.registry.BY_FORMAT[name])

    def array_names(self, name: str) -> tuple[str, ...]:
        """The names of the arrays a matrix `name` is stored as."""
        return (name, name + SCALE_SUFFIX) if self.scaled else (name,)

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored matrix's shape for a logical (out, in)."""
        return (shape[0], shape[1] // 2) if self.packed else tuple(shape)

    def logical_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """The logical (out, in) of a stored matrix's shape."""
        return (stored[0], stored[1] * 2) if self.packed else tuple(stored)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scales' shape for a logical (out, in) matrix."""
        if self.group:
            return (shape[0], shape[1] // self.group_of(shape[1])) + ((2,) if self.offsets else ())
        return (shape[0], shape[1] // int4_group(shape[1])) if self.grouped else (shape[0],)

    def group_of(self, K: int) -> int:
        """A grouped matrix's input channels per group for inner size K: the format's
        group, or K (one group a row) when K is no multiple of it (a GGUF matrix always is)."""
        return self.group if K % self.group == 0 else K

    def stored(self, name: str, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], Any]]:
        """The arrays a matrix `name` of logical `shape` (out, in) is stored as:
        {array name: (shape, dtype)}."""
        if self.packed and shape[1] % 2:
            raise ConfigError(f"{self.name} needs an even number of input channels: '{name}' "
                              f"has {shape[1]}")
        out = {name: (self.stored_shape(shape), np.dtype(self.storage))}
        if self.scaled:
            out[name + SCALE_SUFFIX] = (self.scale_shape(shape), np.dtype(np.float32))
        return out

    def encode(self, name: str, w: np.ndarray) -> dict[str, np.ndarray]:
        """A float32 (out, in) matrix (or a block of its rows) -> its stored arrays (host)."""
        if self.from_file:
            raise ConfigError(f"weight format {self.name!r} keeps a file's {self.file_code} codes "
                              f"as they are; '{name}' is not stored {self.file_code}")
        if self.scaled:
            grouped = quantise_grouped_int4 if self.packed else quantise_grouped_int8
            q, scale = (grouped(w, self.group_of(w.shape[1])) if self.group
                        else quantise_int4(w) if self.grouped else quantise_int8(w))
            return {name: q, name + SCALE_SUFFIX: scale}
        if self.name == "bfloat16":
            return {name: to_bfloat16_bits(w)}
        return {name: w.astype(self.storage, copy=False)}

    def decode(self, q: np.ndarray, scale: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """A stored quantised matrix (or rows of it) and its scales -> float32 of `shape` (host)."""
        out = np.empty(shape, np.float32)
        self.widen(q, out)
        return apply_scale(out, scale)

    def slot(self, float32: bool, compute_dtype: Any) -> tuple["WeightFormat", np.dtype]:
        """(the format a slot is stored in, the dtype its product computes in): a slot marked
        float32 (`params.table.Linear.float32`) computes in float32 when the compute dtype is half, and
        is stored float32 unless the format is quantised (which widens into float32 instead)."""
        if float32 and np.dtype(compute_dtype).itemsize < 4:
            return (self if self.scaled else FORMATS["float32"]), np.dtype(np.float32)
        return self, np.dtype(compute_dtype)


FORMATS: dict[str, WeightFormat] = {
    "float32": WeightFormat("float32", np.float32, "F32"),
    "float16": WeightFormat("float16", np.float16, "F16"),
    "bfloat16": WeightFormat("bfloat16", np.uint16, "BF16", widen=_widen_bfloat16),
    "int8": WeightFormat("int8", np.int8, "I8", scaled=True,
                         quantisation="int8 per output channel"),
    "int4": WeightFormat("int4", np.uint8, "U8", scaled=True, grouped=True, packed=True,
                         widen=_widen_int4,
                         quantisation=f"int4 per group of {INT4_GROUP} input channels"),
    # GGUF's blocks (io/gguf.py): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K in groups of 32, and
    # Q2_K, Q3_K, Q6_K in groups of 16, are each q * scale + offset with q an integer in
    # [-128, 127]. The file codes are no safetensors dtypes: the GGUF reader presents its
    # quantised tensors under them, so the loader takes their bytes as they are.
    "int8g32": WeightFormat("int8g32", np.int8, "I8G32", scaled=True, grouped=True, group=32,
                            offsets=True, quantisation="int8 per group of 32, with offsets"),
    "int8g16": WeightFormat("int8g16", np.int8, "I8G16", scaled=True, grouped=True, group=16,
                            offsets=True, quantisation="int8 per group of 16, with offsets"),
    # GGUF's blocks whose codes fit 4 bits unsigned: Q4_0 (offset -8d), Q4_1, Q4_K in groups of
    # 32, Q2_K and Q3_K (offset -4 x its scale) in groups of 16; two codes a byte as int4's
    # layout, the codes unsigned (0..15), a float32 scale and offset per group
    "int4g32": WeightFormat("int4g32", np.uint8, "I4G32", scaled=True, grouped=True,
                            packed=True, group=32, offsets=True, widen=_widen_nibbles,
                            quantisation="int4 per group of 32, with offsets"),
    "int4g16": WeightFormat("int4g16", np.uint8, "I4G16", scaled=True, grouped=True,
                            packed=True, group=16, offsets=True, widen=_widen_nibbles,
                            quantisation="int4 per group of 16, with offsets"),
}
# fp8 as the file stores it, with a float32 scale per output channel
FP8_FORMATS = {
    "float8_e4m3": WeightFormat("float8_e4m3", np.uint8, "F8_E4M3", scaled=True,
                                widen=_widen_fp8_e4m3, from_file=True),
    "float8_e5m2": WeightFormat("float8_e5m2", np.uint8, "F8_E5M2", scaled=True,
                                widen=_widen_fp8_e5m2, from_file=True),
}
FORMATS.update(FP8_FORMATS)
FP8_FORMAT_BY_FILE_CODE = {f.file_code: f for f in FP8_FORMATS.values()}
# group size -> its format: int8 (any GGUF block) and int4 (blocks whose codes fit 4 bits)
GROUPED_INT8 = {f.group: f for f in FORMATS.values() if f.group and not f.packed}
GROUPED_INT4 = {f.group: f for f in FORMATS.values() if f.group and f.packed}
# by the matrix's file dtype (what `minfer convert` writes: neither fp8 nor the grouped formats)
QUANTISED_BY_FILE_CODE = {f.file_code: f for f in FORMATS.values()
                          if f.scaled and not f.from_file and not f.group}


def weight_format(name: str) -> WeightFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"weight format {name!r} is not supported "
                          f"(supported: {', '.join(FORMATS)})") from None
