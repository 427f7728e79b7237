"""Processors, samplers, options, streaming and stop strings (model-agnostic generation code)."""
import numpy as np
import pytest

from minfer import generation as g
from minfer.errors import InputError


# -- processors: pure and vectorised -------------------------------------------------------------------
def test_processors_do_not_mutate_their_inputs():
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((3, 20)).astype(np.float32)
    seqs = rng.integers(0, 20, (3, 6))
    before = scores.copy()
    for out in (g.repetition_penalty(scores, seqs, 1.5), g.no_repeat_ngram(scores, seqs, 2),
                g.suppress_tokens(scores, [1]), g.temperature(scores, 0.7),
                g.top_k_filter(scores, 5), g.top_p_filter(scores, 0.5)):
        np.testing.assert_array_equal(scores, before)


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    scores = np.array([[2.0, -2.0, 1.0, 4.0]], np.float32)
    out = g.repetition_penalty(scores, np.array([[0, 1, 1]]), 2.0)
    np.testing.assert_array_equal(out, [[1.0, -4.0, 1.0, 4.0]])


def test_no_repeat_ngram_bans_completions_of_seen_ngrams():
    scores = np.zeros((2, 10), np.float32)
    seqs = np.array([[0, 3, 4, 5, 3], [0, 1, 2, 7, 8]])
    out = g.no_repeat_ngram(scores, seqs, 2)
    assert np.isneginf(out[0, 4]) and np.isfinite(out[0]).sum() == 9   # "3 4" seen -> ban 4 after 3
    assert np.isfinite(out[1]).all()
    short = g.no_repeat_ngram(scores, seqs[:, :2], 3)                   # no full 3-gram yet
    assert np.isfinite(short).all()


def test_top_k_keeps_k_and_ties():
    scores = np.array([[1.0, 5.0, 3.0, 3.0, 0.0]], np.float32)
    assert np.isfinite(g.top_k_filter(scores, 2)).tolist() == [[False, True, True, True, False]]
    assert np.isfinite(g.top_k_filter(scores, 1)).sum() == 1


def test_top_p_keeps_the_smallest_nucleus():
    probs = np.array([[0.5, 0.3, 0.15, 0.05]])
    scores = np.log(probs).astype(np.float32)
    assert np.isfinite(g.top_p_filter(scores, 0.7)).tolist() == [[True, True, False, False]]
    assert np.isfinite(g.top_p_filter(scores, 0.8)).tolist() == [[True, True, False, False]]
    assert np.isfinite(g.top_p_filter(scores, 0.81)).tolist() == [[True, True, True, False]]
    assert np.isfinite(g.top_p_filter(scores, 0.01)).sum() == 1  # the best token always stays


def test_sampling_follows_the_distribution_and_is_seeded():
    probs = np.array([0.1, 0.6, 0.3])
    scores = np.tile(np.log(probs).astype(np.float32), (20000, 1))
    draws = g.sample(scores, np.random.default_rng(1))
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 20000, probs, atol=0.015)
    again = g.sample(scores, np.random.default_rng(1))
    np.testing.assert_array_equal(draws, again)
    masked = scores.copy()
    masked[:, 1] = -np.inf
    assert 1 not in g.sample(masked, np.random.default_rng(2))


def test_stop_matcher_holds_back_partial_matches():
    m = g.StopMatcher(["END", "\n\n"])
    pieces = [m.feed(p) for p in ["Hello E", "N", "ough. Then EN", "D more"]]
    assert pieces == [("Hello ", False), ("", False), ("ENough. Then ", False), ("", True)]
    m = g.StopMatcher(["xyz"])
    assert m.feed("abc") == ("abc", False) and m.feed("xy") == ("", False) and m.flush() == "xy"


# -- options ---------------------------------------------------------------------------------------------
class FakeModel:
    def __init__(self, hf_config=None, generation_config=None):
        self.hf_config = hf_config or {}
        self.generation_config = generation_config or {}


def test_option_precedence():
    model = FakeModel({"num_beams": 2, "task_specific_params": {
        "summarization": {"prefix": "summarize: ", "num_beams": 4, "max_length": 200,
                          "min_length": 30, "no_repeat_ngram_size": 3, "length_penalty": 2.0}}},
        {"max_length": 50, "num_beams": 3})
    opts, prefix = g.resolve_options(model)
    assert (opts.num_beams, opts.max_new_tokens, prefix) == (3, 49, "")
    opts, prefix = g.resolve_options(model, task="summarization", num_beams=1)
    assert prefix == "summarize: "
    assert (opts.num_beams, opts.max_new_tokens, opts.min_new_tokens, opts.no_repeat_ngram_size,
            opts.length_penalty) == (1, 199, 29, 3, 2.0)


def test_no_silent_twenty_token_cap():
    assert g.resolve_options(FakeModel({}, {"max_length": 20}))[0].max_new_tokens == \
        g.DEFAULT_MAX_NEW_TOKENS


@pytest.mark.parametrize("bad,needle", [
    ({"temperature": 0}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"num_beams": 0}, "num_beams"), ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"num_return_sequences": 3, "num_beams": 2}, "num_return_sequences"),
    ({"min_new_tokens": 9, "max_new_tokens": 3}, "exceeds"), ({"colour": 1}, "unknown generation option"),
    ({"stop": [""]}, "stop"), ({"seed": "x"}, "seed"),
])
def test_bad_options_are_named(bad, needle):
    with pytest.raises(InputError, match=needle):
        g.resolve_options(FakeModel(), **bad)


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(InputError, match="known: summarization"):
        g.resolve_options(FakeModel({"task_specific_params": {"summarization": {}}}), task="poetry")


