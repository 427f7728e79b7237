"""Transformer-XL: parity with HF references (weights/transfo_xl), rel_shift, memory semantics,
scoring, generation and sessions."""
import importlib.util
import shutil

import numpy as np
import pytest

import minfer
from conftest import ROOT, rel_err
from minfer.errors import CheckpointError, InputError
from minfer.models import transfo_xl as xl

XL_FIXTURES = ROOT / "weights" / "transfo_xl"
XL_CASES = sorted(p.name for p in XL_FIXTURES.glob("*") if (p / "reference.npz").is_file())
TOL = 1e-4


def reference(case):
    with np.load(XL_FIXTURES / case / "reference.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def xl_models():
    cache = {}

    def get(case):
        if case not in cache:
            cache[case] = minfer.load(XL_FIXTURES / case)
        return cache[case]
    return get


# -- rel_shift ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,M", [(1, 0), (4, 0), (4, 3), (5, 9), (7, 2)])
def test_rel_shift_equals_the_naive_loop(T, M):
    K = M + T
    x = np.random.default_rng(T * 10 + M).standard_normal((2, 3, T, K)).astype(np.float32)
    got = xl.rel_shift(np, x)
    for i in range(T):
        for j in range(K):
            if j <= i + M:  # every key the query may see
                assert got[..., i, j].tolist() == x[..., i, j + T - 1 - i].tolist()


def test_attention_mask_same_length():
    cfg = xl.XLConfig.from_hf({"model_type": "transfo-xl", "vocab_size": 10, "cutoffs": [],
                               "div_val": 1, "d_model": 4, "n_head": 1, "d_head": 4,
                               "d_inner": 4, "n_layer": 1, "mem_len": 3, "same_length": True})
    m = xl.attention_mask(cfg, qlen=3, mlen=3)  # (3, 6)
    # query i sits at key position 3+i; with same_length every query sees the same number
    # (mem_len) of keys ending at itself: i+1 .. i+3
    assert m.tolist() == [[True, False, False, False, True, True],
                          [True, True, False, False, False, True],
                          [True, True, True, False, False, False]]
    plain = xl.attention_mask(cfg.__class__(**{**cfg.__dict__, "same_length": False}), 3, 3)
    assert not plain[:, :4].any() and plain[0, 4:].all()


# -- parity with HF --------------------------------------------------------------------------------------
pytestmark_parity = pytest.mark.skipif(not XL_CASES, reason="no Transformer-XL fixtures")


@pytestmark_parity
def test_fixture_set_covers_the_required_cases():
    assert {"adaptive_div4", "plain_softmax", "adaptive_div1_proj"} <= set(XL_CASES)


@pytestmark_parity
@pytest.mark.parametrize("case", XL_CASES)
def test_three_segments_with_memory_match(case, xl_models):
    ref = reference(case)
    model = xl_models(case)
    T = int(ref["segment_len"])
    memory = None
    for s in range(3):
        lp, memory = model.forward(ref["input_ids"][:, s * T:(s + 1) * T], memory)
        assert lp.dtype == np.float32 and lp.shape == ref[f"log_probs_{s}"].shape
        assert rel_err(lp, ref[f"log_probs_{s}"]) < TOL, f"segment {s}"
        hf_mems = ref[f"mems_{s}"].transpose(0, 2, 1, 3)  # (L, M, B, C) -> (L, B, M, C)
        assert memory.to_host().shape == hf_mems.shape
        assert rel_err(memory.to_host(), hf_mems) < TOL, f"memory after segment {s}"
    memory.release()


@pytestmark_parity
@pytest.mark.parametrize("case", XL_CASES)
def test_memory_matters_and_reset_forgets(case, xl_models):
    ref = reference(case)
    model = xl_models(case)
    T = int(ref["segment_len"])
    alone, mem = model.forward(ref["input_ids"][:, 2 * T:], None)
    mem.release()
    assert rel_err(alone, ref["log_probs_nomem_2"]) < TOL
    assert rel_err(alone, ref["log_probs_2"]) > 1e-3  # memory changed segment 3's output


@pytestmark_parity
@pytest.mark.parametrize("case", XL_CASES)
def test_relative_key_table_equals_projecting_the_sinusoids(case, xl_models):
    # the per-layer table (a view, or a gather past clamp_len) must give what projecting the
    # distances' sinusoids at call time gives (the path a prompt longer than the table takes)
    model = xl_models(case)
    be, cfg, params = model.backend, model.config, model.params
    no_table = {**params, "r_tables": [t[:0] for t in params["r_tables"]]}
    for l, p in enumerate(params["layers"]):
        for K in (1, cfg.mem_len + 1, xl.r_table_rows(cfg), cfg.mem_len + cfg.tgt_len + 7):
            got = xl.relative_keys(be, cfg, params, l, p["w_r"], K)
            want = xl.relative_keys(be, cfg, no_table, l, p["w_r"], K)
            assert got.shape == (cfg.n_head, cfg.d_head, K)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))


