"""A sentence-transformers folder: which modules turn encoder states into a sentence embedding.

The folder's `modules.json` lists its modules in the order they run, each with a type and a path
inside the folder: a Transformer (the encoder: config.json and weights, in the folder itself when
its path is "" or in a subfolder such as 0_Transformer, with sentence_bert_config.json's
`max_seq_length` and `do_lower_case`), a Pooling (1_Pooling/config.json: which poolings, in
sentence-transformers' order; written in either of its two layouts, see `_pooling`), Dense layers (their config.json's in/out features, bias and
activation; weights `linear.weight` / `linear.bias` in model.safetensors or pytorch_model.bin,
the latter through the restricted unpickler) and Normalize. config_sentence_transformers.json
may name prompts ("query": "query: ") and a default one.

Type names are accepted in the old form (`sentence_transformers.models.Dense`), with the class
repeated (`sentence_transformers.models.Dense.Dense`) and as sentence-transformers 5.4+ writes
them (`sentence_transformers.sentence_transformer.modules.pooling.Pooling`,
`sentence_transformers.base.modules.dense.Dense`: the class is the last part); nothing is imported or executed from a
folder: an activation is one of a fixed list of torch class names, read as text. Every problem is
a one-line CheckpointError naming the file and the field. The math is minfer/embedding.py.

The folder's author chose every path and value read here: a module's path is a relative name that
stays inside the folder (no absolute path, no `..` or link out of it; a NUL, an overlong name or a
link loop is refused in words, not with the OS's raw error); the JSON files are small (bounded in
bytes and nesting before they are parsed), the modules few, the widths and prompts bounded; and a
message quotes what it was given cut short, so that no value makes an error long.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from .checkpoint import Checkpoint, read_json
from .limits import MAX_LENGTH, read_json_text, shown

MODULES_FILE = "modules.json"
MODULE_KINDS = ("Transformer", "Pooling", "Dense", "Normalize")
# sentence-transformers' pooling flags, in the order its Pooling concatenates their outputs
POOLING_MODES = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens",
                 "weightedmean_tokens", "lasttoken")
# sentence-transformers 5.4+ writes the modes as one string, `pooling_mode` (its Pooling's
# POOLING_MODES names; several joined by "+", as its get_pooling_mode_str writes them), and the
# width as `embedding_dimension`; older versions one `pooling_mode_<mode>` flag per mode and
# `word_embedding_dimension`. Short name -> the flag's suffix above.
POOLING_NAMES = {"cls": "cls_token", "max": "max_tokens", "mean": "mean_tokens",
                 "mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "weightedmean": "weightedmean_tokens", "lasttoken": "lasttoken"}
DIMENSION_KEYS = ("word_embedding_dimension", "embedding_dimension")   # old layout, 5.4+
# torch activation classes a Dense layer may name (sentence-transformers writes the full path)
ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity",
               "torch.nn.modules.activation.Tanh": "tanh",
               "torch.nn.modules.activation.ReLU": "relu",
               "torch.nn.modules.activation.GELU": "gelu",
               "torch.nn.modules.activation.Sigmoid": "sigmoid",
               "torch.nn.modules.activation.SiLU": "silu"}
MAX_SEQ_LENGTH = 1 << 20   # a longer max_seq_length is not a real setting
# Bounds on what a folder states (real folders: 2-5 modules, paths like "2_Dense", settings files
# under 4 KiB, prompts under a thousand characters), far above real use, far below any cost.
MAX_MODULES = 64
MAX_PATH_CHARS = 255         # a module folder's relative path (one file name's limit on Linux)
MAX_SETTINGS_BYTES = 1 << 20  # modules.json and every module's JSON settings file
MAX_PROMPT_CHARS = 1 << 14   # one prompt, prepended to every text
LISTED = 8                   # names listed in a message at most


@dataclass(frozen=True)
class Pooling:
    modes: tuple[str, ...]      # of POOLING_MODES, in their order
    dimension: int              # the encoder's d_model, as the file states it
    include_prompt: bool = True  # False: prompt tokens are left out of the pooling
    dimension_key: str = "word_embedding_dimension"   # the key that stated it (messages)

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


def listed(names: Any) -> str:
    """At most LISTED names from a folder, quoted, and how many more there are."""
    names = list(names)
    more = f", ... ({len(names) - LISTED} more)" if len(names) > LISTED else ""
    return ", ".join(shown(n, 40) for n in names[:LISTED]) + more or "none"


def kind_of(type_name: Any, where: str) -> str:
    """'sentence_transformers.models.Dense' (or '...Dense.Dense') -> 'Dense'; anything else is
    refused by name."""
    parts = type_name.split(".") if isinstance(type_name, str) else []
    if len(parts) >= 2 and parts[-1] == parts[-2]:
        parts = parts[:-1]
    if len(parts) < 2 or parts[0] != "sentence_transformers" or parts[-1] not in MODULE_KINDS:
        raise CheckpointError(f"{where}: module type {shown(type_name, 120)} is not one minfer "
                              f"runs (sentence_transformers.models.{', '.join(MODULE_KINDS)})")
    return parts[-1]


def _inside(folder: Path, path: Any, where: str, needed: bool = True) -> Path:
    """A module's folder: a relative path that stays inside `folder`. A module without files of
    its own (Normalize) may lack it: git, and so the hub, keep no empty folder."""
    if not isinstance(path, str):
        raise CheckpointError(f"{where}: 'path' must be a string, got {shown(path)}")
    said = f"{where}: 'path' {shown(path, 120)}"
    if "\x00" in path:
        raise CheckpointError(f"{said} holds a NUL character")
    if len(path) > MAX_PATH_CHARS:
        raise CheckpointError(f"{said} is {len(path)} characters long, more than the "
                              f"{MAX_PATH_CHARS} of a module folder's name")
    if Path(path).is_absolute():
        raise CheckpointError(f"{said} leaves the model folder")
    try:   # the OS's own errors (a link loop, a name too long) carry the whole path
        root = folder.resolve()
        target = (folder / path).resolve()
        inside = target == root or root in target.parents
        is_dir = inside and target.is_dir()
    except (OSError, RuntimeError, ValueError) as e:   # RuntimeError: a link loop (Python < 3.13)
        why = (e.strerror if isinstance(e, OSError) and e.strerror
               else "a loop of symbolic links" if isinstance(e, RuntimeError) else type(e).__name__)
        raise CheckpointError(f"{said} cannot be followed: {why}") from None
    if not inside:
        raise CheckpointError(f"{said} leaves the model folder")
    if needed and not is_dir:
        raise CheckpointError(f"{said} is not a folder in {folder}")
    return target


def _settings(source: Path, required: bool = False) -> dict | None:
    """A JSON object of the folder's (modules' settings, prompts): None when absent and not
    required; too large, not JSON, not an object, or not a plain file: a one-line error."""
    if not source.is_file():
        if source.is_symlink() or source.exists():   # a folder, a broken or looping link
            raise CheckpointError(f"{source}: not a readable file")
        if required:
            raise CheckpointError(f"{source}: file is missing")
        return None
    value, _ = read_json_text(source, CheckpointError, MAX_SETTINGS_BYTES)
    if not isinstance(value, dict):
        raise CheckpointError(f"{source}: expected a JSON object, got {shown(value)}")
    return value


def _is_width(value: Any) -> bool:
    """A feature count a file may state: 1..MAX_LENGTH (the tensors' shapes check the rest)."""
    return _is_count(value) and value <= MAX_LENGTH


def read_sentence_modules(folder: str | Path) -> SentenceModules | None:
    """The folder's sentence-transformers modules, or None when it has no modules.json."""
    folder = Path(folder)
    source = folder / MODULES_FILE
    if not source.is_file():
        if source.is_symlink() or source.exists():   # not a plain T5 folder: say so
            raise CheckpointError(f"{source}: not a readable file")
        return None
    entries, _ = read_json_text(source, CheckpointError, MAX_SETTINGS_BYTES)
    if not isinstance(entries, list) or not entries:
        raise CheckpointError(f"{source}: expected a non-empty JSON list of modules, got "
                              f"{shown(entries)}")
    if len(entries) > MAX_MODULES:
        raise CheckpointError(f"{source}: {len(entries)} modules, more than the {MAX_MODULES} "
                              "minfer reads")
    order = "must be a Transformer, a Pooling, then Dense / Normalize layers"
    kinds: list[tuple[str, Path, str]] = []
    for i, entry in enumerate(entries):
        where = f"{source}: module {i}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: expected an object with 'type' and 'path', got "
                                  f"{shown(entry)}")
        kind = kind_of(entry.get("type"), where)
        if kind not in (("Transformer",) if i == 0 else ("Pooling",) if i == 1
                        else ("Dense", "Normalize")):
            raise CheckpointError(f"{where}: a {kind} module here; modules {order}")
        kinds.append((kind, _inside(folder, entry.get("path", ""), where, kind != "Normalize"),
                      where))
    if len(kinds) < 2:
        raise CheckpointError(f"{source}: only a {kinds[0][0]} module; modules {order}")
    transformer = kinds[0][1]
    settings = _settings(transformer / "sentence_bert_config.json") or {}
    max_len = settings.get("max_seq_length")
    if max_len is None:   # as transformers truncates then: at the tokenizer's model_max_length
        max_len = (read_json(transformer / "tokenizer_config.json") or {}).get("model_max_length")
        max_len = max_len if _is_count(max_len) and max_len <= MAX_SEQ_LENGTH else None
    elif not (_is_count(max_len) and max_len <= MAX_SEQ_LENGTH):
        raise CheckpointError(f"{transformer / 'sentence_bert_config.json'}: 'max_seq_length' must "
                              f"be an integer 1..{MAX_SEQ_LENGTH}, got {shown(max_len)}")
    lower = _flag(settings, "do_lower_case", False, transformer / "sentence_bert_config.json")
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
    """A Pooling module's settings in either layout (see POOLING_NAMES): the width and the
    modes, in sentence-transformers' order of concatenation whichever order a string names
    them. A file that mixes the layouts, states neither width or no mode is refused by name:
    read half-way, it would pool differently from sentence-transformers."""
    source = path / "config.json"
    cfg = _settings(source, required=True)
    given = [key for key in DIMENSION_KEYS if key in cfg]
    if len(given) > 1:
        raise CheckpointError(f"{source}: states both {' and '.join(map(repr, given))}; "
                              "sentence-transformers writes one of them")
    key = given[0] if given else (DIMENSION_KEYS[1] if "pooling_mode" in cfg else DIMENSION_KEYS[0])
    dim = cfg.get(key)
    if not _is_width(dim):
        raise CheckpointError(f"{source}: '{key}' must be a positive integer "
                              f"(at most {MAX_LENGTH}), got {shown(dim)}")
    flags = [f"pooling_mode_{mode}" for mode in POOLING_MODES]
    if "pooling_mode" in cfg:
        mixed = [flag for flag in flags if flag in cfg]
        if mixed:
            raise CheckpointError(f"{source}: states both 'pooling_mode' and '{mixed[0]}'; "
                                  "sentence-transformers writes one layout or the other")
        modes = _named_modes(cfg["pooling_mode"], source)
    else:
        modes = [mode for mode, flag in zip(POOLING_MODES, flags) if _flag(cfg, flag, False, source)]
        if not modes:
            raise CheckpointError(f"{source}: no pooling mode is switched on "
                                  f"('pooling_mode', or pooling_mode_{', pooling_mode_'.join(POOLING_MODES)})")
    return Pooling(tuple(modes), dim, _flag(cfg, "include_prompt", True, source), key)


