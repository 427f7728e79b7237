"""What `embed`, `token_counts` and `encode` accept as texts, and the one-line InputErrors for
everything else (issue 30, item 15): values that are not text, lists holding non-strings (named
by index), bytes, unordered collections, and a model with no encoder to embed with."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

import minfer
from minfer import embedding
from minfer.errors import InputError

ST = ROOT / "weights" / "family" / "st_prompts"
XL_BIN = ROOT / "weights" / "transfo_xl" / "adaptive_div4_bin"   # Transformer-XL with a vocabulary
EXPECTED = r"expected a string or a list of strings"



@pytest.fixture(scope="module")
def model():
    return minfer.load(ST)


@pytest.fixture(scope="module")
def xl():
    return minfer.load(XL_BIN)


def one_line(error):
    text = str(error.value)
    assert "\n" not in text and len(text) < 300, text
    return text


NOT_TEXT = [(None, "None"), (42, "int 42"), (1.5, "float 1.5"), (True, "bool True"),
            (np.float32(2.5), "float32 2.5"), (b"abc", "bytes"), (bytearray(b"ab"), "bytearray"),
            ({"a": 1}, "dict"), ({"a", "b"}, "set"), (np.array("a"), r"ndarray of shape \(\)"),
            (np.array([["a"]]), r"ndarray of shape \(1, 1\)")]


@pytest.mark.parametrize("value, said", NOT_TEXT, ids=[s for _, s in NOT_TEXT])
@pytest.mark.parametrize("call", ["embed", "token_counts"])
def test_what_is_not_text_is_named(model, value, said, call):
    """None and numbers raised TypeError from list(); bytes were read as integers ("text 0 is
    int"); a dict embedded its keys and a set its items in no input order."""
    run = model.embed if call == "embed" else lambda v: embedding.token_counts(model, v)
    with pytest.raises(InputError, match=rf"^{call}\(\): got {said}, {EXPECTED}") as e:
        run(value)
    one_line(e)


@pytest.mark.parametrize("texts, index, said", [
    (["a", 3], 1, "int 3"), (["a", "b", ["c"]], 2, "list"), ([None], 0, "None"),
    (["a", b"b"], 1, "bytes"), (("a", 1.5), 1, "float 1.5")])
def test_an_item_that_is_not_a_string_is_named_by_index(model, texts, index, said):
    with pytest.raises(InputError, match=rf"^embed\(\): text {index} is {said}, not a string "
                                         rf"\({EXPECTED}") as e:
        model.embed(texts)
    one_line(e)


def test_ordered_collections_of_strings_embed_as_a_list(model):
    want = model.embed(["a cat", "two dogs"])
    for texts in (("a cat", "two dogs"), np.array(["a cat", "two dogs"]),
                  (t for t in ["a cat", "two dogs"])):
        assert np.array_equal(model.embed(texts), want)
    # alone, a row pads to its own width: equal up to float32 rounding
    assert np.allclose(model.embed("a cat"), want[:1], atol=1e-5)


def test_a_prompt_name_that_is_not_a_string(model):
    """A list as prompt_name raised "unhashable type: 'list'"."""
    with pytest.raises(InputError, match=r"prompt_name list is not one of the model's prompts "
                                         r"\('query', 'document', 'passage'\)") as e:
        model.embed("a", prompt_name=["query"])
    one_line(e)


@pytest.mark.parametrize("call", ["embed", "token_counts"])
def test_a_model_without_an_encoder_cannot_embed(xl, call):
    """embedding.embed on a Transformer-XL: an AttributeError before; now it names the family."""
    run = getattr(embedding, call)
    with pytest.raises(InputError, match=r"a transfo-xl model cannot embed: sentence embeddings "
                                         r"need an encoder") as e:
        run(xl, ["a"])
    one_line(e)


def test_model_embed_of_a_transformer_xl_is_an_input_error(xl):
    with pytest.raises(InputError, match="a transfo-xl model cannot embed"):
        xl.embed(["the game"])


def test_minfer_embed_on_a_transformer_xl_is_one_line(tmp_path):
    """`minfer embed` said "unexpected AttributeError: 'XLModel' object has no attribute
    'embed'"."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", NUMBA_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "minfer", "embed", "-m", str(XL_BIN), "the game"],
                         capture_output=True, text=True, env=env, timeout=300)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert re.fullmatch(r"minfer: error: .*adaptive_div4_bin: a transfo-xl model cannot embed: "
                        r"sentence embeddings need an encoder.*", lines[0]), lines[0]


# -- encode: text or token ids ------------------------------------------------------------------
@pytest.mark.parametrize("value, said", [(None, "None"), (42, "int 42"), (1.5, "float 1.5"),
                                         (True, "bool True"), (b"abc", "bytes"), ({"a": 1}, "dict"),
                                         ({1, 2}, "set")])
def test_encode_names_what_is_neither_text_nor_ids(model, value, said):
    """These said "input_ids: expected a non-empty list of token-id lists", though text is
    what most callers pass."""
    with pytest.raises(InputError, match=rf"^encode\(\): got {said}, expected text \(a string or "
                                         r"a list of strings\) or token ids") as e:
        model.encode(value)
    one_line(e)


@pytest.mark.parametrize("value, match", [
    (["a", 3], r"^encode\(\): text 1 is int 3, not a string"),   # was "row 0 is str"
    (["a", None], r"^encode\(\): text 1 is None, not a string"),
    ([[1, 2], "a"], r"^input_ids: row 1 is str, expected a non-empty list of token ids"),
    ([["a"]], r"^input_ids: row 0, position 0 holds 'a' \(str\), not an integer token id"),
    ([[[1]]], r"^input_ids: row 0, position 0 holds \[1\] \(list\)"),
    ([b"x"], r"^input_ids: row 0 is bytes"),
    (np.zeros((1, 2, 2), np.int64), r"^input_ids: expected a non-empty \(batch, length\) array")])
def test_encode_names_the_item_at_fault(model, value, match):
    with pytest.raises(InputError, match=match) as e:
        model.encode(value)
    one_line(e)


def test_encode_still_takes_text_and_ids(model):
    texts = ("a cat", "two dogs")
    by_text = model.encode(list(texts))
    assert np.array_equal(model.encode(texts), by_text)
    ids = [model.tokenizer.encode(t) for t in texts]
    states = model.encode(ids)
    mask = np.zeros(states.shape[:2], bool)
    for i, row in enumerate(ids):
        mask[i, :len(row)] = True
    assert np.allclose(states[mask], by_text[mask], atol=1e-6)
