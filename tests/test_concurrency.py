"""One model shared by threads and by interleaved streams (generation/batcher.py, the models'
locks and per-request arena holds): every result equals the sequential one."""
import json
import random
import threading
from pathlib import Path

import numpy as np
import pytest

import minfer
from conftest import XL_FIXTURES

ROOT = Path(__file__).resolve().parents[1]
DATES = ROOT / "weights" / "tiny-t5-dates"
PROMPTS = [json.loads(line)["prompt"] for line in open(DATES / "heldout.jsonl")][::4]   # 200


@pytest.fixture(scope="module")
def model():
    return minfer.load(DATES)


@pytest.fixture(scope="module")
def sequential(model):
    return [model.generate(p) for p in PROMPTS]


def run_threads(n, work):
    errors, threads = [], []

    def wrap(k):
        try:
            work(k)
        except Exception as e:  # surfaced below, with the thread's index
            errors.append((k, e))
    for k in range(n):
        threads.append(threading.Thread(target=wrap, args=(k,)))
        threads[-1].start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors[:3]


@pytest.mark.parametrize("n_threads", [2, 4, 8])
def test_threads_calling_generate_get_the_sequential_answers(model, sequential, n_threads):
    arena = model.backend.arena
    before = arena.used
    got = [None] * len(PROMPTS)

    def work(k):
        for i in range(k, len(PROMPTS), n_threads):
            got[i] = model.generate(PROMPTS[i])
    run_threads(n_threads, work)
    assert got == sequential
    assert arena.used == before                      # every request's state was given back


def test_concurrent_requests_share_decode_steps(model, monkeypatch):
    """Not a lock only: steps of requests running at the same time are taken together."""
    sizes = []
    real = type(model).step_together
    monkeypatch.setattr(type(model), "step_together",
                        lambda self, states, tokens: (sizes.append(len(states)),
                                                      real(self, states, tokens))[1])
    barrier = threading.Barrier(6)

    def work(k):
        barrier.wait()
        model.generate(PROMPTS[k * 7], max_new_tokens=12, min_new_tokens=12)
    run_threads(6, work)
    assert max(sizes) >= 3 and len(sizes) < 6 * 12   # fewer steps than requests x tokens


def test_threads_calling_forward_get_the_sequential_logits(model):
    rng = np.random.default_rng(0)
    cases = [(rng.integers(2, 590, (2, int(rng.integers(3, 9)))).tolist(),
              rng.integers(2, 590, (2, int(rng.integers(2, 6)))).tolist()) for _ in range(24)]
    want = [model.forward(i, d) for i, d in cases]
    got = [None] * len(cases)

    def work(k):
        for j in range(k, len(cases), 3):
            got[j] = model.forward(*cases[j])
    run_threads(3, work)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_interleaved_streams_closed_and_reopened_in_any_order(model, sequential):
    rnd = random.Random(7)
    todo = list(range(40))
    streams, texts, done = {}, {}, {}
    while todo or streams:
        if todo and (len(streams) < 5 and rnd.random() < 0.5 or not streams):
            i = todo.pop()
            streams[i], texts[i] = model.generate(PROMPTS[i], stream=True), []
            continue
        i = rnd.choice(list(streams))
        if rnd.random() < 0.05:                      # abandon it: close early, run it again later
            streams.pop(i).close()
            todo.insert(0, i)
            continue
        try:
            texts[i].append(next(streams[i]))
        except StopIteration:
            done[i] = "".join(texts[i])
            del streams[i]
    assert [done[i] for i in range(40)] == sequential[:40]
    assert model.backend.arena.used == 0


def test_xl_threads_scoring_and_generating_agree_with_sequential():
    m = minfer.load(XL_FIXTURES / "adaptive_div4")
    rng = np.random.default_rng(1)
    rows = [rng.integers(1, 900, int(rng.integers(5, 40))).tolist() for _ in range(12)]
    want_scores = [m.score(r, segment_len=8)["log_likelihood"] for r in rows]
    want_gen = [m.generate([r[:6]], max_new_tokens=5)[0] for r in rows]
    got_scores, got_gen = [None] * 12, [None] * 12

    def work(k):
        for j in range(k, 12, 4):
            got_scores[j] = m.score(rows[j], segment_len=8)["log_likelihood"]
            got_gen[j] = m.generate([rows[j][:6]], max_new_tokens=5)[0]
    run_threads(4, work)
    assert got_scores == want_scores and got_gen == want_gen
    assert m.backend.arena.used == 0


def test_a_request_with_stop_strings_waits_until_its_consumer_handled_its_event():
    # Between taking an event and reporting the rows it stopped, a consumer must not see its
    # request stepped by another thread's leader: a stopped row would get one more token.
    import collections

    from minfer.generation.batcher import Batcher

    class Model:
        def step_together(self, states, feeds):
            return [None] * len(states)

    class Request:   # the Decoding attributes the batcher reads
        def __init__(self, runs_ahead):
            self.error, self.finished, self.state = None, False, None
            self.events, self.runs_ahead, self.consumed, self.steps = collections.deque(), runs_ahead, True, 0

        def ready(self):
            return True

        def feed(self):
            return None

        def advance(self, scores):
            self.steps += 1
            return self.steps

    model, stops, free = Model(), Request(runs_ahead=False), Request(runs_ahead=True)
    batcher = Batcher(model)
    batcher.join(stops)
    batcher.join(free)
    assert batcher.next_event(stops) == 1          # it led the first step for both
    batcher._step()                                # another thread leads while it handles event 1
    assert (stops.steps, free.steps) == (1, 2)
    assert batcher.next_event(stops) == 2          # back for more: stepped again
    assert stops.steps == 2
