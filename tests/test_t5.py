"""T5 structure: buckets, config parsing, loading checks, incremental decoding, arena use."""
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import minfer
from minfer.errors import ArenaExhausted, CheckpointError, ConfigError, InputError
from minfer.models import t5
from t5_factory import BASE, write_t5


# -- relative position buckets (values from the reference numerics notes, 32 buckets / 128) -------------
@pytest.mark.parametrize("rel,bucket", [(0, 0), (-1, 1), (-8, 8), (-16, 10), (-32, 12), (-64, 14),
                                        (-128, 15), (-1000, 15), (1, 17), (8, 24), (16, 26),
                                        (32, 28), (64, 30), (128, 31), (5000, 31)])
def test_encoder_buckets(rel, bucket):
    assert t5.relative_bucket(np.array([rel]), True, 32, 128)[0] == bucket


@pytest.mark.parametrize("rel,bucket", [(-15, 15), (-16, 16), (-32, 21), (-64, 26), (-128, 31),
                                        (-4000, 31), (0, 0), (1, 0), (300, 0)])
def test_decoder_buckets(rel, bucket):
    assert t5.relative_bucket(np.array([rel]), False, 32, 128)[0] == bucket


def test_buckets_are_monotone_in_distance_and_in_range():
    rel = np.arange(-300, 301)
    for bidirectional in (True, False):
        for nb, md in ((32, 128), (8, 12), (16, 9)):
            b = t5.relative_bucket(rel, bidirectional, nb, md)
            assert b.min() >= 0 and b.max() < nb
            neg = b[rel <= 0][::-1]  # distance 0, 1, 2, ... to the past
            assert (np.diff(neg) >= 0).all()


def test_causal_table_by_distance_gives_each_step_its_row():
    cfg = t5.T5Config.from_hf(BASE)
    rng = np.random.default_rng(0)
    rel_bias = rng.standard_normal((cfg.num_buckets, cfg.num_heads)).astype(np.float32)
    max_len = 40
    table = t5.causal_bias_by_distance(cfg, rel_bias, max_len)
    full = t5.position_bias(cfg, rel_bias, max_len, max_len, bidirectional=False)  # (H, T, T)
    for t in (0, 1, 7, 39):
        np.testing.assert_array_equal(table[:, max_len - 1 - t:], full[:, t, :t + 1])


# -- config --------------------------------------------------------------------------------------------
def test_config_variants():
    gated = t5.T5Config.from_hf({**BASE, "feed_forward_proj": "gated-gelu"})
    assert gated.gated and gated.act == "gelu_new"
    explicit = t5.T5Config.from_hf({**BASE, "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu"})
    assert explicit.act == "gelu"
    assert t5.T5Config.from_hf({**BASE, "num_decoder_layers": None}).num_decoder_layers == 2
    assert t5.T5Config.from_hf({k: v for k, v in BASE.items()
                                if k != "decoder_start_token_id"}).decoder_start_token_id == 0


@pytest.mark.parametrize("change,needle", [
    ({"d_model": 0}, "'d_model'"), ({"num_heads": "8"}, "'num_heads'"),
    ({"feed_forward_proj": "gated-"}, "feed_forward_proj"),
    ({"feed_forward_proj": "fancy-gelu"}, "feed_forward_proj"),
    ({"dense_act_fn": "mish"}, "activation 'mish'"), ({"model_type": "bart"}, "model_type"),
    ({"eos_token_id": 999}, "eos_token_id"), ({"relative_attention_max_distance": 16, "relative_attention_num_buckets": 32}, "max_distance"),
])
def test_config_errors_name_the_key(change, needle):
    with pytest.raises(ConfigError, match=needle):
        t5.T5Config.from_hf({**BASE, **change})


