"""The serving limits: how much the server takes on at once and per request, checked once.

    max_running       requests decoded (or embedded) at once, each in a worker thread; their
                      decode steps are taken together by the continuous batcher
    max_waiting       requests accepted beyond those, waiting for a thread; one more: 429
    max_body_bytes    request body size; larger: 413
    max_tokens        a request's max_tokens at most (and the default's cap); larger: 400
    max_inputs        a request's inputs at most: embedding inputs, prompts, and the sequences
                      it decodes (prompts x n, prompts x beams); more: 400. This bounds the work
                      one request queues and the size of its answer (OpenAI's embeddings: 2048)
    max_input_tokens  prompt tokens at most (embeddings: tokens per input); longer: 400 naming
                      the limit. Default: the longest prompt whose run, generating the model's
                      default new tokens (at most max_tokens), fits the arena alone by the
                      model's memory plan, at most LONGEST_DEFAULT
    request_timeout   seconds from arrival to the last byte; a request still running then is
                      cancelled (504, or an error event in a stream)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ..errors import InputError
from ..generation.options import resolve_options
from ..io.limits import is_integer
from ..generation.planning import largest_fitting

LONGEST_DEFAULT = 16384   # LongT5's inputs; no T5 was trained on longer


@dataclass(frozen=True)
class Limits:
    max_running: int = 64
    max_waiting: int = 256
    max_body_bytes: int = 4 << 20
    max_tokens: int = 2048
    max_inputs: int = 2048
    max_input_tokens: int | None = None
    request_timeout: float = 600.0

    def checked(self, model: Any) -> "Limits":
        """Each limit a positive number (one-line InputError naming it); max_input_tokens
        settled from the model when unset."""
        self.check_values()
        if self.max_input_tokens is None:
            return replace(self, max_input_tokens=longest_prompt(model, self.max_tokens))
        return self

    def check_values(self) -> None:
        """Each limit a positive number (max_waiting: at least 0; request_timeout: finite): a
        one-line InputError naming it. Needs no model: `serve` checks its flags before it
        loads one."""
        for name in ("max_running", "max_waiting", "max_body_bytes", "max_tokens",
                     "max_inputs", "max_input_tokens"):
            value = getattr(self, name)
            if value is not None and (not is_integer(value) or value < (0 if name == "max_waiting"
                                                                       else 1)):
                raise InputError(f"{name} must be a positive integer, got {value!r:.40}")
        timeout = self.request_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not (math.isfinite(timeout) and timeout > 0):
            raise InputError(f"request_timeout must be a positive number of seconds, got "
                             f"{timeout!r:.40}")


def check_grace_period(seconds: Any) -> None:
    """SIGTERM's grace period: a finite number of seconds, at least 0 (one-line InputError)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
            not (math.isfinite(seconds) and seconds >= 0):
        raise InputError(f"grace_period must be a finite number of seconds, at least 0, got "
                         f"{seconds!r:.40}")


def longest_prompt(model: Any, max_tokens: int) -> int:
    """The longest prompt (tokens, at most LONGEST_DEFAULT) that the model's memory plan lets
    run alone in the arena while generating its default number of new tokens."""
    new_tokens = 1   # an encoder alone: one pass
    if model.can_generate:
        new_tokens = min(resolve_options(model)[0].max_new_tokens, max_tokens)
    room = model.free_when_idle
    return largest_fitting(lambda n: model.plan(1, n, new_tokens)["peak"] <= room, 1,
                           LONGEST_DEFAULT)


def clean_api_key(key: str | None, name: str = "api_key") -> str | None:
    """The API key as clients can send it: surrounding whitespace stripped (HTTP strips it from
    header values, so a key kept with it would refuse every request); empty, or holding control
    or non-ASCII characters (which a header cannot carry as typed): a one-line InputError."""
    if key is None:
        return None
    if not isinstance(key, str):
        raise InputError(f"{name} must be a string, got {type(key).__name__}")
    stripped = key.strip()
    if not stripped:
        raise InputError(f"{name} is empty" + (" (only whitespace)" if key else ""))
    bad = next((c for c in stripped if not " " <= c <= "~"), None)
    if bad is not None:
        kind = "a control character" if bad.isascii() or not bad.isprintable() else \
            "a non-ASCII character"
        raise InputError(f"{name} holds {kind} ({bad!r}): a key must be printable ASCII, as "
                         "an HTTP header carries it")
    return stripped
