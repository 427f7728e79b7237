"""The search loops (generation/search.py): greedy rows leaving the batch, beam search against
Hugging Face transformers' (committed references), sampled beam search."""
import json

import numpy as np
import pytest
from conftest import T5_CASES, T5_FIXTURES, load_reference, trim_hf_ids

from minfer.errors import InputError

SEARCH = json.loads((T5_FIXTURES / "search_settings.json").read_text()) if T5_CASES else {}


@pytest.mark.parametrize("setting", sorted(SEARCH))
@pytest.mark.parametrize("case", T5_CASES)
def test_search_matches(case, setting, t5_models):
    ref = load_reference(case)
    options = dict(SEARCH[setting])
    use_min = options.pop("use_min", False)
    model = t5_models(case)
    results = model.generate(ref["input_ids"], attention_mask=ref["attention_mask"],
                             return_details=True,
                             max_new_tokens=int(ref["greedy_max_new_tokens"]),
                             min_new_tokens=int(ref["greedy_min_new_tokens"]) if use_min else 0,
                             **options)
    got = [r.token_ids for row in results for r in row]
    assert got == [trim_hf_ids(r) for r in ref[f"search_{setting}_ids"]]
    if options["num_beams"] > 1:
        scores = [r.score for row in results for r in row]
        np.testing.assert_allclose(scores, ref[f"search_{setting}_scores"], rtol=1e-4, atol=1e-5)


def test_finished_rows_leave_the_batch(text_model, monkeypatch):
    """Rows that end stop costing compute: the state's live batch shrinks."""
    from minfer.models.t5 import T5DecodeState
    sizes = []
    real_step = T5DecodeState.step
    monkeypatch.setattr(T5DecodeState, "step",
                        lambda self, tokens: (sizes.append(self.batch), real_step(self, tokens))[1])
    prompts = ["a b c", "date: 1999", "one two", "x"]
    results = text_model.generate(prompts, max_new_tokens=30, return_details=True,
                                  stop=[" "])
    lengths = sorted(r[0].new_tokens for r in results)
    assert sizes[0] == 4 and sizes == sorted(sizes, reverse=True)
    assert len(sizes) == lengths[-1]
    if lengths[0] < lengths[-1]:
        assert sizes[-1] < 4


def test_sampled_beam_search_is_seeded_ranked_and_differs_from_plain_beams(text_model):
    """do_sample with num_beams: the 2*num_beams candidates are drawn (Gumbel top-k), not taken."""
    opts = dict(num_beams=3, num_return_sequences=3, max_new_tokens=8)

    def run(**extra):
        row = text_model.generate([[5, 6, 7, 1]], return_details=True, **opts, **extra)[0]
        return [(r.token_ids, r.score) for r in row]

    first = run(do_sample=True, seed=1)
    assert first == run(do_sample=True, seed=1)                    # the seed fixes the draws
    scores = [s for _, s in first]
    assert scores == sorted(scores, reverse=True)                   # best first
    assert all(ids[0] == 0 and len(ids) <= 9 for ids, _ in first)  # start token, length limit
    draws = [run(do_sample=True, seed=s) for s in range(2, 8)]
    assert any(d != first for d in draws)
    assert any(d != run() for d in draws)                            # plain beam search differs


# -- degenerate option values: they work, or they are refused; never NaN scores, never padding -----
@pytest.mark.parametrize("temperature,top_p", [(t, p) for t in (1e-45, 1e-38, 1e-20, 1e-9)
                                                for p in (1.0, 1e-45)] + [(1.0, 1e-45), (1e3, 1e-45)])
def test_sampling_at_a_tiny_temperature_or_top_p_is_greedy(text_model, temperature, top_p):
    """Scores are shifted to a maximum of 0 before the temperature divides them: every other token
    goes to -inf instead of the whole row overflowing to NaN (which used to return padding). A tiny
    top_p keeps only the most likely token, whatever the temperature."""
    for prompt in ("a b c", "date: 1999", "one two three"):
        greedy = text_model.generate([prompt], max_new_tokens=16, min_new_tokens=16)
        for seed in range(3):
            assert text_model.generate([prompt], max_new_tokens=16, min_new_tokens=16,
                                       do_sample=True, temperature=temperature, top_p=top_p,
                                       top_k=0, seed=seed) == greedy


