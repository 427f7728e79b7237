"""`minfer convert`: rewrite a model folder as safetensors (from pytorch_model.bin, to another
float dtype, or with int8 layer matrices), copying config, generation config and tokenizer files
alongside. An int8 file stores each matrix that feeds a linear slot (the family's weight table
says which: layers, heads, embeddings) as I8 (out, in) beside `W_scale` (F32, one scale per
output channel, i.e. per row); `Checkpoint.read` dequantises it, so every loader reads it, and a
model loaded as int8 takes the stored bytes as they are.

Reading goes through `io.checkpoint.Checkpoint` (so a legacy .bin is unpickled without running
code); writing uses the `safetensors` package. Tensors are converted one at a time, but the
writer needs them all in memory at once: fine for the checkpoints this targets.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError
from .io.checkpoint import Checkpoint
from .models.registry import family_of
from .params.formats import SCALE_SUFFIX, quantize_int8

COPY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "spiece.model", "vocab.json", "vocab.txt")
_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.float32}


def convert(source: str | Path, output: str | Path, dtype: str = "float32") -> dict[str, Any]:
    """Write `output`/model.safetensors (+ copied side files). Returns a summary dict."""
    from safetensors.numpy import save_file
    if dtype not in _DTYPES:
        raise ConfigError(f"convert: dtype {dtype!r} is not supported (supported: {', '.join(_DTYPES)})")
    ckpt = Checkpoint(source)
    out = Path(output)
    if out.resolve() == Path(source).resolve():
        raise ConfigError(f"convert: output folder {out} is the source folder")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"convert: output folder {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    linear: set[str] = set()  # tensors that feed a linear slot: the ones int8 quantises
    if dtype == "int8":
        spec = family_of(ckpt.config, str(ckpt.folder / "config.json")).spec
        config = spec.config.from_hf(ckpt.config, str(ckpt.folder / "config.json"))
        linear = spec.weight_table(config).linear_sources()
    tensors = {}
    for name in ckpt.names():
        w = ckpt.read(name, _DTYPES[dtype])
        if name in linear:
            tensors[name], tensors[name + SCALE_SUFFIX] = quantize_int8(w)
        else:
            tensors[name] = w
    save_file(tensors, str(out / "model.safetensors"),
              metadata={"format": "pt", **({"minfer.quantization": "int8 per output channel"}
                                           if dtype == "int8" else {})})
    copied = []
    for name in COPY_FILES:
        if (ckpt.folder / name).is_file():
            shutil.copy(ckpt.folder / name, out / name)
            copied.append(name)
    vocab_pickles = [n for n in ("vocab.pkl", "vocab.bin") if (ckpt.folder / n).is_file()]
    if vocab_pickles and not (out / "vocab.txt").exists() and not (out / "vocab.json").exists():
        from .tokenizer import load_tokenizer  # a word vocabulary: rewrite it without pickle
        tok = load_tokenizer(ckpt.folder)
        symbols = [tok.id_to_token(i) for i in range(tok.vocab_size)]
        (out / "vocab.txt").write_text("".join(s + "\n" for s in symbols), encoding="utf-8")
        copied.append("vocab.txt (from " + vocab_pickles[0] + ")")
    return {"tensors": len(tensors), "bytes": (out / "model.safetensors").stat().st_size,
            "copied": copied, "output": str(out)}
