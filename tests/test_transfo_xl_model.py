"""Transformer-XL (models/transfo_xl/model.py) against Hugging Face transformers: three segments
with memory, greedy continuation, scoring, sessions; the committed references in
weights/transfo_xl (weights/make_transfo_xl_fixtures.py) and the live oracle where installed."""
import numpy as np
import pytest
from conftest import ROOT, XL_CASES, XL_FIXTURES, fixture_script, needs_xl_fixtures, needs_xl_oracle, rel_err
from conftest import load_xl_reference as reference

import minfer
from minfer.errors import InputError
from minfer.models.transfo_xl import math as xl_math
from minfer.models.transfo_xl import weights as xl_weights

TOL = 1e-4


@needs_xl_fixtures
def test_fixture_set_covers_the_required_cases():
    assert {"adaptive_div4", "plain_softmax", "adaptive_div1_proj"} <= set(XL_CASES)


@needs_xl_fixtures
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


@needs_xl_fixtures
@pytest.mark.parametrize("case", XL_CASES)
def test_memory_matters_and_reset_forgets(case, xl_models):
    ref = reference(case)
    model = xl_models(case)
    T = int(ref["segment_len"])
    alone, mem = model.forward(ref["input_ids"][:, 2 * T:], None)
    mem.release()
    assert rel_err(alone, ref["log_probs_nomem_2"]) < TOL
    assert rel_err(alone, ref["log_probs_2"]) > 1e-3  # memory changed segment 3's output


@needs_xl_fixtures
@pytest.mark.parametrize("case", XL_CASES)
def test_relative_key_table_equals_projecting_the_sinusoids(case, xl_models):
    # the per-layer table (a view, or a gather past clamp_len) must give what projecting the
    # distances' sinusoids at call time gives (the path a prompt longer than the table takes)
    model = xl_models(case)
    be, cfg, params = model.backend, model.config, model.params
    no_table = {**params, **{f"r_table.{l}": params[f"r_table.{l}"][:0] for l in range(cfg.n_layer)}}
    for l, p in enumerate(params["layers"]):
        for K in (1, cfg.mem_len + 1, xl_weights.r_table_rows(cfg), cfg.mem_len + cfg.tgt_len + 7):
            got = xl_math.relative_keys(be, cfg, params, l, p["w_r"], K)
            want = xl_math.relative_keys(be, cfg, no_table, l, p["w_r"], K)
            assert got.shape == (cfg.n_head, cfg.d_head, K)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))


@needs_xl_fixtures
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


@needs_xl_fixtures
@pytest.mark.parametrize("case", XL_CASES)
def test_greedy_continuation_matches(case, xl_models):
    ref = reference(case)
    model = xl_models(case)
    got = model.generate(ref["greedy_prompt"], max_new_tokens=int(ref["greedy_max_new_tokens"]))
    assert got == ref["greedy_ids"].tolist()


@needs_xl_fixtures
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


@needs_xl_fixtures
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


@needs_xl_fixtures
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


@needs_xl_fixtures
def test_memory_lives_in_the_arena_and_goes_back(xl_models):
    model = xl_models("adaptive_div4")
    arena = model.backend.arena
    before = arena.used
    lp, mem = model.forward([[1, 2, 3, 4]])
    assert arena.used >= before + mem.buffers.states.nbytes + mem.buffers.kv.nbytes
    mem.release()
    assert arena.used == before
    with pytest.raises(InputError, match="released"):
        model.forward([[1, 2]], mem)


@needs_xl_fixtures
def test_session_continues_without_recomputation(xl_models):
    model = xl_models("adaptive_div4")
    ref = reference("adaptive_div4")
    prompt = ref["greedy_prompt"][0].tolist()
    full = model.generate([prompt], max_new_tokens=8)[0]
    with model.session() as s:
        first = s.generate(prompt, max_new_tokens=3)
        rest = s.generate([], max_new_tokens=5)
    assert first + rest == full


