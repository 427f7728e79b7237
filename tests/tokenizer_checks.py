"""What the tokenizer tests share: the fixture scripts of weights/ (importable without
transformers), streaming a list of ids, the shape of a one-line error, and holding minfer and the
installed transformers to the results of the transformers version minfer follows."""

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


def transformers_major(transformers: ModuleType) -> int:
    return int(transformers.__version__.split(".")[0])


def hold_to_versions(module: ModuleType, source: str, mine: dict, theirs: dict,
                     recorded: dict[int, dict], major: int, what: object) -> None:
    """Field by field of a row: where minfer follows the installed transformers' major version
    (`module.follows`), minfer's value is the installed transformers'; where it follows the other
    one (a difference `module.V5_DIFFERENCES` explains), the installed transformers gives what the
    fixtures recorded for its version, and minfer what they recorded for the one it follows."""
    for field, value in mine.items():
        followed = module.follows(source, field)
        if followed == major:
            assert value == theirs[field], (what, field)
        else:
            assert theirs[field] == recorded[major][field], \
                (what, field, f"transformers {major}.x no longer gives its recorded result")
            assert value == recorded[followed][field], (what, field)
