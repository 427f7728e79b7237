"""The decoding protocol between generation and the model families.

Generation imports no model: it drives anything that implements `DecodingModel`, and both
families implement it explicitly (models/base.py). A model opens a `DecodeState` per request
(`start_decoding`, a context manager that releases the state's memory on exit); the loops call
`step` once per position and `reorder` when rows finish or beams follow their parents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ContextManager, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class TokenIds:
    """The token ids generation needs to know about."""
    eos: tuple[int, ...]       # ids that end a sequence (Transformer-XL: none, <eos> ends a line)
    pad: int                   # what finished beams are padded with when there is no eos
    start: int | None = None   # the decoder start token of an encoder-decoder model


@runtime_checkable
class DecodeState(Protocol):
    """One request's incremental decoding state (KV caches, segment memory, ...)."""

    batch: int                 # live rows
    first_tokens: np.ndarray   # (B,) what step 0 is fed: the decoder start token, or the prompt's
                               # last token for a decoder-only model

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """One token per live row (b,) -> that position's scores (b, V) as float32 on the host
        (logits, or log-probabilities for Transformer-XL); valid until the next step."""
        ...

    def reorder(self, rows: np.ndarray, cross: bool = True) -> None:
        """Keep / repeat live rows (finished rows leave, beams follow their parents); `cross=False`
        when every row keeps its source (beams of one input), so cross-attention K/V stay."""
        ...


@runtime_checkable
class DecodingModel(Protocol):
    """What generation reads of a model."""

    token_ids: TokenIds
    is_encoder_decoder: bool   # results keep the start token (HF's convention); decoder-only
                               # results are the new tokens only
    add_eos_to_prompt: bool    # T5 prompts end with </s>; Transformer-XL prompts do not
    tokenizer: Any             # or None: token-id input only
    folder: str
    hf_config: dict            # config.json (task_specific_params, generation keys)
    generation_config: dict    # generation_config.json, or {}

    def batch(self, input_ids: Any, attention_mask: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Token-id lists or a (B, T) array -> validated (B, T) int64 ids and mask."""
        ...

    def start_decoding(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                       max_len: int, repeat: int = 1) -> ContextManager[DecodeState]:
        """A state of B * repeat rows for B inputs: row i * repeat + j decodes input i (beams, or
        several samples of one prompt), and each input is processed once. The state is the
        request's own (arena holds), so any number may be open at once, from any threads."""
        ...

    def step_together(self, states: list[DecodeState],
                      tokens: list[np.ndarray]) -> list[np.ndarray]:
        """One step for several states at once (continuous batching: requests that decode at
        the same time share each step's weight reads): per state its (b,) tokens in, its (b, V)
        scores out. Equal to stepping each state alone, up to float rounding. A state whose own
        scores hold NaN or infinity gets its NonFiniteError in its place (the others go on)."""
        ...