@needs_xl_fixtures
def test_batch_rows_of_different_length_run_separately(xl_models):
    model = xl_models("adaptive_div4")
    a, b = [5, 6, 7, 8], [9, 10]
    together = model.generate([a, b], max_new_tokens=4)
    assert together == [model.generate([a], max_new_tokens=4)[0], model.generate([b], max_new_tokens=4)[0]]


@needs_xl_fixtures
def test_stream_ids_and_beam_search_run(xl_models):
    model = xl_models("plain_softmax")
    ids = list(model.generate([3, 4, 5], stream=True, max_new_tokens=6))
    assert ids == model.generate([[3, 4, 5]], max_new_tokens=6)[0]
    beams = model.generate([[3, 4, 5]], num_beams=3, max_new_tokens=5, return_details=True)
    assert len(beams[0][0].token_ids) == 5 and beams[0][0].score is not None


@needs_xl_oracle
@pytest.mark.parametrize("case", XL_CASES)
def test_live_oracle_agrees_with_committed_references(case):
    script = fixture_script("make_transfo_xl_fixtures")
    live = script.reference_outputs(str(XL_FIXTURES / case))
    ref = reference(case)
    for key in ("log_probs_0", "log_probs_1", "log_probs_2"):
        assert rel_err(live[key], ref[key]) < TOL, key
    assert np.array_equal(live["greedy_ids"], ref["greedy_ids"])


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
    h = xl_math.forward_hidden(be, cfg, model.params, ids, memory.live(), 0).reshape(len(targets), -1)
    full = np.asarray(xl_math.log_probs(be, cfg, model.params, h))
    got = xl_math.target_log_probs(be, cfg, model.params, h, targets)
    want = full[np.arange(len(targets)), targets]
    assert len(ends) - 1 == cfg.n_clusters
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    memory.release()


@pytest.mark.parametrize("bad,needle", [([3, 4.5, 6], "not an integer"), ([3, True, 6], "not an integer"),
                                        (["3", 4], "not an integer"), ([3, 10**6], "outside the vocabulary")])
def test_score_and_sessions_check_their_token_ids(xl_models, bad, needle):
    model = xl_models("adaptive_div4")
    with pytest.raises(InputError, match=needle):
        model.score(bad)
    with model.session() as s, pytest.raises(InputError, match=needle):
        s.generate(bad, max_new_tokens=1)


@pytest.mark.parametrize("segment_len", [0, -3, 1.5, True, "8"])
def test_score_refuses_a_bad_segment_length(xl_models, segment_len):
    with pytest.raises(InputError, match="segment_len must be a positive integer"):
        xl_models("adaptive_div4").score([3, 4, 5, 6], segment_len=segment_len)


def _long_recall_prompt(n_tokens: int = 4000) -> tuple[str, str]:
    """Held-out recall texts joined into an n-token prompt that ends asking for the last one's
    key (stated a few tokens before the end: inside the memory window)."""
    import json
    rows = [json.loads(line) for line in
            (ROOT / "weights" / "tiny-xl-recall" / "heldout.jsonl").read_text().splitlines()]
    words = [w for r in rows[:-1] for w in r["text"].split()]
    last = rows[-1]
    ask = last["text"].split()[:last["ask_position"] + 1]
    assert len(words) + len(ask) >= n_tokens
    return " ".join(words[:n_tokens - len(ask)] + ask), last["answer"]


