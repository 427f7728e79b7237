"""A sentence-transformers folder: which modules turn encoder states into a sentence embedding.

The folder's `modules.json` lists its modules in the order they run, each with a type and a path
inside the folder: a Transformer (the encoder: config.json and weights, in the folder itself when
its path is "" or in a subfolder such as 0_Transformer, with sentence_bert_config.json's
`max_seq_length` and `do_lower_case`), a Pooling (1_Pooling/config.json: which poolings, in
sentence-transformers' order), Dense layers (their config.json's in/out features, bias and
activation; weights `linear.weight` / `linear.bias` in model.safetensors or pytorch_model.bin,
the latter through the restricted unpickler) and Normalize. config_sentence_transformers.json
may name prompts ("query": "query: ") and a default one.

Type names are accepted in the old form (`sentence_transformers.models.Dense`) and with the class
repeated (`sentence_transformers.models.Dense.Dense`); nothing is imported or executed from a
folder: an activation is one of a fixed list of torch class names, read as text. Every problem is
a one-line CheckpointError naming the file and the field. The math is minfer/embedding.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from .checkpoint import Checkpoint, read_json

MODULES_FILE = "modules.json"
MODULE_KINDS = ("Transformer", "Pooling", "Dense", "Normalize")
# sentence-transformers' pooling flags, in the order its Pooling concatenates their outputs
POOLING_MODES = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens",
                 "weightedmean_tokens", "lasttoken")
# torch activation classes a Dense layer may name (sentence-transformers writes the full path)
ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity",
               "torch.nn.modules.activation.Tanh": "tanh",
               "torch.nn.modules.activation.ReLU": "relu",
               "torch.nn.modules.activation.GELU": "gelu",
               "torch.nn.modules.activation.Sigmoid": "sigmoid",
               "torch.nn.modules.activation.SiLU": "silu"}
MAX_SEQ_LENGTH = 1 << 20   # a longer max_seq_length is not a real setting


@dataclass(frozen=True)
class Pooling:
    modes: tuple[str, ...]      # of POOLING_MODES, in their order
    dimension: int              # word_embedding_dimension: the encoder's d_model
    include_prompt: bool = True  # False: prompt tokens are left out of the pooling

    @property
    def out_features(self) -> int:
        return self.dimension * len(self.modes)


@dataclass(frozen=True)
class Dense:
    weight: np.ndarray          # (out, in) float32
    bias: np.ndarray | None     # (out,) float32
    activation: str             # a value of ACTIVATIONS
    path: Path


@dataclass(frozen=True)
class Normalize:
    """L2 normalisation of each embedding."""


@dataclass(frozen=True)
class SentenceModules:
    folder: Path
    transformer: Path                 # the folder holding the encoder's config.json and weights
    max_seq_length: int | None        # tokens kept per text (None: no limit set)
    do_lower_case: bool
    pooling: Pooling
    steps: tuple[Dense | Normalize, ...]   # after pooling, in order
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None

    @property
    def dimension(self) -> int:
        dims = [s.weight.shape[0] for s in self.steps if isinstance(s, Dense)]
        return dims[-1] if dims else self.pooling.out_features

    def describe(self) -> str:
        parts = ["pooling " + "+".join(m.replace("_tokens", "").replace("_token", "")
                                       for m in self.pooling.modes)]
        parts += [f"dense {s.weight.shape[1]}->{s.weight.shape[0]} {s.activation}"
                  if isinstance(s, Dense) else "normalize" for s in self.steps]
        return ", ".join(parts) + f" -> {self.dimension}"


def kind_of(type_name: Any, where: str) -> str:
    """'sentence_transformers.models.Dense' (or '...Dense.Dense') -> 'Dense'; anything else is
    refused by name."""
    parts = type_name.split(".") if isinstance(type_name, str) else []
    if len(parts) >= 2 and parts[-1] == parts[-2]:
        parts = parts[:-1]
    if len(parts) < 2 or parts[0] != "sentence_transformers" or parts[-1] not in MODULE_KINDS:
        raise CheckpointError(f"{where}: module type {type_name!r:.120} is not one minfer runs "
                              f"(sentence_transformers.models.{', '.join(MODULE_KINDS)})")
    return parts[-1]


def _inside(folder: Path, path: Any, where: str, needed: bool = True) -> Path:
    """A module's folder: a relative path that stays inside `folder`. A module without files of
    its own (Normalize) may lack it: git, and so the hub, keep no empty folder."""
    if not isinstance(path, str):
        raise CheckpointError(f"{where}: 'path' must be a string, got {path!r:.80}")
    target = (folder / path).resolve()
    root = folder.resolve()
    if Path(path).is_absolute() or (target != root and root not in target.parents):
        raise CheckpointError(f"{where}: 'path' {path!r:.120} leaves the model folder")
    if needed and not target.is_dir():
        raise CheckpointError(f"{where}: 'path' {path!r:.120} is not a folder in {folder}")
    return target


def read_sentence_modules(folder: str | Path) -> SentenceModules | None:
    """The folder's sentence-transformers modules, or None when it has no modules.json."""
    folder = Path(folder)
    source = folder / MODULES_FILE
    if not source.is_file():
        return None
    from .limits import read_json_text
    entries, _ = read_json_text(source, CheckpointError)
    if not isinstance(entries, list) or not entries:
        raise CheckpointError(f"{source}: expected a non-empty JSON list of modules")
    kinds: list[tuple[str, Path, str]] = []
    for i, entry in enumerate(entries):
        where = f"{source}: module {i}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: expected an object with 'type' and 'path'")
        kind = kind_of(entry.get("type"), where)
        kinds.append((kind, _inside(folder, entry.get("path", ""), where, kind != "Normalize"),
                      where))
    order = [k for k, _, _ in kinds]
    if order[:2] != ["Transformer", "Pooling"] or any(k not in ("Dense", "Normalize") for k in order[2:]):
        raise CheckpointError(f"{source}: modules {order} must be a Transformer, a Pooling, then "
                              "Dense / Normalize layers")
    transformer = kinds[0][1]
    settings = read_json(transformer / "sentence_bert_config.json") or {}
    max_len = settings.get("max_seq_length")
    if max_len is None:   # as transformers truncates then: at the tokenizer's model_max_length
        max_len = (read_json(transformer / "tokenizer_config.json") or {}).get("model_max_length")
        max_len = max_len if _is_count(max_len) and max_len <= MAX_SEQ_LENGTH else None
    elif not (_is_count(max_len) and max_len <= MAX_SEQ_LENGTH):
        raise CheckpointError(f"{transformer / 'sentence_bert_config.json'}: 'max_seq_length' must "
                              f"be an integer 1..{MAX_SEQ_LENGTH}, got {max_len!r:.40}")
    lower = settings.get("do_lower_case", False)
    if not isinstance(lower, bool):
        raise CheckpointError(f"{transformer / 'sentence_bert_config.json'}: 'do_lower_case' "
                              f"must be true or false, got {lower!r:.40}")
    pooling = _pooling(kinds[1][1])
    steps: list[Dense | Normalize] = []
    width = pooling.out_features
    for kind, path, where in kinds[2:]:
        if kind == "Normalize":
            steps.append(Normalize())
            continue
        steps.append(_dense(path, width))
        width = steps[-1].weight.shape[0]
    prompts, default = _prompts(folder / "config_sentence_transformers.json")
    return SentenceModules(folder, transformer, max_len, lower, pooling, tuple(steps), prompts,
                           default)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _pooling(path: Path) -> Pooling:
    source = path / "config.json"
    cfg = read_json(source, required=True)
    dim = cfg.get("word_embedding_dimension")
    if not _is_count(dim):
        raise CheckpointError(f"{source}: 'word_embedding_dimension' must be a positive integer, "
                              f"got {dim!r:.40}")
    modes = []
    for mode in POOLING_MODES:
        flag = cfg.get(f"pooling_mode_{mode}", False)
        if not isinstance(flag, bool):
            raise CheckpointError(f"{source}: 'pooling_mode_{mode}' must be true or false, "
                                  f"got {flag!r:.40}")
        if flag:
            modes.append(mode)
    if not modes:
        raise CheckpointError(f"{source}: no pooling mode is switched on "
                              f"(pooling_mode_{', pooling_mode_'.join(POOLING_MODES)})")
    include = cfg.get("include_prompt", True)
    if not isinstance(include, bool):
        raise CheckpointError(f"{source}: 'include_prompt' must be true or false, got {include!r:.40}")
    return Pooling(tuple(modes), dim, include)


