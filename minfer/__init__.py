"""minfer: framework-free inference for T5 and Transformer-XL over NumPy (and CuPy).

The public surface: `load()`, the model classes and the errors. See README.md for the API and
docs/architecture.md for how a token travels from the CLI to the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .backend import make_backend
from .checkpoint import Checkpoint, read_json
from .errors import ArenaExhausted, CheckpointError, ConfigError, InputError, MinferError
from .models.t5 import T5Config, T5Model

__all__ = ["load", "T5Model", "T5Config", "MinferError", "ConfigError", "CheckpointError",
           "InputError", "ArenaExhausted"]
__version__ = "0.1.0"


def load(model: str | Path, device: str = "cpu", dtype: Any = None, workspace: int | str | None = None,
         **options: Any) -> T5Model:
    """Load a model from a local folder in the Hugging Face layout.

    model: folder with config.json and model.safetensors (or an index and shards).
    device: "cpu" (CUDA arrives with the CuPy backend).
    dtype: compute dtype; float32 on the CPU (bf16/fp16 checkpoints are widened).
    workspace: arena size for activations and caches, e.g. "512MiB" (default 1GiB, paged in
        lazily, so only what a run touches costs memory).
    """
    if options:
        raise ConfigError(f"load(): unknown option {sorted(options)[0]!r}")
    folder = Path(model)
    if not folder.exists():
        raise ConfigError(f"model {str(model)!r}: no such folder")
    ckpt = Checkpoint(folder)
    model_type = ckpt.config.get("model_type", "t5")
    if model_type not in ("t5", "mt5"):
        raise ConfigError(f"{folder / 'config.json'}: model_type {model_type!r} is not supported "
                          "(supported: t5, mt5)")
    from .models import t5
    be = make_backend(device, dtype, workspace)
    return t5.load(ckpt, be, read_json(folder / "generation_config.json"))