@pytest.mark.parametrize("lp", [-5.0, -8.0, -20.0])
def test_beams_refuse_a_length_penalty_that_sinks_every_score(text_model, lp):
    """log-prob * length**-lp below -1e9 (the search's 'impossible' offset) used to come back as an
    empty hypothesis scored -1e9."""
    with pytest.raises(InputError, match="length_penalty"):
        text_model.generate(["a b c"], num_beams=3, length_penalty=lp, max_new_tokens=30,
                            min_new_tokens=15)


@pytest.mark.parametrize("lp", [-1.0, 0.0, 2.0, 10.0])
def test_beams_with_moderate_length_penalties_return_finite_scores(text_model, lp):
    [row] = text_model.generate(["a b c"], num_beams=3, num_return_sequences=3, length_penalty=lp,
                                max_new_tokens=12, min_new_tokens=6, return_details=True)
    assert all(np.isfinite(r.score) and r.score > -1e9 and r.new_tokens >= 6 for r in row)


@pytest.mark.parametrize("options", [{}, {"do_sample": True, "seed": 1}, {"num_beams": 2}])
def test_a_vocabulary_banned_whole_is_refused(tmp_path, options):
    """no_repeat_ngram_size=1 over 64 ids bans everything after 63 steps: argmax of an all -inf row
    would be id 0 and the sampler's cdf NaN; it is an InputError instead."""
    from factories import write_t5

    import minfer
    model = minfer.load(write_t5(tmp_path / "m"))
    with pytest.raises(InputError, match="no_repeat_ngram_size 1"):
        model.generate([[3, 4, 5, 1]], no_repeat_ngram_size=1, max_new_tokens=80,
                       min_new_tokens=80, **options)


@pytest.mark.parametrize("penalty", [1e-3, 0.5, 2.0, 1e3])
@pytest.mark.parametrize("mode", [{}, {"do_sample": True, "seed": 0}, {"num_beams": 3},
                                  {"num_beams": 2, "do_sample": True, "seed": 0}])
def test_repetition_penalty_at_its_bounds_keeps_scores_finite(text_model, penalty, mode):
    [row] = text_model.generate(["a b c"], repetition_penalty=penalty, max_new_tokens=10,
                                min_new_tokens=10, return_details=True, **mode)
    for r in row:   # (a penalty < 1 favours repeats: also of the start token, pad, as in HF)
        assert r.new_tokens == 10 and isinstance(r.text, str)
        assert r.score is None or (np.isfinite(r.score) and r.score > -1e9)


# -- wide searches: the host work is chunked, bounded whatever the rows ---------------------------------
@pytest.mark.parametrize("V", [50, 6])   # 6: fewer tokens than candidates a beam keeps (2K)
@pytest.mark.parametrize("sample", [False, True])
def test_beam_candidates_equal_one_top_k_over_every_beams_scores(sample, V, monkeypatch):
    from minfer.generation import search
    from minfer.generation.options import GenerationOptions
    from minfer.generation.processors import log_softmax, top_k_indices
    monkeypatch.setattr(search, "SEARCH_CHUNK_BYTES", 3 * 4 * V)     # 3 rows a chunk
    rng = np.random.default_rng(4)
    b, K, keep_n = 3, 4, 8
    logits = rng.standard_normal((b * K, V)).astype(np.float32)
    logits[0, 1] = logits[0, 3] = logits[0].max() + 1                   # a tie, inside one beam
    run = rng.standard_normal((b, K)).astype(np.float32)
    seqs = np.zeros((b * K, 1), np.int64)
    opts = GenerationOptions(num_beams=K, do_sample=sample, temperature=0.7, top_k=0).validate()
    got_scores, got_idx = search.beam_candidates(logits, seqs, run, opts, 0, (1,), K, keep_n,
                                                 np.random.default_rng(9) if sample else None)
    acc = (log_softmax(logits).reshape(b, K, V) + run[:, :, None]).reshape(b, K * V)
    if sample:
        acc = (log_softmax(logits) / np.float32(0.7)).reshape(b, K, V) + run[:, :, None]
        acc = acc.reshape(b, K * V)
        noisy = acc + np.random.default_rng(9).gumbel(size=acc.shape).astype(np.float32)
        want = np.argsort(-noisy, axis=1, kind="stable")[:, :keep_n]
    else:
        want = top_k_indices(acc, keep_n)
    np.testing.assert_array_equal(got_idx, want)
    np.testing.assert_allclose(got_scores, np.take_along_axis(acc, want, axis=1), rtol=1e-6)


