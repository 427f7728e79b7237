"""LongT5 (local and transient-global encoder attention: models/t5/long_attention.py) against
transformers 4.57: the committed references in weights/longt5 (weights/make_longt5_fixtures.py),
the config and weight names, and memory linear in the input length."""
import importlib.util
import json

import numpy as np
import pytest
from conftest import ROOT, fixture_script, _models, load_reference, rel_err, trim_hf_ids
from factories import write_t5

import minfer
from minfer.errors import CheckpointError, ConfigError
from minfer.models.t5 import T5Config
from minfer.models.t5 import buffers as t5_buffers
from minfer.models.t5.buffers import LongEncoderScratch, run_bytes
from minfer.models.t5.long_attention import global_blocks
from minfer.models.t5.weights import weight_table

FIXTURES = ROOT / "weights" / "longt5"
CASES = sorted(p.name for p in FIXTURES.glob("*") if (p / "reference.npz").is_file())
TOL = 1e-4


@pytest.fixture
def models(kernel_mode, _loaded_models):
    return _models(FIXTURES, _loaded_models, kernel_mode)


def reference(case):
    return load_reference(case, FIXTURES)


def test_fixtures_cover_both_attentions_and_the_awkward_lengths():
    assert {"local", "tglobal", "tglobal_float_blocks"} <= set(CASES)
    for case in CASES:
        cfg = json.loads((FIXTURES / case / "config.json").read_text())
        ref = reference(case)
        T = ref["input_ids"].shape[1]
        assert T % (cfg["local_radius"] + 1) and T > 4 * (cfg["local_radius"] + 1)
        assert len(set(ref["attention_mask"].sum(axis=1))) == 3   # padding in the batch
        if cfg["encoder_attention_type"] == "transient-global":
            assert T % cfg["global_block_size"]


# -- parity ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_encoder_states_match(case, models):
    ref = reference(case)
    got = models(case).encode(ref["input_ids"], ref["attention_mask"])
    mask = ref["attention_mask"].astype(bool)   # padded positions are not the reference's
    assert got.shape == ref["encoder_states"].shape
    assert rel_err(got[mask], ref["encoder_states"][mask]) < TOL


@pytest.mark.parametrize("case", CASES)
def test_logits_match(case, models):
    ref = reference(case)
    got = models(case).forward(ref["input_ids"], ref["decoder_input_ids"], ref["attention_mask"])
    assert rel_err(got, ref["logits"]) < TOL


@pytest.mark.parametrize("case", CASES)
def test_greedy_ids_match_batched_and_alone(case, models):
    ref = reference(case)
    model, n = models(case), int(ref["greedy_max_new_tokens"])
    got = model.generate(ref["input_ids"], attention_mask=ref["attention_mask"], max_new_tokens=n)
    assert got == [trim_hf_ids(r) for r in ref["greedy_ids"]]
    for i, (row, mask) in enumerate(zip(ref["input_ids"], ref["attention_mask"])):
        alone = model.generate([[int(t) for t, m in zip(row, mask) if m]], max_new_tokens=n)
        assert alone == [trim_hf_ids(r) for r in ref[f"greedy_single_ids_{i}"]], f"row {i}"


@pytest.mark.parametrize("case", CASES)
def test_chunks_of_one_block_and_one_global_block_give_the_same_states(case, monkeypatch):
    """The chunk loops (queries a block at a time, global sums one block at a time) against the
    reference: every chunk boundary, the partial last block and the last global group."""
    monkeypatch.setattr(t5_buffers, "QUERY_ROWS", 1)
    monkeypatch.setattr(t5_buffers, "AGGREGATE_BLOCKS", 1)
    ref = reference(case)
    got = minfer.load(FIXTURES / case).encode(ref["input_ids"], ref["attention_mask"])
    mask = ref["attention_mask"].astype(bool)
    assert rel_err(got[mask], ref["encoder_states"][mask]) < TOL