def _named_modes(value: Any, source: Path) -> list[str]:
    """`pooling_mode` "mean" (or "cls+mean") -> the modes in POOLING_MODES' order."""
    names = value.lower().split("+") if isinstance(value, str) else None
    if not names or any(name not in POOLING_NAMES for name in names) or len(set(names)) < len(names):
        raise CheckpointError(f"{source}: 'pooling_mode' must name sentence-transformers' pooling "
                              f"modes ({', '.join(POOLING_NAMES)}; several joined by '+'), "
                              f"got {shown(value)}")
    wanted = {POOLING_NAMES[name] for name in names}
    return [mode for mode in POOLING_MODES if mode in wanted]


def _flag(settings: dict, key: str, default: bool, source: Path) -> bool:
    """A true / false setting, or a one-line CheckpointError naming the file and the key."""
    value = settings.get(key, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"{source}: '{key}' must be true or false, got {shown(value)}")
    return value


def _dense(path: Path, in_width: int) -> Dense:
    """A Dense layer's config and weights, checked against the width it receives."""
    source = path / "config.json"
    cfg = _settings(source, required=True)   # checked before its weights are opened
    n_in, n_out = cfg.get("in_features"), cfg.get("out_features")
    for key, value in (("in_features", n_in), ("out_features", n_out)):
        if not _is_width(value):
            raise CheckpointError(f"{source}: '{key}' must be a positive integer (at most "
                                  f"{MAX_LENGTH}), got {shown(value)}")
    if n_in != in_width:
        raise CheckpointError(f"{source}: 'in_features' {n_in} does not fit the {in_width} "
                              "features the module before it gives")
    has_bias = cfg.get("bias", True)
    if not isinstance(has_bias, bool):
        raise CheckpointError(f"{source}: 'bias' must be true or false, got {shown(has_bias)}")
    act_name = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
    if not isinstance(act_name, str) or act_name not in ACTIVATIONS:
        raise CheckpointError(f"{source}: 'activation_function' {shown(act_name, 120)} is not one "
                              "of the torch activations minfer runs (torch.nn.modules' "
                              f"{', '.join(a.rsplit('.', 1)[1] for a in ACTIVATIONS)})")
    ckpt = Checkpoint(path)   # its weight file (config.json read again: the checks above held)
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
    cfg = _settings(source) or {}
    prompts = cfg.get("prompts")
    prompts = {} if prompts is None else prompts
    if not isinstance(prompts, dict):
        raise CheckpointError(f"{source}: 'prompts' must map names to prompt strings, got "
                              f"{shown(prompts)}")
    for name, text in prompts.items():
        if not isinstance(text, str):
            raise CheckpointError(f"{source}: 'prompts' must map names to prompt strings: "
                                  f"{shown(name, 40)} maps to {shown(text)}")
        if len(text) > MAX_PROMPT_CHARS:
            raise CheckpointError(f"{source}: prompt {shown(name, 40)} is {len(text)} characters "
                                  f"long, more than the {MAX_PROMPT_CHARS} minfer prepends")
    default = cfg.get("default_prompt_name")
    if default is not None and (not isinstance(default, str) or default not in prompts):
        raise CheckpointError(f"{source}: 'default_prompt_name' {shown(default, 80)} is not one "
                              f"of its prompts ({listed(prompts)})")
    return prompts, default
