"""One .safetensors file holding a whole model without its folder: the files diffusion users hold
(ComfyUI's t5xxl_fp16.safetensors, t5xxl_fp8_e4m3fn_scaled.safetensors, umt5_xxl_*: a T5 / UMT5
encoder in Hugging Face's tensor names, no config.json beside it).

`SingleFile` is a `Checkpoint` over that one file: the same reads, fp8 widening and scaled fp8
(checkpoint.py), with no index and no config.json. Its config is given by the caller: inferred
from the tensors (`models.t5.config.config_from_tensors`) or read from `config=` (a config.json or
a folder holding one). `check_names` holds the file's names and shapes against the weight table
that config implies, each problem one line naming the file and the tensor, before anything is
read. `folder` is the file's folder (what lists files and names the model in messages and
`minfer info`); `path` is the file. `SingleFileChecks` (config=, the shapes, the name checks) is
shared with io/gguf.py's reader of GGUF files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError
from .checkpoint import Checkpoint, read_json
from .limits import is_regular_file, quoted, shown

SUFFIX = ".safetensors"
# other single files users hold, which this reader does not parse: say so instead of "not a
# safetensors file"
_OTHER_FORMATS = {".bin": "a torch pickle file", ".pt": "a torch file",
                  ".pth": "a torch file", ".ckpt": "a torch checkpoint", ".sft": None}


def is_single_file(model: Any) -> Path | None:
    """`model` as a path to an existing file (a folder or a hub name: None)."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    text = os.fspath(model)
    if not isinstance(text, str) or not text.strip():
        return None
    path = Path(text).expanduser()
    try:
        return path if path.is_file() else None
    except (OSError, ValueError):   # a name over the file-name limit, a NUL: not a file
        return None


class SingleFileChecks:
    """What the single-file readers share (this one's SingleFile and io/gguf.py's GGUFFile):
    config=, the tensors' shapes, and the names checked against a weight table. The reader
    provides `path`, `names()`, `info(name)`, and `file_name(name)`: a tensor's name as the file
    spells it (messages name that)."""

    path: Path
    inferred_from = "its tensors"        # what an inferred config comes from (minfer info)

    def file_name(self, name: str) -> str:
        return name

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(self.info(name).shape) for name in self.names()}

    def use_config(self, config: Any) -> None:
        """`config=`: a config.json, or a folder holding one, instead of the inferred config."""
        if not isinstance(config, (str, os.PathLike)) or not os.fspath(config).strip():
            raise ConfigError(f"config={shown(config)}: expected the path of a config.json or of "
                              "a folder holding one")
        where = Path(config).expanduser()
        if where.is_dir():
            where = where / "config.json"
        self.config = read_json(where, required=True, error=ConfigError)
        self.config_source = str(where)

    def check_names(self, tensors: dict[str, tuple[int, ...]],
                    optional: dict[str, tuple[int, ...]], aliases: dict[str, tuple[str, ...]],
                    what: str) -> None:
        """Every name and shape of the file against a weight table (its `tensors`, `optional`
        names and `aliases`): a missing tensor, one the model has no place for and a shape the
        config does not imply are one-line errors naming this file and the tensor; `what` says
        where the config came from."""
        named = self.file_name
        present = set(self.names())
        for name in tensors:
            if name not in present and not any(a in present for a in aliases.get(name, ())):
                raise CheckpointError(f"{self.path}: tensor '{quoted(named(name))}' is missing "
                                      f"({what} needs it)")
        unexpected = sorted(present - set(tensors) - set(optional))
        comfy = [n for n in unexpected if n.endswith((".comfy_quant", ".weight_scale"))
                 or n == "_quantization_metadata"]
        if comfy:   # ComfyUI's newer quantised layout: say so rather than "no part of it"
            raise CheckpointError(f"{self.path}: tensor '{quoted(comfy[0])}': ComfyUI's newer "
                                  "quantised layout (comfy_quant / weight_scale) is not supported "
                                  "yet; its scaled_fp8 layout and plain fp8 / F16 / BF16 files are")
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            raise CheckpointError(f"{self.path}: unexpected tensor '{quoted(named(unexpected[0]))}'"
                                  f"{more}: no part of {what}")
        stands_for = {a: n for n, alts in aliases.items() for a in alts}
        for name in sorted(present):
            want = tensors.get(name) or optional.get(name) or tensors.get(stands_for.get(name, ""))
            got = tuple(self.info(name).shape)
            if want is not None and got != tuple(want):
                raise CheckpointError(f"{self.path}: tensor '{quoted(named(name))}' has shape "
                                      f"{list(got)}, {what} implies {list(want)}")


class SingleFile(SingleFileChecks, Checkpoint):
    """A model's weights in one .safetensors file; `config` is set by the caller."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.folder = self.path.parent
        kind = _OTHER_FORMATS.get(self.path.suffix.lower(), "")
        if kind:
            raise CheckpointError(f"{self.path}: {kind}; a single-file model is read from a "
                                  f"{SUFFIX} or .gguf file (or pass the model's folder)")
        if not is_regular_file(self.path, CheckpointError):
            raise CheckpointError(f"{self.path}: file is missing")
        self.index = None
        self.config: dict = {}
        self.config_source = str(self.path)
        self._open([self.path])
