"""`minfer convert`: rewrite a model folder as safetensors (from pytorch_model.bin, to another
float dtype, or with int8 layer matrices), copying config, generation config and tokenizer files
alongside. An int8 file stores each quantised matrix `W` as I8 (out, in) beside `W_scale` (F32,
one scale per output row); `Checkpoint.read` dequantises it, so every loader reads it. For T5 the
RMS norm weights are folded into the matrices they feed before quantising (and stored as ones),
as the loader would fold them.

Reading goes through `checkpoint.Checkpoint` (so a legacy .bin is unpickled without running
code); writing uses the `safetensors` package. Tensors are converted one at a time, but the
writer needs them all in memory at once: fine for the checkpoints this targets.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import SCALE_NAME_SUFFIX, Checkpoint
from .errors import ConfigError

COPY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "spiece.model", "vocab.json", "vocab.txt")
_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.float32}


def is_layer_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """The weights `--dtype int8` quantises: 2-D matrices inside the layer stacks (T5's
    `*.block.N.*`, Transformer-XL's `*.layers.N.*`). Embeddings, output heads and position
    biases stay float: they are looked up or shared, and small next to the layers (T5's bias
    table sits inside block 0, hence the explicit exclusion)."""
    return (len(shape) == 2 and name.endswith(".weight") and (".block." in name or ".layers." in name)
            and "relative_attention_bias" not in name)


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF (out, in) float -> int8 (out, in) and float32 per-row scales (out,): one scale per
    output channel, symmetric absmax / 127, round to nearest."""
    from .streaming import quantize_int8
    q, scale = quantize_int8(np.ascontiguousarray(w.T))
    return np.ascontiguousarray(q.T), scale


def t5_norm_folds(ckpt: Checkpoint) -> dict[str, str]:
    """For a T5 checkpoint: every layer matrix fed by an RMS norm -> that norm's weight. An int8
    file stores the matrices with the norms folded in (and the norms as ones): the model is the
    same function, and loading it re-quantises exactly the stored int8 instead of rounding a
    second time after its own folding. Transformer-XL folds nothing."""
    if ckpt.config.get("model_type", "t5") not in ("t5", "mt5"):
        return {}
    from .models.t5 import T5Config, all_folded_norms
    return all_folded_norms(T5Config.from_hf(ckpt.config, str(ckpt.folder / "config.json")))


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
    folds = t5_norm_folds(ckpt) if dtype == "int8" else {}
    folded_norm_names = set(folds.values())
    tensors = {}
    for name in ckpt.names():
        w = ckpt.read(name, _DTYPES[dtype])
        if name in folds:
            w = w * ckpt.read(folds[name], np.float32)[None, :]  # (out, in) * g over `in`
        if dtype == "int8" and is_layer_matrix(name, w.shape):
            tensors[name], tensors[name + SCALE_NAME_SUFFIX] = quantize_rows(w)
        elif name in folded_norm_names:
            tensors[name] = np.ones_like(w)  # folded into the matrices it feeds
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