def test_wide_searches_keep_their_host_arrays_bounded(tmp_path):
    # 640 beams, sampled beams, 640 samples: their scores over rows x vocabulary lived outside
    # the arena (t5-small under a 600 MiB limit peaked at 1.3 GB); now chunked. NumPy reports
    # its arrays to tracemalloc: the peak of what the calls allocate outside the (preallocated)
    # arena, whatever the allocator keeps or the threads hold.
    import tracemalloc

    import minfer

    from factories import write_t5
    folder = write_t5(tmp_path / "m", seed=1, vocab_size=32128, d_model=32, d_kv=8, num_heads=4,
                      d_ff=64)
    m = minfer.load(folder, memory_limit="200MiB")
    for kw in (dict(num_beams=80), dict(do_sample=True, num_return_sequences=80)):
        m.generate([[5, 6, 7, 1]], max_new_tokens=2, **kw)   # the kernels load (numba's typing)
    tracemalloc.start()
    try:
        for kw in (dict(num_beams=640), dict(num_beams=640, do_sample=True, seed=1),
                   dict(do_sample=True, num_return_sequences=640, seed=1)):
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            m.generate([[5, 6, 7, 8, 9, 1]], max_new_tokens=4, min_new_tokens=4, **kw)
            grown = tracemalloc.get_traced_memory()[1] - base
            # a few chunks of scores and each beam's 2K best candidates (640 x 1280 of them);
            # before: 82 MB per (rows, V) array, several alive at once
            assert grown < 40 << 20, (kw, grown >> 20)
    finally:
        tracemalloc.stop()


def test_more_beams_than_half_the_vocabulary(kernel_mode):
    # each beam keeps its best 2 x num_beams candidates: more than a row has when num_beams > V/2
    # (a raw IndexError or ValueError, or garbage beams from uninitialised slots)
    import minfer
    from conftest import XL_FIXTURES
    m = minfer.load(XL_FIXTURES / "plain_softmax")
    V = m.config.vocab_size
    got = m.generate([[3, 4, 5]], num_beams=V // 2 + 1, max_new_tokens=2, return_details=True)
    assert got[0][0].error is None and len(got[0][0].token_ids) == 2


def test_the_first_tokens_are_read_before_another_thread_can_step_the_request(monkeypatch):
    # info["first"] was copied after joining the batcher: another thread's leader could take
    # two steps first, drop the rows that ended, and the results got the wrong start tokens
    import contextlib

    from minfer.generation import batcher as batcher_module
    from minfer.generation.options import GenerationOptions
    from minfer.generation.protocol import TokenIds

    class State:
        def __init__(self, B):
            self.batch, self.first_tokens, self.t = B, np.array([7, 8, 9][:B]), 0

        def step(self, tokens):
            out = np.zeros((self.batch, 4), np.float32)
            out[:, 2] = 1.0
            if self.t == 0:
                out[0, 1] = 5.0          # row 0 ends (eos) at once
            self.t += 1
            return out

        def reorder(self, rows, cross=True):
            self.batch = len(rows)

    class Model:
        token_ids = TokenIds(eos=(1,), pad=0)

        @contextlib.contextmanager
        def start_decoding(self, ids, mask, n, repeat=1):
            yield State(ids.shape[0])

        def step_together(self, states, tokens):
            return [s.step(t) for s, t in zip(states, tokens)]

    real_join = batcher_module.Batcher.join

    def join_then_another_leader_steps(self, request, release=None):
        real_join(self, request, release)
        if request is not None:
            for _ in range(2):
                self.leading = True
                self._lead()
    monkeypatch.setattr(batcher_module.Batcher, "join", join_then_another_leader_steps)
    info = {}
    ids = np.zeros((3, 2), np.int64)
    from minfer.generation import search as search_module
    list(search_module.token_loop(Model(), ids, np.ones_like(ids),
                                  GenerationOptions(max_new_tokens=5), info=info))
    assert info["first"].tolist() == [7, 8, 9]
