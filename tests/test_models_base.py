"""The shared façade (models/base.py): input batches, sizes, the decoding protocol."""
import re

import numpy as np
import pytest
from conftest import ROOT
from factories import write_t5

import minfer
from minfer.errors import ArenaExhausted, InputError


@pytest.mark.parametrize("inputs,needle", [([], "empty"), ([[3, 4], []], "row 1 is empty"),
                                           ([[3, 999]], "token id 999"), ([[3, -1]], "token id -1"),
                                           ([["a"]], "row 0, position 0 holds")])
def test_bad_inputs_are_named(tmp_path, inputs, needle):
    model = minfer.load(write_t5(tmp_path / "m"))
    with pytest.raises(InputError, match=needle):
        model.generate(inputs, max_new_tokens=3)


def test_too_small_workspace_fails_up_front(tmp_path):
    model = minfer.load(write_t5(tmp_path / "m"), workspace="64KiB")
    with pytest.raises(ArenaExhausted, match="bytes available of 65536"):
        model.generate([[3, 4, 5, 1]], max_new_tokens=100_000)
    assert model.backend.arena.used == 0


def test_both_families_implement_the_decoding_protocol(tmp_path):
    from conftest import XL_FIXTURES
    from minfer.generation.protocol import DecodeState, DecodingModel
    for model in (minfer.load(write_t5(tmp_path / "m")), minfer.load(XL_FIXTURES / "adaptive_div4")):
        assert isinstance(model, DecodingModel)
        ids, mask = model.batch([[3, 4, 5]])
        with model.start_decoding(ids, mask, 4) as state:
            assert isinstance(state, DecodeState)
            first = state.step(state.first_tokens)
            assert first.dtype == np.float32 and first.shape == (1, model.config.vocab_size)
            assert isinstance(first, np.ndarray)  # host scores, whatever the device


def test_facade_reports_sizes_and_closes(tmp_path):
    with minfer.load(write_t5(tmp_path / "m")) as model:
        assert model.family.name == "t5" and model.is_encoder_decoder
        plan = model.plan(batch=2, input_len=9, max_new_tokens=5)
        assert plan["peak"] == plan["decode_state"] + max(plan["encoder_scratch"],
                                                          plan["cross_kv_scratch"])
        assert model.plan(2, 9, 50)["peak"] > plan["peak"]
        assert dict(model.describe())["layers"] == "2 encoder / 2 decoder"
        assert repr(model).startswith("T5Model(") and "d_model=16" in repr(model)


# -- token-id inputs: generated bad ids at generated places, each named by row and position ---------
from minfer.models.base import as_batch  # noqa: E402

V = 64
BAD_IDS = [1.0, np.float32(1), np.float64(2), True, False, np.bool_(True), "1", b"1", None, [1],
           (1,), 2**63, 2**64, 10**400, -1, -(2**63) - 1, V, np.uint64(2**63), np.int64(-5), 1 + 0j]
PLACES = [(0, 0), (0, 3), (1, 2), (2, 1)]


def rows_with(bad, r, c):
    rows = [[3, 4, 5, 6], [7, 8, 9], [10, 11]]
    rows[r][c] = bad
    return rows


@pytest.mark.parametrize("r,c", PLACES)
@pytest.mark.parametrize("bad", BAD_IDS, ids=lambda v: f"{type(v).__name__}:{v!r:.20}")
def test_every_bad_id_is_named_by_row_and_position(bad, r, c):
    with pytest.raises(InputError) as e:
        as_batch(rows_with(bad, r, c), 0, V)
    msg = str(e.value)
    assert f"row {r}, position {c}" in msg and "\n" not in msg and len(msg) < 200


@pytest.mark.parametrize("inputs,needle", [
    ([[1, 2], 3], "row 1 is int"), ([1, [2]], "row 0 is int"), ([[[1]]], "row 0, position 0 holds [1]"),
    ([[1], []], "row 1 is empty"), ([], "an empty list"), ((), "an empty list"), (None, "NoneType"),
    ({1, 2}, "set"), ("abc", "str"), ({"a": 1}, "dict"), (iter([[1]]), "iterator"),
])
def test_bad_structures_are_named(inputs, needle):
    with pytest.raises(InputError, match=re.escape(needle)):
        as_batch(inputs, 0, V)


@pytest.mark.parametrize("array,needle", [
    (np.array([[1.0, 2.0]]), "dtype float64"), (np.array([[1, 2]], np.float32), "dtype float32"),
    (np.array([[True, False]]), "dtype bool"), (np.array([[1, "a"]], dtype=object), "dtype object"),
    (np.array([[1 + 0j]]), "dtype complex128"), (np.zeros((1, 2, 3), np.int64), "shape (1, 2, 3)"),
    (np.array(5), "shape ()"), (np.zeros((0, 3), np.int64), "shape (0, 3)"),
    (np.array([[3, 2**63]], np.uint64), "token id 9223372036854775808 at row 0, position 1"),
    (np.array([[3, 2**64 - 1]], np.uint64), "at row 0, position 1"),
    (np.array([[3], [-2]], np.int8), "token id -2 at row 1, position 0"),
])
def test_bad_arrays_are_named(array, needle):
    with pytest.raises(InputError, match=re.escape(needle)):
        as_batch(array, 0, V)


