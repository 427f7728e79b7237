"""T5's public class: the shared façade plus encode / forward and per-request decode states."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import numpy as np

from ...embedding import given, text_list
from ...encoding.cache import row_key
from ...encoding.presets import preset_named
from ...encoding.tensors import as_tensors, check_tensors_option, stays_on_device
from ...errors import ArenaExhausted, InputError, NonFiniteError
from ...numerics import all_finite, first_bad_layer, first_non_finite, non_finite, quiet
from ...generation.protocol import DecodeState
from ...io.sentence_transformers import SentenceModules
from ...tokenizers.select import need_tokenizer
from ...padding import is_right_padding, right_padded
from ..base import PLAN_MAX, Model, as_batch
from . import math as t5
from .buffers import DecodeBuffers, StepScratch
from .family import FAMILY


class T5DecodeState(DecodeState):
    """One generation's state: its arena buffers (KV caches, cross K/V, step scratch) and the
    position. Lives inside `T5Model.start_decoding`'s arena scope: not usable after it closes."""

    def __init__(self, model: "T5Model", buffers: DecodeBuffers, batch: int, max_len: int):
        self.be, self.cfg, self.params = model.backend, model.config, model.params
        self.model = model
        self.lock = model.lock
        self.buf, self.max_len = buffers, max_len
        self.batch = batch          # live rows (<= the allocated batch); `reorder` shrinks it
        self.live = buffers         # views of the live rows, rebuilt only when they change
        self.length = 0             # positions already in the self-attention caches
        self.first_tokens = np.full(batch, self.cfg.decoder_start_token_id, np.int64)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """(b,) tokens at the next position -> logits (b, V) float32 (on the CPU a view of the
        arena, valid until the next step)."""
        self.check_room()
        # CUDA: CuPy's temporaries come from the scope
        with self.lock, quiet(), self.be.arena.scope():
            logits = t5.decode_steps(self.be, self.cfg, self.params, [(self.live, self.length)],
                                     tokens, self.live, self.live.logits)
            result = self.took_step(np.asarray(self.be.to_host(logits), np.float32))
            if isinstance(result, NonFiniteError):
                raise result
            return result

    def took_step(self, logits: np.ndarray) -> np.ndarray | NonFiniteError:
        """After a step wrote this state's caches at its position: its host logits (b, V) when
        finite, else the NonFiniteError naming where they began; the position moves on."""
        error = self.non_finite(logits)
        self.length += 1
        return logits if error is None else error

    def non_finite(self, logits: np.ndarray) -> NonFiniteError | None:
        """None when this step's host logits (b, V) are finite, else the NonFiniteError naming
        where NaN or infinity began: the encoder's output when the cross-attention keys and
        values hold them, else the decoder layer read from the self-attention caches this step
        wrote at its position. Call before `length` moves on."""
        if all_finite(np, logits):
            return None
        xp, L = self.be.xp, self.cfg.num_decoder_layers
        if not all_finite(xp, self.live.cross_k, self.live.cross_v):
            where = "the encoder's output (every decoder layer's cross-attention keys and values)"
        else:
            where = first_bad_layer(xp, [self.live.self_k[i][:, :, self.length] for i in range(L)],
                                    L, "decoder ")
        return non_finite(self.model, "logits", where)

    def check_room(self) -> None:
        if self.length >= self.max_len:
            raise InputError(f"decode state is full ({self.max_len} positions)")

    def reorder(self, rows: Sequence[int] | np.ndarray, cross: bool = True) -> None:
        rows = np.asarray(rows, np.int64)
        if rows.ndim != 1 or len(rows) == 0 or len(rows) > self.batch \
                or rows.min() < 0 or rows.max() >= self.batch:
            raise InputError(f"reorder: rows must be 1..{self.batch} indices below {self.batch}")
        n = len(rows)
        if not (n == self.batch and (rows == np.arange(n)).all()):
            with self.lock:
                t5.reorder_state(self.be, self.buf, rows, self.length, cross)
        if n != self.batch:
            self.batch, self.live = n, self.buf.rows(n)