def _dense(path: Path, in_width: int) -> Dense:
    """A Dense layer's config and weights, checked against the width it receives."""
    source = path / "config.json"
    ckpt = Checkpoint(path)   # config.json (the layer's settings) and its weight file
    cfg = ckpt.config
    n_in, n_out = cfg.get("in_features"), cfg.get("out_features")
    for key, value in (("in_features", n_in), ("out_features", n_out)):
        if not _is_count(value):
            raise CheckpointError(f"{source}: '{key}' must be a positive integer, got {value!r:.40}")
    if n_in != in_width:
        raise CheckpointError(f"{source}: 'in_features' {n_in} does not fit the {in_width} "
                              "features the module before it gives")
    has_bias = cfg.get("bias", True)
    if not isinstance(has_bias, bool):
        raise CheckpointError(f"{source}: 'bias' must be true or false, got {has_bias!r:.40}")
    act_name = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
    if act_name not in ACTIVATIONS:
        raise CheckpointError(f"{source}: 'activation_function' {act_name!r:.120} is not one of "
                              f"{', '.join(ACTIVATIONS)}")
    want = {"linear.weight": (n_out, n_in), **({"linear.bias": (n_out,)} if has_bias else {})}
    for name, shape in want.items():
        if name not in ckpt:
            raise CheckpointError(f"{path}: tensor '{name}' is missing")
        info = ckpt.info(name)
        if tuple(info.shape) != shape:
            raise CheckpointError(f"{info.file}: tensor '{name}' has shape {list(info.shape)}, "
                                  f"{source.name} implies {list(shape)}")
    extra = sorted(set(ckpt.names()) - set(want))
    if extra:
        raise CheckpointError(f"{ckpt.info(extra[0]).file}: unexpected tensor '{extra[0]}'")
    return Dense(ckpt.read("linear.weight"), ckpt.read("linear.bias") if has_bias else None,
                 ACTIVATIONS[act_name], path)


def _prompts(source: Path) -> tuple[dict[str, str], str | None]:
    cfg = read_json(source) or {}
    prompts = cfg.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in prompts.items()):
        raise CheckpointError(f"{source}: 'prompts' must map names to prompt strings")
    default = cfg.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise CheckpointError(f"{source}: 'default_prompt_name' {default!r:.80} is not one of "
                              f"its prompts ({', '.join(prompts) or 'none'})")
    return prompts, default