def test_global_blocks_follow_the_reference_float_arithmetic():
    """transformers numbers global blocks with a float32 sum of 1/47: token 141 lands in block 2,
    not 141 // 47 = 3 (the tglobal_float_blocks fixture depends on it)."""
    ids, valid = global_blocks(np.ones((1, 190), np.int64), 47)
    assert ids[0, 140] == 2 and ids[0, 141] == 2 and ids[0, 142] == 3 and ids[0, 189] == 3
    assert valid.tolist() == [[True] * 4]
    mask = np.array([[1] * 10 + [0] * 3, [1] * 13])
    ids, valid = global_blocks(mask, 3)        # padding -1; the tail joins the last full block
    assert ids.tolist() == [[0, 0, 0, 1, 1, 1, 2, 2, 2, 2, -1, -1, -1],
                            [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3]]
    assert valid.tolist() == [[True, True, True, False], [True] * 4]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None
                    or importlib.util.find_spec("transformers") is None,
                    reason="torch + transformers (the [dev] extra) not installed")
@pytest.mark.parametrize("case", CASES)
def test_live_oracle_agrees_with_committed_references(case):
    script = fixture_script("make_longt5_fixtures")
    live, ref = script.reference_outputs(str(FIXTURES / case)), reference(case)
    for key in ("encoder_states", "logits"):
        assert rel_err(live[key], ref[key]) < TOL, key
    assert np.array_equal(live["greedy_ids"], ref["greedy_ids"])


# -- weight formats and streaming ----------------------------------------------------------------------
# Measured relative L2 error of the logits against transformers' float32 (the fixtures' widths are
# 16, so int8's per-row scales are coarse): float16 <= 2.4e-3, bfloat16 <= 1.5e-2, int8 <= 3.3e-2.
FORMAT_TOL = {"float16": 1e-2, "bfloat16": 5e-2, "int8": 6e-2}


@pytest.mark.parametrize("dtype", sorted(FORMAT_TOL))
@pytest.mark.parametrize("case", CASES)
def test_compressed_formats_stay_close(case, dtype, kernel_mode):
    ref = reference(case)
    got = minfer.load(FIXTURES / case, dtype=dtype).forward(
        ref["input_ids"], ref["decoder_input_ids"], ref["attention_mask"])
    want = ref["logits"].astype(np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < FORMAT_TOL[dtype]


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_streamed_layers_give_the_resident_results(dtype):
    ref = reference("tglobal")
    resident = minfer.load(FIXTURES / "tglobal", dtype=dtype)
    plan, workspace = resident.weight_plan, 300_000
    # two streaming slots and the widening scratch (int8), not every layer
    limit = plan.fixed + workspace + 2 * max(plan.unit_bytes.values()) + plan.scratch_bytes
    streamed = minfer.load(FIXTURES / "tglobal", dtype=dtype, memory_limit=limit,
                           workspace=workspace)
    assert streamed.weight_plan.streamed
    args = ref["input_ids"], ref["decoder_input_ids"], ref["attention_mask"]
    np.testing.assert_array_equal(streamed.forward(*args), resident.forward(*args))


# -- config and weight names ---------------------------------------------------------------------------
LONG = {"model_type": "longt5", "vocab_size": 64, "d_model": 8, "d_kv": 2, "num_heads": 2,
        "d_ff": 8, "num_layers": 1, "num_decoder_layers": 1, "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False, "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 16}


def test_config_reads_longt5_fields_with_transformers_defaults():
    cfg = T5Config.from_hf(LONG)
    assert (cfg.encoder_attention, cfg.local_radius, cfg.global_block_size) == ("local", 127, 16)
    cfg = T5Config.from_hf({**LONG, "encoder_attention_type": "transient-global",
                            "local_radius": 5, "global_block_size": 7})
    assert (cfg.encoder_attention, cfg.local_radius, cfg.global_block_size) == \
        ("transient-global", 5, 7)
    facts = dict(cfg.describe())
    assert facts["encoder attention"].startswith("transient-global, radius 5 (blocks of 6), "
                                                 "one global token per 7 tokens")
    assert "encoder attention" not in dict(T5Config.from_hf({**LONG, "model_type": "t5"}).describe())


@pytest.mark.parametrize("change,field", [
    ({"local_radius": 0}, "local_radius"), ({"local_radius": -3}, "local_radius"),
    ({"local_radius": 2.0}, "local_radius"), ({"global_block_size": 0}, "global_block_size"),
    ({"global_block_size": True}, "global_block_size"),
    ({"encoder_attention_type": "global"}, "encoder_attention_type")])
def test_bad_longt5_fields_are_one_line_errors_naming_file_and_field(change, field):
    with pytest.raises(ConfigError) as err:
        T5Config.from_hf({**LONG, **change}, "/m/config.json")
    message = str(err.value)
    assert message.startswith("/m/config.json: ") and f"'{field}'" in message
    assert "\n" not in message


def test_bad_radius_is_refused_at_load_and_by_the_cli(tmp_path):
    folder = write_t5(tmp_path / "m", **LONG)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "local_radius": 0}))
    with pytest.raises(ConfigError, match=r"config\.json: 'local_radius' must be an integer"):
        minfer.load(folder)
    from test_cli import assert_one_line_error, run
    assert_one_line_error(run("info", "-m", str(folder)), 1, "'local_radius'")