def test_long_prompt_runs_segment_by_segment_in_bounded_memory():
    # start_decoding gives each prompt segment's scratch back before the next (as score does):
    # a 4,000-token prompt fits the arena of one segment plus the memory. Before, every
    # segment's scratch stayed until the prompt ended: this failed under a 16 MiB limit.
    folder = ROOT / "weights" / "tiny-xl-recall"
    prompt, answer = _long_recall_prompt()
    model = minfer.load(folder)
    assert len(model.tokenizer.encode(prompt, add_eos=False)) == 4000
    want = model.generate(prompt, max_new_tokens=4, return_details=True)[0]
    assert want.text.split()[0] == answer
    peak = model.plan(1)["peak"]  # the segment memory + one tgt_len segment's scratch
    # the plan of a prompt this long is that of the segments it runs in (the batch planner asks
    # it: a plan for 4,000-token segments refused this prompt under `workspace=peak`)
    assert model.plan(1, 4000)["peak"] == peak
    for opts in ({"memory_limit": "16MiB"}, {"workspace": peak}):
        with minfer.load(folder, **opts) as small:
            before = small.backend.arena.used  # resident weights under a limit, else nothing
            got = small.generate(prompt, max_new_tokens=4, return_details=True)[0]
            assert got.token_ids == want.token_ids, opts
            assert small.backend.arena.used == before


# -- whose memory: sessions, memories of other models, prompts that fit only in segments ---------------
@needs_xl_fixtures
def test_a_closed_session_refuses_to_generate_and_never_writes_the_next_sessions_memory(xl_models):
    model = xl_models("adaptive_div4")
    prompt = reference("adaptive_div4")["greedy_prompt"][0].tolist()
    with model.session() as fresh:
        want = fresh.generate(prompt, max_new_tokens=6)
    old = model.session()
    old.generate(prompt[:3], max_new_tokens=2)
    stream = old.generate(prompt[3:], max_new_tokens=6, stream=True)   # made before the close
    old.close()
    with pytest.raises(InputError, match="session: it was closed"):
        old.generate(prompt, max_new_tokens=2)
    with pytest.raises(InputError, match="session: it was closed"):
        old.score(prompt)
    with model.session() as new:   # takes the block the closed session gave back
        got = new.generate(prompt, max_new_tokens=3)
        with pytest.raises(InputError, match="released"):
            list(stream)
        got += new.generate([], max_new_tokens=3)
    assert got == want


@needs_xl_fixtures
@pytest.mark.parametrize("other", ["adaptive_div4_bin", "plain_softmax", "adaptive_div1_proj"])
def test_a_memory_made_by_another_model_is_refused_naming_it(xl_models, other):
    model, stranger = xl_models("adaptive_div4"), xl_models(other)
    theirs = stranger.new_memory(1)
    try:
        for call in (lambda: model.forward([[3, 4, 5]], theirs),
                     lambda: model.score([3, 4, 5, 6], memory=theirs),
                     lambda: list(model.start_decoding(np.array([[3, 4]]), np.ones((1, 2), np.int64),
                                                       4, memory=theirs).__enter__().first_tokens)):
            with pytest.raises(InputError, match="made by another model"):
                call()
    finally:
        theirs.release()
    with pytest.raises(InputError, match="expected a SegmentMemory"):
        model.forward([[3, 4, 5]], np.zeros((2, 1, 12, 16), np.float32))


def test_a_prompt_of_one_calls_length_runs_in_exact_segments_when_one_call_does_not_fit():
    # tiny-xl-recall: mem_len 48, tgt_len 16, no same_length: a prompt of up to 64 tokens run in
    # 16-token segments sees what one call would (the memory holds the rest)
    folder = ROOT / "weights" / "tiny-xl-recall"
    model = minfer.load(folder)
    prompt = _long_recall_prompt(60)[0]
    want = model.generate(prompt, max_new_tokens=4, return_details=True)[0]
    peak = model.plan(1)["peak"]   # the memory and one 16-token segment's scratch
    assert model.plan(1, 60)["peak"] > peak   # a large arena: one call
    with minfer.load(folder, workspace=peak) as small:
        assert small.plan(1, 60)["peak"] == peak   # a small one: segments, and so it plans
        got = small.generate(prompt, max_new_tokens=4, return_details=True)[0]
        assert got.error is None and got.token_ids == want.token_ids


