"""T5 against Hugging Face transformers: the committed references in weights/t5 (made by
weights/make_t5_fixtures.py), and the live oracle where torch and transformers are installed."""
import importlib.util

import numpy as np
import pytest
from conftest import T5_CASES, T5_FIXTURES, fixture_script, load_reference, rel_err, trim_hf_ids

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
    script = fixture_script("make_t5_fixtures")
    live = script.reference_outputs(str(T5_FIXTURES / case))
    ref = load_reference(case)
    for key in ("encoder_states", "logits"):
        assert rel_err(live[key], ref[key]) < TOL, key
    assert np.array_equal(live["greedy_ids"], ref["greedy_ids"])
    got = t5_models(case).forward(ref["input_ids"], ref["decoder_input_ids"], ref["attention_mask"])
    assert rel_err(got, live["logits"]) < TOL


# -- compressed weight formats -----------------------------------------------------------------------
# float16 keeps 11 significant bits, bfloat16 8: every stored weight is off by up to 2^-11 or 2^-8
# of itself, and the random fixtures (untrained, narrow) amplify that through their layers.
# Measured relative L2 errors of the logits against transformers' float32: float16 <= 5.5e-3,
# bfloat16 1.6e-2 .. 3.9e-2 on the float32-stored T5 fixtures (fixtures stored in float16 or
# bfloat16 load as their own bytes: 1e-6). What is checked exactly is that the compressed paths
# compute with precisely the stored values (test_compressed_formats_compute_exactly_...).
FORMAT_TOL = {"float16": 1e-2, "bfloat16": 5e-2}


def rel_l2(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("dtype", sorted(FORMAT_TOL))
@pytest.mark.parametrize("case", T5_CASES)
def test_half_formats_stay_close_to_the_float32_reference(case, dtype, kernel_mode):
    import minfer
    ref = load_reference(case)
    model = minfer.load(T5_FIXTURES / case, dtype=dtype, compute="float32")   # (the format alone)
    got = model.forward(ref["input_ids"], ref["decoder_input_ids"], ref["attention_mask"])
    assert rel_l2(got, ref["logits"]) < FORMAT_TOL[dtype]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])
def test_compressed_formats_compute_exactly_their_stored_weights(tmp_path, dtype, kernel_mode):
    """A float32 checkpoint whose weights are already representable in the format (and whose
    norms are 1, so folding changes nothing) gives the same logits in that format."""
    import minfer
    from safetensors.numpy import save_file

    from factories import write_t5
    from minfer.io.checkpoint import Checkpoint
    from minfer.io.formats import FORMATS
    from minfer.products import PackedWeight, wrap
    src = write_t5(tmp_path / "src", seed=11, feed_forward_proj="gated-gelu", num_layers=3)
    ckpt, fmt = Checkpoint(src), FORMATS[dtype]
    tensors = {}
    for name in ckpt.names():
        w = ckpt.read(name)
        if name.endswith("layer_norm.weight"):
            w = np.ones_like(w)
        elif w.ndim == 2 and "relative_attention_bias" not in name:
            stored = fmt.encode("w", w)
            packed = wrap(fmt, "w", stored, np.float32, np.empty(w.size, np.float32), None)
            if isinstance(packed, PackedWeight):
                w = packed.rows(np, np.arange(w.shape[0]), np.empty_like(w))
        tensors[name] = np.ascontiguousarray(w, np.float32)
    rounded = tmp_path / "rounded"
    rounded.mkdir()
    (rounded / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(rounded / "model.safetensors"))
    ids, dec = [[5, 6, 7, 8, 1], [9, 10, 1]], [[0, 3, 4], [0, 5, 6]]
    want = minfer.load(rounded).forward(ids, dec)
    got = minfer.load(rounded, dtype=dtype, compute="float32").forward(ids, dec)
    assert rel_err(got, want) < 1e-5