# -- loading checks --------------------------------------------------------------------------------------
def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path):
    name = "decoder.block.1.layer.2.DenseReluDense.wo.weight"
    write_t5(tmp_path / "missing", drop=(name,))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is missing"):
        minfer.load(tmp_path / "missing")

    write_t5(tmp_path / "extra", extra_tensors={"encoder.block.0.surprise": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'encoder.block.0.surprise'"):
        minfer.load(tmp_path / "extra")

    write_t5(tmp_path / "shape", extra_tensors={name: np.zeros((16, 31), np.float32)})
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \[16, 31\], config implies \[16, 32\]"):
        minfer.load(tmp_path / "shape")


def test_aliases_and_legacy_tensors_are_accepted(tmp_path):
    base = write_t5(tmp_path / "a", seed=3)
    tensors = {}
    from minfer.checkpoint import Checkpoint
    ckpt = Checkpoint(base)
    for n in ckpt.names():
        tensors[n] = ckpt.read(n)
    shared = tensors.pop("shared.weight")
    tensors["encoder.embed_tokens.weight"] = shared  # only an alias of the embedding
    tensors["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = \
        np.ones((8, 4), np.float32)
    other = tmp_path / "b"
    other.mkdir()
    (other / "config.json").write_text((base / "config.json").read_text())
    save_file(tensors, str(other / "model.safetensors"))
    ids = [[5, 6, 7, 1]]
    np.testing.assert_array_equal(minfer.load(base).forward(ids, [[0, 9, 4]]),
                                  minfer.load(other).forward(ids, [[0, 9, 4]]))


def test_load_rejects_bad_options(tmp_path):
    folder = write_t5(tmp_path / "m")
    with pytest.raises(ConfigError, match="device 'tpu'"):
        minfer.load(folder, device="tpu")
    with pytest.raises(ConfigError, match="dtype 'float16'"):
        minfer.load(folder, dtype="float16")
    with pytest.raises(ConfigError, match="unknown option 'colour'"):
        minfer.load(folder, colour="red")
    with pytest.raises(minfer.errors.ModelNotFoundError, match="no such folder"):
        minfer.load(tmp_path / "nope")


# -- decoding ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [{}, {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False},
                                       {"num_layers": 3, "num_decoder_layers": 1, "d_kv": 5}])
def test_incremental_steps_equal_the_full_forward(tmp_path, overrides):
    model = minfer.load(write_t5(tmp_path / "m", seed=1, **overrides))
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 64, (2, 11))
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    dec = rng.integers(2, 64, (2, 20))
    dec[:, 0] = 0
    full = model.forward(ids, dec, mask)  # (B, T, V)
    with model.start_decoding(ids, mask, max_len=20) as state:
        for t in range(20):
            step = np.array(state.step(dec[:, t]))
            np.testing.assert_allclose(step, full[:, t], rtol=1e-5, atol=1e-5 * np.abs(full).max())


def test_generation_uses_the_arena_and_gives_it_back(tmp_path, monkeypatch):
    model = minfer.load(write_t5(tmp_path / "m", seed=2), workspace="4MiB")
    arena = model.backend.arena
    calls = []
    real_cross_kv = t5.cross_kv
    monkeypatch.setattr(t5, "cross_kv", lambda *a, **k: (calls.append(1), real_cross_kv(*a, **k)))
    arena.reset_peak()
    before = arena.stats()
    out = model.generate([[3, 4, 5, 6, 1], [7, 8, 1]], max_new_tokens=30, min_new_tokens=30)
    after = arena.stats()
    assert [len(r) for r in out] == [31, 31]
    assert after.used == before.used  # everything released
    plan = model.plan(batch=2, src_len=5, max_new_tokens=30)
    assert after.peak >= plan["decode_state"]  # the KV caches and cross K/V lived in the arena
    assert after.peak <= plan["peak"]
    assert len(calls) == 1  # cross K/V computed once per encode, not per step


def test_decode_steps_do_not_grow_the_arena(tmp_path):
    model = minfer.load(write_t5(tmp_path / "m"))
    ids, mask = np.array([[3, 4, 5, 1]]), np.ones((1, 4), int)
    with model.start_decoding(ids, mask, max_len=8) as state:
        used = model.backend.arena.used
        for t in range(8):
            state.step(np.array([t + 2]))
            assert model.backend.arena.used == used


def test_too_small_workspace_fails_up_front(tmp_path):
    model = minfer.load(write_t5(tmp_path / "m"), workspace="64KiB")
    with pytest.raises(ArenaExhausted, match="bytes available of 65536"):
        model.generate([[3, 4, 5, 1]], max_new_tokens=100_000)
    assert model.backend.arena.used == 0


@pytest.mark.parametrize("inputs,needle", [([], "empty"), ([[3, 4], []], "row 1 is empty"),
                                           ([[3, 999]], "token id 999"), ([[3, -1]], "token id -1"),
                                           ([["a"]], "row 0 holds")])
def test_bad_inputs_are_named(tmp_path, inputs, needle):
    model = minfer.load(write_t5(tmp_path / "m"))
    with pytest.raises(InputError, match=needle):
        model.generate(inputs, max_new_tokens=3)


@pytest.mark.parametrize("options,needle", [({"max_new_tokens": 0}, "max_new_tokens"),
                                            ({"max_new_tokens": 2.5}, "max_new_tokens"),
                                            ({"min_new_tokens": -1}, "min_new_tokens")])
def test_bad_generation_options_are_named(tmp_path, options, needle):
    model = minfer.load(write_t5(tmp_path / "m"))
    with pytest.raises(InputError, match=needle):
        model.generate([[3, 4, 1]], **options)


def test_generation_config_sets_the_default_length(tmp_path):
    folder = write_t5(tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4}))
    model = minfer.load(folder)
    out = model.generate([[3, 4, 1]], min_new_tokens=4)
    assert len(out[0]) == 5