# -- end to end on a small random model with the tiny vocabulary ------------------------------------------
def test_text_in_text_out_shapes(text_model):
    one = text_model.generate("date: March 5, 2021", max_new_tokens=6)
    assert isinstance(one, str)
    many = text_model.generate(["a b c", "date: 1999"], max_new_tokens=6)
    assert isinstance(many, list) and len(many) == 2 and all(isinstance(t, str) for t in many)
    assert many[0] == text_model.generate("a b c", max_new_tokens=6)  # batching changes nothing
    multi = text_model.generate("a b c", max_new_tokens=5, num_beams=3, num_return_sequences=2)
    assert isinstance(multi, list) and len(multi) == 2
    ids = text_model.generate([[5, 6, 7, 1]], max_new_tokens=4)
    assert ids[0][0] == 0 and 1 < len(ids[0]) <= 5


def test_details_report_ids_and_reasons(text_model):
    [[r]] = text_model.generate(["a b c"], max_new_tokens=5, return_details=True)
    assert r.token_ids[0] == 0 and r.new_tokens == len(r.token_ids) - 1 <= 5
    assert r.finish_reason in ("eos", "length") and r.prompt_tokens > 0
    assert r.text == text_model.tokenizer.decode(r.token_ids)


@pytest.mark.parametrize("options", [{}, {"do_sample": True, "seed": 3, "top_k": 20},
                                     {"stop": ["e"]}, {"num_beams": 3}])
def test_stream_pieces_join_to_the_whole_text(text_model, options):
    prompt = "translate: the house is wonderful"
    whole = text_model.generate(prompt, max_new_tokens=24, **options)
    pieces = list(text_model.generate(prompt, max_new_tokens=24, stream=True, **options))
    assert "".join(pieces) == whole
    if "num_beams" not in options:
        assert all(isinstance(p, str) and p for p in pieces)


def test_stream_of_token_ids_yields_ids(text_model):
    ids = list(text_model.generate([9, 10, 11, 1], stream=True, max_new_tokens=7))
    assert all(isinstance(i, int) for i in ids)
    assert [0] + ids == text_model.generate([[9, 10, 11, 1]], max_new_tokens=7)[0]


def test_closing_a_stream_early_releases_the_arena(text_model):
    arena = text_model.backend.arena
    before = arena.used
    it = text_model.generate("a b c d", stream=True, max_new_tokens=50, min_new_tokens=50)
    next(it)
    assert arena.used > before
    it.close()
    assert arena.used == before


def test_stop_strings_cut_and_stop(text_model):
    full = text_model.generate("a b c", max_new_tokens=30, min_new_tokens=30)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip()
    [[r]] = text_model.generate(["a b c"], max_new_tokens=30, min_new_tokens=30, stop=[stop],
                                return_details=True)
    assert r.finish_reason == "stop" and r.text == full[:full.find(stop)]
    assert r.new_tokens < 30  # decoding stopped, not just the text


def test_sampling_is_reproducible_and_varies_with_the_seed(text_model):
    a = text_model.generate("a b c", do_sample=True, seed=7, max_new_tokens=12, temperature=1.5)
    b = text_model.generate("a b c", do_sample=True, seed=7, max_new_tokens=12, temperature=1.5)
    others = {text_model.generate("a b c", do_sample=True, seed=s, max_new_tokens=12,
                                  temperature=1.5) for s in range(8, 14)}
    assert a == b and len(others | {a}) > 1


def test_finished_rows_leave_the_batch(text_model, monkeypatch):
    """Rows that end stop costing compute: the state's live batch shrinks."""
    from minfer.models import t5
    sizes = []
    real_step = t5.DecodeState.step
    monkeypatch.setattr(t5.DecodeState, "step",
                        lambda self, tokens: (sizes.append(self.batch), real_step(self, tokens))[1])
    prompts = ["a b c", "date: 1999", "one two", "x"]
    results = text_model.generate(prompts, max_new_tokens=30, return_details=True,
                                  stop=[" "])
    lengths = sorted(r[0].new_tokens for r in results)
    assert sizes[0] == 4 and sizes == sorted(sizes, reverse=True)
    assert len(sizes) == lengths[-1]
    if lengths[0] < lengths[-1]:
        assert sizes[-1] < 4


def test_task_applies_prefix_and_settings(text_model):
    with_task = text_model.generate("The house", task="translation_en_to_de", return_details=True)
    manual = text_model.generate("translate English to German: The house", num_beams=2,
                                 max_new_tokens=8, early_stopping=True, return_details=True)
    assert with_task[0][0].token_ids == manual[0][0].token_ids
    assert with_task[0][0].new_tokens <= 8


def test_text_input_needs_a_tokenizer(tmp_path):
    import minfer
    from t5_factory import write_t5
    model = minfer.load(write_t5(tmp_path / "m"))
    with pytest.raises(InputError, match="text input requires a tokenizer"):
        model.generate("hello")
    with pytest.raises(InputError, match="stop strings requires a tokenizer"):
        model.generate([[1]], stop=["x"])


@pytest.mark.parametrize("prompt", ["", "   ", [""]])
def test_empty_prompts_are_refused(text_model, prompt):
    with pytest.raises(InputError, match="empty prompt"):
        text_model.generate(prompt)
