"""Generation options: what can be asked, their checks, and where unset ones come from.

Precedence, lowest first: minfer's defaults, config.json's generation keys, the checkpoint's
generation_config.json, the task's task_specific_params, then the call's arguments. HF's lengths
(`max_length`, `min_length`) count the decoder start token; minfer's count new tokens only, so a
call's `max_length=` is refused with a pointer to `max_new_tokens`.

Types are strict (a wrong type is refused, never coerced): integers are ints or NumPy integers
(not bools, not floats), numbers also take floats and NumPy floats, switches are bools (or NumPy
bools). A bad value from a call is an `InputError` naming the option; from the checkpoint's files
a `ConfigError` naming the file and the key. Bounds keep every score finite:
- temperature in (0, 1e3], and not so small that float32 rounds it to 0 (exactly 0 means greedy
  decoding, as OpenAI's API reads it: `_temperature_zero_is_greedy`). Plain sampling divides
  scores shifted to a maximum of 0 (search.token_loop), so any such temperature works: a tiny one
  is greedy decoding. Sampled beam search accumulates scores scaled by 1/temperature, which must
  stay far above its -1e9 "impossible" offset: there temperature >= 1e-3.
- repetition_penalty in [1e-3, 1e3]: scores are multiplied or divided by it (0 * inf is NaN).
- beam search: |length_penalty| * ln(max_new_tokens + 1) <= 80: length**length_penalty must stay
  inside float32's range (about e**88).
- seeds are integers in 0..2**64-1 (NumPy's generator takes no negative seed; -1 is not
  "random": leave the seed unset for that).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError, InputError
from ..io.limits import MAX_LENGTH, is_integer, short_repr
from .protocol import DecodingModel
from .structured import ResponseFormat, check_format

# When neither the call nor the checkpoint says how long to decode. Deliberately long: a silent
# 20-token cut (HF's max_length default) truncates real outputs; eos ends most generations sooner.
DEFAULT_MAX_NEW_TOKENS = 256

MAX_ROWS = 4096                 # beams / sequences per prompt: rows are copied before the arena
                                # is asked, so an absurd count must fail before that copy
MAX_SEED = 2**64 - 1
MAX_TEMPERATURE = 1e3
MIN_BEAM_TEMPERATURE = 1e-3
MIN_PENALTY, MAX_PENALTY = 1e-3, 1e3
MAX_LOGPROBS = 20              # alternatives per token at most (OpenAI's and vLLM's cap)
MAX_LOG_LENGTH_PENALTY = 80.0   # |length_penalty| * ln(longest length): float32 max is ~e**88


class _Bad(Exception):
    """A check's "must be ..." text; the caller says where the value came from."""


def _integer(low: int, high: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if not is_integer(v) or not low <= v <= high:
            raise _Bad(f"an integer in {low}..{high}")
        return int(v)
    return check


def _number(low: float, high: float, low_open: bool = False) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        try:  # float(10**400) overflows: refused like any other out-of-range number
            x = float(v) if is_integer(v) or isinstance(v, (float, np.floating)) else math.nan
        except OverflowError:
            x = math.nan
        if not (math.isfinite(x) and (x > low if low_open else x >= low) and x <= high):
            bounds = ("" if low == -math.inf and high == math.inf
                      else f" {'>' if low_open else '>='} {low:g}" if high == math.inf
                      else f" in {'(' if low_open else '['}{low:g}, {high:g}]")
            raise _Bad(f"a finite number{bounds}")
        return x
    return check


def _switch(v: Any) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise _Bad("true or false (a bool)")
    return bool(v)


def _early_stopping(v: Any) -> bool | str:
    # checked by type, not by `in (True, False, "never")`: 1 == True would pass and then fail
    # the search's `is True` tests, silently meaning False
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, str) and v == "never":
        return "never"
    raise _Bad("true, false or 'never'")


def _stop(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        v = (v,)
    if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) and s for s in v):
        raise _Bad("a non-empty string or a list of non-empty strings")
    return tuple(str(s) for s in v)


