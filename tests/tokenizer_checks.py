"""What the tokenizer tests share: the fixture scripts of weights/ (importable without
transformers), streaming a list of ids, and the shape of a one-line error."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from minfer.tokenizers import IncrementalDecoder

WEIGHTS = Path(__file__).resolve().parents[1] / "weights"


def weights_script(name: str) -> ModuleType:
    """weights/<name>.py as a module (their top levels need no transformers)."""
    spec = importlib.util.spec_from_file_location(name, WEIGHTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stream(tok, ids, skip_special_tokens=True) -> list[str]:
    """The pieces IncrementalDecoder gives for `ids`, the flush last."""
    dec = IncrementalDecoder(tok, skip_special_tokens)
    return [dec.push(i) for i in ids] + [dec.flush()]


def one_line_naming(err: pytest.ExceptionInfo, *what) -> None:
    """One line that names each of `what`, with no library exception chained on."""
    message = str(err.value)
    assert "\n" not in message
    for w in what:
        assert str(w) in message, message
    assert err.value.__cause__ is None
    assert err.value.__context__ is None or err.value.__suppress_context__
