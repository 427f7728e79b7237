"""What every model family shares: the public façade, how it is loaded, and input batches.

A family is a declaration plus math (models/<family>/: config.py, weights.py, buffers.py, tied
together by family.py's `FAMILY`; and math.py). Its public class
subclasses `Model`, points `family` at that declaration (a `models.family.Family`: config class,
weight table, run sizes) and adds only what differs: `start_decoding` and the family's own API.
Everything else is written here once: loading (check -> plan -> place, through
params/loader.py), `plan`, `parameter_count`, `describe`, `close` and the context manager,
`batch`, `generate` and `repr`. `Model` implements generation's
`DecodingModel` protocol explicitly, so generation never imports a model. Generation calls back
into the model because it drives the search (greedy, sampled, beam, steps of concurrent requests
taken together) and asks the model only for each step's scores (`start_decoding`, then a state's
`step` and `reorder`): the search is written once for every family, and no model imports it.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any, ClassVar

import numpy as np

from ..backend import Backend
from ..embedding import embed
from ..errors import ConfigError, InputError, NonFiniteError
from ..generation import generate
from ..generation.protocol import DecodingModel, TokenIds
from ..io.checkpoint import Checkpoint
from ..io.limits import is_integer, short_repr
from ..io.formats import weight_format
from ..params.loader import describe_formats, load_params, plan_placement, slot_formats
from .. import scoring
from ..padding import right_padded
from ..scoring import PairScore
from ..params.runtime import OwnsWeights, WeightRuntime
from .family import Family


class Model(OwnsWeights, DecodingModel):
    """A loaded model: config, parameters placed on a backend, tokenizer, and the public API."""

    family: ClassVar[Family]  # the family's declaration

    # Pickling: `minfer.load` records itself with its arguments (set_load_call, a functools.partial).
    # A model pickles as that call, a few hundred bytes, and unpickling loads it again; never its
    # weights and arena (cloudpickle wrote 2.1 GB for a small model: the untouched 1 GiB arena,
    # twice). A model built another way has no such call and refuses to pickle, saying why.
    _reload_call: Any = None
    # encoder rows kept between calls (encoding/cache.py): set by load(encode_cache=); None: none
    encode_cache: Any = None
    _no_reload_reason: str = ("it was not made by minfer.load (built from in-memory objects), "
                              "so there are no load arguments to send")

    def __init__(self, config: Any, params: dict, backend: Backend, folder: str,
                 hf_config: dict | None = None, generation_config: dict | None = None,
                 tokenizer: Any = None):
        self.config = config
        self.params = params
        self.backend = backend
        self.folder = folder
        self.hf_config = hf_config or {}                  # config.json as read (task params, ...)
        self.generation_config = generation_config or {}  # generation_config.json, if any
        self.tokenizer = tokenizer
        self.token_ids: TokenIds = config.token_ids()
        # One compute call at a time: scratch scopes are a stack, weights stream through shared
        # slots, packed products widen into a shared scratch. Requests still run concurrently:
        # each owns its state (arena holds), and decode steps of requests that run at the same
        # time are taken together (generation/batcher.py), so the lock costs little.
        self.lock = threading.RLock()
        self.free_when_idle = backend.arena.available   # set again once the weights are placed
        self.weight_formats = ""   # what each kind of tensor is stored as (`minfer info`; load)

    @property
    def is_encoder_decoder(self) -> bool:
        return self.family.is_encoder_decoder

    @property
    def add_eos_to_prompt(self) -> bool:
        return self.family.add_eos_to_prompt

    @property
    def parts(self) -> tuple[str, ...]:
        """What this model holds and runs: "encoder", "decoder", "head" (T5; an encoder-only
        model just "encoder"), "pooling" when it carries a sentence-embedding head."""
        return getattr(self.config, "parts", ("decoder", "head"))

    @property
    def can_generate(self) -> bool:
        return "head" in self.parts

    def check_can_generate(self) -> None:
        """A one-line error for a model that holds no decoder (an encoder-only save)."""
        if not self.can_generate:
            raise InputError(f"{self.folder}: loaded as an encoder only (parts: "
                             f"{', '.join(self.parts)}; no decoder or head): it can encode and "
                             "embed, not generate")

    def check_batch(self, ids: np.ndarray, mask: np.ndarray) -> None:
        """A family's own conditions on a validated batch (none by default)."""

    # -- loading --------------------------------------------------------------------------------------
    @classmethod
    def load(cls, ckpt: Checkpoint, backend: Backend, generation_config: dict | None = None,
             tokenizer: Any = None, recorder: Any = None, parts: str | None = None) -> "Model":
        """Parse the config, restrict it to the parts asked for (None: what the checkpoint
        holds), plan where the weights go (all resident without a memory limit), then read them
        layer by layer into place."""
        config = cls.family.config.from_hf(ckpt.config, str(ckpt.folder / "config.json"))
        if cls.family.with_parts is not None:
            config = cls.family.with_parts(config, ckpt.names(), parts, str(ckpt.folder))
        elif parts not in (None, "all"):
            raise ConfigError(f"parts={parts!r}: a {cls.family.name} model loads only whole "
                              "(parts='all')")
        table = cls.family.weight_table(config)
        fmt = weight_format(backend.weight_format)
        formats = slot_formats(table, ckpt, fmt, "cpu" if backend.device == "cpu" else "cuda")
        planned = cls.family.run_bytes(config, backend.dtype, 1, None, None,
                                       compute=backend.compute)["peak"]
        plan = plan_placement(table, backend.dtype, fmt, backend.memory_limit,
                              backend.workspace_reserve(planned), formats)
        runtime = WeightRuntime(backend, plan, recorder)
        try:
            params = load_params(table, ckpt, backend.dtype, fmt, runtime, formats)
        except BaseException:
            runtime.close()
            raise
        model = cls(config, params, backend, str(ckpt.folder), ckpt.config, generation_config,
                    tokenizer)
        model.attach_runtime(plan, runtime)
        model.weight_formats = describe_formats(table, backend.dtype, fmt, formats)   # (info)
        # what stays in the arena whatever runs (the weights under a limit): a request that does
        # not fit in the rest can never run, one that does may have to wait for others
        model.free_when_idle = backend.arena.available
        return model

    def embed(self, texts: Any, *, prompt_name: str | None = None, prompt: str | None = None,
              batch_size: int = 32, dimensions: int | None = None) -> np.ndarray:
        """Sentence embeddings (N, E) float32 of a text or a list of texts: the folder's
        sentence-transformers modules (pooling, Dense, Normalize; prompts by name or the
        default) over the encoder states, as `SentenceTransformer.encode` computes them; a folder
        without modules.json: the mean of the encoder states over each text's tokens
        (minfer/embedding.py). A family with no encoder (Transformer-XL) refuses in one line.
        `dimensions`: the first d entries of each vector, re-normalised when the folder's head
        normalises (OpenAI's `dimensions`)."""
        return embed(self, texts, prompt_name=prompt_name, prompt=prompt, batch_size=batch_size,
                     dimensions=dimensions)

    def score_pairs(self, sources: Any, targets: Any, *, batch_size: int = 16) -> list[PairScore]:
        """How likely the model finds each target given its source (a seq2seq model): per pair
        the target's ids (`</s>` last), each token's log-probability and their sum (`.total`,
        `.mean`); one source scores every target, or two lists pair up (minfer/scoring.py)."""
        return scoring.score_pairs(self, sources, targets, batch_size=batch_size)

    def rerank(self, query: str, documents: Any, *, top_n: int | None = None,
               words: tuple[str, str] = scoring.MONOT5_WORDS, batch_size: int = 16,
               max_input_tokens: int | None = None) -> list[tuple[int, float]]:
        """(document index, relevance) best first: monoT5's P("true") for a seq2seq model
        (documents cut to fit max_input_tokens when given), the cosine similarity of the
        embeddings for an encoder alone (minfer/scoring.py)."""
        return scoring.rerank(self, query, documents, top_n=top_n, words=words,
                              batch_size=batch_size, max_input_tokens=max_input_tokens)

    # -- inputs and sizes -----------------------------------------------------------------------------
    def batch(self, input_ids: Any, attention_mask: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Token-id lists or a (B, T) array -> right-padded (B, T) int64 ids and mask, validated."""
        ids, mask = as_batch(input_ids, self.token_ids.pad, self.config.vocab_size, "input_ids",
                             attention_mask)
        self.check_batch(ids, mask)
        return ids, mask

    def plan(self, batch: int = 1, input_len: int | None = None,
             max_new_tokens: int | None = None, repeat: int = 1) -> dict[str, int]:
        """Arena bytes a run of this shape needs (pure: nothing is allocated): named parts and
        their "peak". batch: rows; input_len: prompt tokens (T5) or segment length
        (Transformer-XL); repeat: rows per prompt (beams, samples: batch // repeat prompts)."""
        check_plan_arguments(batch, input_len, max_new_tokens, repeat)
        return self.family.run_bytes(self.config, self.backend.dtype, batch, input_len,
                                     max_new_tokens, compute=self.backend.compute, repeat=repeat)

    def parameter_count(self) -> int:
        return self.family.weight_table(self.config).parameter_count()

    def describe(self) -> list[tuple[str, str]]:
        """Architecture facts for `minfer info`."""
        return self.config.describe()

    def step_together(self, states: list[Any], tokens: list[np.ndarray]) -> list[np.ndarray]:
        """One step for several decode states (see the protocol); this default steps each in
        turn, a family that can share the products overrides it. A state whose own step finds
        NaN or infinity gets its NonFiniteError in its place (the protocol)."""
        out: list[Any] = []
        with self.lock:
            for state, t in zip(states, tokens):
                try:
                    out.append(state.step(t))
                except NonFiniteError as e:
                    out.append(e)
        return out

    # -- generation -----------------------------------------------------------------------------------
    def generate(self, inputs: Any, *, stream: bool = False, task: str | None = None,
                 return_details: bool = False, attention_mask: Any = None, **options: Any) -> Any:
        """Generate from a prompt, a list of prompts, or token ids.

        inputs: str -> str; list of str -> list of str; token-id lists (or a (B, T) array) -> id
            lists (T5: starting with the decoder start token, ending at eos, included;
            Transformer-XL: the new ids only). With num_return_sequences n > 1 each prompt gives a
            list of n (ids: n rows each).
        stream: return an iterator of text pieces (token ids for id input) for one prompt.
        task: apply the checkpoint's task_specific_params (prefix and settings), e.g.
            "translation_en_to_de" or "summarization".
        return_details: per prompt a list of `generation.Result` (text, token_ids, finish_reason,
            prompt_tokens, new_tokens, seconds, score, error); a string in gives its own list
            (one Result per returned sequence), a list of prompts or token ids (one id row
            too, as without details) a list of such lists. A prompt that cannot run (empty,
            too long, too big for the arena even alone) is then a Result with `error` set and
            the others are decoded; without return_details the first such prompt raises,
            naming it, before anything is decoded.
        attention_mask: with a (B, T) id array, which positions are real (T5; padding right).
        options: max_new_tokens, min_new_tokens, do_sample, temperature, top_k, top_p,
            repetition_penalty, no_repeat_ngram_size, num_beams, length_penalty, early_stopping,
            num_return_sequences, stop, seed. Unset ones come from generation_config.json, then
            config.json, then minfer's defaults (max_new_tokens 256; never a silent 20-token cap).
            How to run, never read from the checkpoint: max_batch_size (default 32; the memory
            plan may allow fewer), max_input_tokens, truncation (cut longer prompts instead of
            refusing them). Any number of prompts is cut into batches, shortest first, and the
            results come back in input order. Calls from several threads at once are decoded
            together (continuous batching).
        """
        self.check_can_generate()
        return generate(self, inputs, stream_output=stream, task=task,
                        return_details=return_details, attention_mask=attention_mask, **options)

    # -- pickling -------------------------------------------------------------------------------------
    def set_load_call(self, call: Any, why_not: str | None = None) -> None:
        """What this model pickles as: the `minfer.load` call that made it (a functools.partial
        with its arguments), or None and why it cannot be pickled."""
        self._reload_call = call
        if why_not is not None:
            self._no_reload_reason = why_not

    @property
    def load_recipe(self) -> dict[str, Any] | None:
        """The `minfer.load` arguments this model pickles as (None: it cannot be pickled)."""
        return None if self._reload_call is None else dict(self._reload_call.keywords)

    def __reduce__(self) -> tuple:
        if self._reload_call is None:
            raise pickle.PicklingError(f"{type(self).__name__} from {self.folder} cannot be "
                                       f"pickled: {self._no_reload_reason}")
        return self._reload_call, ()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.folder!r}, {self.config.summary()}, "
                f"device={self.backend.device!r})")