def test_weight_names_are_transformers_longt5_names():
    local = weight_table(T5Config.from_hf(LONG)).tensors
    tglobal = weight_table(T5Config.from_hf({**LONG, "encoder_attention_type": "transient-global"}))
    names = set(tglobal.tensors)
    attn = "encoder.block.0.layer.0.TransientGlobalSelfAttention"
    assert {f"{attn}.q.weight", f"{attn}.relative_attention_bias.weight",
            f"{attn}.global_relative_attention_bias.weight",
            f"{attn}.global_input_layer_norm.weight"} <= names
    assert "encoder.block.0.layer.0.LocalSelfAttention.k.weight" in local
    assert not any("global" in n for n in local)
    assert not any("encoder" in n and ".SelfAttention." in n for n in [*local, *names])
    assert "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in names
    # the global norm is per layer, streamed with it; the global bias table is fixed, on the host
    assert "ln_global" in tglobal.stacks["encoder"][0]
    assert tglobal.fixed["encoder.global_rel_bias"].host


def test_a_missing_global_norm_is_named(tmp_path):
    attn = "encoder.block.0.layer.0.TransientGlobalSelfAttention"
    folder = write_t5(tmp_path / "m", drop=(f"{attn}.global_input_layer_norm.weight",),
                      **{**LONG, "encoder_attention_type": "transient-global"})
    with pytest.raises(CheckpointError, match="global_input_layer_norm"):
        minfer.load(folder)


def test_info_describes_the_encoder_attention():
    from test_cli import run
    proc = run("info", "-m", str(FIXTURES / "tglobal"), "--src-len", "4096")
    assert proc.returncode == 0, proc.stderr
    assert "longt5 (gated-gelu_new FF, untied head)" in proc.stdout
    assert "encoder attention" in proc.stdout and "transient-global, radius 3" in proc.stdout


# -- memory linear in the input length -----------------------------------------------------------------
TGLOBAL_BASE = {**LONG, "d_model": 768, "d_kv": 64, "num_heads": 12, "d_ff": 2048, "num_layers": 12,
                "num_decoder_layers": 12, "vocab_size": 32128, "relative_attention_num_buckets": 32,
                "relative_attention_max_distance": 128, "encoder_attention_type": "transient-global"}


