"""Model-agnostic decoding loops over a model's incremental `DecodeState`.

A model provides `start_decoding(ids, mask, max_len)` (a context manager yielding a state whose
`step(tokens (B,)) -> logits (B, V)` feeds one token per row) and a config with
`decoder_start_token_id`, `eos_token_ids` and `pad_token_id`. Greedy decoding matches Hugging Face
transformers: float32 logits, eos masked while fewer than `min_new_tokens` tokens were made,
argmax taking the first index on ties, finished rows padded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import InputError

# When neither the call nor the checkpoint's generation_config.json says how long to decode.
# Deliberately long: a silent 20-token cut (HF's max_length default) truncates real outputs.
DEFAULT_MAX_NEW_TOKENS = 256


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InputError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def resolve_max_new_tokens(model: Any, max_new_tokens: int | None) -> int:
    if max_new_tokens is None:
        max_new_tokens = model.generation_config.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS
    return _check_int("max_new_tokens", max_new_tokens, 1)


def suppress_tokens(logits: np.ndarray, token_ids: tuple[int, ...]) -> np.ndarray:
    """A copy of logits (B, V) with `token_ids` set to -inf (the input is left untouched)."""
    out = np.array(logits, dtype=np.float32, copy=True)
    out[:, list(token_ids)] = -np.inf
    return out


def greedy_generate(model: Any, input_ids: np.ndarray, attention_mask: np.ndarray,
                    max_new_tokens: int | None = None, min_new_tokens: int = 0) -> list[list[int]]:
    """Greedy decoding of a padded batch. Returns per row [start, tok, ..., eos?]."""
    cfg = model.config
    max_new = resolve_max_new_tokens(model, max_new_tokens)
    min_new = _check_int("min_new_tokens", min_new_tokens, 0)
    B = input_ids.shape[0]
    eos = np.asarray(cfg.eos_token_ids, dtype=np.int64)
    tokens = np.full(B, cfg.decoder_start_token_id, np.int64)
    out = [[int(cfg.decoder_start_token_id)] for _ in range(B)]
    finished = np.zeros(B, bool)
    with model.start_decoding(input_ids, attention_mask, max_new) as state:
        for step in range(max_new):
            logits = model.backend.to_host(state.step(tokens))  # (B, V)
            if step < min_new:
                logits = suppress_tokens(logits, cfg.eos_token_ids)
            tokens = np.argmax(logits, axis=-1).astype(np.int64)
            tokens[finished] = cfg.pad_token_id
            for r in np.flatnonzero(~finished):
                out[r].append(int(tokens[r]))
            finished |= np.isin(tokens, eos)
            if finished.all():
                break
    return out
