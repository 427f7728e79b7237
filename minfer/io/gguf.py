"""One GGUF file of a T5 / UMT5 model, as llama.cpp's convert_hf_to_gguf.py writes it (architecture
`t5encoder` for a T5EncoderModel, `t5` for a whole seq2seq model; city96's T5-XXL and UMT5-XXL
encoder files are these), presented as a checkpoint in Hugging Face's names.

The header (metadata and the tensor table) is parsed by the `gguf` package, llama.cpp's own
reader; every tensor's type, size and place in the file is checked first (`_CheckedReader`), so a
truncated file or an unknown type is a one-line error naming the tensor. Tensor bytes are then
read with file I/O, a tensor or a block of its rows at a time, not through the reader's memory
map (mapped pages would count as the process's memory beside the packed copies, as
checkpoint.py explains).

Names: GGUF's (`token_embd.weight`, `enc.blk.N.attn_q.weight`, `enc.blk.N.attn_rel_b.weight`,
`enc.output_norm.weight`, ...; gguf's tensor_mapping.py holds the correspondence) are presented as
Hugging Face's (`shared.weight`, `encoder.block.N.layer.0.SelfAttention.q.weight`, ...), so the
T5 weight table and `config_from_tensors` apply as they are; messages name the file's own names.
`ffn_up` is `wi_1` in a block with `ffn_gate` (`wi_0`, a gated FF) and `wi` otherwise. The
metadata (`t5encoder.embedding_length`, `.attention.head_count`, `.attention.key_length`,
`.attention.relative_buckets_count`, `.attention.layer_norm_rms_epsilon`, ...) gives the config
fields the shapes cannot (`metadata_config`); the relative attention's maximum distance is not
in the file (llama.cpp fixes it at 128, as every released T5 has it).

Values, exactly as GGUF's own float32 dequantisation gives them: F32, F16 and BF16 as stored;
every supported block type is, per group of 16 or 32 values, an integer q times a float32 scale
plus a float32 offset (Q8_0: d * q; Q4_0: d * (q - 8); Q4_1: d * q + m; Q5_0: d * (q - 16);
Q5_1: d * q + m; Q2_K, Q4_K, Q5_K: (d * sc) * q - dmin * m with 6- or 4-bit sc, m per sub-block;
Q3_K: (d * (sc - 32)) * q; Q6_K: (d * sc) * (q - 32)). d * sc (a float16 times a small integer)
is exact in float32 and so is its product with q, so q * scale + offset rounds once, as the
reference does. The blocks decode into q (int8) and (scale, offset) pairs, with Q4_0's and
Q3_K's q taken unsigned (0..15, 0..7) and their shift in the offset (-8d, -4 x scale: exact, as
both terms are whole multiples of the scale): the grouped int8 weight formats (io/formats.py
"int8g32", "int8g16") hold every type as it is, the grouped int4 ones ("int4g32", "int4g16":
half the bytes) the types whose q fit 4 bits (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K; `present_as`, and
`read_blocks` in a slot's own format: a file may use both, int8 for the slots with a wider type).

The tokenizer: the file's sentencepiece vocabulary (tokenizer.ggml.*: pieces, scores, types,
the normalizer's precompiled charsmap) becomes a tokenizer.json for the `tokenizers` library
(tokenizers/gguf_vocab.py), used when `tokenizer=` names no folder.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from .formats import FORMATS, GROUPED_INT4, GROUPED_INT8, WeightFormat, pack_nibbles
from .gguf_blocks import BLOCK_TYPES, FLOAT_TYPES, SUPPORTED, decode_rows
from .limits import MAX_TENSORS, is_integer, is_regular_file, quoted, shown
from .single_file import SingleFileChecks
from .tensors import TensorInfo, bf16_to_float32

MAGIC = b"GGUF"
ARCHITECTURES = ("t5encoder", "t5")     # general.architecture values this reader takes
MAX_METADATA_KEYS = 1 << 16             # real files hold ~40
# the vocabulary's arrays (gguf_vocab.py makes the tokenizer of them): read whole when at most
# MAX_VOCABULARY entries (mT5 / UMT5: 256,384 tokens; T5's precompiled_charsmap: 237,561 bytes)
VOCABULARY_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                     "tokenizer.ggml.token_type", "tokenizer.ggml.precompiled_charsmap")
MAX_VOCABULARY = 1 << 21


# =====================================================================================================
# Names
# =====================================================================================================
_TOP_NAMES = {"token_embd": "shared", "output": "lm_head",
              "enc.output_norm": "encoder.final_layer_norm",
              "dec.output_norm": "decoder.final_layer_norm"}
_STACKS = {"enc": "encoder", "dec": "decoder"}
# a block's GGUF name -> its Hugging Face name inside the block ({ff}: the FF sublayer, 1 in the
# encoder, 2 in the decoder; ffn_up: wi_1 beside ffn_gate, else wi)
_BLOCK_NAMES = {
    "attn_norm": "layer.0.layer_norm", "attn_q": "layer.0.SelfAttention.q",
    "attn_k": "layer.0.SelfAttention.k", "attn_v": "layer.0.SelfAttention.v",
    "attn_o": "layer.0.SelfAttention.o",
    "attn_rel_b": "layer.0.SelfAttention.relative_attention_bias",
    "cross_attn_norm": "layer.1.layer_norm", "cross_attn_q": "layer.1.EncDecAttention.q",
    "cross_attn_k": "layer.1.EncDecAttention.k", "cross_attn_v": "layer.1.EncDecAttention.v",
    "cross_attn_o": "layer.1.EncDecAttention.o",
    "cross_attn_rel_b": "layer.1.EncDecAttention.relative_attention_bias",
    "ffn_norm": "layer.{ff}.layer_norm", "ffn_gate": "layer.{ff}.DenseReluDense.wi_0",
    "ffn_up": "layer.{ff}.DenseReluDense.wi_1", "ffn_down": "layer.{ff}.DenseReluDense.wo",
}
_CROSS = {p for p in _BLOCK_NAMES if p.startswith("cross_")}   # decoder blocks' only
_GGUF_BLOCK = re.compile(r"(enc|dec)\.blk\.(\d+)\.(\w+)\.weight")
_HF_BLOCK = re.compile(r"(encoder|decoder)\.block\.(\d+)\.(.+)\.weight")


def _ff(stack: str) -> str:
    return "1" if stack in ("enc", "encoder") else "2"


def hf_name(name: str, gated: bool) -> str | None:
    """A GGUF tensor name -> its Hugging Face name (None: no T5 tensor); `gated`: the block has
    an ffn_gate."""
    if name.endswith(".weight") and name[:-len(".weight")] in _TOP_NAMES:
        return _TOP_NAMES[name[:-len(".weight")]] + ".weight"
    m = _GGUF_BLOCK.fullmatch(name)
    if m is None or m.group(3) not in _BLOCK_NAMES or (m.group(1) == "enc" and m.group(3) in _CROSS):
        return None
    stack, i, part = m.groups()
    inner = _BLOCK_NAMES[part].format(ff=_ff(stack))
    if part == "ffn_up" and not gated:
        inner = inner[:-len("_1")]
    return f"{_STACKS[stack]}.block.{int(i)}.{inner}.weight"


_HF_TOP = {hf + ".weight": gguf + ".weight" for gguf, hf in _TOP_NAMES.items()}


def gguf_name(name: str) -> str:
    """A Hugging Face T5 tensor name -> the name GGUF gives it (the name itself when none)."""
    if name in _HF_TOP:
        return _HF_TOP[name]
    m = _HF_BLOCK.fullmatch(name)
    if m is None:
        return name
    stack, i, inner = m.groups()
    if inner.endswith("DenseReluDense.wi"):     # an ungated FF's input is ffn_up too
        inner += "_1"
    short = "enc" if stack == "encoder" else "dec"
    for part, hf in _BLOCK_NAMES.items():
        if hf.format(ff=_ff(stack)) == inner and not (short == "enc" and part in _CROSS):
            return f"{short}.blk.{i}.{part}.weight"
    return name


# =====================================================================================================
# The header
# =====================================================================================================
def is_gguf(path: Path) -> bool:
    """Whether the file starts with GGUF's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def _gguf_package():
    try:
        import gguf
    except ImportError:
        raise CheckpointError("reading a GGUF file needs the gguf package (llama.cpp's reader): "
                              "pip install 'minfer[gguf]'") from None
    return gguf


