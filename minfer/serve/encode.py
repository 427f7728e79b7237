"""POST /v1/encode: per-token encoder states of texts, for diffusion pipelines that take
`prompt_embeds` from a remote text encoder.

Request:  {"model", "input": str | [str], "preset"?: "flux" | "sd3" | "wan" | "chroma" | "ltx",
           "max_length"?: int, "dtype"?: "float32" | "float16" | "bfloat16",
           "encoding_format"?: "float" | "base64"}
Answer:   {"object": "list", "model", "data": [{"object": "encoding", "index", "shape": [T, C],
           "dtype", "states", "attention_mask"}], "usage": {"prompt_tokens", "total_tokens"}}

With a preset every input has the pipeline's T (its length, or max_length) and
"attention_mask" is the mask that pipeline hands its transformer (chroma, ltx), else which
positions hold the input's tokens (model.encode's return_mask); without one, each input's states
cover its own tokens (mask all ones). "states" are nested lists (float), or base64 of the
little-endian bytes in "dtype" (bfloat16: the top half of each float32, rounded to nearest
even, as torch casts). Each request runs in a worker thread; its rows go to the encode queue
(encode_passes.py), where concurrent requests with the same preset and length share encoder
passes (model.encode). With `--encode-cache` each input's rendered answer (per dtype and format,
written as the whole body of a request of it alone) is kept in the cache beside its states, so
a repeated input is a lookup: no tokenizing, no encoder pass, no conversion, no base64; a
one-input request sends the kept body as it is, several inputs' are joined.
"""

from __future__ import annotations

import binascii
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.responses import Response

from ..encoding.presets import PRESETS
from ..errors import InputError
from ..io.limits import short_repr
from .encode_passes import SHARE_MIN_POSITIONS, EncodePasses, PassRule
from .errors import APIError
from .jobs import Job
from .schema import _check_count, _integer, _strings

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class EncodeRequest:
    texts: list[str]
    preset: str | None
    max_length: int | None
    dtype: str
    base64: bool


def encode_request(body: dict, max_inputs: int) -> EncodeRequest:
    """The checked body: 400 naming the field otherwise."""
    texts = _strings(body, "input")
    if texts is None:
        raise APIError(400, "input is required: a string or a list of strings", param="input")
    _check_count(texts, "input", "inputs", max_inputs)
    preset = body.get("preset")
    if preset is not None and preset not in PRESETS:
        raise APIError(400, f"preset must be one of {', '.join(PRESETS)}, got "
                            f"{short_repr(preset)}", param="preset")
    dtype = body.get("dtype") or "float32"
    if dtype not in DTYPES:
        raise APIError(400, f"dtype must be one of {', '.join(DTYPES)}, got {short_repr(dtype)}",
                       param="dtype")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise APIError(400, f"encoding_format must be \"float\" or \"base64\", got "
                            f"{short_repr(fmt)}", param="encoding_format")
    return EncodeRequest(texts, preset, _integer(body, "max_length", 1), dtype, fmt == "base64")


@dataclass(frozen=True)
class Rendered:
    """One input's answer, written as the whole body of a request of that input alone, so a
    repeated one-input request sends `body` as it is; `body[start:end]` is the input's object
    after its "index" (shape to closing brace), which a request of several inputs joins."""
    body: bytes
    start: int
    end: int
    tokens: int


def run(job: Job, req: EncodeRequest, max_input_tokens: int, passes: EncodePasses,
        name: str) -> tuple[bytes, int]:
    """In a worker: the answer's JSON bytes and the prompt tokens run. With an encode cache an
    input whose answer (in this dtype and format) is kept there is that answer, found by its
    text: no tokenizing, no pass, no conversion. Each other text is tokenized (cleaned and cut as
    its preset says), so its length is checked against the server's limit before anything is
    encoded and counted for the usage; their rows go to the encode queue (encode_passes.py: a
    pass shared with concurrent requests of the same rule), are rendered here, and kept."""
    job.check()
    model = job.model
    if not callable(getattr(model, "encoder_states", None)):
        raise InputError(f"{model.folder}: this model has no encoder")
    length = padded_length(req, max_input_tokens)
    cache = getattr(model, "encode_cache", None)
    scope = answer_scope(req, length)
    keys: list[bytes] = []
    found: list[Rendered | None] = [None] * len(req.texts)
    if cache is not None and scope is not None:
        rendering = (f"{model.cache_identity}|{id(model.tokenizer)}|/v1/encode|{name}|"
                     f"{max_input_tokens}|{req.preset}|{length}|{req.dtype}|{req.base64}|{scope}")
        keys = [answer_key(rendering, text) for text in req.texts]
        found = [cache.get_answer(key) for key in keys]
    todo = [i for i, r in enumerate(found) if r is None]
    if todo:
        rows = token_rows(model, req, length, max_input_tokens, todo)
        job.check()
        rule = PassRule(req.preset, length if req.preset is not None else max(map(len, rows)))
        got = passes.encode(job, rule, rows)
        if req.dtype == "float16":   # (float32 and bfloat16 share float32's range)
            top = max(float(np.abs(s).max(initial=0)) for s, _ in got)
            if top > HALF_MAX:
                raise InputError(f"dtype float16: the states reach {top:.6g}, beyond float16's "
                                 f"largest value {HALF_MAX:g}; ask for float32 or bfloat16")
        for i, row, (states, mask) in zip(todo, rows, got):
            found[i] = rendered(encoded_row(states, mask, req), name, len(row))
            if keys:
                cache.put_answer(keys[i], found[i], len(found[i].body))
    done = [r for r in found if r is not None]   # (all, by now)
    tokens = sum(r.tokens for r in done)
    if len(done) == 1:
        return done[0].body, tokens
    return answer([memoryview(r.body)[r.start:r.end] for r in done], name, tokens), tokens


