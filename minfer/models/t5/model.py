"""T5's public class: the shared façade plus encode / forward and per-request decode states."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import numpy as np

from ...errors import InputError
from ...generation.protocol import DecodeState
from ..base import Model, as_batch
from . import math as t5
from .spec import FAMILY, DecodeBuffers


class T5DecodeState(DecodeState):
    """One generation's state: its arena buffers (KV caches, cross K/V, step scratch) and the
    position. Lives inside `T5Model.start_decoding`'s arena scope: not usable after it closes."""

    def __init__(self, model: "T5Model", buffers: DecodeBuffers, batch: int, max_len: int):
        self.be, self.cfg, self.params = model.backend, model.config, model.params
        self.buf, self.max_len = buffers, max_len
        self.batch = batch          # live rows (<= the allocated batch); `reorder` shrinks it
        self.live = buffers         # views of the live rows, rebuilt only when they change
        self.length = 0             # positions already in the self-attention caches
        self.first_tokens = np.full(batch, self.cfg.decoder_start_token_id, np.int64)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """(b,) tokens at the next position -> logits (b, V) float32 (on the CPU a view of the
        arena, valid until the next step)."""
        if self.length >= self.max_len:
            raise InputError(f"decode state is full ({self.max_len} positions)")
        with self.be.arena.scope():  # on CUDA, CuPy's temporaries of this step come from here
            logits = t5.decode_step(self.be, self.cfg, self.params, self.live, tokens, self.length)
            self.length += 1
            return np.asarray(self.be.to_host(logits), np.float32)

    def reorder(self, rows: Sequence[int] | np.ndarray, cross: bool = True) -> None:
        rows = np.asarray(rows, np.int64)
        if rows.ndim != 1 or len(rows) == 0 or len(rows) > self.batch \
                or rows.min() < 0 or rows.max() >= self.batch:
            raise InputError(f"reorder: rows must be 1..{self.batch} indices below {self.batch}")
        n = len(rows)
        if not (n == self.batch and (rows == np.arange(n)).all()):
            t5.reorder_state(self.be, self.buf, rows, self.length, cross)
        if n != self.batch:
            self.batch, self.live = n, self.buf.rows(n)


class T5Model(Model):
    """A loaded T5 (v1.0, v1.1 / flan-t5, mT5): encode, forward, generate."""

    spec = FAMILY

    def encode(self, input_ids: Any, attention_mask: Any = None) -> np.ndarray:
        """(B, T) token ids -> encoder states (B, T, C) float32 on the host."""
        ids, mask = self.batch(input_ids, attention_mask)
        be = self.backend
        with be.arena.scope():
            out = be.arena.alloc((*ids.shape, self.config.d_model), be.dtype, "encoder output")
            t5.encode(be, self.config, self.params, ids, mask, out)
            return np.array(be.to_host(out), dtype=np.float32)

    def forward(self, input_ids: Any, decoder_input_ids: Any, attention_mask: Any = None) -> np.ndarray:
        """Teacher-forced logits (B, T_dec, V) float32 for given encoder and decoder ids."""
        ids, mask = self.batch(input_ids, attention_mask)
        dec, _ = as_batch(decoder_input_ids, self.config.pad_token_id, self.config.vocab_size,
                          "decoder_input_ids")
        if dec.shape[0] != ids.shape[0]:
            raise InputError(f"decoder_input_ids: batch {dec.shape[0]} != input_ids batch "
                             f"{ids.shape[0]}")
        be = self.backend
        with be.arena.scope():
            enc = be.arena.alloc((*ids.shape, self.config.d_model), be.dtype, "encoder output")
            t5.encode(be, self.config, self.params, ids, mask, enc)
            return t5.decode_full(be, self.config, self.params, dec, enc, mask)

    @contextlib.contextmanager
    def start_decoding(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                       max_len: int, repeat: int = 1) -> Iterator[T5DecodeState]:
        """Encode once, fill the cross-attention K/V and yield a decode state of `max_len`
        positions and B * repeat rows (row i * repeat + j decodes input i: beams, samples).
        Everything it holds is arena memory released when the `with` block exits."""
        be = self.backend
        B, S = input_ids.shape
        with be.arena.scope():
            buf = DecodeBuffers.allocate(be.arena, self.config, B * repeat, S, max_len, be.dtype)
            t5.start_state(be, self.config, self.params, input_ids, attention_mask, buf, max_len,
                           repeat)
            be.end_bulk_phase()  # the encoder's large products are done; steps are small ones
            yield T5DecodeState(self, buf, B * repeat, max_len)