@pytest.mark.parametrize("mask,needle", [
    (np.array([[1.0, 1.0]]), "dtype float64"), (np.array([[1, 2]]), "value 2 at row 0, position 1"),
    (np.array([[1, -1]]), "value -1"), (np.array([[1, 1, 1]]), "shape (1, 3)"),
    (np.array([[0, 0]]), "row 0 masks every token"), ([[1, 0.5]], "dtype float64"),
])
def test_bad_masks_are_named(mask, needle):
    with pytest.raises(InputError, match=re.escape(needle)):
        as_batch(np.array([[3, 4]]), 0, V, attention_mask=mask)


def test_good_ids_of_every_integer_kind_are_accepted():
    for kind in (np.int8, np.uint8, np.int32, np.uint64, np.int64):
        ids, mask = as_batch([[kind(3), 4], [kind(5)]], 0, V)
        assert ids.tolist() == [[3, 4], [5, 0]] and mask.tolist() == [[1, 1], [1, 0]]
        ids, _ = as_batch(np.array([[3, 63]], kind), 0, V, attention_mask=np.array([[True, True]]))
        assert ids.dtype == np.int64 and ids.tolist() == [[3, 63]]


@pytest.mark.parametrize("inputs,needle", [
    (["ok", 5], "prompt 1 is int"), (["ok", None], "prompt 1 is NoneType"),
    ([5, "ok"], "item 0 is int"), ([[3, 4], "ok"], "item 1 is str"), (["ok", ["x"]], "prompt 1 is list"),
    ([[3, 4.0]], "row 0, position 1 holds 4.0"), ([[3, 2**63]], "token id 9223372036854775808"),
    (np.array([[3.0]]), "dtype float64"), (np.ones((1, 1, 1), np.int64), "shape (1, 1, 1)"),
])
def test_generate_names_bad_inputs(tmp_path, inputs, needle):
    model = minfer.load(write_t5(tmp_path / "m"))
    with pytest.raises(InputError, match=re.escape(needle)):
        model.generate(inputs, max_new_tokens=3)


def test_attention_mask_goes_with_ids_only(tmp_path):
    model = minfer.load(write_t5(tmp_path / "m"))
    with pytest.raises(InputError, match="attention_mask: pass it only with token ids"):
        model.generate("hello", attention_mask=[[1]])
    with pytest.raises(InputError, match=re.escape("row 1, position 0 holds 'x'")):
        model.generate([[3, 4], ["x", 5]], attention_mask=np.ones((2, 2), np.int64))
    with pytest.raises(InputError, match="attention_mask: the token-id rows must have equal"):
        model.generate([[3, 4], [5]], attention_mask=np.ones((2, 2), np.int64))
    with pytest.raises(InputError, match="attention_mask: shape"):
        model.generate([[3, 4], [5, 6]], attention_mask=np.ones((2, 3), np.int64))
    ids = model.generate([[3, 4], [5, 6]], attention_mask=np.array([[1, 1], [1, 0]]), max_new_tokens=2)
    assert len(ids) == 2


@pytest.mark.parametrize("args", [(-1, 5, 5), ("2", 5, 5), (2.5, 5, 5), (True,), (1, 0), (1, 5, -1),
                                  (1, 10**41)])
def test_plan_refuses_sizes_that_are_not_integers_in_range(args):
    """A negative batch planned negative bytes; a string batch repeated itself into a number
    hundreds of digits long."""
    import minfer
    from minfer.errors import InputError
    for folder in ("tiny-t5-dates", "tiny-xl-recall"):
        m = minfer.load(ROOT / "weights" / folder)
        with pytest.raises(InputError, match=r"^plan\(\): \w+ must be an integer in \["):
            m.plan(*args)


def test_encode_to_a_max_length_beyond_the_arena_fails_before_padding_anything():
    """encode(padding='max_length', max_length=10**9) padded the ids first: 8 GB of ids, then a
    (1, 10**9, C) result, before the arena said no (the process was killed at 22 GB)."""
    import tracemalloc

    import minfer
    from minfer.errors import ArenaExhausted
    m = minfer.load(ROOT / "weights" / "tiny-t5-dates")
    tracemalloc.start()
    try:
        with pytest.raises(ArenaExhausted, match="encode\\(\\): one row of max_length 1000000000"):
            m.encode("date: 1999", padding="max_length", max_length=10**9)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    assert m.encode("date: 1999", padding="max_length", max_length=16).shape[:2] == (1, 16)
