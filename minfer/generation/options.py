"""Generation options: what can be asked, their checks, and where unset ones come from.

Precedence, lowest first: minfer's defaults, config.json's generation keys, the checkpoint's
generation_config.json, the task's task_specific_params, then the call's arguments. HF's lengths
(`max_length`, `min_length`) count the decoder start token; minfer's count new tokens only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError
from .protocol import DecodingModel

# When neither the call nor the checkpoint says how long to decode. Deliberately long: a silent
# 20-token cut (HF's max_length default) truncates real outputs; eos ends most generations sooner.
DEFAULT_MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class GenerationOptions:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50          # HF's default, used only when sampling
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def validate(self) -> "GenerationOptions":
        def integer(name: str, minimum: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
                raise InputError(f"{name} must be an integer >= {minimum}, got {v!r}")

        def number(name: str, low: float, high: float, low_open: bool = False) -> None:
            v = getattr(self, name)
            ok = (isinstance(v, (int, float, np.floating)) and not isinstance(v, bool)
                  and np.isfinite(v) and (v > low if low_open else v >= low) and v <= high)
            if not ok:
                bound = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high != np.inf else "")
                raise InputError(f"{name} must be a number {bound}, got {v!r}")

        integer("max_new_tokens", 1)
        integer("min_new_tokens", 0)
        integer("top_k", 0)
        integer("no_repeat_ngram_size", 0)
        integer("num_beams", 1)
        integer("num_return_sequences", 1)
        number("temperature", 0.0, np.inf, low_open=True)
        number("top_p", 0.0, 1.0, low_open=True)
        number("repetition_penalty", 0.0, np.inf, low_open=True)
        number("length_penalty", -np.inf, np.inf)
        if self.early_stopping not in (True, False, "never"):
            raise InputError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if self.num_return_sequences > self.num_beams and not self.do_sample:
            raise InputError(f"num_return_sequences ({self.num_return_sequences}) must not exceed "
                             f"num_beams ({self.num_beams}) without sampling")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InputError(f"seed must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InputError(f"stop must be a list of non-empty strings, got {list(self.stop)!r}")
        return self


_OPTION_NAMES = {f.name for f in dataclasses.fields(GenerationOptions)}
# HF names that take a different shape here: lengths counted with the decoder start token.
_LENGTH_KEYS = {"max_length": "max_new_tokens", "min_length": "min_new_tokens"}


def _from_hf(params: dict | None, prompt_len: int = 1) -> dict:
    """Generation settings of an HF config dict in minfer's terms (only keys we know)."""
    out: dict[str, Any] = {}
    for key, value in (params or {}).items():
        if key in _LENGTH_KEYS and isinstance(value, int):
            out[_LENGTH_KEYS[key]] = max(value - prompt_len, 0 if key == "min_length" else 1)
        elif key in _OPTION_NAMES and key not in ("stop", "seed") and value is not None:
            out[key] = value
    if "max_new_tokens" in (params or {}) and params["max_new_tokens"] is not None:
        out["max_new_tokens"] = params["max_new_tokens"]
    if "min_new_tokens" in (params or {}) and params["min_new_tokens"] is not None:
        out["min_new_tokens"] = params["min_new_tokens"]
    return out


def resolve_options(model: DecodingModel, task: str | None = None, **overrides: Any) -> tuple[GenerationOptions, str]:
    """Options from (lowest first) minfer's defaults, config.json's generation keys, the checkpoint's
    generation_config.json, the task's task_specific_params, then explicit arguments (None = unset).
    Returns the options and the task's prompt prefix."""
    unknown = sorted(set(overrides) - _OPTION_NAMES)
    if unknown:
        raise InputError(f"unknown generation option {unknown[0]!r}")
    raw_config = model.hf_config
    settings: dict[str, Any] = {}
    settings.update(_from_hf({k: v for k, v in raw_config.items()
                              if k in _OPTION_NAMES or k in _LENGTH_KEYS}))
    generation_config = dict(model.generation_config or {})
    if generation_config.get("max_length") == 20 and "max_new_tokens" not in generation_config:
        generation_config.pop("max_length")  # HF's default cap copied into old files: not a choice
    settings.update(_from_hf(generation_config))
    prefix = ""
    if task is not None:
        tasks = raw_config.get("task_specific_params") or {}
        if task not in tasks:
            known = ", ".join(sorted(tasks)) or "none"
            raise InputError(f"task {task!r} is not defined by this checkpoint (known: {known})")
        params = dict(tasks[task])
        prefix = str(params.pop("prefix", "") or "")
        settings.update(_from_hf(params))
    settings.update({k: v for k, v in overrides.items() if v is not None})
    if isinstance(settings.get("stop"), str):
        settings["stop"] = (settings["stop"],)
    settings["stop"] = tuple(settings.get("stop", ()))
    if settings.get("min_new_tokens", 0) > settings.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS):
        if "min_new_tokens" not in overrides or overrides.get("min_new_tokens") is None:
            settings["min_new_tokens"] = settings.get("max_new_tokens")  # a task minimum vs user max
    options = GenerationOptions(**settings).validate()
    if options.min_new_tokens > options.max_new_tokens:
        raise InputError(f"min_new_tokens ({options.min_new_tokens}) exceeds max_new_tokens "
                         f"({options.max_new_tokens})")
    return options, prefix