class T5Model(Model):
    """A loaded T5 (v1.0, v1.1 / flan-t5, mT5, UMT5; or only its encoder): encode, embed,
    forward, generate."""

    family = FAMILY
    sentence_modules: SentenceModules | None = None   # a sentence-transformers folder's head

    @property
    def parts(self) -> tuple[str, ...]:
        return self.config.parts + (("pooling",) if self.sentence_modules is not None else ())

    def encode(self, inputs: Any, attention_mask: Any = None, *, padding: str = "longest",
               max_length: int | None = None, truncation: bool = False,
               use_attention_mask: bool = True, preset: str | None = None,
               return_mask: bool = False, return_tensors: str | None = None,
               padding_states: bool = True) -> Any:
        """Token ids ((B, T) array or id lists) or text (a string or a list of them, tokenized
        with `</s>`) -> encoder states (B, T, C) float32 on the host.

        padding: "longest" (rows padded to the longest) or "max_length" (every row padded to
            `max_length` tokens). max_length: longer rows are an error, or cut to it with
            truncation=True (text keeps its closing `</s>`, as transformers' tokenizers cut).
        use_attention_mask: False attends to the padding too, as diffusers' Flux and SD3
            pipelines call their T5 text encoder (padding="max_length", max_length=512 or 256,
            truncation=True, no attention mask: every position's state is used).
        preset: a diffusion pipeline's rule, "flux", "sd3", "wan", "chroma" or "ltx"
            (minfer/encoding/presets.py: its prompt cleaning, padding and cut to its length, the
            mask the encoder sees, Wan's states past the prompt set to zero); the states are what
            that pipeline computes before its cast to the encoder's dtype. `max_length=` overrides
            the preset's length; padding, truncation and use_attention_mask are the preset's.
        return_mask: return (states, mask (B, T) int64): the mask the preset's pipeline hands its
            transformer (chroma, ltx), else which positions hold the input's tokens.
        return_tensors: "np" (default) or "pt": torch tensors sharing the arrays' memory (DLPack,
            no copy; needs torch). On a CUDA model "pt" tensors (and "cupy": CuPy arrays) are on
            the model's device, states and mask: the states never go through the host.
        padding_states: False when only each row's own tokens' states are wanted (the mask
            used, right padding): the padded positions' states are zeros, and cached rows are
            keyed by their own tokens, whatever the padding of the call they came in (embed,
            /v1/encode and Wan's preset, which zeroes them anyway, ask for this).
        With `encode_cache=` at load, rows already encoded with the same ids and mask come from
        the cache (the same bytes as when they were computed).
        """
        rule = None
        if preset is not None:
            rule = preset_named(preset)
            if padding != "longest" or truncation or not use_attention_mask:
                raise InputError(f"encode(): preset {rule.name!r} sets padding, truncation and the "
                                 "mask; only max_length= overrides it")
            padding, truncation, use_attention_mask = "max_length", True, rule.encoder_mask
            max_length = rule.max_length if max_length is None else max_length
            if rule.clean is not None and _is_text(inputs):
                inputs = [rule.clean(t) for t in text_list(inputs, "encode()")]
        on_gpu = self.backend.device != "cpu"
        check_tensors_option(return_tensors, on_gpu=on_gpu)
        on_device = stays_on_device(return_tensors, on_gpu)
        ids, mask = self._encoder_batch(inputs, attention_mask, padding, max_length, truncation)
        own = use_attention_mask and (not padding_states or bool(rule and rule.zero_tail))
        states = self.encoder_states(ids, mask if use_attention_mask else np.ones_like(mask), own,
                                     on_device)
        if rule is not None and rule.zero_tail:   # (B, T, C): the padding's states -> 0
            _zero_padding(self.backend, states, mask)
        if not return_mask:
            return as_tensors(states, return_tensors)
        handed_on = rule.pipeline_mask(mask) if rule is not None else None
        handed_on = mask if handed_on is None else handed_on
        if on_device:   # (B, T): beside the states, where a pipeline reads both
            handed_on = self.backend.asarray(handed_on)
        return as_tensors(states, return_tensors), as_tensors(handed_on, return_tensors)

    @property
    def cache_identity(self) -> str:
        """What makes this model's encoder rows its own in an encode cache: the weights' source
        and how they are stored and computed."""
        be = self.backend
        return (f"{type(self).__name__}|{self.folder}|{be.device}|{np.dtype(be.dtype).name}|"
                f"{be.weight_format}|{be.compute}")

    def encoder_states(self, ids: np.ndarray, mask: np.ndarray, own_tokens: bool = False,
                       on_device: bool = False) -> Any:
        """(B, T) ids and the (B, T) mask the encoder attends with -> states (B, T, C) float32,
        each row from the encode cache when it holds it (the rest computed together, then
        kept). `own_tokens` (a right-padding mask): only each row's own tokens' states are
        wanted; the padding's are zeros and a row is keyed by its own tokens (as generation
        keys it), whatever the padding of the call. `on_device`: the states in a device array
        the caller owns (Backend.owned_empty); without a cache they never reach the host, with
        one the cache's host rows are assembled and uploaded once."""
        lengths = mask.sum(axis=1)
        own = own_tokens and is_right_padding(mask)
        cache = self.encode_cache
        if cache is None:
            states = self._run_encoder(ids, mask, on_device)
            if own:
                _zero_padding(self.backend, states, mask)
            return states
        if own:
            keys = [row_key(self.cache_identity, row[:n], np.ones(n, np.int64))
                    for row, n in zip(ids, lengths)]
        else:
            keys = [row_key(self.cache_identity, i, m) for i, m in zip(ids, mask)]
        out = (np.zeros if own else np.empty)((*ids.shape, self.config.d_model), np.float32)
        first: dict[bytes, int] = {}    # each missing key's first row (a repeated row runs once)
        for b, key in enumerate(keys):
            hit = cache.get(key)
            if hit is not None:
                out[b, :len(hit)] = hit
            else:
                first.setdefault(key, b)
        if first:
            rows = list(first.values())
            fresh = self._run_encoder(ids[rows], mask[rows])        # (b, T, C)
            where = {}
            for j, b in enumerate(rows):
                kept = fresh[j, :lengths[b]] if own else fresh[j]
                cache.put(keys[b], kept)
                where[keys[b]] = kept
            for b, key in enumerate(keys):
                if key in where:
                    out[b, :len(where[key])] = where[key]
        if on_device:
            states = self.backend.owned_empty(out.shape, np.float32)
            self.backend.upload(states, out)
            return states
        return out

    def _run_encoder(self, ids: np.ndarray, mask: np.ndarray, on_device: bool = False) -> Any:
        """The encoder pass: (B, T) ids and mask -> states (B, T, C) float32 on the host, or
        (`on_device`) in a device array the caller owns, copied there from the arena."""
        be = self.backend
        B, T = ids.shape
        shape = (B, T, self.config.d_model)
        xp = be.xp if on_device else np       # where `out` lives
        out = be.owned_empty(shape, np.float32) if on_device else np.empty(shape, np.float32)
        # host float32 activations (the CPU): the pass writes `out` itself, not an arena copy
        # of it (8 MiB of a 512-token T5-XXL pass's arena pages left untouched)
        direct = be.xp is np and np.dtype(be.dtype) == np.float32
        with self.lock, quiet():
            # rows in passes that fit the arena's free bytes (a batch of 8 x 512 tokens of a
            # 64-head encoder needs 1.7 GB of scratch; under a memory limit it runs 4 + 4)
            step = self._rows_per_pass(B, T)
            for a in range(0, B, step):
                with be.arena.scope():
                    part = out[a:a + step] if direct else be.arena.alloc(
                        (min(step, B - a), T, self.config.d_model), be.dtype, "encoder output")
                    t5.encode(be, self.config, self.params, ids[a:a + step], mask[a:a + step], part)
                    if not direct:
                        out[a:a + step] = part if on_device else be.to_host(part)
                    if not all_finite(xp, out[a:a + step]):   # (on the device: one scalar read)
                        raise non_finite(self, "encoder states", self._where_encoder_fails(
                            ids[a:a + step], mask[a:a + step], part))
        return out

    def _where_encoder_fails(self, ids: np.ndarray, mask: np.ndarray, out: Any) -> str | None:
        """The first encoder layer whose output holds NaN or infinity (the pass run again with a
        probe; only on the failing path)."""
        be = self.backend
        return first_non_finite(be.xp, lambda probe: t5.encode(be, self.config, self.params, ids,
                                                               mask, out, probe))

    def _check_row_fits(self, length: int) -> None:
        """One row of `length` tokens fits the encoder pass in the arena's free bytes when
        nothing else runs, else ArenaExhausted now (not after ids, mask and a (B, T, C) result
        of that length were allocated outside the arena)."""
        need = self.plan(1, min(length, PLAN_MAX))["encoder_scratch"]
        if need > self.free_when_idle:
            arena = self.backend.arena
            raise ArenaExhausted(arena.name, need, self.free_when_idle, arena.capacity,
                                 f"encode(): one row of max_length {length} tokens")

    def _rows_per_pass(self, batch: int, length: int) -> int:
        """The most rows of `length` tokens whose encoder pass fits the arena's free bytes (at
        least 1: a row that does not fit fails in the arena, naming the bytes)."""
        free, rows = self.backend.arena.available, batch
        while rows > 1 and self.plan(rows, length)["encoder_scratch"] > free:
            rows = (rows + 1) // 2
        return rows

    def _encoder_batch(self, inputs: Any, attention_mask: Any, padding: str,
                       max_length: int | None, truncation: bool) -> tuple[np.ndarray, np.ndarray]:
        """encode()'s inputs -> (B, T) ids and mask, tokenized, cut and padded as asked."""
        if padding not in ("longest", "max_length"):
            raise InputError(f"encode(): padding {padding!r:.40} is not 'longest' or 'max_length'")
        if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool)
                                       or max_length < 1):
            raise InputError(f"encode(): max_length must be a positive integer, got {max_length!r:.40}")
        if padding == "max_length" and max_length is None:
            raise InputError("encode(): padding='max_length' needs max_length")
        if padding == "max_length":   # before any row is padded to it (10**9: 8 GB of ids alone)
            self._check_row_fits(max_length)
        if truncation and max_length is None:
            raise InputError("encode(): truncation=True needs max_length")
        texts = [inputs] if isinstance(inputs, str) else inputs
        # text when its first item is a string (every other item must be one too: named if not)
        is_text = isinstance(texts, (list, tuple)) and len(texts) > 0 and isinstance(texts[0], str)
        if not is_text and not isinstance(inputs, (list, tuple)) and not (
                hasattr(inputs, "shape") and hasattr(inputs, "dtype")):
            raise InputError(f"encode(): got {given(inputs)}, expected text (a string or a list "
                             "of strings) or token ids (id lists or a (batch, length) array)")
        if is_text:
            texts = text_list(texts, "encode()")
            if attention_mask is not None:
                raise InputError("encode(): attention_mask applies to token ids, not to text")
            tok = need_tokenizer(self, "encode() of text")
            if max_length is None:
                rows = tok.encode_batch(texts)
            else:   # cut as transformers does (the closing </s> kept), the work bounded by it
                rows = []
                for i, text in enumerate(texts):
                    row, cut = tok.encode_cut(text, max_length)
                    if cut and not truncation:
                        raise InputError(f"encode(): row {i} has more than max_length "
                                         f"{max_length} tokens (truncation=True cuts it)")
                    rows.append(row)
        elif max_length is None and padding == "longest":
            return self.batch(inputs, attention_mask)
        else:
            ids, mask = self.batch(inputs, attention_mask)
            rows = [list(r[m.astype(bool)]) for r, m in zip(ids, mask)]
        for i, row in enumerate(rows):   # token-id rows (text rows are cut above)
            if max_length is not None and len(row) > max_length:
                if not truncation:
                    raise InputError(f"encode(): row {i} has {len(row)} tokens, more than "
                                     f"max_length {max_length} (truncation=True cuts it)")
                rows[i] = row[:max_length]
        ids, mask = right_padded(rows, self.token_ids.pad,
                                 max_length if padding == "max_length" else None)
        return self.batch(ids, mask)

    def forward(self, input_ids: Any, decoder_input_ids: Any, attention_mask: Any = None) -> np.ndarray:
        """Teacher-forced logits (B, T_dec, V) float32 for given encoder and decoder ids."""
        self.check_can_generate()
        ids, mask = self.batch(input_ids, attention_mask)
        dec, _ = as_batch(decoder_input_ids, self.config.pad_token_id, self.config.vocab_size,
                          "decoder_input_ids")
        if dec.shape[0] != ids.shape[0]:
            raise InputError(f"decoder_input_ids: batch {dec.shape[0]} != input_ids batch "
                             f"{ids.shape[0]}")
        be = self.backend
        with self.lock, quiet(), be.arena.scope():
            enc = be.arena.alloc((*ids.shape, self.config.d_model), be.dtype, "encoder output")
            t5.encode(be, self.config, self.params, ids, mask, enc)
            logits = t5.decode_full(be, self.config, self.params, dec, enc, mask)
            if not all_finite(np, logits):
                where = self._where_encoder_fails(ids, mask, enc) or first_non_finite(
                    be.xp, lambda probe: t5.decode_full(be, self.config, self.params, dec, enc,
                                                        mask, probe))
                raise non_finite(self, "logits", where)
            return logits

    def teacher_forced_logits(self, input_ids: Any, decoder_input_ids: Any) -> np.ndarray:
        """Logits (B, T_dec, V) of given decoder ids (generation scores finished beams' tokens
        with them: the `logprobs` option)."""
        return self.forward(input_ids, decoder_input_ids)

    @contextlib.contextmanager
    def start_decoding(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                       max_len: int, repeat: int = 1) -> Iterator[T5DecodeState]:
        """Encode once, fill the cross-attention K/V and yield a decode state of `max_len`
        positions and B * repeat rows (row i * repeat + j decodes input i: beams, samples).
        Everything it holds is arena memory released when the `with` block exits."""
        self.check_can_generate()
        be = self.backend
        B, S = input_ids.shape
        with self.lock:   # the state is this request's own hold: released in any order
            buf, held = DecodeBuffers.hold(be.arena, self.config, B * repeat, S, max_len, be.dtype,
                                           B)   # (cross K/V once per input)
        try:
            with self.lock, quiet(), be.arena.scope():
                t5.start_state(be, self.config, self.params, input_ids, attention_mask, buf,
                               max_len, repeat, self._cached_encoder(input_ids, attention_mask))
                # on the CPU the encoder layer is named here; a device would sync for it: the
                # first step names it
                if be.xp is np and not all_finite(np, buf.cross_k, buf.cross_v):
                    enc = be.arena.alloc((B, S, self.config.d_model), be.dtype, "encoder output")
                    where = self._where_encoder_fails(input_ids, attention_mask, enc)
                    raise non_finite(self, "encoder states", where or
                                     "the decoder's cross-attention keys and values")
            yield T5DecodeState(self, buf, B * repeat, max_len)
        finally:
            held.release()

    def _cached_encoder(self, ids: np.ndarray, mask: np.ndarray) -> Any:
        """For start_state: None without an encode cache (the encoder runs), else a function
        that fills the arena's (B, S, C) encoder output from the cache when it holds every
        input, or runs the encoder and keeps each input's states. Generation needs only the
        states of an input's own tokens (cross-attention masks the padding), so a row is kept
        as its unpadded ids with a mask of ones: the key `encode` of that unpadded row uses,
        whatever the padding of the batch it came in. A mask that is not right padding (ones,
        then zeros) skips the cache."""
        cache = self.encode_cache
        if cache is None:
            return None
        lengths = mask.sum(axis=1)
        if not is_right_padding(mask):
            return None   # not right padding (a caller's own mask): the unpadded key would lie
        keys = [row_key(self.cache_identity, row[:n], np.ones(n, np.int64))
                for row, n in zip(ids, lengths)]

        def fill(enc: Any) -> None:
            be = self.backend
            hits = [cache.get(key) for key in keys]
            if all(hit is not None for hit in hits):
                B, S, C = enc.shape
                host = np.zeros((B, S, C), np.float32)   # padding's states: masked, kept finite
                for b, (hit, n) in enumerate(zip(hits, lengths)):
                    host[b, :n] = hit
                be.upload(enc, host.astype(be.dtype, copy=False))
                return
            t5.encode(be, self.config, self.params, ids, mask, enc)
            host = np.asarray(be.to_host(enc), np.float32)
            if all_finite(np, host):   # (a non-finite pass is named by start_decoding)
                for key, row, n in zip(keys, host, lengths):
                    cache.put(key, row[:n])
        return fill

    def step_together(self, states: list[T5DecodeState], tokens: list[np.ndarray]) -> list[np.ndarray]:
        """One step for several decode states: their rows stacked, every product run once over
        all of them (the weights read once), attention per state over its own caches. The stacked
        rows' scratch comes from what the arena has free: states that do not fit together are
        stepped in smaller groups, and a state alone uses its own step scratch (part of its
        plan), so a request that fits alone is never failed by the company it keeps."""
        for state in states:
            state.check_room()
        out: list[np.ndarray | NonFiniteError] = []
        with self.lock:
            for group in self._groups_that_fit(states):
                if len(group) == 1:
                    try:
                        out.append(states[group[0]].step(tokens[group[0]]))
                    except NonFiniteError as e:   # that state's own failure (see the protocol)
                        out.append(e)
                else:
                    out.extend(self._step_stacked([states[i] for i in group],
                                                  [tokens[i] for i in group]))
        return out

    def _groups_that_fit(self, states: list[T5DecodeState]) -> list[list[int]]:
        """Consecutive runs of states whose stacked step scratch fits the arena's free bytes."""
        be, cfg = self.backend, self.config
        free = be.arena.available - be.arena.scope_overhead()   # (a device scope's pool first)
        groups: list[list[int]] = []
        rows = keys = 0
        for i, s in enumerate(states):
            r, k = rows + s.batch, max(keys, s.length + 1, s.buf.cross_k.shape[3])
            if groups and StepScratch.nbytes(cfg, r, k, be.dtype) <= free:
                groups[-1].append(i)
                rows, keys = r, k
            else:
                groups.append([i])
                rows, keys = s.batch, max(s.length + 1, s.buf.cross_k.shape[3])
        return groups

    def _step_stacked(self, states: list[T5DecodeState], tokens: list[np.ndarray]) -> list[np.ndarray]:
        be, cfg = self.backend, self.config
        R = sum(state.batch for state in states)
        keys = max(max(s.length + 1 for s in states), max(s.buf.cross_k.shape[3] for s in states))
        with self.lock, quiet(), be.arena.scope():
            ws = StepScratch.allocate(be.arena, cfg, R, keys, be.dtype)
            out = t5.decode_steps(be, cfg, self.params, [(s.live, s.length) for s in states],
                                  np.concatenate(tokens), ws, ws.logits)
            # each state's rows into its own (planned) logits buffer: the scope ends here, and a
            # host copy of every row's logits would be memory no plan counts
            bounds = np.cumsum([0] + [s.batch for s in states])
            for state, a, b in zip(states, bounds[:-1], bounds[1:]):
                state.live.logits[:, 0] = out[a:b]
        results: list[np.ndarray | NonFiniteError] = []
        for state in states:   # each state's rows judged alone: one bad prompt fails only itself
            results.append(state.took_step(np.asarray(be.to_host(state.live.logits[:, 0]),
                                                      np.float32)))
        return results


def _is_text(inputs: Any) -> bool:
    """A string, or a list / tuple whose first item is one (text_list names any other item)."""
    return isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and len(inputs) > 0
                                       and isinstance(inputs[0], str))


def _zero_padding(be: Any, states: Any, mask: np.ndarray) -> None:
    """states (B, T, C) -> 0.0 where the (B, T) mask is 0, in place: host states by their
    positions, device states through the uploaded mask (no host copy of the states)."""
    if isinstance(states, np.ndarray):
        states[mask == 0] = 0.0
        return
    with be.on_device():   # (the model's device, which need not be the thread's current one)
        be.xp.copyto(states, np.float32(0), where=be.asarray(mask[..., None] == 0))
