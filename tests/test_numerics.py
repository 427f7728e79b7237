"""Outputs that hold NaN or infinity (numerics.py): weights that load but overflow make every
public call fail in one line naming the model and the layer where the values began, never hand
back NaN."""
import json
import shutil
import warnings

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import minfer
from minfer import numerics
from minfer.errors import NonFiniteError

from conftest import ROOT
from factories import write_t5

HUGE = 1e20   # under the loader's bound on a weight (1e30), but two such products overflow float32


def _scaled(folder, *names, factor=HUGE):
    """The checkpoint with these tensors multiplied by `factor`: they load, and the layer that
    multiplies by both overflows to infinity."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for name in names:
        tensors[name] = (tensors[name].astype(np.float64) * factor).astype(np.float32)
    save_file(tensors, str(path))
    return folder


def _ff(stack, layer, sub):
    """The two weights of a T5 feed-forward (relu): both scaled, its output overflows."""
    return (f"{stack}.block.{layer}.layer.{sub}.DenseReluDense.wi.weight",
            f"{stack}.block.{layer}.layer.{sub}.DenseReluDense.wo.weight")


@pytest.fixture
def t5_folder(tmp_path):
    return write_t5(tmp_path / "t5", seed=2, num_layers=3, num_decoder_layers=3)


def test_all_finite_sees_nan_and_infinity_anywhere():
    a = np.zeros((3, 1000), np.float32)
    assert numerics.all_finite(np, a, None)
    for bad in (np.nan, np.inf, -np.inf):
        b = a.copy()
        b[2, 777] = bad
        assert not numerics.all_finite(np, a, b)
    big = np.full(1 << 16, 3e38, np.float32)    # finite values whose float32 sum overflows
    assert numerics.all_finite(np, big)
    assert not numerics.all_finite(np, np.array([np.inf], np.float16))


def test_encode_names_the_encoder_layer_where_the_values_began(t5_folder):
    _scaled(t5_folder, *_ff("encoder", 1, 1))
    model = minfer.load(t5_folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # nothing but the error: no NumPy warnings
        with pytest.raises(NonFiniteError) as e:
            model.encode([[5, 6, 7, 1], [8, 9, 1, 0]])
    message = str(e.value)
    assert "\n" not in message and str(t5_folder) in message
    assert "encoder states" in message and "beginning at encoder layer 1" in message


def test_generate_and_forward_fail_in_one_line_when_the_encoder_overflows(t5_folder):
    model = minfer.load(_scaled(t5_folder, *_ff("encoder", 0, 1)))
    for call in (lambda: model.generate([[5, 6, 7, 1]], max_new_tokens=3),
                 lambda: model.generate([[5, 6, 7, 1]], max_new_tokens=3, num_beams=2),
                 lambda: model.forward([[5, 6, 7, 1]], [[0, 3, 4]])):
        with pytest.raises(NonFiniteError, match="beginning at encoder layer 0"):
            call()


def test_a_decoder_layer_that_overflows_is_named_in_steps_and_in_forward(t5_folder):
    model = minfer.load(_scaled(t5_folder, *_ff("decoder", 1, 2)))
    assert np.isfinite(model.encode([[5, 6, 7, 1]])).all()
    with pytest.raises(NonFiniteError, match=r"logits .*beginning at decoder layer 1"):
        model.generate([[5, 6, 7, 1]], max_new_tokens=3)
    with pytest.raises(NonFiniteError, match=r"logits .*beginning at decoder layer 1"):
        model.forward([[5, 6, 7, 1]], [[0, 3, 4]])


def test_steps_taken_together_fail_only_the_state_whose_values_are_not_finite(t5_folder):
    """Two requests stepped together (their rows stacked): the one whose encoder output holds
    NaN gets its own NonFiniteError in its place; the other's logits are what it gets alone."""
    model = minfer.load(t5_folder)
    ids, mask = np.array([[5, 6, 7, 1]]), np.ones((1, 4), np.int64)
    with model.start_decoding(ids, mask, 4) as alone:
        want = alone.step(alone.first_tokens).copy()
    with model.start_decoding(ids, mask, 4) as a, model.start_decoding(ids, mask, 4) as b:
        b.buf.cross_k[1] = np.nan                    # as if b's encoder output had overflowed
        for pair in ([a, b], [b, a]):
            for state in pair:
                state.length = 0
            out = model.step_together(pair, [s.first_tokens for s in pair])
            got, error = (out[0], out[1]) if pair[0] is a else (out[1], out[0])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            assert isinstance(error, NonFiniteError) and "the encoder's output" in str(error)


