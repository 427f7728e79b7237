"""Logits processors and the sampler (generation/processors.py)."""
import numpy as np

from minfer.generation import processors as g


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