def answer_scope(req: EncodeRequest, length: int | None) -> str | None:
    """Which requests may share an input's kept answer: "any" where its states do not depend on
    what else was in its pass (every input padded to one length of at least
    SHARE_MIN_POSITIONS: each product of the pass takes the same code path for any number of
    rows, and the rows' sums do not depend on the others), "alone" for a request of one input
    (its states depend on the pass's longest row and, below SHARE_MIN_POSITIONS, on the number
    of rows: such an answer is only the answer to that input sent alone), else None: nothing
    is kept, and a hit would be another batch's rounding."""
    if length is not None and length >= SHARE_MIN_POSITIONS:
        return "any"
    return "alone" if len(req.texts) == 1 else None


def padded_length(req: EncodeRequest, max_input_tokens: int) -> int | None:
    """The length every input is cut and padded to (the preset's, or max_length; None: each
    row's own), within the server's limit."""
    rule = PRESETS[req.preset] if req.preset is not None else None
    length = req.max_length if req.max_length is not None or rule is None else rule.max_length
    if length is not None and length > max_input_tokens:
        raise InputError(f"max_length: {length} tokens, more than this server's limit of "
                         f"{max_input_tokens} (serve --max-input-tokens)")
    return length


def token_rows(model: Any, req: EncodeRequest, length: int | None, max_input_tokens: int,
               which: list[int]) -> list[list[int]]:
    """The token ids of the inputs `which`, cleaned and cut as the preset says, each within the
    server's limit (else an InputError naming the input)."""
    tok = model.tokenizer
    clean = PRESETS[req.preset].clean if req.preset is not None else None
    rows = []
    for i in which:
        text = req.texts[i] if clean is None else clean(req.texts[i])
        try:
            row = tok.encode_cut(text, length)[0] if length is not None else tok.encode(text)
        except InputError as e:   # (a lone surrogate): named by its input
            raise InputError(f"input[{i}]: {str(e).split(': ', 1)[-1]}") from None
        if len(row) > max_input_tokens:
            raise InputError(f"input[{i}]: {len(row)} tokens, more than this server's limit of "
                             f"{max_input_tokens} (serve --max-input-tokens)")
        rows.append(row)
    return rows


def answer_key(rendering: str, text: str) -> bytes:
    """The encode cache's key of one input's answer: what decides it besides the text (the
    model and its tokenizer, this server's name and limit, preset, length, dtype, format) and
    the text, as a 32-byte digest. The tokenizer is the model's for the process's lifetime, so
    the text decides the ids."""
    h = hashlib.blake2b(digest_size=32)
    h.update(rendering.encode("utf-8", "surrogatepass") + b"\0")
    h.update(text.encode("utf-8", "surrogatepass"))
    return h.digest()


HALF_MAX = float(np.finfo(np.float16).max)   # 65504: a larger state would be sent as infinity


def as_dtype(states: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """float32 states -> (the bytes to send in `dtype`, little-endian; their values as float32)."""
    if dtype == "float32":
        return np.ascontiguousarray(states, "<f4"), states
    if dtype == "float16":
        half = np.ascontiguousarray(states, "<f2")
        return half, half.astype(np.float32)
    bits = np.ascontiguousarray(states, np.float32).view(np.uint32)
    top = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")   # round half to even
    return top, (top.astype(np.uint32) << 16).view(np.float32)


def encoded_row(states: np.ndarray, mask: np.ndarray, req: EncodeRequest) -> bytes:
    """One input's answer after its "index": shape, dtype, attention_mask and states, to the
    closing brace. base64 states go in as bytes (no JSON escaping of megabytes that need none:
    512 x 4096 states are 11 MB of base64)."""
    raw, values = as_dtype(states, req.dtype)
    head = _json({"shape": list(states.shape), "dtype": req.dtype,
                  "attention_mask": mask.tolist()})[1:-1]
    if req.base64:
        return b"".join([head, b',"states":"', binascii.b2a_base64(raw, newline=False), b'"}'])
    return b"".join([head, b',"states":', _json(values.tolist()), b"}"])


LIST_HEAD = b'{"object":"list","data":['


def _item_head(index: int) -> bytes:
    return b'{"object":"encoding","index":%d,' % index


def _closing(model: str, tokens: int) -> bytes:
    return b"]," + _json({"model": model, "usage": {"prompt_tokens": tokens,
                                                    "total_tokens": tokens}})[1:]


def rendered(part: bytes, model: str, tokens: int) -> Rendered:
    """An input's encoded_row as the answer to a request of it alone."""
    head = LIST_HEAD + _item_head(0)
    return Rendered(b"".join([head, part, _closing(model, tokens)]), len(head),
                    len(head) + len(part), tokens)


def answer(parts: list, model: str, tokens: int) -> bytes:
    """The answer's JSON bytes from each input's encoded_row."""
    out = [LIST_HEAD]
    for i, part in enumerate(parts):
        out += [b"," if i else b"", _item_head(i), part]
    out.append(_closing(model, tokens))
    return b"".join(out)


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False).encode("utf-8")


def plan(service: Any, body: dict) -> tuple:
    """routes' one-job plan for POST /v1/encode: the job, its arguments, the answer."""
    req = encode_request(body, service.limits.max_inputs)

    def respond(got: tuple[bytes, int]) -> Response:
        body, tokens = got
        service.metrics.tokens(tokens, 0)
        return Response(body, media_type="application/json")
    return (run, (req, service.limits.max_input_tokens, service.encode_passes, service.name),
            respond)