def _temperature(v: Any) -> float:
    x = _number(0.0, MAX_TEMPERATURE, low_open=True)(v)
    if np.float32(x) == 0:  # the warper divides float32 scores by float32(temperature)
        raise _Bad(f"a number in (0, {MAX_TEMPERATURE:g}] that float32 does not round to 0")
    return x


def _seed(v: Any) -> int | None:
    return None if v is None else _integer(0, MAX_SEED)(v)


def _logprobs(v: Any) -> int | None:
    return None if v is None else _integer(0, MAX_LOGPROBS)(v)


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "max_new_tokens": _integer(1, MAX_LENGTH),
    "min_new_tokens": _integer(0, MAX_LENGTH),
    "do_sample": _switch,
    "temperature": _temperature,
    "top_k": _integer(0, MAX_LENGTH),
    "top_p": _number(0.0, 1.0, low_open=True),
    "repetition_penalty": _number(MIN_PENALTY, MAX_PENALTY),
    "no_repeat_ngram_size": _integer(0, MAX_LENGTH),
    "num_beams": _integer(1, MAX_ROWS),
    "length_penalty": _number(-math.inf, math.inf),
    "early_stopping": _early_stopping,
    "num_return_sequences": _integer(1, MAX_ROWS),
    "stop": _stop,
    "seed": _seed,
    "logprobs": _logprobs,
    "response_format": check_format,   # (its own InputErrors, naming response_format)
}
_HINTS = {"seed": " (leave it unset for a random seed)"}


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
    # each new token's log-probability (the log-softmax of the model's scores before any
    # processor, as vLLM reports them) and this many alternatives (0: none); None: not kept
    logprobs: int | None = None
    # structured output (structured.py): tokens the format's grammar forbids are masked before
    # each choice; None (or {"type": "text"}): free text. Never from a checkpoint's files.
    response_format: ResponseFormat | dict | None = None

    def validate(self, origin: dict[str, str] | None = None) -> "GenerationOptions":
        """The options checked and normalised (Python scalars, stop a tuple). `origin` names the
        file a value came from (then a bad one is a ConfigError naming it); else the call."""
        opts = _checked(self, _CHECKS, origin)
        if opts.num_return_sequences > opts.num_beams and (opts.num_beams > 1 or not opts.do_sample):
            # beam search (sampled or not) returns some of its beams; only plain sampling draws
            # any number of independent sequences
            raise InputError(f"num_return_sequences ({opts.num_return_sequences}) must not exceed "
                             f"num_beams ({opts.num_beams}) unless sampling without beams")
        if opts.num_beams > 1 and opts.do_sample and opts.temperature < MIN_BEAM_TEMPERATURE:
            raise InputError(f"temperature {opts.temperature:g} is too low for sampled beam search "
                             f"(>= {MIN_BEAM_TEMPERATURE:g}: beam scores scale as 1/temperature); "
                             "for the best beams use do_sample=False")
        if opts.num_beams > 1 and (abs(opts.length_penalty) * math.log(opts.max_new_tokens + 1)
                                   > MAX_LOG_LENGTH_PENALTY):
            raise InputError(
                f"length_penalty {opts.length_penalty:g} with max_new_tokens {opts.max_new_tokens}: "
                f"length**length_penalty leaves float32's range (|length_penalty| * "
                f"ln(max_new_tokens + 1) must be <= {MAX_LOG_LENGTH_PENALTY:g})")
        if opts.min_new_tokens > opts.max_new_tokens:
            raise InputError(f"min_new_tokens ({opts.min_new_tokens}) exceeds max_new_tokens "
                             f"({opts.max_new_tokens})")
        return opts


_OPTION_NAMES = {f.name for f in dataclasses.fields(GenerationOptions)}
# HF names that take a different shape here: lengths counted with the decoder start token.
_LENGTH_KEYS = {"max_length": "max_new_tokens", "min_length": "min_new_tokens"}


