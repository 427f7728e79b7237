"""OpenAI response bodies: completions and chat completions (whole, or as server-sent-event chunks),
embeddings, the model list, usage. Pure functions of what generate / embed returned.

minfer's finish reasons map to OpenAI's: "eos" and "stop" (a stop string) are "stop", "length"
is "length". Choice `index` runs over prompts, then over the n sequences of each:
prompt i's sequence j is index i * n + j (OpenAI's and vLLM's order).
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Any, Iterable

import numpy as np

from ..tokenizers import IncrementalDecoder

DONE = b"data: [DONE]\n\n"
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def finish_reason(reason: str | None) -> str | None:
    return _FINISH.get(reason or "", reason)


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_logprobs(tok: Any, result: Any, chat: bool, encoder_decoder: bool) -> dict | None:
    """A result's log-probabilities as OpenAI shapes them: a completion's {tokens,
    token_logprobs, top_logprobs, text_offset}, a chat answer's {content: [{token, logprob, bytes,
    top_logprobs}]}. Each chosen token's text is the piece it adds to the decoded text (so they
    join to it; a skipped special token adds ""), an alternative's its own decoding."""
    if result.token_logprobs is None:
        return None
    ids = result.token_ids[1:] if encoder_decoder else result.token_ids
    pieces = StreamedLogprobs(tok, chat)
    return pieces.take(ids, result.token_logprobs, result.top_logprobs, final=True)


class StreamedLogprobs:
    """One sequence's logprobs objects a part at a time, for the chunks of a stream: `take` the
    tokens decided since the last part; the parts' token texts join to the whole text (each is
    the piece its id adds to the decoding so far) and `text_offset` runs on across parts."""

    def __init__(self, tok: Any, chat: bool):
        self.tok, self.chat = tok, chat
        self.decoder = IncrementalDecoder(tok) if tok is not None else None
        self.sent = 0          # tokens already given
        self.offset = 0        # characters of text before the next part's first token

    def take(self, ids: list[int], values: list[float], tops: list[list[tuple[int, float]]],
             final: bool = False) -> dict | None:
        """The part for ids[sent:] (ids, values and tops: the sequence's lists so far); None
        when there is nothing new. `final`: the last part (the decoder's held-back text)."""
        new = range(self.sent, len(values))
        if not new and (self.sent or not final):   # (a whole answer of no tokens: empty lists)
            return None
        pieces = [self._text(ids[i], push=True) for i in new]
        if final and self.decoder is not None:
            tail = self.decoder.flush()
            if pieces:
                pieces[-1] += tail
        self.sent = len(values)
        tops = [tops[i] for i in new]
        if self.chat:
            return {"content": [
                {"token": piece, "logprob": values[i], "bytes": list(piece.encode("utf-8")),
                 "top_logprobs": [{"token": self._text(t), "logprob": v,
                                   "bytes": list(self._text(t).encode("utf-8"))} for t, v in top]}
                for piece, i, top in zip(pieces, new, tops)]}
        offsets = []
        for piece in pieces:
            offsets.append(self.offset)
            self.offset += len(piece)
        return {"tokens": pieces, "token_logprobs": [values[i] for i in new],
                "top_logprobs": [{self._text(t): v for t, v in top} for top in tops],
                "text_offset": offsets}

    def _text(self, token: int, push: bool = False) -> str:
        """A chosen token's piece (push: through the sequence's decoder), or an alternative's
        own decoding."""
        if self.tok is None:
            return str(token)
        if push:
            return self.decoder.push(token)
        return self.tok.decode([token], skip_special_tokens=False)


def event(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + _json(body) + b"\n\n"


class Answer:
    """The response shapes of one generation request: `chat` (chat.completion) or a text
    completion, with one id, creation time and model name for all its chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, choices: Iterable[tuple[int, str, str, dict | None]],
              use: dict[str, int]) -> dict[str, Any]:
        """The non-streamed response: choices as (index, text, minfer's finish reason, the
        logprobs object or None)."""
        out = []
        for index, text, reason, logprobs in choices:
            choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason(reason)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
                choice["logprobs"] = logprobs
            else:
                choice.update(text=text, logprobs=logprobs)
            out.append(choice)
        return {**self._head(False), "choices": out, "usage": use}

    def chunk(self, index: int, text: str | None = None, reason: str | None = None,
              first: bool = False, logprobs: dict | None = None) -> dict[str, Any]:
        """A streamed chunk: a piece of choice `index`'s text, or its end (`reason`), with the
        logprobs of the tokens decided since the last chunk (the logprobs option). A chat
        choice's first chunk also says the role."""
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason(reason)}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
            if logprobs is not None:
                choice["logprobs"] = logprobs
        else:
            choice.update(text=text or "", logprobs=logprobs)
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        """stream_options.include_usage: the last chunk, with no choices."""
        return {**self._head(True), "choices": [], "usage": use}


def embeddings(vectors: np.ndarray, model: str, prompt_tokens: int, as_base64: bool) -> bytes:
    """(N, E) float32 vectors -> the embeddings list's JSON bytes; base64 holds each vector's
    little-endian float32 bytes (what the openai client asks for by default). Written a vector
    at a time: the answer's Python floats are one vector's, not all N x E of them at once (the
    whole answer as one dict held ~4 times its size in float objects)."""
    parts = [b'{"object":"list","data":[']
    for i, v in enumerate(vectors):
        vector = np.ascontiguousarray(v, "<f4")
        value: Any = base64.b64encode(vector.tobytes()).decode("ascii") if as_base64 \
            else vector.tolist()
        parts.append((b"," if i else b"") + _json({"object": "embedding", "index": i,
                                                   "embedding": value}))
    tail = {"model": model, "usage": {"prompt_tokens": prompt_tokens,
                                      "total_tokens": prompt_tokens}}
    parts.append(b"]," + _json(tail)[1:])
    return b"".join(parts)


def scores(values: list[float], model: str, created: int, tokens: int) -> dict[str, Any]:
    """POST /v1/score's answer (vLLM's shape)."""
    return {"id": new_id("score"), "object": "list", "created": created, "model": model,
            "data": [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def ranking(ranked: list, documents: list[str], keep_documents: bool, model: str,
            tokens: int) -> dict[str, Any]:
    """POST /v1/rerank's answer (Cohere's and Jina's shape), best first."""
    return {"id": new_id("rerank"), "model": model,
            "results": [{"index": i, "relevance_score": s,
                         **({"document": {"text": documents[i]}} if keep_documents else {})}
                        for i, s in ranked],
            "usage": {"total_tokens": tokens}}


def _json(body: Any) -> bytes:
    """Compact JSON bytes (NaN or infinity refused, as JSON has neither)."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode("utf-8")


def model_list(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "minfer"}]}