@pytestmark_parity
@pytest.mark.parametrize("case", XL_CASES)
def test_reordered_memory_rows_continue_their_own_history(case, xl_models):
    # beams and trimmed batches reorder the memory: its states and the cached keys/values of
    # every layer must follow their rows, or the next call attends to another row's past
    model = xl_models(case)
    rng = np.random.default_rng(3)
    V = model.config.vocab_size
    first = rng.integers(0, V, (3, 5))
    nxt = rng.integers(0, V, (3, 2))
    _, mem = model.forward(first)
    mem.reorder(np.array([1, 1, 0]))
    together, mem = model.forward(nxt, mem)
    mem.release()
    for row, source in enumerate([1, 1, 0]):
        _, alone_mem = model.forward(first[source:source + 1])
        alone, alone_mem = model.forward(nxt[row:row + 1], alone_mem)
        alone_mem.release()
        assert rel_err(together[row:row + 1], alone) < TOL, f"row {row}"


@pytestmark_parity
@pytest.mark.parametrize("case", XL_CASES)
def test_greedy_continuation_matches(case, xl_models):
    ref = reference(case)
    model = xl_models(case)
    got = model.generate(ref["greedy_prompt"], max_new_tokens=int(ref["greedy_max_new_tokens"]))
    assert got == ref["greedy_ids"].tolist()


@pytestmark_parity
@pytest.mark.parametrize("case", XL_CASES)
def test_score_equals_summed_reference_log_probs(case, xl_models):
    ref = reference(case)
    T = int(ref["segment_len"])
    row = ref["input_ids"][0]
    # score() predicts token t+1 from the segment holding token t: segments of T over ids[:-1]
    expected, n = 0.0, len(row) - 1
    lp_all = np.concatenate([ref[f"log_probs_{s}"][0] for s in range(3)])  # (3T, V)
    expected = float(sum(lp_all[t, row[t + 1]] for t in range(n)))
    out = xl_models(case).score(row.tolist(), segment_len=T)
    assert out["tokens"] == n
    assert abs(out["log_likelihood"] - expected) < 1e-4 * abs(expected)
    assert np.isclose(out["perplexity"], np.exp(-expected / n), rtol=1e-4)


@pytestmark_parity
def test_segment_three_depends_on_segment_one(xl_models):
    """Change only segment 1: segment 3's output moves when memory is carried (it reaches back
    through segment 2's memory), and not when the memory is reset before segment 3."""
    case = "adaptive_div4"
    ref = reference(case)
    model = xl_models(case)
    T = int(ref["segment_len"])
    ids = ref["input_ids"][:1]
    other = ids.copy()
    other[:, :T] = (other[:, :T] + 7) % model.config.vocab_size

    def run(x, reset):
        mem = None
        for s in range(3):
            if reset and s == 2:
                mem.reset()
            lp, mem = model.forward(x[:, s * T:(s + 1) * T], mem)
        mem.release()
        return lp

    assert rel_err(run(ids, False), run(other, False)) > 1e-4
    np.testing.assert_array_equal(run(ids, True), run(other, True))


@pytestmark_parity
def test_legacy_bin_checkpoint_matches_safetensors(xl_models):
    folder = XL_FIXTURES / "adaptive_div4_bin"
    if not (folder / "pytorch_model.bin").is_file():
        pytest.skip("no .bin fixture")
    ref = reference("adaptive_div4")
    model = minfer.load(folder)
    T = int(ref["segment_len"])
    lp, mem = model.forward(ref["input_ids"][:, :T])
    mem.release()
    assert rel_err(lp, ref["log_probs_0"]) < TOL


