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
even, as torch casts). The run is model.encode in a worker thread, as /v1/embeddings runs
model.embed (the model's lock takes one encoder pass at a time); with `--encode-cache` a
repeated input is answered from the cache without an encoder pass.
"""

from __future__ import annotations

import binascii
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.responses import Response

from ..encoding.presets import PRESETS
from ..errors import InputError
from ..io.limits import short_repr
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


def run(job: Job, req: EncodeRequest, max_input_tokens: int) -> tuple[list, int]:
    """In a worker: [(states (T, C), mask (T,))] per input and the prompt tokens run. Each text
    is tokenized once here (cleaned and cut as its preset says), so its length is checked
    against the server's limit before anything is encoded and counted for the usage; the ids
    go to model.encode with the preset, which pads them and applies its mask rule."""
    job.check()
    model = job.model
    if not callable(getattr(model, "encoder_states", None)):
        raise InputError(f"{model.folder}: this model has no encoder")
    tok = model.tokenizer
    rule = PRESETS[req.preset] if req.preset is not None else None
    length = req.max_length if req.max_length is not None or rule is None else rule.max_length
    if length is not None and length > max_input_tokens:
        raise InputError(f"max_length: {length} tokens, more than this server's limit of "
                         f"{max_input_tokens} (serve --max-input-tokens)")
    rows = []
    for i, text in enumerate(req.texts):
        if rule is not None and rule.clean is not None:
            text = rule.clean(text)
        try:
            row = tok.encode_cut(text, length)[0] if length is not None else tok.encode(text)
        except InputError as e:   # (a lone surrogate): named by its input
            raise InputError(f"input[{i}]: {str(e).split(': ', 1)[-1]}") from None
        if len(row) > max_input_tokens:
            raise InputError(f"input[{i}]: {len(row)} tokens, more than this server's limit of "
                             f"{max_input_tokens} (serve --max-input-tokens)")
        rows.append(row)
    job.check()
    tokens = sum(map(len, rows))
    if rule is not None:
        states, mask = model.encode(rows, preset=req.preset, max_length=length, return_mask=True)
        got = list(zip(states, mask))
    else:
        states, mask = model.encode(rows, return_mask=True, padding_states=False)
        got = [(s[:len(r)], k[:len(r)]) for s, k, r in zip(states, mask, rows)]
    if req.dtype == "float16":   # (float32 and bfloat16 share float32's range)
        top = max(float(np.abs(s).max(initial=0)) for s, _ in got)
        if top > HALF_MAX:
            raise InputError(f"dtype float16: the states reach {top:.6g}, beyond float16's "
                             f"largest value {HALF_MAX:g}; ask for float32 or bfloat16")
    return got, tokens


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


def answer(rows: list, model: str, tokens: int, req: EncodeRequest) -> bytes:
    """The answer's JSON bytes, written an input at a time; base64 states go in as bytes (no
    JSON escaping of megabytes that need none: 512 x 4096 states are 11 MB of base64)."""
    parts = [b'{"object":"list","data":[']
    for i, (states, mask) in enumerate(rows):
        raw, values = as_dtype(states, req.dtype)
        head = {"object": "encoding", "index": i, "shape": list(states.shape),
                "dtype": req.dtype, "attention_mask": mask.tolist()}
        parts += [b"," if i else b"", _json(head)[:-1], b',"states":']
        parts += [b'"', binascii.b2a_base64(raw, newline=False), b'"}'] if req.base64 \
            else [_json(values.tolist()), b"}"]
    tail = {"model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    parts.append(b"]," + _json(tail)[1:])
    return b"".join(parts)


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False).encode("utf-8")


def plan(service: Any, body: dict) -> tuple:
    """routes' one-job plan for POST /v1/encode: the job, its arguments, the answer."""
    req = encode_request(body, service.limits.max_inputs)

    def respond(got: tuple[list, int]) -> Response:
        rows, tokens = got
        service.metrics.tokens(tokens, 0)
        return Response(answer(rows, service.name, tokens, req), media_type="application/json")
    return run, (req, service.limits.max_input_tokens), respond