@pytest.mark.parametrize("length", [200, 300, 512, 513, 600])
def test_a_prompt_whose_one_call_does_not_fit_runs_in_segments_at_every_length(length, monkeypatch):
    # tiny-xl-recall (mem_len 48, tgt_len 16): from 65 tokens on, segments do not see all that one
    # call sees; a prompt whose one call does not fit still runs, in tgt_len segments (before,
    # 65-512 tokens were refused while 513 and more ran), and gives what the unlimited model
    # gives when it too reads the prompt in segments
    from minfer.models.transfo_xl import model as xl_model
    folder = ROOT / "weights" / "tiny-xl-recall"
    model = minfer.load(folder)
    prompt = _long_recall_prompt(length)[0]
    peak = model.plan(1)["peak"]
    assert model.plan(1, length)["peak"] > peak or length > 512   # one call, in a large arena
    with monkeypatch.context() as patch:             # the unlimited model, made to use segments
        patch.setattr(xl_model, "prompt_call_bytes", lambda *a: 1 << 60)
        want = model.generate(prompt, max_new_tokens=4, return_details=True)[0]
    with minfer.load(folder, workspace=peak) as small:
        assert small.plan(1, length)["peak"] == peak   # the memory and one segment, any length
        got = small.generate(prompt, max_new_tokens=4, return_details=True)[0]
    assert got.error is None and got.token_ids == want.token_ids


def _segments_equal_one_call(cfg, prompt_len: int) -> bool:
    """Whether tgt_len segments see what one call sees (up to rounding): the memory keeps every
    segment before the last, which starts at tgt_len * ((prompt_len - 1) // tgt_len), and the
    attention span does not depend on the call's length (no same_length)."""
    before_last = cfg.tgt_len * ((prompt_len - 1) // cfg.tgt_len)
    return not cfg.same_length and cfg.mem_len >= before_last


@needs_xl_fixtures
@pytest.mark.parametrize("case", XL_CASES)
def test_segments_called_exact_give_what_one_call_gives(case, monkeypatch):
    # the rule was mem_len >= prompt - tgt_len; the last segment starts at tgt_len * ((P-1) //
    # tgt_len), which differs when mem_len is not a multiple of tgt_len (plain_softmax: tgt_len
    # 8, mem_len 5, P = 9: log-probs 30 apart)
    from minfer.models.transfo_xl import model as xl_model
    m = minfer.load(XL_FIXTURES / case)
    cfg = m.config
    rng = np.random.default_rng(0)
    exact = 0
    for P in range(2, 3 * cfg.tgt_len + 2):
        if not _segments_equal_one_call(cfg, P):
            continue
        exact += 1
        ids = rng.integers(5, cfg.vocab_size, size=(1, P))
        mask = np.ones_like(ids)
        with m.start_decoding(ids, mask, 2) as state:
            whole = np.array(state.step(state.first_tokens))
        with monkeypatch.context() as patch:   # one call never fits: segments
            patch.setattr(xl_model, "prompt_call_bytes", lambda *a: 1 << 60)
            with m.start_decoding(ids, mask, 2) as state:
                parts = np.array(state.step(state.first_tokens))
        np.testing.assert_allclose(parts, whole, atol=1e-4, err_msg=f"P={P}")
    assert exact > 0 or cfg.same_length


def test_text_ids_is_what_score_reads_a_text_as(xl_models):
    # one reading of a text, shared by score() and `minfer score` (which counts its <unk> ids)
    model = xl_models("adaptive_div4_bin")
    tok = model.tokenizer
    text = "the game began .\n\nit was played .\n"
    ids = model.text_ids(text)
    lines = ["the game began .", "", "it was played ."]      # the final newline ends a line only
    assert ids == [t for line in lines for t in tok.encode(line, add_eos=True)]
    assert ids.count(tok.eos_id) == len(lines) and ids[-1] == tok.eos_id
    assert model.text_ids(text.rstrip("\n")) == ids
    assert model.score(text)["log_likelihood"] == model.score(ids)["log_likelihood"]
    with pytest.raises(InputError, match=r"^text input requires a tokenizer, and .* has none$"):
        xl_models("adaptive_div4").text_ids(text)
