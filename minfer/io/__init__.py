"""Tensor files and model folders: safetensors, torch pickle files, the folder that holds them.

`Checkpoint(folder)` is the entry point (`single_file.SingleFile(path)` for one .safetensors file
without its folder); the readers beneath it validate everything a file claims (sizes, offsets,
dtypes) before allocating, and never run pickle code.
"""

from .checkpoint import Checkpoint, read_json
from .limits import parse_json, read_json_text

__all__ = ["Checkpoint", "read_json", "read_json_text", "parse_json"]