PLAN_MAX = 1 << 40   # rows or tokens a plan is asked about, at most (byte counts stay int64)


def check_plan_arguments(batch: Any, input_len: Any, max_new_tokens: Any,
                         repeat: Any = 1) -> None:
    """plan()'s sizes are integers in range (a negative batch planned negative bytes, a string
    batch repeated itself into a number hundreds of digits long), repeat divides batch, or a
    one-line InputError."""
    for name, value, low in (("batch", batch, 1), ("input_len", input_len, 1),
                             ("max_new_tokens", max_new_tokens, 0), ("repeat", repeat, 1)):
        if value is None and name not in ("batch", "repeat"):
            continue
        if not is_integer(value) or not low <= int(value) <= PLAN_MAX:
            raise InputError(f"plan(): {name} must be an integer in [{low}, {PLAN_MAX}], "
                             f"got {short_repr(value)}")
    if int(batch) % int(repeat):
        raise InputError(f"plan(): batch {int(batch)} is not a whole number of prompts of "
                         f"repeat {int(repeat)} rows each")


def as_batch(inputs: Any, pad_id: int, vocab_size: int, what: str = "input_ids",
             attention_mask: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (a list of id lists, or a (B, T) array) -> right-padded (B, T) int64 ids + mask.

    A token id is an int or NumPy integer in 0..vocab_size-1: not a bool, not a float (1.0 is
    refused, not truncated), not a nested list. Every error is one line naming the row and the
    position; ranges are checked before any int64 conversion (2**63 would overflow it, a uint64
    array would wrap). A mask holds only 0 and 1."""
    for name, given in ((what, inputs), ("attention_mask", attention_mask)):
        if hasattr(given, "__cuda_array_interface__"):   # np.asarray would raise TypeError
            raise InputError(f"{name}: a device (CuPy) array; pass it on the host: a list or a "
                             "NumPy array (cupy.asnumpy)")
    if isinstance(inputs, np.ndarray) or (hasattr(inputs, "shape") and hasattr(inputs, "dtype")):
        ids = np.asarray(inputs)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
            raise InputError(f"{what}: expected a non-empty (batch, length) array, "
                             f"got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"{what}: expected integer token ids, got dtype {ids.dtype}")
        _check_range(ids, vocab_size, what)
        ids = ids.astype(np.int64)
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask)
        if mask.shape != ids.shape:
            raise InputError(f"attention_mask: shape {mask.shape} does not match {what} {ids.shape}")
        if mask.dtype != bool and not np.issubdtype(mask.dtype, np.integer):
            raise InputError(f"attention_mask: expected 0/1 integers or booleans, got dtype {mask.dtype}")
        if ((mask != 0) & (mask != 1)).any():
            r, c = np.argwhere((mask != 0) & (mask != 1))[0]
            raise InputError(f"attention_mask: value {mask[r, c]} at row {r}, position {c} is not 0 or 1")
        mask = mask.astype(np.int64)
    else:
        rows = list(inputs) if isinstance(inputs, (list, tuple)) else None
        if not rows:
            got = type(inputs).__name__ if rows is None else "an empty list"
            raise InputError(f"{what}: expected a non-empty list of token-id lists, got {got}")
        if all(is_integer(t) for t in rows):
            rows = [rows]  # a single sequence
        for r, row in enumerate(rows):
            if not isinstance(row, (list, tuple, np.ndarray)) or len(row) == 0:
                got = "empty" if isinstance(row, (list, tuple, np.ndarray)) else type(row).__name__
                raise InputError(f"{what}: row {r} is {got}, expected a non-empty list of token ids")
            for c, t in enumerate(row):
                if not is_integer(t):
                    raise InputError(f"{what}: row {r}, position {c} holds {short_repr(t)} "
                                     f"({type(t).__name__}), not an integer token id")
                if not 0 <= t < vocab_size:
                    raise InputError(f"{what}: token id {short_repr(t)} at row {r}, position {c} is "
                                     f"outside the vocabulary (0..{vocab_size - 1})")
        if attention_mask is not None:
            raise InputError("attention_mask: pass it only with an array of token ids")
        ids, mask = right_padded(rows, pad_id)
    if not mask.any(axis=1).all():
        raise InputError(f"attention_mask: row {int(np.argmin(mask.any(axis=1)))} masks every token")
    return ids, mask


def _check_range(ids: np.ndarray, vocab_size: int, what: str) -> None:
    """Token ids in 0..vocab_size-1, compared in the array's own dtype (no wrap-around)."""
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise InputError(f"{what}: token id {ids[r, c]} at row {r}, position {c} is outside the "
                         f"vocabulary (0..{vocab_size - 1})")
