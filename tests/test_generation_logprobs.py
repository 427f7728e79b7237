"""The logprobs option (issue 29): each new token's log-probability, the log-softmax of the
model's scores before temperature and penalties (as vLLM reports them), and its best
alternatives; greedy, sampled and beam outputs alike (beams: one teacher-forced pass over each
returned sequence), equal to the log-softmax of `forward`'s logits at the same positions."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import minfer
from minfer import InputError

ROOT = Path(__file__).resolve().parent.parent
DATES = ROOT / "weights" / "tiny-t5-dates"
RECALL = ROOT / "weights" / "tiny-xl-recall"
PROMPTS = ["date: 4th of July 1976", "date: 12 March 1999"]


@pytest.fixture(scope="module")
def dates():
    return minfer.load(DATES)


def forced(model, prompt: str, token_ids: list[int]) -> np.ndarray:
    """log-softmax (n, V) of forward's logits for the new tokens of an encoder-decoder result."""
    logits = model.forward([model.tokenizer.encode(prompt)], [token_ids[:-1]])[0].astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))


def check_against_forward(model, prompt, result, k):
    new = result.token_ids[1:]
    lp = forced(model, prompt, result.token_ids)
    assert len(result.token_logprobs) == len(result.top_logprobs) == len(new) == result.new_tokens
    assert np.allclose(result.token_logprobs, lp[np.arange(len(new)), new], atol=1e-4)
    for row, top in zip(lp, result.top_logprobs):
        assert len(top) == k
        best = np.argsort(-row, kind="stable")[:k]
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert np.allclose([v for _, v in top], row[best], atol=1e-4)


def test_greedy_logprobs_are_the_log_softmax_of_forward(dates):
    for prompt, row in zip(PROMPTS, dates.generate(PROMPTS, logprobs=3, return_details=True)):
        r = row[0]
        check_against_forward(dates, prompt, r, 3)
        # greedy: the chosen token is the best alternative
        assert all(t == top[0][0] for t, top in zip(r.token_ids[1:], r.top_logprobs))


def test_sampled_logprobs_ignore_the_temperature(dates):
    got = dates.generate(PROMPTS[:1], logprobs=1, do_sample=True, temperature=200.0, seed=3,
                         num_return_sequences=3, max_new_tokens=6, return_details=True)[0]
    assert len({tuple(r.token_ids) for r in got}) > 1      # the temperature did sample
    for r in got:
        check_against_forward(dates, PROMPTS[0], r, 1)


def test_each_returned_beam_carries_its_own_tokens_logprobs(dates):
    got = dates.generate(PROMPTS[:1], logprobs=2, num_beams=4, num_return_sequences=3,
                         return_details=True)[0]
    assert len(got) == 3 and len({tuple(r.token_ids) for r in got}) == 3
    for r in got:
        check_against_forward(dates, PROMPTS[0], r, 2)
        assert r.score is not None


def test_without_the_option_nothing_is_kept(dates):
    r = dates.generate(PROMPTS[:1], return_details=True)[0][0]
    assert r.token_logprobs is None and r.top_logprobs is None


def test_transformer_xl_greedy_logprobs_are_its_own_log_probabilities():
    xl = minfer.load(RECALL)
    ids = [5, 6, 7, 8]
    r = xl.generate([ids], logprobs=2, max_new_tokens=3, return_details=True)[0][0]
    assert len(r.token_logprobs) == 3 and all(v <= 0 for v in r.token_logprobs)
    assert all(t == top[0][0] for t, top in zip(r.token_ids, r.top_logprobs))
    with pytest.raises(InputError, match="logprobs with beam search needs an encoder-decoder"):
        xl.generate([ids], logprobs=1, num_beams=2, max_new_tokens=2)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_the_option_is_an_integer_in_0_to_20(dates, bad):
    with pytest.raises(InputError, match="logprobs"):
        dates.generate(PROMPTS[:1], logprobs=bad)


@pytest.mark.parametrize("options", [{}, {"do_sample": True, "temperature": 50.0, "seed": 5},
                                     {"num_beams": 3}])
def test_a_stream_carries_each_decided_tokens_logprobs(dates, options):
    """Greedy, sampled and beam streams: after each piece one entry per decided token, and
    at the end the same values as the whole sequence scored by forward."""
    s = dates.generate(PROMPTS[1], logprobs=2, stream=True, max_new_tokens=12, **options)
    seen = []
    for _ in s:
        assert len(s.token_logprobs) == len(s.top_logprobs) == len(s.decided_ids)
        seen.append(len(s.decided_ids))
    assert seen == sorted(seen) and s.new_tokens == len(s.token_logprobs)
    result = type("R", (), {"token_ids": [dates.token_ids.start] + s.token_ids,
                            "token_logprobs": s.token_logprobs, "top_logprobs": s.top_logprobs,
                            "new_tokens": s.new_tokens})
    check_against_forward(dates, PROMPTS[1], result, 2)


def test_a_stream_without_the_option_keeps_none(dates):
    s = dates.generate(PROMPTS[0], stream=True, max_new_tokens=4)
    list(s)
    assert s.token_logprobs is None and s.top_logprobs is None
    assert s.decided_ids == s.token_ids and 1 <= s.new_tokens <= 4
