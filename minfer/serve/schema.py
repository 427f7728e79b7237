"""OpenAI request bodies: their fields checked (type and range, each error naming its field) and
mapped onto the options `model.generate` and `model.embed` take.

Completions and chat completions share the sampling fields; vLLM's extras are read under vLLM's
names. Unknown fields are ignored, as OpenAI's API ignores them; a known field that asks for
something minfer does not do (echo, suffix, logit_bias, presence or frequency
penalties, tools) is refused rather than silently dropped. A null field is
unset. The mapping (README "Serving" lists it for users):

    max_tokens, max_completion_tokens   max_new_tokens (unset: the checkpoint's, capped by the server)
    temperature                         0: greedy; > 0: sampling at that temperature; unset: the
                                        checkpoint's own (greedy for most T5 checkpoints)
    top_p, top_k                        top_p, top_k (-1 or 0: no cut); either alone means sampling
    n                                   num_return_sequences
    best_of + use_beam_search, num_beams  num_beams (vLLM's beam width); length_penalty, early_stopping
    stop, seed, repetition_penalty      the same names
    min_tokens                          min_new_tokens
    ignore_eos                          min_new_tokens = max_new_tokens (eos cannot end it early)
    truncate_prompt_tokens              cut longer prompts to this many tokens (truncation)
    logprobs (completions: k; chat: true + top_logprobs k)   logprobs=k
    response_format (both endpoints), structured_outputs {"choice" | "json"}, guided_choice,
    guided_json (vLLM's)                response_format (generation/structured.py)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import InputError
from ..generation.options import BATCH_OPTION_NAMES, MAX_LOGPROBS, resolve_options
from ..generation.structured import check_format, grammar_for
from ..tokenizers.select import need_tokenizer
from ..io.limits import is_integer, short_repr
from .chat import chat_prompt
from .errors import APIError, in_request_words
from .limits import Limits

DEFAULT_MAX_INPUTS = Limits.max_inputs

# minfer's option -> the request field that sets it (for errors the library's checks raise)
_FIELD_OF = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
             "num_return_sequences": "n", "num_beams": "best_of", "do_sample": "temperature",
             "max_input_tokens": "truncate_prompt_tokens", "dimensions": "dimensions"}

# request fields the serving jobs' own messages begin with
_REQUEST_FIELDS = ("text_1", "text_2", "query", "documents", "logprobs", "normalize",
                   "response_format", "dtype")

_SAME_NAME = ("temperature", "top_p", "top_k", "stop", "seed", "repetition_penalty",
              "length_penalty", "early_stopping")

# Stop strings per request at most: each is matched against the text after every token (OpenAI
# allows 4; vLLM any number)
MAX_STOP = 16

# OpenAI fields minfer cannot honour: refused unless they ask for nothing (null, false, 0, "",
# an empty list or object)
_UNSUPPORTED = ("echo", "suffix", "logit_bias", "presence_penalty", "frequency_penalty", "tools",
                "functions", "prompt_logprobs")


# -- the body ---------------------------------------------------------------------------------------
def parse_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object (strict JSON: no NaN or Infinity), or a 400 saying why not."""
    def refuse_constant(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=refuse_constant)
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not UTF-8 (byte {e.start})") from None
    except (ValueError, RecursionError) as e:   # JSONDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def check_model(body: dict, served: str) -> None:
    """`model`, if given, must be the served model's name (vLLM answers 404 otherwise)."""
    name = body.get("model")
    if name is None:
        return
    if not isinstance(name, str):
        raise APIError(400, f"model must be a string, got {short_repr(name)}", param="model")
    if name != served:
        raise APIError(404, f"The model {name!r:.100} does not exist (this server serves "
                       f"{served!r})", param="model", code="model_not_found")


# -- typed fields -----------------------------------------------------------------------------------
def _get(body: dict, name: str, check: Callable[[Any], bool], must: str) -> Any:
    value = body.get(name)
    if value is not None and not check(value):
        raise APIError(400, f"{name} must be {must}, got {short_repr(value)}", param=name)
    return value


def _integer(body: dict, name: str, low: int | None = None) -> int | None:
    value = _get(body, name, is_integer, "an integer")
    if value is not None and low is not None and value < low:
        raise APIError(400, f"{name} must be at least {low}, got {short_repr(value)}", param=name)
    return value