@pytestmark_parity
def test_convert_bin_to_safetensors(tmp_path):
    folder = XL_FIXTURES / "adaptive_div4_bin"
    if not (folder / "pytorch_model.bin").is_file():
        pytest.skip("no .bin fixture")
    from minfer.convert import convert
    summary = convert(folder, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file() and summary["tensors"] > 0
    ref = reference("adaptive_div4")
    lp, mem = minfer.load(tmp_path / "out").forward(ref["input_ids"][:, :int(ref["segment_len"])])
    mem.release()
    assert rel_err(lp, ref["log_probs_0"]) < TOL


# -- memory object, sessions, arena ----------------------------------------------------------------------
@pytestmark_parity
def test_memory_lives_in_the_arena_and_goes_back(xl_models):
    model = xl_models("adaptive_div4")
    arena = model.backend.arena
    before = arena.used
    lp, mem = model.forward([[1, 2, 3, 4]])
    assert arena.used >= before + mem.states.nbytes
    mem.release()
    assert arena.used == before
    with pytest.raises(InputError, match="released"):
        model.forward([[1, 2]], mem)


@pytestmark_parity
def test_session_continues_without_recomputation(xl_models):
    model = xl_models("adaptive_div4")
    ref = reference("adaptive_div4")
    prompt = ref["greedy_prompt"][0].tolist()
    full = model.generate([prompt], max_new_tokens=8)[0]
    with model.session() as s:
        first = s.generate(prompt, max_new_tokens=3)
        rest = s.generate([], max_new_tokens=5)
    assert first + rest == full


@pytestmark_parity
def test_batch_rows_of_different_length_run_separately(xl_models):
    model = xl_models("adaptive_div4")
    a, b = [5, 6, 7, 8], [9, 10]
    together = model.generate([a, b], max_new_tokens=4)
    assert together == [model.generate([a], max_new_tokens=4)[0], model.generate([b], max_new_tokens=4)[0]]


@pytestmark_parity
def test_stream_ids_and_beam_search_run(xl_models):
    model = xl_models("plain_softmax")
    ids = list(model.generate([3, 4, 5], stream=True, max_new_tokens=6))
    assert ids == model.generate([[3, 4, 5]], max_new_tokens=6)[0]
    beams = model.generate([[3, 4, 5]], num_beams=3, max_new_tokens=5, return_details=True)
    assert len(beams[0][0].token_ids) == 5 and beams[0][0].score is not None


# -- loading errors ---------------------------------------------------------------------------------------
@pytestmark_parity
def test_missing_and_misshaped_tensors_are_named(tmp_path):
    from minfer.checkpoint import Checkpoint
    from safetensors.numpy import save_file
    src = XL_FIXTURES / "plain_softmax"
    ckpt = Checkpoint(src)
    tensors = {n: ckpt.read(n) for n in ckpt.names()}
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(src / "config.json", folder)
    name = "transformer.layers.1.pos_ff.CoreNet.3.bias"
    save_file({k: v for k, v in tensors.items() if k != name}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"'{name}' is missing"):
        minfer.load(folder)
    save_file({**tensors, name: np.zeros(3, np.float32)}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"'{name}' has shape"):
        minfer.load(folder)


# -- live oracle ------------------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("torch") is None
                    or importlib.util.find_spec("transformers") is None,
                    reason="torch + transformers (the [dev] extra) not installed")
@pytest.mark.parametrize("case", XL_CASES)
def test_live_oracle_agrees_with_committed_references(case):
    spec = importlib.util.spec_from_file_location("make_transfo_xl_fixtures",
                                                  ROOT / "weights" / "make_transfo_xl_fixtures.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    live = script.reference_outputs(str(XL_FIXTURES / case))
    ref = reference(case)
    for key in ("log_probs_0", "log_probs_1", "log_probs_2"):
        assert rel_err(live[key], ref[key]) < TOL, key
    assert np.array_equal(live["greedy_ids"], ref["greedy_ids"])


# -- scoring without the full vocabulary matrix ---------------------------------------------------------
@pytest.mark.parametrize("case", XL_CASES)
def test_target_log_probs_equal_the_full_matrix_at_the_targets(xl_models, case):
    model = xl_models(case)
    cfg, be = model.config, model.backend
    rng = np.random.default_rng(len(case))
    ends = cfg.cluster_ends
    # one target in every cluster, the rest random
    targets = np.concatenate([[ends[i] + (ends[i + 1] - ends[i]) // 2 for i in range(len(ends) - 1)],
                              rng.integers(0, cfg.vocab_size, 9)])
    ids = rng.integers(0, cfg.vocab_size, (1, len(targets)))
    memory = model.new_memory(1)
    h = xl.forward_hidden(be, cfg, model.params, ids, memory).reshape(len(targets), -1)
    full = np.asarray(xl.log_probs(be, cfg, model.params, h))
    got = xl.target_log_probs(be, cfg, model.params, h, targets)
    want = full[np.arange(len(targets)), targets]
    assert len(ends) - 1 == len(model.params["clusters"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    memory.release()
