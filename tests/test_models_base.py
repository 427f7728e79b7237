"""The shared façade (models/base.py): input batches, sizes, the decoding protocol."""
import numpy as np
import pytest
from factories import write_t5

import minfer
from minfer.errors import ArenaExhausted, InputError


@pytest.mark.parametrize("inputs,needle", [([], "empty"), ([[3, 4], []], "row 1 is empty"),
                                           ([[3, 999]], "token id 999"), ([[3, -1]], "token id -1"),
                                           ([["a"]], "row 0 holds")])
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
        assert model.family == "t5" and model.is_encoder_decoder
        plan = model.plan(batch=2, input_len=9, max_new_tokens=5)
        assert plan["peak"] == plan["decode_state"] + max(plan["encoder_scratch"],
                                                          plan["cross_kv_scratch"])
        assert model.plan(2, 9, 50)["peak"] > plan["peak"]
        assert dict(model.describe())["layers"] == "2 encoder / 2 decoder"
        assert repr(model).startswith("T5Model(") and "d_model=16" in repr(model)