@pytest.mark.parametrize("config", [TGLOBAL_BASE, {**TGLOBAL_BASE, "encoder_attention_type": "local"}])
def test_plan_grows_linearly_with_the_input(config):
    """google/long-t5-*-base's shape: each doubling of the input doubles the encoder's scratch
    (T5's full attention would quadruple its bias and scores)."""
    cfg = T5Config.from_hf(config)
    enc = [run_bytes(cfg, np.float32, 1, n, 64)["encoder_scratch"] for n in (4096, 8192, 16384)]
    assert 1.8 < enc[1] / enc[0] < 2.05 and 1.8 < enc[2] / enc[1] < 2.05
    full = T5Config.from_hf({**config, "model_type": "t5"})
    t5 = [run_bytes(full, np.float32, 1, n, 64)["encoder_scratch"] for n in (4096, 8192)]
    assert t5[1] / t5[0] > 3


def test_buffer_set_allocates_exactly_what_it_counts():
    from minfer.arena import Arena, align_up
    arena = Arena("64MiB")
    for attention in ("local", "transient-global"):
        cfg = T5Config.from_hf({**LONG, "encoder_attention_type": attention, "local_radius": 3,
                                "global_block_size": 5})
        for B, T in ((2, 3), (3, 29), (1, 600)):
            with arena.scope():
                buf = LongEncoderScratch.allocate(arena, cfg, B, T, np.float32)
                assert align_up(arena.used) == LongEncoderScratch.nbytes(cfg, B, T, np.float32)
                assert set(LongEncoderScratch.specs(cfg, B, T, np.float32)) == \
                    {k for k, v in vars(buf).items() if v is not None}


def test_16k_tokens_run_within_the_plan_with_linear_memory(tmp_path):
    """A LongT5-tglobal with LongT5's radius and global blocks but a tiny width: 16384 input tokens
    encode and generate; the arena's peak is within the plan, and each doubling of the input
    adds twice what the previous doubling added (linear, not quadratic)."""
    config = {**LONG, "encoder_attention_type": "transient-global", "local_radius": 127,
              "global_block_size": 16}
    model = minfer.load(write_t5(tmp_path / "m", seed=4, **config))
    arena = model.backend.arena
    rng = np.random.default_rng(0)
    peaks, plans = [], []
    for n in (4096, 8192, 16384):
        ids = rng.integers(2, 64, (1, n))
        ids[0, -1] = 1
        arena.reset_peak()
        base = arena.stats().used
        states = model.encode(ids)
        peaks.append(arena.stats().peak - base)
        plans.append(model.plan(1, n, 4)["encoder_scratch"])
        assert states.shape == (1, n, 8) and np.isfinite(states).all()
        assert 0.95 * plans[-1] <= peaks[-1] <= plans[-1]
    assert 1.9 < (peaks[2] - peaks[1]) / (peaks[1] - peaks[0]) < 2.1
    assert peaks[2] / peaks[1] < 2.05
    arena.reset_peak()
    out = model.generate(ids, max_new_tokens=4, min_new_tokens=4)
    assert len(out[0]) == 5 and arena.stats().peak <= model.plan(1, 16384, 4)["peak"]


def test_a_longt5_encoder_only_save_loads_and_encodes_as_the_full_model(tmp_path):
    # LongT5EncoderModel writes only encoder.* and shared.*: it loads as an encoder-only model
    import json

    from safetensors.numpy import load_file, save_file
    src = ROOT / "weights" / "longt5" / "tglobal"
    tensors = {k: v for k, v in load_file(str(src / "model.safetensors")).items()
               if not (k.startswith("decoder.") or k == "lm_head.weight")}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["LongT5EncoderModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    ref = np.load(src / "reference.npz")
    ids, mask = ref["input_ids"], ref["attention_mask"]
    enc = minfer.load(tmp_path)
    assert enc.config.encoder_only
    got = enc.encode(ids, mask) * mask[..., None]
    np.testing.assert_array_equal(got, minfer.load(src).encode(ids, mask) * mask[..., None])
    with pytest.raises(minfer.InputError):
        enc.generate([[5, 6, 1]])
