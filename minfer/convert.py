"""`minfer convert`: rewrite a model folder as safetensors (from pytorch_model.bin, or in another
weight format: float32, float16, bfloat16, or int8 / int4 matrices), copying config, generation
config and tokenizer files alongside. A quantised file stores each matrix that feeds a linear
slot (the family's weight table says which: layers, heads, embeddings) in its format's arrays
(io/formats.py: int8 as I8 (out, in) beside `W_scale`, F32 one scale per output channel;
int4 as U8 (out, in / 2), two values a byte, beside `W_scale`, F32 (out, in / group)), the other
tensors as float32; `Checkpoint.read` dequantises it, so every loader reads it, and a model
loaded in the file's own format (what `dtype=None` or "auto" picks) takes the stored bytes as
they are.

Reading goes through `io.checkpoint.Checkpoint` (so a legacy .bin is unpickled without running
code, and every tensor's values are checked as read). The safetensors file is written as it goes:
its header is computed first from the source's tensor shapes (the format needs every size up
front), then each tensor is read, converted and appended, so at most one tensor (and its
quantised copy) is in memory at a time and a model larger than RAM converts. Problems with the
output (a read-only folder, a full disk, a parent that is a file) are one-line ConfigErrors naming
the path; what was written before the failure is removed.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CheckpointError, ConfigError
from .io.checkpoint import Checkpoint
from .io.limits import is_regular_file
from .io.tensors import STORAGE
from .models.registry import model_class_of
from .io.formats import FORMATS, SCALE_SUFFIX, to_bfloat16_bits
from .tokenizers.select import PICKLED_VOCABULARIES, TOKENIZER_FILES, load_tokenizer

COPY_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)
# dtype -> the safetensors dtype of every tensor that is not a quantised matrix
# (not the fp8 formats: they keep a file's own codes, and convert rounds nothing to fp8; not the
# grouped int8 ones: they hold a GGUF file's blocks, and no safetensors file carries them)
_CODES = {name: "F32" if f.scaled else f.file_code for name, f in FORMATS.items()
          if not f.from_file and not f.group}
_CODE_OF = {dt: code for code, dt in STORAGE.items()}   # a stored array's dtype -> its code


def _float_data(ckpt: Checkpoint, name: str, code: str) -> np.ndarray:
    """A float tensor in the stored dtype `code` (bfloat16 as its rounded uint16 bits; float16
    read as such, so a value beyond its range is refused naming the tensor, not written as inf)."""
    if code == "BF16":
        return to_bfloat16_bits(ckpt.read(name, np.float32))
    return ckpt.read(name, STORAGE[code])


def _plan(ckpt: Checkpoint, dtype: str, linear: set[str]
          ) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor the output holds, in file order: the
    float tensors first (one dtype: all aligned), then each quantised matrix's F32 scales
    followed by the matrix (the scales stay 4-byte aligned when the matrices' sizes are multiples
    of 4, as in every real model; safetensors allows unaligned data, it only costs a copy on
    read)."""
    fmt = FORMATS[dtype]
    floats, matrices = [], []
    for name in ckpt.names():
        shape = ckpt.info(name).shape
        if name in linear:
            arrays = fmt.stored(name, shape)
            matrices += [(n, _CODE_OF[dt], s) for n, (s, dt) in reversed(arrays.items())]
        else:
            floats.append((name, _CODES[dtype], shape))
    return floats + matrices


