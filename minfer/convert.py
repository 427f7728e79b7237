"""`minfer convert`: rewrite a model folder as safetensors (from pytorch_model.bin, or to another
float dtype), copying config, generation config and tokenizer files alongside.

Reading goes through `checkpoint.Checkpoint` (so a legacy .bin is unpickled without running
code); writing uses the `safetensors` package. Tensors are converted one at a time, but the
writer needs them all in memory at once: fine for the checkpoints this targets.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import Checkpoint
from .errors import ConfigError

COPY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "spiece.model", "vocab.json", "vocab.txt")
_DTYPES = {"float32": np.float32, "float16": np.float16}


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
    tensors = {name: ckpt.read(name, _DTYPES[dtype]) for name in ckpt.names()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
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
