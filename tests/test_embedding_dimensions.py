"""`dimensions` (issue 29): embeddings cut to their first d entries, re-normalised when the model
normalises them (OpenAI's semantics), refused above the model's width before anything runs."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import minfer
from minfer import InputError

FAMILY = Path(__file__).resolve().parent.parent / "weights" / "family"
TEXTS = ["a short one", "a somewhat longer text to embed here", "x"]


def test_a_normalising_head_gives_unit_vectors_of_the_first_entries():
    m = minfer.load(FAMILY / "st_sentence_t5")        # ... Dense, Normalize
    full = m.embed(TEXTS)
    assert np.allclose(np.linalg.norm(full, axis=1), 1, atol=1e-5)
    short = m.embed(TEXTS, dimensions=5)
    assert short.shape == (3, 5) and short.dtype == np.float32
    want = full[:, :5] / np.linalg.norm(full[:, :5], axis=1, keepdims=True)
    assert np.allclose(short, want, atol=1e-6)
    assert np.array_equal(m.embed(TEXTS, dimensions=full.shape[1]), full)


def test_a_head_that_does_not_normalise_is_cut_only():
    m = minfer.load(FAMILY / "st_prompts")            # pooling, no Normalize
    full = m.embed(TEXTS)
    assert not np.allclose(np.linalg.norm(full, axis=1), 1)
    assert np.array_equal(m.embed(TEXTS, dimensions=3), full[:, :3])


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_dimensions_must_be_a_positive_integer(bad):
    m = minfer.load(FAMILY / "st_prompts")
    with pytest.raises(InputError, match="dimensions must be a positive integer"):
        m.embed(TEXTS, dimensions=bad)


def test_more_dimensions_than_the_model_has_are_refused_before_encoding(monkeypatch):
    m = minfer.load(FAMILY / "st_sentence_t5")
    width = m.embed("x").shape[1]
    monkeypatch.setattr(m, "encode", lambda *a, **k: pytest.fail("encoded"))
    with pytest.raises(InputError, match=f"dimensions {width + 1}: this model's embeddings have "
                                         f"{width}"):
        m.embed(TEXTS, dimensions=width + 1)
