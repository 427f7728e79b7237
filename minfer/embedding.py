"""Sentence embeddings: a small head over a model's `encode` (Reimers & Gurevych 2019,
"Sentence-BERT"; Ni et al. 2021, "Sentence-T5").

`embed(model, texts)` computes what sentence-transformers' `SentenceTransformer.encode` does for
the folder's modules (io/sentence_transformers.py): prompt prepended, text stripped (and
lower-cased when the folder says so), tokens cut at `max_seq_length` (the last kept before `</s>`),
encoder states of the real tokens pooled, then each Dense layer (x W^T + b, activation) and
Normalize in order. A folder without modules.json embeds by mean pooling of the encoder states
over the real tokens, with no projection or normalisation.

Texts are a string or an ordered collection of strings (`text_list`: anything else, bytes, a dict
or a set is a one-line InputError naming what was given, or the index of the item that is no
string); a model without an encoder (Transformer-XL) cannot embed, in one line too.

The head runs on the host over the float32 states `encode` returns: (B, T, C) -> (B, dim) is a
few operations per state, next to the encoder's whole stack. Shapes: B batch, T tokens, C
d_model, E the embedding width.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from math import erf, sqrt
from typing import Any, Sequence

import numpy as np

from . import kernels
from .errors import InputError
from .numerics import all_finite, non_finite, quiet
from .padding import right_padded
from .io.limits import quoted
from .io.sentence_transformers import Dense, Normalize, Pooling, SentenceModules, listed

MEAN_POOLING = Pooling(("mean_tokens",), 0)   # a T5 folder without modules.json
DEFAULT_BATCH = 32
_NORM_EPS = 1e-12   # torch.nn.functional.normalize's floor on the norm


# =====================================================================================================
# The math (host float32)
# =====================================================================================================
def pool(states: np.ndarray, mask: np.ndarray, modes: Sequence[str]) -> np.ndarray:
    """(B, T, C) states and (B, T) 0/1 mask -> (B, len(modes) * C): each pooling over the masked
    tokens, concatenated in `modes`' order (sentence-transformers' Pooling)."""
    B, T, C = states.shape
    m = mask.astype(np.float32)[:, :, None]                  # (B, T, 1)
    count = np.maximum(m.sum(axis=1), 1e-9)                   # (B, 1)
    out = []
    for mode in modes:
        if mode == "cls_token":
            first = states[:, 0]
            if "max_tokens" in modes:
                # sentence-transformers 5.1 (the oracle) sets masked states to -1e9 in place for
                # max pooling, and its CLS output is a view of position 0: a row whose first
                # token is masked (a prompt left out of the pooling) gets -1e9 there
                first = np.where(m[:, 0] > 0, first, np.float32(-1e9))
            out.append(first)
        elif mode == "max_tokens":
            out.append(np.where(m > 0, states, np.float32(-1e9)).max(axis=1))
        elif mode in ("mean_tokens", "mean_sqrt_len_tokens"):
            total = (states * m).sum(axis=1)
            out.append(total / (count if mode == "mean_tokens" else np.sqrt(count)))
        elif mode == "weightedmean_tokens":   # position k (from 1) weighs k
            w = m * np.arange(1, T + 1, dtype=np.float32)[None, :, None]
            out.append((states * w).sum(axis=1) / np.maximum(w.sum(axis=1), 1e-9))
        elif mode == "lasttoken":             # the last real token (right padding)
            last = np.where(mask.any(axis=1), T - 1 - np.argmax(mask[:, ::-1] > 0, axis=1), T - 1)
            out.append(states[np.arange(B), last] * m[np.arange(B), last])
        else:
            raise InputError(f"unknown pooling mode {mode!r}")
    return np.concatenate(out, axis=1).astype(np.float32, copy=False)


def _activate(x: np.ndarray, name: str) -> np.ndarray:
    if name == "tanh":
        return np.tanh(x)
    if name == "relu":
        return np.maximum(x, 0)
    if name == "sigmoid":
        return 1 / (1 + np.exp(-x))
    if name == "silu":
        return x / (1 + np.exp(-x))
    if name == "gelu":   # torch's default GELU: the exact erf form
        return (0.5 * x * (1 + np.vectorize(erf, otypes=[np.float64])(x / sqrt(2)))).astype(np.float32)
    return x


def dense(x: np.ndarray, layer: Dense) -> np.ndarray:
    """(B, in) -> (B, out): activation(x W^T + b)."""
    product: list[np.ndarray] = []
    kernels.on_pool(lambda: product.append(x @ layer.weight.T))   # BLAS only on the pool
    y = product[0]
    if layer.bias is not None:
        y += layer.bias
    return _activate(y, layer.activation).astype(np.float32, copy=False)


def normalize(x: np.ndarray) -> np.ndarray:
    """Each row divided by its L2 norm (at least 1e-12)."""
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), _NORM_EPS)


def head(states: np.ndarray, mask: np.ndarray, modules: SentenceModules | None) -> np.ndarray:
    """Encoder states (B, T, C) of a batch -> embeddings (B, E)."""
    if modules is None:
        return pool(states, mask, MEAN_POOLING.modes)
    x = pool(states, mask, modules.pooling.modes)
    for step in modules.steps:
        x = normalize(x) if isinstance(step, Normalize) else dense(x, step)
    return x


# =====================================================================================================
# Texts -> embeddings
# =====================================================================================================
TEXTS_EXPECTED = "expected a string or a list of strings"


def given(value: Any) -> str:
    """What a caller passed, for a one-line message: a scalar with its value, else its type."""
    if value is None:
        return "None"
    name = type(value).__name__
    if isinstance(value, (bool, int, float, complex, np.number, np.bool_)):
        text = str(value)   # (NumPy 2's repr of 2.5 is "np.float32(2.5)")
        return f"{name} {text if len(text) <= 40 else text[:37] + '...'}"
    return name


def text_list(texts: Any, what: str) -> list[str]:
    """A string, or an ordered collection of strings (a list, a tuple, a 1-D array, a generator)
    -> a list of strings; anything else is a one-line InputError saying what was given, and for
    an item that is not a string, its index. Bytes are refused rather than read as integers, and
    a dict or a set rather than embedded in an order that matches no input."""
    if isinstance(texts, str):
        return [texts]
    if isinstance(texts, (bytes, bytearray, memoryview)):
        raise InputError(f"{what}: got {given(texts)}, {TEXTS_EXPECTED} (decode bytes first)")
    if (isinstance(texts, (Mapping, Set)) or not isinstance(texts, Iterable)
            or (isinstance(texts, np.ndarray) and texts.ndim != 1)):
        shape = f" of shape {texts.shape}" if isinstance(texts, np.ndarray) else ""
        raise InputError(f"{what}: got {given(texts)}{shape}, {TEXTS_EXPECTED}")
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            hint = "; decode bytes first" if isinstance(text, (bytes, bytearray)) else ""
            raise InputError(f"{what}: text {i} is {given(text)}, not a string "
                             f"({TEXTS_EXPECTED}{hint})")
    return texts


def check_can_embed(model: Any) -> None:
    """A one-line error for a model with no encoder to embed with (Transformer-XL)."""
    if not callable(getattr(model, "encode", None)):
        family = getattr(getattr(model, "family", None), "name", type(model).__name__)
        raise InputError(f"{getattr(model, 'folder', 'this model')}: a {family} model cannot "
                         "embed: sentence embeddings need an encoder (a T5-family model)")


def prompt_for(modules: SentenceModules | None, prompt_name: str | None,
               prompt: str | None) -> str:
    """The prompt prepended to every text: given, named, or the folder's default."""
    if prompt is not None and prompt_name is not None:
        raise InputError("embed(): give prompt or prompt_name, not both")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InputError(f"embed(): prompt must be a string, got {type(prompt).__name__}")
        return prompt
    prompts = modules.prompts if modules is not None else {}
    if prompt_name is not None:
        if not isinstance(prompt_name, str) or prompt_name not in prompts:
            name = (f"'{quoted(prompt_name, 80)}'" if isinstance(prompt_name, str)
                    else given(prompt_name))
            raise InputError(f"embed(): prompt_name {name} is not one of the model's prompts "
                             f"({listed(prompts)})")
        return prompts[prompt_name]
    default = modules.default_prompt_name if modules is not None else None
    return prompts[default] if default is not None else ""