def test_beams_of_several_prompts_name_the_encoder(t5_folder, monkeypatch):
    """With beams, each prompt's cross K/V are spread over its beams' rows before the check:
    every row is checked (the first B rows hold only the first prompts' beams)."""
    from minfer.models.t5 import math as t5
    real = t5.cross_kv

    def second_prompt_overflows(be, cfg, params, states, cache_k, cache_v):
        real(be, cfg, params, states, cache_k, cache_v)
        if cache_k.shape[1] > 1:
            cache_k[:, 1] = np.nan                  # (L, B, H, S, D): input 1's keys
    model = minfer.load(t5_folder)
    monkeypatch.setattr(t5, "cross_kv", second_prompt_overflows)
    with pytest.raises(NonFiniteError, match="encoder states .*cross-attention keys and values"):
        model.generate([[5, 6, 7, 1], [8, 9, 10, 1]], max_new_tokens=3, num_beams=2)


def test_a_healthy_model_is_untouched(t5_folder):
    model = minfer.load(t5_folder)
    assert np.isfinite(model.encode([[5, 6, 7, 1]])).all()
    assert len(model.generate([[5, 6, 7, 1]], max_new_tokens=3)[0]) >= 1


@pytest.fixture
def xl_folder(tmp_path):
    return shutil.copytree(ROOT / "weights" / "tiny-xl-recall", tmp_path / "xl")


def test_transformer_xl_names_the_layer_in_forward_score_and_generate(xl_folder):
    model = minfer.load(_scaled(xl_folder, "transformer.layers.0.pos_ff.CoreNet.0.weight",
                                 "transformer.layers.0.pos_ff.CoreNet.3.weight"))
    ids = [[3, 4, 5, 6]]
    for call in (lambda: model.forward(ids), lambda: model.score([3, 4, 5, 6, 7]),
                 lambda: model.generate(ids, max_new_tokens=2)):
        with pytest.raises(NonFiniteError, match="beginning at layer 0"):
            call()


def test_embed_and_the_cli_embed_fail_in_one_line(tmp_path):
    """`minfer embed` wrote NaN (not JSON) and exited 0; now one line and a failing status."""
    import os
    import subprocess
    import sys

    from conftest import make_text_model_folder
    folder = make_text_model_folder(tmp_path / "m")
    _scaled(folder, *_ff("encoder", 1, 1))
    model = minfer.load(folder)
    with pytest.raises(NonFiniteError, match="beginning at encoder layer 1"):
        model.embed(["a b c", "d e"])
    run = subprocess.run([sys.executable, "-m", "minfer", "embed", "-m", str(folder), "a b c"],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, NUMBA_NUM_THREADS="1"))
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert "encoder layer 1" in lines[0] and "NaN or infinity" in lines[0]
    def no_constants(name):
        raise AssertionError(f"{name} in the output: not JSON")
    [record] = [json.loads(line, parse_constant=no_constants) for line in run.stdout.splitlines()]
    assert record["embedding"] is None and "encoder layer 1" in record["error"]


def test_a_sentence_head_that_overflows_is_named(monkeypatch):
    """The encoder states are checked in encode; the sentence-transformers head after them
    (pooling, Dense, normalisation) is checked on its own vectors."""
    from minfer import embedding
    model = minfer.load(ROOT / "weights" / "family" / "st_prompts")
    real = embedding.head
    monkeypatch.setattr(embedding, "head", lambda *a: real(*a) * np.float32(np.inf))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(NonFiniteError, match="embeddings .*the sentence-transformers head"):
            model.embed(["a b c", "d e"])


def test_a_transformer_xl_session_goes_on_from_an_empty_memory_after_a_failure(xl_folder):
    model = minfer.load(_scaled(xl_folder, "transformer.layers.1.pos_ff.CoreNet.0.weight",
                                "transformer.layers.1.pos_ff.CoreNet.3.weight"))
    with model.session() as session:
        for _ in range(2):   # the second failure names the same layer: nothing kept from the first
            with pytest.raises(NonFiniteError, match="beginning at layer 1"):
                session.score([3, 4, 5, 6, 7])
            assert session.memory.length == 0
