"""Prompts in: the shapes a call's inputs may take (`normalise_inputs`: one prompt, prompts, or
token-id rows), each prompt's checks, how errors name a row, and the tokenizer text input needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from ..errors import InputError
from ..io.limits import is_integer
from ..tokenizers import check_text


# How a prompt over max_input_tokens is told it can run, in the library's words: the CLI and the
# server put their own option in its place (--truncate, truncate_prompt_tokens).
TRUNCATION_CURE = "truncation=True cuts it"


def normalise_inputs(inputs: Any) -> tuple[str, list]:
    """-> ("text", [str]) | ("texts", [item, ...]) | ("ids", [[id, ...], ...]). Prompts are checked
    row by row later (`_Rows`), so that a bad one can be a per-row error; the shape of the input
    is checked here. Any sequence of strings is prompts: lists, tuples, NumPy unicode / object
    arrays, pandas and Arrow string columns (duck-typed: neither library is imported)."""
    if isinstance(inputs, str):
        return "text", [inputs]
    if hasattr(inputs, "to_pylist") and not isinstance(inputs, (list, tuple, np.ndarray)):
        inputs = inputs.to_pylist()          # an Arrow Array / ChunkedArray: str or None items
    if hasattr(inputs, "__cuda_array_interface__"):   # np.asarray would raise TypeError
        raise InputError("inputs: a device (CuPy) array; pass token ids on the host: a list or "
                         "a NumPy array (cupy.asnumpy)")
    if isinstance(inputs, np.ndarray) or (hasattr(inputs, "shape") and hasattr(inputs, "dtype")):
        arr = np.asarray(inputs)             # pandas Series too (object / string dtypes)
        if arr.dtype.kind in "UO":
            return _string_array(arr)
        if arr.dtype.kind == "S":            # bytes have no text until someone decodes them
            raise InputError(f"inputs: an array of bytes (dtype {arr.dtype}): decode it to str "
                             "first (for NumPy: arr.astype(str) after a decode)")
        if arr.ndim not in (1, 2) or arr.size == 0:
            raise InputError(f"inputs: expected a non-empty (batch, length) array of token ids, "
                             f"got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):  # floats, bools are no token ids
            raise InputError(f"inputs: expected integer token ids, got dtype {arr.dtype}")
        return "ids", [list(r) for r in (arr[None] if arr.ndim == 1 else arr)]
    if (isinstance(inputs, Sequence) and not isinstance(inputs, (list, tuple, bytes, bytearray))
            and len(inputs) > 0):
        inputs = list(inputs)                # any other sequence (collections.deque, UserList)
    if isinstance(inputs, (list, tuple)) and inputs:
        if _prompt_items(inputs):            # prompts: every item must be one (checked per row)
            return "texts", list(inputs)
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


def _prompt_items(items: Sequence) -> bool:
    """Whether a list holds prompts: its first item is a string, or a missing value (None, NaN,
    pandas' NA, as a string column with gaps has) followed somewhere by a string."""
    first = items[0]
    if isinstance(first, str):
        return True
    missing = first is None or isinstance(first, float) or type(first).__name__ in ("NAType", "NaTType")
    return missing and any(isinstance(p, str) for p in items)


def _string_array(arr: np.ndarray) -> tuple[str, list]:
    """A NumPy unicode or object array (or what pandas gave np.asarray) -> prompts."""
    if arr.ndim == 0:
        item = arr.item()
        if isinstance(item, str):
            return "text", [item]
        raise InputError(f"inputs: a 0-d array holding {type(item).__name__}: expected prompts")
    if arr.ndim != 1 or arr.size == 0:
        raise InputError(f"inputs: expected a non-empty 1-D array of prompts, got shape {arr.shape}")
    items = arr.tolist()                     # Python str (not np.str_) for both dtypes
    if arr.dtype.kind == "U" or _prompt_items(items):
        return "texts", items
    if all(isinstance(r, (list, tuple, np.ndarray)) for r in items):
        return "ids", [list(r) for r in items]   # a ragged object array of token-id rows
    raise InputError(f"inputs: an object array whose item 0 is {type(items[0]).__name__}: expected "
                     "prompt strings (or token-id rows)")


def check_prompt(prompt: Any, where: str) -> str:
    """A prompt string: valid Unicode (no lone surrogate) and not blank, or a one-line error
    naming the row (`where`, e.g. "inputs: prompt 3")."""
    if not isinstance(prompt, str):
        raise InputError(f"{where} is {type(prompt).__name__}: expected every item to be a prompt "
                         "string (or every item a list of token ids)")
    if not prompt.strip():
        raise InputError(f"{where}: empty prompt (nothing but whitespace)")
    check_text(prompt, where)   # the tokenizer's own check, here naming the prompt
    return prompt


def row_names(kind: str) -> Callable[[int], str]:
    """How errors name row i of an input of this kind."""
    if kind == "ids":
        return lambda i: f"input_ids: row {i}"
    return (lambda i: "inputs") if kind == "text" else (lambda i: f"inputs: prompt {i}")