def embed(model: Any, texts: str | Sequence[str], *, prompt_name: str | None = None,
          prompt: str | None = None, batch_size: int = DEFAULT_BATCH,
          dimensions: int | None = None) -> np.ndarray:
    """Texts -> (N, E) float32 embeddings (a single text: (1, E)); see the module docstring.
    Rows run in batches of similar length (at most `batch_size`; `encode` runs a batch in fewer
    rows at a time when the arena cannot hold it); results keep the input order. `dimensions`:
    each vector cut to its first d entries, and scaled back to length 1 when the model
    normalises its embeddings (OpenAI's `dimensions`, for models trained to be cut so)."""
    check_can_embed(model)
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)
                                   or dimensions < 1):
        raise InputError(f"embed(): dimensions must be a positive integer, got {given(dimensions)}")
    tok = model.tokenizer
    if tok is None:
        raise InputError(f"embed() needs a tokenizer, and {model.folder} has none: encode token "
                         "ids with model.encode instead")
    texts = text_list(texts, "embed()")
    if not texts:
        raise InputError("embed(): expected a text or a non-empty list of texts")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InputError(f"embed(): batch_size must be a positive integer, got {batch_size!r:.40}")
    modules = model.sentence_modules
    width = modules.dimension if modules is not None else model.config.d_model
    if dimensions is not None and dimensions > width:   # before anything is encoded
        raise InputError(f"dimensions {dimensions}: this model's embeddings have {width}")
    text_prompt = prompt_for(modules, prompt_name, prompt)
    ids = [tokens_of(model, text_prompt + t, modules) for t in texts]
    skip = 0   # prompt tokens left out of the pooling (include_prompt: false)
    if text_prompt and modules is not None and not modules.pooling.include_prompt:
        skip = len(tokens_of(model, text_prompt, modules)) - 1   # its tokens, not its </s>
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: np.ndarray | None = None
    for start in range(0, len(order), batch_size):   # encode() splits what the arena cannot hold
        rows = order[start:start + batch_size]
        grid, mask = right_padded([ids[i] for i in rows], model.token_ids.pad)
        states = model.encode(grid, mask, padding_states=False)   # (pooled under the mask)
        pooled_mask = mask.copy()
        pooled_mask[:, :skip] = 0
        with quiet():   # overflow in the head is raised below, not printed
            vectors = head(states, pooled_mask, modules)
        if not all_finite(np, vectors):   # the states were checked: the head's own layers
            raise non_finite(model, "embeddings", "the sentence-transformers head (pooling, "
                             "Dense layers, normalisation)")
        if out is None:
            out = np.empty((len(ids), vectors.shape[1]), np.float32)
        out[rows] = vectors
    assert out is not None
    return out if dimensions is None else shortened(out, dimensions, modules)