def _number(body: dict, name: str, low: float | None = None) -> float | None:
    def finite(v: Any) -> bool:
        return (is_integer(v) or isinstance(v, float)) and math.isfinite(float(v))
    value = _get(body, name, finite, "a finite number")
    if value is not None and low is not None and value < low:
        raise APIError(400, f"{name} must be at least {low:g}, got {short_repr(value)}", param=name)
    return value


def _boolean(body: dict, name: str) -> bool | None:
    return _get(body, name, lambda v: isinstance(v, bool), "true or false")


def _strings(body: dict, name: str) -> list[str] | None:
    """A string or a non-empty list of strings (stop, prompt, input)."""
    value = _get(body, name, lambda v: isinstance(v, str) or (
        isinstance(v, list) and bool(v) and all(isinstance(s, str) for s in v)),
        "a string or a non-empty list of strings")
    return None if value is None else [value] if isinstance(value, str) else value


# -- generation -------------------------------------------------------------------------------------
@dataclass
class GenerationRequest:
    """A checked completion or chat request: what to run and how to answer."""
    prompts: list[str]
    options: dict[str, Any]           # model.generate's keyword options (None: unset)
    n: int = 1
    stream: bool = False
    include_usage: bool = False       # stream_options.include_usage: a last chunk with usage
    ignore_eos: bool = False