def _from_hf(params: dict, source: str) -> dict:
    """Generation settings of an HF config dict in minfer's terms (only keys we know; null =
    unset). HF's lengths count the decoder start token; an explicit new-token count wins."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if value is None:
            continue
        if key in _LENGTH_KEYS:
            if params.get(_LENGTH_KEYS[key]) is not None:
                continue
            if not is_integer(value) or not 0 <= value <= MAX_LENGTH:
                raise ConfigError(f"{source}: '{key}' must be an integer in 0..{MAX_LENGTH}, "
                                  f"got {short_repr(value)}")
            out[_LENGTH_KEYS[key]] = max(int(value) - 1, 0 if key == "min_length" else 1)
        elif key in _OPTION_NAMES and key not in ("stop", "seed", "response_format"):
            out[key] = value
    return out


def _unknown(names: list[str]) -> InputError:
    name = names[0]
    if name in _LENGTH_KEYS:  # what HF users type: say what to use instead
        return InputError(f"generation option {name!r} is not supported: use "
                          f"{_LENGTH_KEYS[name]} (minfer counts new tokens only)")
    known = ", ".join(sorted(_OPTION_NAMES | set(BATCH_OPTION_NAMES)))
    return InputError(f"unknown generation option {name!r} (known: {known})")


# -- how a call's prompts are batched ----------------------------------------------------------------
# Prompts per batch when the call does not say. Measured on the shipped tiny T5 (800 prompts,
# 2 cores): batches of 8 / 16 / 32 / 64 / 128 took 1.23 / 0.88 / 0.73 / 0.66 / 2.0 s (the compiled
# kernels take products of up to 64 rows). 32 is CTranslate2's translate_iterable default too,
# and 32 t5-small rows of 64 prompt tokens at 256 new tokens plan ~300 MiB of arena (800 plan
# 7.5 GiB); the memory plan lowers it further where the workspace is smaller.
DEFAULT_MAX_BATCH_SIZE = 32
MAX_BATCH_SIZE = 1 << 16   # a sanity bound: the memory plan refuses far smaller batches anyway


@dataclass(frozen=True)
class BatchOptions:
    """How one call's prompts are cut into batches and how long a prompt may be. They are not
    GenerationOptions: they say how to run, not what to generate, so they never come from a
    checkpoint's config.json / generation_config.json (a file cannot set a machine's batch size)
    and do not take part in that precedence.

    max_batch_size: prompts per batch at most (beams and samples of a prompt count as one); the
        model's memory plan may allow fewer.
    max_input_tokens: prompt tokens at most (None: only the memory plan bounds them). A longer
        prompt is a per-row error unless `truncation`.
    truncation: cut a longer prompt to max_input_tokens instead (needs max_input_tokens)."""
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_input_tokens: int | None = None
    truncation: bool = False

    def validate(self) -> "BatchOptions":
        opts = _checked(self, _BATCH_CHECKS)
        if opts.truncation and opts.max_input_tokens is None:
            raise InputError("truncation=True needs max_input_tokens (the length to cut prompts to)")
        return opts


_BATCH_CHECKS = {"max_batch_size": _integer(1, MAX_BATCH_SIZE),
                 "max_input_tokens": lambda v: None if v is None else _integer(1, MAX_LENGTH)(v),
                 "truncation": _switch}


def _checked(options: Any, checks: dict[str, Callable[[Any], Any]],
             origin: dict[str, str] | None = None) -> Any:
    """A copy of the options dataclass with each field through its check; a field that fails is
    a ConfigError naming the file `origin` says it came from, else an InputError naming it."""
    values = {}
    for name, check in checks.items():
        value = getattr(options, name)
        try:
            values[name] = check(value)
        except _Bad as e:
            where = (origin or {}).get(name)
            if where is not None:
                raise ConfigError(f"{where}: '{name}' must be {e}, got {short_repr(value)}") from None
            raise InputError(f"{name} must be {e}, got {short_repr(value)}{_HINTS.get(name, '')}") \
                from None
    return dataclasses.replace(options, **values)


BATCH_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(BatchOptions))


def split_batch_options(options: dict[str, Any]) -> tuple[BatchOptions, dict[str, Any]]:
    """A call's keyword options -> (its checked BatchOptions, the generation options left).
    None means unset, as for generation options."""
    given = {k: v for k, v in options.items() if k in BATCH_OPTION_NAMES and v is not None}
    rest = {k: v for k, v in options.items() if k not in BATCH_OPTION_NAMES}
    return BatchOptions(**given).validate(), rest


def _temperature_zero_is_greedy(settings: dict[str, Any], origin: dict[str, str]) -> None:
    """temperature 0 means greedy decoding, as OpenAI's API, the server and the CLI read it and as
    transformers treats a checkpoint's `temperature: 0` beside greedy settings: the temperature
    is dropped and sampling is off. Only a sampling asked for in the same call conflicts."""
    t = settings.get("temperature")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t != 0:
        return
    if settings.get("do_sample") is True and "do_sample" not in origin:   # the call's own
        raise InputError("temperature 0 is greedy decoding: it does not combine with "
                         "do_sample=True (give a temperature above 0 to sample)")
    settings.pop("temperature")
    origin.pop("temperature", None)
    settings["do_sample"] = False


def resolve_options(model: DecodingModel, task: str | None = None, **overrides: Any) -> tuple[GenerationOptions, str]:
    """Options from (lowest first) minfer's defaults, config.json's generation keys, the checkpoint's
    generation_config.json, the task's task_specific_params, then explicit arguments (None = unset).
    Returns the options and the task's prompt prefix."""
    unknown = sorted(set(overrides) - _OPTION_NAMES)
    if unknown:
        raise _unknown(unknown)
    folder = getattr(model, "folder", None)

    def where(name: str) -> str:
        return f"{folder}/{name}" if folder else name

    settings: dict[str, Any] = {}
    origin: dict[str, str] = {}    # option -> the file it came from (absent: the call)

    def take(values: dict, source: str | None) -> None:
        settings.update(values)
        for k in values:
            if source is None:
                origin.pop(k, None)
            else:
                origin[k] = source

    raw_config = model.hf_config
    take(_from_hf({k: v for k, v in raw_config.items() if k in _OPTION_NAMES or k in _LENGTH_KEYS},
                  where("config.json")), where("config.json"))
    generation_config = dict(model.generation_config or {})
    if (is_integer(generation_config.get("max_length")) and generation_config["max_length"] == 20
            and "max_new_tokens" not in generation_config):  # (20.0 is refused, not dropped)
        generation_config.pop("max_length")  # HF's default cap copied into old files: not a choice
    take(_from_hf(generation_config, where("generation_config.json")),
         where("generation_config.json"))
    prefix = ""
    if task is not None:
        if not isinstance(task, str):
            raise InputError(f"task must be a string, got {short_repr(task)}")
        tasks = raw_config.get("task_specific_params") or {}
        source = where("config.json") + f" task_specific_params[{task!r}]"
        if not isinstance(tasks, dict):
            raise ConfigError(f"{where('config.json')}: 'task_specific_params' must be an object, "
                              f"got {short_repr(tasks)}")
        if task not in tasks:
            known = ", ".join(sorted(map(str, tasks))) or "none"
            raise InputError(f"task {task!r} is not defined by this checkpoint (known: {known})")
        if not isinstance(tasks[task], dict):
            raise ConfigError(f"{source}: must be an object, got {short_repr(tasks[task])}")
        params = dict(tasks[task])
        prefix = params.pop("prefix", "") or ""
        if not isinstance(prefix, str):
            raise ConfigError(f"{source}: 'prefix' must be a string, got {short_repr(prefix)}")
        take(_from_hf(params, source), source)
    calls = {k: v for k, v in overrides.items() if v is not None}
    take(calls, None)
    _temperature_zero_is_greedy(settings, origin)
    # a minimum from the checkpoint's files yields to the call's maximum (it is not an error of
    # the caller's); a call's own min > max is refused by validate()
    lo, hi = settings.get("min_new_tokens", 0), settings.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if ("min_new_tokens" not in calls and is_integer(lo) and is_integer(hi)
            and hi < lo <= MAX_LENGTH):  # (an out-of-range minimum is still refused below)
        settings["min_new_tokens"] = hi
    options = GenerationOptions(**settings).validate(origin)
    return options, prefix
