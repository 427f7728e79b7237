"""T5 against Hugging Face transformers: the committed references in weights/t5 (made by
weights/make_t5_fixtures.py), and the live oracle where torch and transformers are installed."""
import importlib.util

import numpy as np
import pytest
from conftest import ROOT, T5_CASES, T5_FIXTURES, load_reference, rel_err, trim_hf_ids

TOL = 1e-4


def test_fixture_set_covers_the_required_cases():
    assert {"v1_0_relu_tied", "v1_1_gated_untied", "odd_shapes"} <= set(T5_CASES)


@pytest.mark.parametrize("case", T5_CASES)
def test_encoder_states_match(case, t5_models):
    ref = load_reference(case)
    got = t5_models(case).encode(ref["input_ids"], ref["attention_mask"])
    assert got.dtype == np.float32 and got.shape == ref["encoder_states"].shape
    mask = ref["attention_mask"].astype(bool)  # padded positions are not compared
    assert rel_err(got[mask], ref["encoder_states"][mask]) < TOL


@pytest.mark.parametrize("case", T5_CASES)
def test_logits_match(case, t5_models):
    ref = load_reference(case)
    got = t5_models(case).forward(ref["input_ids"], ref["decoder_input_ids"], ref["attention_mask"])
    assert got.dtype == np.float32 and got.shape == ref["logits"].shape
    assert rel_err(got, ref["logits"]) < TOL


@pytest.mark.parametrize("case", T5_CASES)
def test_greedy_padded_batch_matches(case, t5_models):
    ref = load_reference(case)
    model = t5_models(case)
    got = model.generate(ref["input_ids"], attention_mask=ref["attention_mask"],
                         max_new_tokens=int(ref["greedy_max_new_tokens"]))
    assert got == [trim_hf_ids(r) for r in ref["greedy_ids"]]


@pytest.mark.parametrize("case", T5_CASES)
def test_greedy_single_rows_match(case, t5_models):
    ref = load_reference(case)
    model = t5_models(case)
    for i, row in enumerate(ref["input_ids"]):
        tokens = [int(t) for t, m in zip(row, ref["attention_mask"][i]) if m]
        got = model.generate([tokens], max_new_tokens=int(ref["greedy_max_new_tokens"]))
        assert got == [trim_hf_ids(r) for r in ref[f"greedy_single_ids_{i}"]], f"row {i}"


@pytest.mark.parametrize("case", T5_CASES)
def test_min_new_tokens_matches(case, t5_models):
    ref = load_reference(case)
    got = t5_models(case).generate(ref["input_ids"], attention_mask=ref["attention_mask"],
                                   max_new_tokens=int(ref["greedy_max_new_tokens"]),
                                   min_new_tokens=int(ref["greedy_min_new_tokens"]))
    assert got == [trim_hf_ids(r) for r in ref["greedy_min_ids"]]


def test_some_fixture_stops_at_eos_early():
    """The greedy references must exercise eos handling, or the tests above prove less."""
    early = [case for case in T5_CASES
             if any(len(trim_hf_ids(r)) <= int(load_reference(case)["greedy_max_new_tokens"])
                    for r in load_reference(case)["greedy_ids"])]
    assert early


@pytest.mark.skipif(importlib.util.find_spec("torch") is None
                    or importlib.util.find_spec("transformers") is None,
                    reason="torch + transformers (the [dev] extra) not installed")
@pytest.mark.parametrize("case", T5_CASES)
def test_live_oracle_agrees_with_committed_references(case, t5_models):
    spec = importlib.util.spec_from_file_location("make_t5_fixtures",
                                                  ROOT / "weights" / "make_t5_fixtures.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    live = script.reference_outputs(str(T5_FIXTURES / case))
    ref = load_reference(case)
    for key in ("encoder_states", "logits"):
        assert rel_err(live[key], ref[key]) < TOL, key
    assert np.array_equal(live["greedy_ids"], ref["greedy_ids"])
    got = t5_models(case).forward(ref["input_ids"], ref["decoder_input_ids"], ref["attention_mask"])
    assert rel_err(got, live["logits"]) < TOL