def shortened(vectors: np.ndarray, dimensions: int, modules: SentenceModules | None) -> np.ndarray:
    """(N, E) embeddings cut to (N, dimensions <= E), re-normalised when the head normalises."""
    out = np.ascontiguousarray(vectors[:, :dimensions])
    if modules is not None and any(isinstance(step, Normalize) for step in modules.steps):
        return normalize(out).astype(np.float32, copy=False)
    return out


def token_counts(model: Any, texts: Sequence[str], *, prompt_name: str | None = None,
                 prompt: str | None = None) -> list[int]:
    """How many tokens `embed` encodes for each text (the prompt's included, cut at
    max_seq_length): a server's usage counts, and what it bounds."""
    check_can_embed(model)
    texts = text_list(texts, "token_counts()")
    modules = model.sentence_modules
    text_prompt = prompt_for(modules, prompt_name, prompt)
    return [len(tokens_of(model, text_prompt + t, modules)) for t in texts]


def tokens_of(model: Any, text: str, modules: SentenceModules | None) -> list[int]:
    """Token ids of one text as sentence-transformers' Transformer module makes them: stripped,
    lower-cased if asked, cut at max_seq_length keeping the closing `</s>`."""
    text = text.strip()
    if modules is not None and modules.do_lower_case:
        text = text.lower()
    limit = modules.max_seq_length if modules is not None else None
    if limit is None:
        return model.tokenizer.encode(text)
    return model.tokenizer.encode_cut(text, limit)[0]   # (bounded work however long the text)
