"""Errors as OpenAI's API returns them: an HTTP status and `{"error": {"message", "type", "param",
"code"}}`, whatever went wrong (a bad field, a full queue, a model that cannot do it, a bug).

`APIError` is raised by the request checks and the routes; `from_exception` maps what minfer
raises to one: a request the model cannot run (bad options, a prompt over the limit, too big for
the arena even alone, an encoder-only model asked to generate: InputError, ArenaExhausted) is the
client's (400); outputs that hold NaN or infinity (NonFiniteError: the weights overflow) are the
server's, code "non_finite_output"; anything else is the server's too (500, its message kept to
one line).
"""

from __future__ import annotations

import re
from typing import Any

from starlette.responses import JSONResponse

from ..errors import ArenaExhausted, InputError, NonFiniteError
from ..generation.prompts import TRUNCATION_CURE

# OpenAI's `type` for each status it uses (their API reference's error codes).
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          421: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
          503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    """One failed request: its status, and the fields of OpenAI's error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = " ".join(str(message).split())   # one line
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def from_exception(e: BaseException, param: str | None = None) -> APIError:
    """What a request's failure inside minfer means for its client."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, (InputError, ArenaExhausted)):
        # options out of range, prompts over max_input_tokens or too big for the arena even
        # alone, a model that cannot generate or embed: the request, not the server (a bad
        # value in the checkpoint's own files, a ConfigError, is the server's)
        return APIError(400, in_request_words(str(e)), param=param)
    if isinstance(e, NonFiniteError):   # the model's weights, not the request: the server's
        return APIError(500, str(e), code="non_finite_output")
    return APIError(500, f"{type(e).__name__}: {e}", code="internal_error")


# generate's "more sequences than beams" check, as the request's fields say it
_SEQUENCES = re.compile(r"num_return_sequences \((\d+)\) must not exceed num_beams \((\d+)\) "
                        r"unless sampling without beams")


def _sequences_in_request_words(m: re.Match) -> str:
    n, beams = m.group(1), int(m.group(2))
    if beams == 1:
        return (f"n {n} (more than one sequence per prompt) needs sampling (temperature above "
                f"0) or beam search of at least n beams (use_beam_search with best_of)")
    return (f"n {n} is more than the beam width {beams}: beam search returns some of its beams "
            f"(best_of at least n), only sampling without beam search draws more")


def in_request_words(message: str) -> str:
    """A library message with the request's field where it names a Python option: a prompt
    over the server's prompt limit is cut by `truncate_prompt_tokens`, not `truncation=True`;
    n, not num_return_sequences; a temperature, not do_sample."""
    message = re.sub(r"\bmax_input_tokens (\d+)", r"the server's limit of \1 prompt tokens", message)
    message = _SEQUENCES.sub(_sequences_in_request_words, message)
    message = message.replace("do_sample=False", "temperature 0").replace(
        "do_sample=True", "a temperature above 0")
    return message.replace(TRUNCATION_CURE, "truncate_prompt_tokens cuts it")


def shutting_down(detail: str = "") -> APIError:
    """The answer of a request the server stopped because it is shutting down (SIGTERM)."""
    return APIError(503, "the server is shutting down" + (f": {detail}" if detail else ""),
                    code="shutting_down")


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