def _header(plan: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """The 8-byte length and the JSON header, padded with spaces to a multiple of 8 bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    at = 0
    for name, code, shape in plan:
        size = math.prod(shape) * STORAGE[code].itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [at, at + size]}
        at += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


def convert(source: str | Path, output: str | Path, dtype: str = "float32") -> dict[str, Any]:
    """Write `output`/model.safetensors (+ copied side files). Returns a summary dict."""
    if dtype not in _CODES:
        raise ConfigError(f"convert: dtype {dtype!r} is not supported (supported: {', '.join(_CODES)})")
    ckpt = Checkpoint(source)
    out = Path(output)
    if _resolved(out, "output") == _resolved(Path(source), "model"):
        raise ConfigError(f"convert: output folder {out} is the source folder")
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"convert: output {out} exists and is not an empty folder")
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"convert: cannot create the output folder {out}: "
                          f"{e.strerror or e}") from None
    written: list[Path] = []   # files created so far, the last one being written
    try:
        tensors, copied = _write(ckpt, out, dtype, written)
        size = (out / "model.safetensors").stat().st_size
    except BaseException as e:   # a bad tensor, a full disk, Ctrl-C: leave nothing behind
        for path in written:
            with contextlib.suppress(OSError):   # it may never have been created
                path.unlink()
        if created:
            shutil.rmtree(out, ignore_errors=True)
        if not isinstance(e, OSError):
            raise
        where = e.filename or (written[-1] if written else out)   # ENOSPC, EROFS, EACCES...
        raise ConfigError(f"convert: cannot write {where}: {e.strerror or e}") from None
    return {"tensors": tensors, "bytes": size, "copied": copied, "output": str(out)}


def _resolved(path: Path, what: str) -> Path:
    """The path with its links followed, or a one-line error (a symlink loop is a RuntimeError
    before Python 3.13, an OSError after; a name over the limit an OSError)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else "a symbolic link loop"
        raise ConfigError(f"convert: {what} {path}: {reason}") from None


def _write(ckpt: Checkpoint, out: Path, dtype: str, written: list[Path]) -> tuple[int, list[str]]:
    """Write model.safetensors and the side files; returns the tensor count and the copied."""
    fmt = FORMATS[dtype]
    linear: set[str] = set()  # tensors that feed a linear slot: the ones int8 / int4 quantise
    if fmt.scaled:
        family = model_class_of(ckpt.config, str(ckpt.folder / "config.json")).family
        config = family.config.from_hf(ckpt.config, str(ckpt.folder / "config.json"))
        linear = family.weight_table(config).linear_sources()
    plan = _plan(ckpt, dtype, linear)
    metadata = {"format": "pt", **({"minfer.quantisation": fmt.quantisation}
                                   if fmt.scaled else {})}
    path = out / "model.safetensors"
    written.append(path)
    with open(path, "wb") as f:
        f.write(_header(plan, metadata))
        pending: dict = {}                     # a quantised matrix whose scales were just written
        for name, code, shape in plan:
            if name in pending:
                data = pending.pop(name)
            elif name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in linear:
                base = name[:-len(SCALE_SUFFIX)]
                pending = fmt.encode(base, ckpt.read(base, np.float32))
                data = pending.pop(name)
            else:
                data = _float_data(ckpt, name, code)
            data = np.ascontiguousarray(data, dtype=STORAGE[code])  # little-endian, as declared
            assert data.shape == shape, (name, data.shape, shape)
            f.write(data.reshape(-1).view(np.uint8))
    copied = []
    for name in COPY_FILES:
        if is_regular_file(ckpt.folder / name, CheckpointError):   # a looping one: named
            written.append(out / name)
            shutil.copy(ckpt.folder / name, out / name)
            copied.append(name)
    vocab_pickles = [n for n in PICKLED_VOCABULARIES
                     if is_regular_file(ckpt.folder / n, CheckpointError)]
    if vocab_pickles and not (out / "vocab.txt").exists() and not (out / "vocab.json").exists():
        tok = load_tokenizer(ckpt.folder)
        symbols = [tok.id_to_token(i) for i in range(tok.vocab_size)]
        written.append(out / "vocab.txt")
        (out / "vocab.txt").write_text("".join(s + "\n" for s in symbols), encoding="utf-8")
        copied.append("vocab.txt (from " + vocab_pickles[0] + ")")
    return len(plan), copied