def completion_request(body: dict, max_tokens: int, max_input_tokens: int,
                       max_inputs: int = DEFAULT_MAX_INPUTS) -> GenerationRequest:
    """POST /v1/completions: `prompt` a string or a list of at most `max_inputs` strings."""
    if body.get("prompt") is None:
        raise APIError(400, "prompt is required: a string or a list of strings", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(is_integer(t) or isinstance(t, list)
                                                   for t in prompt):
        raise APIError(400, "prompt: token ids are not supported here, send text",
                       param="prompt")
    prompts = _strings(body, "prompt")
    _check_count(prompts, "prompt", "prompts", max_inputs)
    logprobs = _integer(body, "logprobs", 0)          # the alternatives per token
    return _generation(body, prompts, "max_tokens", max_tokens, max_input_tokens, max_inputs,
                       _at_most(logprobs, "logprobs"))


def chat_request(body: dict, max_tokens: int, max_input_tokens: int,
                 max_inputs: int = DEFAULT_MAX_INPUTS) -> GenerationRequest:
    """POST /v1/chat/completions: `messages` made one prompt by the chat rule (chat.py)."""
    limit_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    wanted = _boolean(body, "logprobs")
    top = _at_most(_integer(body, "top_logprobs", 0), "top_logprobs")
    if top is not None and not wanted:
        raise APIError(400, "top_logprobs needs \"logprobs\": true", param="top_logprobs")
    return _generation(body, [chat_prompt(body.get("messages"))], limit_field, max_tokens,
                       max_input_tokens, max_inputs, (top or 0) if wanted else None)


def _at_most(k: int | None, field: str) -> int | None:
    if k is not None and k > MAX_LOGPROBS:
        raise APIError(400, f"{field} must be at most {MAX_LOGPROBS}, got {k}", param=field)
    return k


def _check_count(values: list, field: str, what: str, max_inputs: int) -> None:
    """At most max_inputs of them: a request's work and its answer's size stay bounded whatever
    its body packs into max_body_bytes (100,000 one-letter inputs fit in 0.5 MB)."""
    if len(values) > max_inputs:
        raise APIError(400, f"{field}: {len(values)} {what}, more than this server's limit of "
                       f"{max_inputs} per request (serve --max-inputs)", param=field)


def _check_sequences(prompts: int, n: int, beams: tuple[int | None, str],
                     max_inputs: int, whose: str = "") -> None:
    """The sequences a request decodes at once (prompts x n, or prompts x beams: each a row
    and, streamed, a stream) at most max_inputs; `beams` is the beam width and the field that
    set it; `whose`, if the width is not the request's, says where it came from."""
    num_beams, beams_field = beams
    field, width = ("n", n) if n >= (num_beams or 1) else (beams_field, num_beams or 1)
    if prompts * width > max_inputs:
        count = f"{field} {width}" if prompts == 1 else \
            f"{field} {width} x {prompts} prompts = {prompts * width}"
        raise APIError(400, f"{count} sequences{whose if field != 'n' else ''}, more than this "
                       f"server's limit of {max_inputs} per request (serve --max-inputs)",
                       param=field)


def _generation(body: dict, prompts: list[str], tokens_field: str, max_tokens: int,
                max_input_tokens: int, max_inputs: int,
                logprobs: int | None = None) -> GenerationRequest:
    for name in _UNSUPPORTED:
        if body.get(name):
            raise APIError(400, f"{name} is not supported by minfer's server", param=name)
    wanted = _integer(body, tokens_field, 1)
    if wanted is not None and wanted > max_tokens:
        raise APIError(400, f"{tokens_field} {wanted} is over this server's limit of "
                       f"{max_tokens} (serve --max-tokens)", param=tokens_field)
    temperature = _number(body, "temperature", 0)
    top_p, top_k = _number(body, "top_p"), _integer(body, "top_k", -1)
    do_sample = (None if temperature is None and top_p is None and top_k is None
                 else temperature is None or temperature > 0)
    n = _integer(body, "n", 1) or 1
    num_beams = _integer(body, "num_beams", 1)
    beams_field = "num_beams"
    best_of = _integer(body, "best_of", 1)
    if _boolean(body, "use_beam_search"):
        num_beams = best_of if best_of is not None else n
        beams_field = "best_of" if best_of is not None else "n"
        if num_beams < 2:
            raise APIError(400, "best_of must be greater than 1 with use_beam_search (it is the "
                           "beam width)", param="best_of")
    elif best_of is not None and best_of != n and num_beams is None:
        raise APIError(400, "best_of other than n needs use_beam_search (minfer does not rank "
                       "sampled sequences)", param="best_of")
    _check_sequences(len(prompts), n, (num_beams, beams_field), max_inputs)
    truncate = _integer(body, "truncate_prompt_tokens", 1)
    if truncate is not None and truncate > max_input_tokens:
        raise APIError(400, f"truncate_prompt_tokens {truncate} is over this server's limit of "
                       f"{max_input_tokens} prompt tokens", param="truncate_prompt_tokens")
    stream = bool(_boolean(body, "stream"))
    usage = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object") or {}
    include_usage = usage.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise APIError(400, "stream_options.include_usage must be true or false",
                       param="stream_options")
    stop = _strings(body, "stop")
    if stop is not None and len(stop) > MAX_STOP:
        raise APIError(400, f"stop: {len(stop)} strings, more than {MAX_STOP}", param="stop")
    early = body.get("early_stopping")
    if early is not None and not (isinstance(early, bool) or early == "never"):
        raise APIError(400, "early_stopping must be true, false or \"never\"",
                       param="early_stopping")
    options = dict(
        response_format=_response_format(body),
        max_new_tokens=wanted, min_new_tokens=_integer(body, "min_tokens", 0),
        do_sample=do_sample, temperature=temperature or None,
        top_p=top_p, top_k=None if top_k is None else max(top_k, 0),
        num_return_sequences=n, num_beams=num_beams,
        length_penalty=_number(body, "length_penalty"), early_stopping=early,
        stop=stop, seed=_integer(body, "seed"),
        repetition_penalty=_number(body, "repetition_penalty"),
        max_input_tokens=truncate or max_input_tokens, truncation=truncate is not None or None,
        logprobs=logprobs)
    return GenerationRequest(prompts, options, n, stream, include_usage,
                             bool(_boolean(body, "ignore_eos")))


def _response_format(body: dict) -> Any:
    """OpenAI's response_format, or vLLM's structured_outputs {"choice": [...]} / {"json":
    schema} and its older guided_choice / guided_json: one of them at most, checked here (the
    grammar against the model's vocabulary in `settle`)."""
    given = {}
    extra = _get(body, "structured_outputs", lambda v: isinstance(v, dict), "an object") or {}
    for field, value in (("response_format", body.get("response_format")),
                         ("structured_outputs", extra.get("choice") and {"type": "choice",
                                                 "choice": extra["choice"]}),
                         ("structured_outputs", extra.get("json") is not None and _schema(
                             extra["json"], "structured_outputs.json")),
                         ("guided_choice", body.get("guided_choice") is not None and {
                             "type": "choice", "choice": body["guided_choice"]}),
                         ("guided_json", body.get("guided_json") is not None and _schema(
                             body["guided_json"], "guided_json"))):
        if value:
            given.setdefault(field, value)
    if len(given) > 1:
        raise APIError(400, f"send one of {' and '.join(sorted(given))}", param=sorted(given)[0])
    if not given:
        return None
    [(field, value)] = given.items()
    try:
        return check_format(value)
    except InputError as e:
        raise APIError(400, str(e) if field == "response_format" else
                       str(e).replace("response_format.choice", field), param=field) from None


def _schema(value: Any, field: str) -> dict:
    if isinstance(value, str):   # vLLM takes the schema as JSON text too
        try:
            value = json.loads(value)
        except ValueError:
            raise APIError(400, f"{field} is not valid JSON", param=field) from None
    return {"type": "json_schema", "json_schema": {"name": field, "schema": value}}


def settle(model: Any, request: GenerationRequest, max_tokens: int,
           max_inputs: int = DEFAULT_MAX_INPUTS) -> GenerationRequest:
    """The options checked against the model (its defaults apply to what the request leaves
    unset; an unset max_tokens is the checkpoint's, at most the server's limit), before the
    request is queued: a bad combination is a 400 naming the request's field, and so are more
    than max_inputs sequences once the checkpoint's own beam width counts."""
    options = {k: v for k, v in request.options.items() if v is not None}
    if "max_new_tokens" not in options:
        default, _ = resolve_options(model)   # the checkpoint's own (or minfer's 256)
        options["max_new_tokens"] = min(default.max_new_tokens, max_tokens)
    if request.ignore_eos:
        options["min_new_tokens"] = options["max_new_tokens"]
    try:
        settled, _ = resolve_options(model, **{k: v for k, v in options.items()
                                               if k not in BATCH_OPTION_NAMES})
    except InputError as e:
        raise APIError(400, in_request_words(str(e)), param=field_of(str(e))) from None
    if "num_beams" not in options:   # the checkpoint's beam width: the request's check saw none
        _check_sequences(len(request.prompts), settled.num_return_sequences,
                         (settled.num_beams, "num_beams"), max_inputs,
                         whose=" (this model's default num_beams; send num_beams 1 to decode "
                               "one sequence per prompt)")
    if request.stream and request.n > 1 and settled.num_beams > 1:
        raise APIError(400, "stream with n > 1 and beam search is not supported (a beam search "
                       "streams its result once, at the end)", param="n")
    if settled.response_format is not None:   # the grammar against the model's vocabulary
        try:
            grammar_for(need_tokenizer(model, "response_format"), settled.response_format)
        except InputError as e:
            raise APIError(400, str(e), param="response_format") from None
    request.options = options
    return request


def field_of(message: str, prompt_field: str = "prompt") -> str | None:
    """The request field a library message's leading name stands for ("inputs": the prompts or
    texts, which the request sent as `prompt_field`; so does a word-level tokenizer's "word ...
    is not in the vocabulary", which names no row)."""
    word = re.match(r"[a-z_][a-z_0-9]*", message)
    name = word.group(0) if word else ""
    if name in ("inputs", prompt_field):
        return prompt_field
    if name == "word" and "not in the vocabulary" in message:   # the tokenizer's, on a prompt
        return prompt_field
    if name in _REQUEST_FIELDS:
        return name
    return _FIELD_OF.get(name, name if name in _SAME_NAME else None)


# -- tokenize / detokenize --------------------------------------------------------------------------
def tokenize_request(body: dict) -> tuple[str, bool]:
    """POST /tokenize (vLLM's): `prompt` a string, or chat `messages` made one prompt by the chat
    rule; `add_special_tokens` (default true: the ids a completion's prompt becomes) ->
    (the text, whether to add them)."""
    if "messages" in body and body["messages"] is not None:
        if body.get("prompt") is not None:
            raise APIError(400, "send prompt or messages, not both", param="messages")
        prompt = chat_prompt(body["messages"])
    else:
        prompt = _get(body, "prompt", lambda v: isinstance(v, str), "a string")
        if prompt is None:
            raise APIError(400, "prompt (a string) or messages is required", param="prompt")
    add = _boolean(body, "add_special_tokens")
    return prompt, True if add is None else add


def detokenize_request(body: dict, vocab_size: int) -> list[int]:
    """POST /detokenize: `tokens` a list of token ids of the model's vocabulary."""
    tokens = _get(body, "tokens", lambda v: isinstance(v, list) and all(
        is_integer(t) and 0 <= t < vocab_size for t in v),
        f"a list of token ids (integers in 0..{vocab_size - 1})")
    if tokens is None:
        raise APIError(400, "tokens is required: a list of token ids", param="tokens")
    return [int(t) for t in tokens]


# -- score, rerank ----------------------------------------------------------------------------------
@dataclass
class ScoreRequest:
    texts_1: list[str]      # one text, or as many as texts_2
    texts_2: list[str]
    normalize: bool         # a seq2seq model's score per target token instead of the sum


def score_request(body: dict, max_inputs: int = DEFAULT_MAX_INPUTS) -> ScoreRequest:
    """POST /v1/score (vLLM's): `text_1` a string or a list, `text_2` a string or a list; one
    text_1 scores every text_2, or the lists pair up."""
    texts = []
    for field in ("text_1", "text_2"):
        value = _strings(body, field)
        if value is None:
            raise APIError(400, f"{field} is required: a string or a non-empty list of strings",
                           param=field)
        _check_count(value, field, "texts", max_inputs)
        texts.append(value)
    if len(texts[0]) not in (1, len(texts[1])) and len(texts[1]) != 1:
        raise APIError(400, f"text_1 has {len(texts[0])} texts and text_2 {len(texts[1])}: send "
                       "one text_1, or as many as text_2", param="text_2")
    return ScoreRequest(texts[0], texts[1], bool(_boolean(body, "normalize")))


@dataclass
class RerankRequest:
    query: str
    documents: list[str]
    top_n: int | None
    return_documents: bool
    truncate: int | None = None   # truncate_prompt_tokens: monoT5 inputs cut to fit it


def rerank_request(body: dict, max_inputs: int = DEFAULT_MAX_INPUTS,
                   max_input_tokens: int | None = None) -> RerankRequest:
    """POST /v1/rerank, /rerank (Cohere's and Jina's shape): `query` a string, `documents`
    strings or {"text": ...} objects, `top_n`, `return_documents` (default true), and vLLM's
    `truncate_prompt_tokens` (a seq2seq reranker's inputs: documents cut to fit it, at most the
    server's max_input_tokens)."""
    query = _get(body, "query", lambda v: isinstance(v, str), "a string")
    if query is None:
        raise APIError(400, "query is required: a string", param="query")
    raw = body.get("documents")
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "documents is required: a non-empty list of strings or "
                       "{\"text\": ...} objects", param="documents")
    _check_count(raw, "documents", "documents", max_inputs)
    documents = []
    for i, d in enumerate(raw):
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str):
            raise APIError(400, f"documents[{i}] must be a string or an object with a text "
                           f"string, got {short_repr(d)}", param="documents")
        documents.append(text)
    keep = _boolean(body, "return_documents")
    truncate = _integer(body, "truncate_prompt_tokens", 1)
    if truncate is not None and max_input_tokens is not None and truncate > max_input_tokens:
        raise APIError(400, f"truncate_prompt_tokens {truncate} is over this server's limit of "
                       f"{max_input_tokens} prompt tokens", param="truncate_prompt_tokens")
    return RerankRequest(query, documents, _integer(body, "top_n", 1),
                         True if keep is None else keep, truncate)


# -- embeddings -------------------------------------------------------------------------------------
@dataclass
class EmbeddingRequest:
    texts: list[str]
    base64: bool            # encoding_format "base64": little-endian float32 bytes
    dimensions: int | None


def embedding_request(body: dict, max_inputs: int = DEFAULT_MAX_INPUTS) -> EmbeddingRequest:
    """POST /v1/embeddings: `input` a string or a non-empty list of at most `max_inputs`
    strings. An empty string is a text like any other (model.embed, `minfer embed` and
    sentence-transformers embed it: its special tokens alone)."""
    value = body.get("input")
    if isinstance(value, list) and value and all(is_integer(t) or isinstance(t, list)
                                                 for t in value):
        raise APIError(400, "input: token ids are not supported here, send text", param="input")
    texts = _strings(body, "input")
    if texts is None:
        raise APIError(400, "input is required: a string or a list of strings", param="input")
    _check_count(texts, "input", "inputs", max_inputs)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise APIError(400, f"encoding_format must be \"float\" or \"base64\", got {short_repr(fmt)}",
                       param="encoding_format")
    return EmbeddingRequest(texts, fmt == "base64", _integer(body, "dimensions", 1))