@dataclass(frozen=True)
class _Tensor:
    """A tensor of the file: its GGUF name and type, its shape as NumPy orders it (GGUF lists
    the dimensions the other way round: (out, in) for a matrix, as Hugging Face stores it), and
    its bytes' place."""
    name: str
    kind: str
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def rows(self) -> int:
        """Rows as reads take them: the first axis of a matrix (or more), one for a vector."""
        return self.shape[0] if len(self.shape) > 1 else 1

    @property
    def row_values(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else math.prod(self.shape)


def _read_header(path: Path) -> tuple[dict[str, Any], list[_Tensor]]:
    """The metadata (key -> Python value; arrays of more than 16 values skipped: the tokenizer's)
    and the tensor table of a GGUF file, every tensor checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (it does not start with {MAGIC!r})")
    version = int.from_bytes(head[4:8], "little")
    if version & 0xFFFF == 0 and version:     # (how gguf's reader tells the other byte order)
        raise CheckpointError(f"{path}: a big-endian GGUF file; minfer reads little-endian ones")
    if version not in (2, 3):
        raise CheckpointError(f"{path}: GGUF version {version}; minfer reads versions 2 and 3")
    tensors, keys = int.from_bytes(head[8:16], "little"), int.from_bytes(head[16:24], "little")
    if tensors > MAX_TENSORS or keys > MAX_METADATA_KEYS:
        raise CheckpointError(f"{path}: GGUF header claims {tensors} tensors and {keys} metadata "
                              f"keys (at most {MAX_TENSORS} and {MAX_METADATA_KEYS}): corrupt?")
    gguf = _gguf_package()
    table: list[_Tensor] = []

    class _CheckedReader(gguf.GGUFReader):
        """gguf's reader, with each tensor's type and extent checked before the reader builds
        its view (which fails on a short file without naming the tensor)."""

        def _build_tensors(self, start_offs, fields):
            for field in fields:   # (name length, name, rank, dims, type, offset): GGUF's order
                _, name, _, dims, raw_type, offset = field.parts
                table.append(_tensor_entry(path, size, bytes(name).decode("utf-8", "replace"),
                                           [int(d) for d in dims], int(raw_type[0]),
                                           int(start_offs) + int(offset[0]), gguf))
            return super()._build_tensors(start_offs, fields)

    try:
        reader = _CheckedReader(path)
    except CheckpointError:
        raise
    except Exception as e:   # gguf's own errors: ValueError, KeyError, IndexError, ...
        raise CheckpointError(f"{path}: not a GGUF file gguf {_version(gguf)} can read: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    metadata = {key: _field_value(field, key in VOCABULARY_ARRAYS)
                for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    del reader       # (and its memory map: nothing keeps a view of it)
    return metadata, table


def _version(gguf: Any) -> str:
    try:
        from importlib.metadata import version
        return version("gguf")
    except Exception:
        return "(version unknown)"


def _tensor_entry(path: Path, size: int, name: str, dims: list[int], raw_type: int, start: int,
                  gguf: Any) -> _Tensor:
    what = f"{path}: tensor '{quoted(name)}'"
    try:
        kind = gguf.GGMLQuantizationType(raw_type).name
    except ValueError:
        raise CheckpointError(f"{what} has GGML type {raw_type}, which gguf {_version(gguf)} does "
                              f"not know (supported: {', '.join(SUPPORTED)})") from None
    if kind not in SUPPORTED:
        raise CheckpointError(f"{what} is {kind}: that quantisation is not supported (supported: "
                              f"{', '.join(SUPPORTED)})")
    shape = tuple(reversed(dims))
    values = math.prod(shape)
    t = BLOCK_TYPES.get(kind)
    if len(shape) > 2 or any(d < 1 for d in shape):
        raise CheckpointError(f"{what} has shape {list(shape)}: no T5 tensor has it")
    if t is not None and (len(shape) == 0 or shape[-1] % t.values):
        raise CheckpointError(f"{what} is {kind} with rows of {shape[-1] if shape else 0} "
                              f"values, not whole blocks of {t.values}")
    nbytes = values // t.values * t.nbytes if t else values * FLOAT_TYPES[kind].itemsize
    if start + nbytes > size:
        raise CheckpointError(f"{what} ends at byte {start + nbytes}, past the end of the file "
                              f"({size} bytes): the file is truncated")
    return _Tensor(name, kind, shape, start, nbytes)


def _field_value(field: Any, vocabulary: bool = False) -> Any:
    """A metadata field's value: a Python scalar or string (arrays: a list when short, or when
    one of the vocabulary's (VOCABULARY_ARRAYS) of at most MAX_VOCABULARY entries; else None)."""
    types = [int(t) for t in field.types]
    if not types:
        return None
    STRING, ARRAY = 8, 9                # GGUFValueType's codes
    if types[0] == ARRAY:
        if len(field.data) > (MAX_VOCABULARY if vocabulary else 16):
            return None
        return [(bytes(field.parts[i]).decode("utf-8", "replace") if types[-1] == STRING
                 else field.parts[i].tolist()[0]) for i in field.data]
    part = field.parts[field.data[0]]
    if types[0] == STRING:
        return bytes(part).decode("utf-8", "replace")
    return part.tolist()[0]


def _holds(fmt: WeightFormat, kind: str) -> bool:
    """Whether the grouped format `fmt` holds GGUF type `kind`'s blocks as they are: a block type
    whose group fmt's divides, whose q fit 4 bits unsigned if fmt is a grouped int4."""
    t = BLOCK_TYPES.get(kind)
    return (bool(fmt.group) and t is not None and t.group % fmt.group == 0
            and (t.nibbles or not fmt.packed))


# =====================================================================================================
# The checkpoint
# =====================================================================================================
# Hugging Face config field -> the metadata key it is read from ("{arch}." before it), and
# whether it may be 0 (token ids)
_CONFIG_KEYS = {
    "d_model": ("embedding_length", False), "d_ff": ("feed_forward_length", False),
    "num_layers": ("block_count", False), "num_decoder_layers": ("decoder_block_count", False),
    "num_heads": ("attention.head_count", False), "d_kv": ("attention.key_length", False),
    "relative_attention_num_buckets": ("attention.relative_buckets_count", False),
    "decoder_start_token_id": ("decoder_start_token_id", True),
}
_EPSILON_KEYS = ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon")
_TOKEN_KEYS = {"eos_token_id": "tokenizer.ggml.eos_token_id",
               "pad_token_id": "tokenizer.ggml.padding_token_id"}


class GGUFFile(SingleFileChecks):
    """A T5 / UMT5 model in one GGUF file, read like a `Checkpoint` under Hugging Face's names.
    `config` is set by the caller (`config_from_tensors` over `shapes()`, updated with
    `metadata_config()`, or `use_config`)."""

    inferred_from = "its GGUF metadata and tensors"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.folder = self.path.parent
        if not is_regular_file(self.path, CheckpointError):
            raise CheckpointError(f"{self.path}: file is missing")
        self.config: dict = {}
        self.config_source = str(self.path)
        self.index = None
        self.use_mmap = False             # (Checkpoint's switch: reads here are file I/O)
        self.check_values = True
        self.metadata, table = _read_header(self.path)
        self.architecture = self.metadata.get("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise CheckpointError(f"{self.path}: a GGUF file of architecture "
                                  f"{shown(self.architecture)}; minfer reads T5 / UMT5 models "
                                  f"(architecture {' or '.join(map(repr, ARCHITECTURES))})")
        present = {t.name for t in table}
        self._tensors: dict[str, _Tensor] = {}
        for t in table:
            m = _GGUF_BLOCK.fullmatch(t.name)
            gated = m is not None and f"{m.group(1)}.blk.{m.group(2)}.ffn_gate.weight" in present
            name = hf_name(t.name, gated) or t.name
            if name in self._tensors:     # (blk.1 and blk.01: one block twice)
                raise CheckpointError(f"{self.path}: tensors '{quoted(self._tensors[name].name)}' "
                                      f"and '{quoted(t.name)}' are the same tensor ({name})")
            self._tensors[name] = t
        self._presented: Any = None      # the grouped format the blocks are read in
        self._read_as: dict[str, Any] = {}   # tensor -> the grouped format read_blocks gave it
        self.present_as(self.exact_format())

    # -- what the file holds ----------------------------------------------------------------------
    def file_name(self, name: str) -> str:
        t = self._tensors.get(name)
        return t.name if t is not None else gguf_name(name)

    def in_file_names(self, message: str) -> str:
        """A message naming tensors in Hugging Face's words ('encoder.block.0....weight') with
        the file's own names instead (config_from_tensors speaks Hugging Face's)."""
        return re.sub(r"'([\w.]+\.weight)'", lambda m: f"'{self.file_name(m.group(1))}'", message)

    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def holds_fp8(self) -> bool:
        return False

    def quantised_format(self) -> str | None:
        return self._presented.name if self._presented is not None else None

    def info(self, name: str) -> TensorInfo:
        """The tensor's shape and what it reads as: its float type, or for a block type the
        grouped format it is presented in (`present_as`), else F32 (its float32 values)."""
        t = self._tensors[name]
        held = self._held(t)
        code = t.kind if t.kind in FLOAT_TYPES else held.file_code if held else "F32"
        return TensorInfo(name, code, t.shape, self.path, t.start, t.start + t.nbytes)

    def _held(self, t: _Tensor) -> Any:
        """The grouped format a block-typed tensor is presented in (None: its values)."""
        fmt = self._presented
        return fmt if fmt is not None and _holds(fmt, t.kind) else None

    def metadata_config(self) -> dict[str, Any]:
        """The Hugging Face config fields the metadata states (checked: positive integers, a
        positive epsilon); what the shapes say is `config_from_tensors`'."""
        arch = self.architecture
        out: dict[str, Any] = {}
        for field, (key, zero) in _CONFIG_KEYS.items():
            value = self.metadata.get(f"{arch}.{key}")
            if value is not None:
                out[field] = self._integer(f"{arch}.{key}", value, zero)
        for field, key in _TOKEN_KEYS.items():
            if self.metadata.get(key) is not None:
                out[field] = self._integer(key, self.metadata[key], True)
        for key in _EPSILON_KEYS:
            value = self.metadata.get(f"{arch}.{key}")
            if value is None:
                continue
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not math.isfinite(value) or not 0 < value < 1):
                raise CheckpointError(f"{self.path}: metadata '{arch}.{key}' is {shown(value)}, "
                                      "expected an epsilon in (0, 1)")
            out["layer_norm_epsilon"] = float(value)
            break
        return out

    def _integer(self, key: str, value: Any, zero: bool) -> int:
        if not is_integer(value) or value < (0 if zero else 1) or value > 2**31 - 1:
            raise CheckpointError(f"{self.path}: metadata '{key}' is {shown(value)}, expected "
                                  f"a{' non-negative' if zero else ' positive'} integer")
        return int(value)

    # -- the weight format ------------------------------------------------------------------------
    def _matrix_kinds(self, matrices: Any) -> set[str]:
        return {t.kind for n, t in self._tensors.items()
                if (len(t.shape) == 2 if matrices is None else n in matrices)}

    def exact_format(self, device_kind: str = "cpu", matrices: Any = None) -> str:
        """The weight format of a file's matrices: on the CPU, when any is of a block type, the
        grouped int4 of the finest group its 4-bit types use (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K), or
        with none the grouped int8 of the finest group; a slot with a source that format does
        not hold (a Q6_K v fused with Q4_K q and k in llama.cpp's Q4_K_M, an F16 embedding)
        keeps an exact format of its own (`keeps`, `slot_format`: params.loader.slot_formats);
        else `widened_format`."""
        blocks = {BLOCK_TYPES[k] for k in self._matrix_kinds(matrices) if k in BLOCK_TYPES}
        if blocks and device_kind == "cpu":
            four = [t.group for t in blocks if t.nibbles]
            if four:
                return GROUPED_INT4[min(four)].name
            return GROUPED_INT8[min(t.group for t in blocks)].name
        return self.widened_format(device_kind, matrices)

    def slot_format(self, device_kind: str = "cpu", matrices: Any = None) -> str:
        """The most compact format that holds every one of `matrices` (a slot's sources)
        exactly: on the CPU, when all are of block types, the grouped int4 (every type's q fit 4
        bits) or int8 of their finest group; else `widened_format`."""
        kinds = self._matrix_kinds(matrices)
        if kinds and device_kind == "cpu" and kinds <= set(BLOCK_TYPES):
            blocks = [BLOCK_TYPES[k] for k in kinds]
            grouped = GROUPED_INT4 if all(t.nibbles for t in blocks) else GROUPED_INT8
            return grouped[min(t.group for t in blocks)].name
        return self.widened_format(device_kind, matrices)

    def widened_format(self, device_kind: str = "cpu", matrices: Any = None) -> str:
        """The most compact float format that holds every one of `matrices` exactly: float16
        or (CPU) bfloat16 when all are stored so, else float32 (blocks included: on CUDA, whose
        products have no grouped int8 form)."""
        kinds = self._matrix_kinds(matrices)
        if kinds == {"F16"}:
            return "float16"
        return "bfloat16" if kinds == {"BF16"} and device_kind == "cpu" else "float32"

    def keeps(self, name: str, fmt: Any) -> bool:
        """Whether tensor `name` is stored in a form the weight format `fmt` holds as it is: a
        block type whose groups the grouped `fmt` divides (and whose q fit 4 bits for int4)."""
        t = self._tensors.get(name)
        return isinstance(fmt, WeightFormat) and t is not None and _holds(fmt, t.kind)

    def present_as(self, weight_format: str, matrices: Any = None) -> None:
        """Present each block-typed tensor the grouped `weight_format` holds (`keeps`) in it
        (read_stored then gives q and the (scale, offset) pairs), every other one as its float32
        values (from which its slot's format encodes: params.loader.slot_formats gives a slot
        whose sources the format does not all keep an exact float format of its own);
        remembered for storage_note."""
        fmt = FORMATS.get(weight_format)
        self._presented = fmt if fmt is not None and fmt.group else None
        self._weight_format, self._matrices = weight_format, matrices

    def storage_note(self) -> str:
        """What the matrices became, for `minfer info`: per GGUF type, how many and into what."""
        counts: dict[str, int] = {}
        for n, t in self._tensors.items():
            if not (len(t.shape) == 2 if self._matrices is None else n in self._matrices):
                continue
            held = self._read_as.get(n) or self._held(t)
            if held is not None:
                into = f"{held.name} (exact: q x scale + offset per group of {held.group})"
            elif t.kind in BLOCK_TYPES and self._presented is not None:   # its slot: float32
                into = "float32 (exact)"
            elif t.kind in BLOCK_TYPES:
                into = ("float32 (exact)" if self._weight_format == "float32" else
                        f"{self._weight_format} (rounded from its float32 values)")
            elif self._presented is not None:   # a float matrix beside blocks: its own format
                into = self.widened_format("cpu", {n})
            else:
                into = self._weight_format or "float32"
            key = f"{t.kind} -> {into}"
            counts[key] = counts.get(key, 0) + 1
        return f"GGUF {self.architecture}; " + "; ".join(
            f"{key}: {n} matri{'ces' if n != 1 else 'x'}" for key, n in counts.items())

    # -- reads ------------------------------------------------------------------------------------
    def _raw(self, name: str, rows: tuple[int, int] | None) -> tuple[_Tensor, np.ndarray]:
        """The tensor's bytes (rows [a, b) of a matrix) as (rows, bytes per row) uint8."""
        t = self._tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: tensor '{quoted(gguf_name(name))}' is missing")
        a, b = rows if rows is not None else (0, t.rows)
        if not (len(t.shape) >= 1 and 0 <= a <= b <= t.shape[0]):
            raise CheckpointError(f"{self.path}: rows {rows} outside tensor '{quoted(t.name)}' "
                                  f"{list(t.shape)}")
        width = t.nbytes // t.rows
        out = np.empty((b - a, width), np.uint8)
        try:
            with open(self.path, "rb") as f:
                f.seek(t.start + a * width)
                got = f.readinto(memoryview(out).cast("B"))
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read tensor '{quoted(t.name)}': "
                                  f"{e.strerror or e}") from None
        if got != out.nbytes:
            raise CheckpointError(f"{self.path}: tensor '{quoted(t.name)}' is cut short (the "
                                  "file shrank since it was opened?)")
        return t, out

    @staticmethod
    def _shaped(t: _Tensor, rows: tuple[int, int] | None) -> tuple[int, ...]:
        """The shape of rows [a, b) of the tensor (all of it: its shape)."""
        return t.shape if rows is None else (rows[1] - rows[0], *t.shape[1:])

    def read(self, name: str, dtype: Any = np.float32, rows: tuple[int, int] | None = None,
             check: bool | None = None) -> np.ndarray:
        """The tensor (or rows [a, b)) as `dtype`: float types widened, block types decoded to
        their exact float32 values; values checked as Checkpoint.read checks them."""
        from .checkpoint import check_fits, check_weight_values
        t, raw = self._raw(name, rows)
        what = f"{self.path}: tensor '{quoted(t.name)}'"
        if t.kind in BLOCK_TYPES:
            q, params = decode_rows(t.kind, raw, t.row_values, BLOCK_TYPES[t.kind].group)
            values = q.astype(np.float32)
            G = BLOCK_TYPES[t.kind].group
            view = values.reshape(q.shape[0], -1, G)
            view *= params[..., 0:1]
            view += params[..., 1:2]
        else:
            values = raw.view(FLOAT_TYPES[t.kind])
            if t.kind == "BF16":
                values = bf16_to_float32(values)
        values = values.reshape(self._shaped(t, rows))
        if np.dtype(dtype).kind == "f" and np.dtype(dtype).itemsize < values.dtype.itemsize:
            check_fits(values, dtype, what, rows[0] if rows else 0)
        out = np.ascontiguousarray(values, dtype=dtype)
        if self.check_values if check is None else check:
            check_weight_values(out, what, rows[0] if rows else 0)
        return out

    def read_blocks(self, name: str, fmt: WeightFormat, rows: tuple[int, int] | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """A block-typed tensor (or rows) in the grouped format `fmt` that holds it (`keeps`):
        q (int8, or two 4-bit codes a byte for a grouped int4) and its (scale, offset) pairs in
        fmt's groups (remembered for storage_note: what the tensor became)."""
        from .checkpoint import check_weight_values
        t, raw = self._raw(name, rows)
        q, params = decode_rows(t.kind, raw, t.row_values, fmt.group)
        if self.check_values:
            check_weight_values(params, f"{self.path}: tensor '{quoted(t.name)}' (its block "
                                "scales)", rows[0] if rows else 0)
        self._read_as[name] = fmt
        return (pack_nibbles(q) if fmt.packed else q), params

    def read_stored(self, name: str, rows: tuple[int, int] | None = None
                    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The tensor (or rows) as `info(name).dtype` says: a float type as stored (BF16 as its
        uint16 bits), a block type as q (int8, or two 4-bit codes a byte for a grouped int4) and
        its (scale, offset) pairs in the presented format's groups, or (presented as F32) its
        float32 values."""
        from .checkpoint import check_weight_values
        t = self._tensors.get(name)
        if t is not None and t.kind in BLOCK_TYPES and self._held(t) is None:
            return self.read(name, np.float32, rows), None
        if t is not None and t.kind in BLOCK_TYPES:
            return self.read_blocks(name, self._presented, rows)
        t, raw = self._raw(name, rows)
        what = f"{self.path}: tensor '{quoted(t.name)}'"
        check = self.check_values
        values = raw.view(FLOAT_TYPES[t.kind]).reshape(self._shaped(t, rows))
        if check:
            check_weight_values(bf16_to_float32(values) if t.kind == "BF16" else values, what,
                                rows[0] if rows else 0)
        return values, None
