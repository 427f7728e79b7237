"""The text layer: prompts in, text (or token ids) out, optionally streamed as decided.

Prompts are tokenized (with a task's prefix), batched, decoded by the search loops, and detokenized
per row as tokens arrive (`tokenizer.IncrementalDecoder`), with stop strings cut as soon as they
appear and never emitted. `generate` is what the models' public `generate()` calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import InputError
from .options import GenerationOptions, is_integer, resolve_options
from .protocol import DecodingModel
from .search import Hypothesis, beam_search, token_loop


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back any tail that could still become
    one, so what is emitted never has to be taken back."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """New text in -> (text safe to emit, whether a stop string was hit)."""
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[:min(hits)], True
        hold = 0
        for s in self.stops:  # longest suffix of buf that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Result:
    """One generated sequence with what the CLI's --json and callers may want to know."""
    text: str | None             # None for token-id requests without a tokenizer
    token_ids: list[int]         # encoder-decoder: starts with the decoder start token (HF's
                                 # convention); decoder-only: the new tokens only
    finish_reason: str           # "eos", "length" or "stop"
    prompt_tokens: int
    new_tokens: int
    seconds: float = 0.0
    score: float | None = None   # beam score (length-penalised log-probability)


class _RowText:
    """Per-row streaming detokeniser plus stop-string matcher."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], eos: set[int]):
        from ..tokenizer import IncrementalDecoder
        self.decoder = IncrementalDecoder(tokenizer)
        self.matcher = StopMatcher(stops)
        self.eos = eos
        self.text: list[str] = []
        self.stopped = False

    def push(self, token: int) -> str:
        """A new token -> the text it makes safe to emit ("" while held back)."""
        if self.stopped or token in self.eos:
            return ""
        out, self.stopped = self.matcher.feed(self.decoder.push(int(token)))
        self.text.append(out)
        return out

    def finish(self) -> str:
        if self.stopped:
            return ""
        out, self.stopped = self.matcher.feed(self.decoder.flush())
        if not self.stopped:
            out += self.matcher.flush()
        self.text.append(out)
        return out


def _normalise_inputs(inputs: Any) -> tuple[str, list]:
    """-> ("text", [str]) | ("texts", [str, ...]) | ("ids", [[id, ...], ...]). Prompts are checked
    here (type, valid Unicode, not blank), token ids by `model.batch` (models/base.py: as_batch),
    which names a bad row and position."""
    if isinstance(inputs, str):
        return "text", [_check_prompt(inputs, None)]
    if isinstance(inputs, np.ndarray) or (hasattr(inputs, "shape") and hasattr(inputs, "dtype")):
        arr = np.asarray(inputs)
        if arr.ndim not in (1, 2) or arr.size == 0:
            raise InputError(f"inputs: expected a non-empty (batch, length) array of token ids, "
                             f"got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):  # floats, bools, objects are no token ids
            raise InputError(f"inputs: expected integer token ids, got dtype {arr.dtype}")
        return "ids", [list(r) for r in (arr[None] if arr.ndim == 1 else arr)]
    if isinstance(inputs, (list, tuple)) and inputs:
        if isinstance(inputs[0], str):   # prompts: every item must be one
            return "texts", [_check_prompt(p, i) for i, p in enumerate(inputs)]
        if all(is_integer(t) for t in inputs):
            return "ids", [list(inputs)]
        for i, row in enumerate(inputs):  # rows of token ids: as_batch checks what they hold
            if not isinstance(row, (list, tuple, np.ndarray)):
                raise InputError(f"inputs: item {i} is {type(row).__name__}: expected every item "
                                 "to be a list of token ids (or every item a prompt string)")
        return "ids", list(inputs)
    raise InputError("inputs: expected a prompt string, a list of prompts or token-id lists, "
                     f"got {type(inputs).__name__ if inputs is not None else 'None'}"
                     + (" (empty)" if isinstance(inputs, (list, tuple)) else ""))


def _check_prompt(prompt: Any, i: int | None) -> str:
    """A prompt string: valid Unicode (no lone surrogate) and not blank, or a one-line error."""
    where = "inputs" if i is None else f"inputs: prompt {i}"
    if not isinstance(prompt, str):
        raise InputError(f"{where} is {type(prompt).__name__}: expected every item to be a prompt "
                         "string (or every item a list of token ids)")
    if not prompt.strip():
        raise InputError(f"{where}: empty prompt (nothing but whitespace)")
    from ..tokenizer import check_text   # the tokenizer's own check, here naming the prompt
    check_text(prompt, where)
    return prompt


# The vocabulary files a checkpoint of each kind ships (tokenizer.load_tokenizer reads any of
# them): T5, the encoder-decoder family, tokenizer.json or spiece.model; Transformer-XL, the
# decoder-only one, its word vocabulary.
_TOKENIZER_FILES = {True: "tokenizer.json or spiece.model",
                    False: "vocab.txt, vocab.pkl, vocab.bin or vocab.json"}


def tokenizer_files(model: DecodingModel) -> str:
    """The vocabulary files a model of this kind would have its tokenizer read from."""
    return _TOKENIZER_FILES[bool(model.is_encoder_decoder)]


def need_tokenizer(model: DecodingModel, why: str) -> Any:
    if model.tokenizer is None:
        raise InputError(f"{why} requires a tokenizer, and {model.folder} has none "
                         f"({tokenizer_files(model)}): pass token ids instead")
    return model.tokenizer


def _prompt_ids(model: DecodingModel, kind: str, prompts: list, prefix: str, tok: Any) -> list[list[int]]:
    if kind == "ids":
        pre = tok.encode(prefix, add_eos=False) if prefix and tok is not None else []
        return [pre + list(p) for p in prompts]
    return [tok.encode(prefix + p, add_eos=model.add_eos_to_prompt) for p in prompts]


def _batches(model: DecodingModel, rows: list, attention_mask: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """One padded batch, or (decoder-only models, which cannot pad) one batch per length."""
    if attention_mask is not None:
        # the rows' ids are checked as lists first (errors name the row and position; a ragged
        # or out-of-range list never reaches NumPy), then paired with the mask
        ids, _ = model.batch(rows)
        if len({len(r) for r in rows}) > 1:  # padding them would put a token under the mask
            raise InputError("attention_mask: the token-id rows must have equal lengths "
                             f"(got {sorted({len(r) for r in rows})})")
        return [model.batch(ids, attention_mask)]
    if model.is_encoder_decoder or len({len(r) for r in rows}) <= 1:
        return [model.batch(rows)]
    return [model.batch([r]) for r in rows]


def _finish(model: DecodingModel, h: Hypothesis, text: str | None, reason: str, prompt_len: int,
            score: float | None = None) -> Result:
    ids = h.tokens if model.is_encoder_decoder else h.tokens[1:]
    return Result(text, ids, reason, prompt_len, len(h.tokens) - 1, score=score)


def _run_batch(model: DecodingModel, ids: np.ndarray, mask: np.ndarray, opts: GenerationOptions,
               tok: Any) -> list[list[Result]]:
    eos = set(model.token_ids.eos)
    n = opts.num_return_sequences
    prompt_lens = mask.sum(axis=1)
    enc_dec = model.is_encoder_decoder
    if opts.num_beams > 1:
        results = []
        for i, hyps in enumerate(beam_search(model, ids, mask, opts)):
            row = []
            for h in hyps:
                text, reason = None, h.finish_reason
                if tok is not None:
                    text, hit = StopMatcher(opts.stop).feed(
                        tok.decode(h.tokens if enc_dec else h.tokens[1:]))
                    reason = "stop" if hit else reason
                row.append(_finish(model, h, text, reason, int(prompt_lens[i]), h.score))
            results.append(row)
        return results
    hyps = [Hypothesis([]) for _ in range(ids.shape[0] * n)]
    texts = [_RowText(tok, opts.stop, eos) for _ in hyps] if tok is not None else None
    stopped: set[int] = set()
    info: dict = {}
    for step, (rows, tokens) in enumerate(token_loop(model, ids, mask, opts, stopped=stopped,
                                                     info=info, repeat=n)):
        if step == 0:
            for h, first in zip(hyps, info["first"]):
                h.tokens.append(int(first))
        for r, t in zip(rows, tokens):
            hyps[r].tokens.append(int(t))
            if t in eos:
                hyps[r].finish_reason = "eos"
            elif texts is not None:
                texts[r].push(t)
                if texts[r].stopped:
                    stopped.add(int(r))
                    hyps[r].finish_reason = "stop"
    results = []
    for i in range(ids.shape[0]):
        row = []
        for j in range(i * n, (i + 1) * n):
            text = None
            if texts is not None:
                texts[j].finish()
                text = "".join(texts[j].text)
            row.append(_finish(model, hyps[j], text, hyps[j].finish_reason, int(prompt_lens[i])))
        results.append(row)
    return results


def run(model: DecodingModel, inputs: Any, *, task: str | None = None, attention_mask: Any = None,
        **options: Any) -> tuple[str, list[list[Result]]]:
    """Decode every prompt; returns the input kind and per prompt its list of results."""
    opts, prefix = resolve_options(model, task, **options)
    kind, prompts = _normalise_inputs(inputs)
    if attention_mask is not None and kind != "ids":
        raise InputError("attention_mask: pass it only with token ids (text prompts make their own)")
    tok = model.tokenizer
    if kind != "ids" or opts.stop:
        tok = need_tokenizer(model, "text input" if kind != "ids" else "stop strings")
    rows = _prompt_ids(model, kind, prompts, prefix, tok)
    results: list[list[Result]] = []
    for ids, mask in _batches(model, rows, attention_mask):
        t0 = time.perf_counter()
        batch_results = _run_batch(model, ids, mask, opts, tok)
        seconds = time.perf_counter() - t0
        for row in batch_results:
            for r in row:
                r.seconds = seconds
        results += batch_results
    return kind, results


def stream(model: DecodingModel, inputs: Any, *, task: str | None = None, **options: Any) -> Iterator[Any]:
    """Text pieces (or token ids, for token-id input) as they are decided, for one prompt.
    Beam search cannot know its result before the end: it yields the final text once.
    Closing the iterator stops decoding and releases its arena memory. Inputs are checked now,
    not at the first `next()`."""
    opts, prefix = resolve_options(model, task, **options)
    kind, prompts = _normalise_inputs(inputs)
    if len(prompts) != 1:
        raise InputError(f"stream=True takes one prompt, got {len(prompts)}")
    if opts.num_return_sequences != 1:
        raise InputError("stream=True returns one sequence: num_return_sequences must be 1")
    tok = model.tokenizer
    if kind != "ids" or opts.stop:
        tok = need_tokenizer(model, "text input" if kind != "ids" else "stop strings")
    rows = _prompt_ids(model, kind, prompts, prefix, tok)
    if opts.num_beams > 1:
        return _stream_beam(model, rows, kind, opts, tok)
    ids, mask = model.batch(rows)
    return stream_tokens(model, ids, mask, kind, opts, tok)


def _stream_beam(model: DecodingModel, rows: list, kind: str, opts: GenerationOptions, tok: Any) -> Iterator[Any]:
    ids, mask = model.batch(rows)
    r = _run_batch(model, ids, mask, opts, tok)[0][0]
    if kind != "ids":
        yield r.text
    else:
        yield from r.token_ids[len(r.token_ids) - r.new_tokens:]


def stream_tokens(model: DecodingModel, ids: np.ndarray, mask: np.ndarray, kind: str,
                  opts: GenerationOptions, tok: Any, start_decoding: Any = None,
                  on_done: Any = None) -> Iterator[Any]:
    """Text pieces (kind "text") or token ids (kind "ids") of one row as they are decided.
    `start_decoding` replaces the model's (a session continuing its memory); `on_done(tokens)`
    receives the generated ids when the stream ends, however it ends."""
    eos = set(model.token_ids.eos)
    text = _RowText(tok, opts.stop, eos) if kind != "ids" or opts.stop else None
    generated: list[int] = []
    loop = token_loop(model, ids, mask, opts, start_decoding=start_decoding)
    try:
        for _, tokens in loop:
            t = int(tokens[0])
            generated.append(t)
            if text is not None:
                piece = text.push(t)
                if kind != "ids" and piece:
                    yield piece
                if text.stopped:
                    return
            if kind == "ids":
                yield t
        if kind != "ids":
            tail = text.finish()
            if tail:
                yield tail
    finally:
        loop.close()
        if on_done is not None:
            on_done(generated)


def generate(model: DecodingModel, inputs: Any, *, stream_output: bool = False, task: str | None = None,
             return_details: bool = False, attention_mask: Any = None, **options: Any) -> Any:
    """The public generate(): see `T5Model.generate`."""
    for name, value in (("stream", stream_output), ("return_details", return_details)):
        if not isinstance(value, (bool, np.bool_)):  # "no" would be truthy: a silent stream
            raise InputError(f"{name} must be true or false (a bool), got {value!r:.40}")
    if stream_output:
        if return_details or attention_mask is not None:
            raise InputError("stream=True does not combine with return_details or attention_mask")
        return stream(model, inputs, task=task, **options)
    kind, results = run(model, inputs, task=task, attention_mask=attention_mask, **options)
    if return_details:
        return results
    if kind == "ids":
        return [r.token_ids for row in results for r in row]
    texts = [[r.text for r in row] for row in results]
    shaped = [t[0] if len(t) == 1 else t for t in texts]
    return shaped[0] if kind == "text" else shaped
