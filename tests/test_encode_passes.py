"""/v1/encode's queue (minfer/serve/encode_passes.py) in one process: requests waiting while the
model is busy share the next encoder pass and get exactly the rows they get alone; a cancelled
request leaves without losing the others' rows; a failed shared pass is rerun per request."""
import time

import numpy as np
import pytest

import minfer
from factories import in_threads
from minfer.errors import Cancelled, InputError
from minfer.serve.encode_passes import SHARE_MIN_POSITIONS, EncodePasses, PassRule
from minfer.serve.jobs import Job

LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)   # > 128 tokens


@pytest.fixture(scope="module")
def model(text_model_folder):
    return minfer.load(text_model_folder)


def rows_of(model, texts, length=None):
    return [model.tokenizer.encode_cut(t, length)[0] if length else model.tokenizer.encode(t)
            for t in texts]


def wait_until(condition, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# (preset, length, texts): the rules a server sees; every pass has T >= 128 positions a row
RULES = [("flux", 512, ["a cat sat on the mat", "hi there"]),
         ("sd3", 256, ["one two three four"]),
         ("wan", 512, ["  a   dog &amp; a cat ", "sun"]),
         (None, None, [LONG, "a short one"])]


def rule_of(model, preset, length, texts):
    rows = rows_of(model, texts, length)
    return PassRule(preset, length if preset else max(map(len, rows))), rows


def test_waiting_requests_share_one_pass_and_get_their_rows_exactly(model):
    passes = EncodePasses(model)
    alone = {}
    for preset, length, texts in RULES:
        rule, rows = rule_of(model, preset, length, texts)
        alone[preset] = EncodePasses(model).encode(Job(model), rule, rows)
    calls = []
    for preset, length, texts in RULES * 2:   # two requests of each rule
        rule, rows = rule_of(model, preset, length, texts)
        calls.append((preset, lambda rule=rule, rows=rows: passes.encode(Job(model), rule, rows)))
    with model.lock:   # the model is busy: the first caller leads and waits, the rest queue
        out, threads = in_threads([c for _, c in calls])
        wait_until(lambda: len(passes.waiting) == len(calls) - 1)
    for t in threads:
        t.join(60)
    # the leader's pass, then one pass per rule for the 7 that waited
    assert passes.passes == 1 + len(RULES) and passes.requests == len(calls)
    for (preset, _), got in zip(calls, out):
        assert not isinstance(got, BaseException), got
        want = alone[preset]
        assert len(got) == len(want)
        for (s, m), (ws, wm) in zip(got, want):   # the same bytes as the request alone
            assert s.tobytes() == ws.tobytes() and np.array_equal(m, wm)
    # and those are model.encode's of the request alone, with its preset
    flux = model.encode(RULES[0][2], preset="flux", return_mask=True)
    assert alone["flux"][0][0].tobytes() == flux[0][0].tobytes()


def test_a_pass_takes_at_most_max_rows_but_always_the_oldest_whole(model):
    passes = EncodePasses(model, max_rows=3)
    rule, rows = rule_of(model, "sd3", 256, ["a", "b"])
    big_rule, big = rule_of(model, "sd3", 256, ["c", "d", "e", "f"])
    with model.lock:
        out, threads = in_threads([lambda: passes.encode(Job(model), rule, rows)] +
                                  [lambda: passes.encode(Job(model), big_rule, big)] +
                                  [lambda: passes.encode(Job(model), rule, rows)] * 2)
        wait_until(lambda: len(passes.waiting) == 3)
    for t in threads:
        t.join(60)
    assert all(not isinstance(o, BaseException) for o in out)
    assert [len(o) for o in out] == [2, 4, 2, 2]
    # leader (2 rows); then the 4-row request alone (over 3 but the oldest); then 2 + 2 > 3:
    # one request a pass
    assert passes.passes == 4 and passes.requests == 4


def test_a_request_of_few_positions_runs_its_own_pass(model):
    """Below SHARE_MIN_POSITIONS (rows x T) the products of a shared pass could take another
    path than the request's alone: it never waits in the queue."""
    passes = EncodePasses(model)
    rule, rows = rule_of(model, "sd3", 256, ["a"])
    small_rule, small = rule_of(model, None, None, ["a short one", "and another"])
    assert len(small) * small_rule.length < SHARE_MIN_POSITIONS
    with model.lock:
        out, threads = in_threads([lambda: passes.encode(Job(model), rule, rows)])
        wait_until(lambda: passes.leading and not passes.waiting)
        more, others = in_threads([lambda: passes.encode(Job(model), small_rule, small)] * 2)
        time.sleep(0.2)
        assert not passes.waiting
    for t in threads + others:
        t.join(60)
    want = model.encode(small, return_mask=True, padding_states=False)[0]
    for got in more:
        assert [s.tobytes() for s, _ in got] == [w[:len(r)].tobytes() for w, r in zip(want, small)]
    assert passes.passes == 3 and passes.requests == 3


def test_a_cancelled_waiter_leaves_and_the_others_get_their_rows(model):
    passes = EncodePasses(model)
    rule, rows = rule_of(model, "flux", 512, ["a cat sat on the mat"])
    leader_job, gone_job, kept_job = Job(model), Job(model), Job(model)
    with model.lock:
        out, threads = in_threads([lambda: passes.encode(leader_job, rule, rows)])
        wait_until(lambda: passes.leading and not passes.waiting)
        more, others = in_threads([lambda: passes.encode(gone_job, rule, rows),
                                   lambda: passes.encode(kept_job, rule, rows)])
        wait_until(lambda: len(passes.waiting) == 2)
        gone_job.cancel()     # the client went away while its rows waited
        leader_job.cancel()   # the leader's own client too: its pass still runs
        wait_until(lambda: len(passes.waiting) == 1)   # the cancelled waiter left
    for t in threads + others:
        t.join(60)
    assert isinstance(more[0], Cancelled)
    alone = EncodePasses(model).encode(Job(model), rule, rows)
    for got in (out[0], more[1]):   # the leader finished its pass; the other got its rows
        assert not isinstance(got, BaseException), got
        assert got[0][0].tobytes() == alone[0][0].tobytes()
    assert passes.passes == 2 and passes.requests == 2 and not passes.waiting


def test_a_failed_shared_pass_reruns_each_request_alone(model, monkeypatch):
    """One request's row fails the pass (as a row with non-finite states would): the others in
    the pass still get their rows, the failing one its own error."""
    passes = EncodePasses(model)
    real = model.encode
    bad_rule, bad = rule_of(model, "sd3", 256, ["the bad one"])

    def encode(rows, **options):
        if any(list(r) == list(bad[0]) for r in rows):
            raise InputError("row refused")
        return real(rows, **options)
    monkeypatch.setattr(model, "encode", encode)
    rule, rows = rule_of(model, "sd3", 256, ["a good one"])
    with model.lock:
        first, threads = in_threads([lambda: passes.encode(Job(model), rule, rows)])
        wait_until(lambda: passes.leading and not passes.waiting)
        rest, more = in_threads([lambda: passes.encode(Job(model), bad_rule, bad),
                                 lambda: passes.encode(Job(model), rule, rows)])
        wait_until(lambda: len(passes.waiting) == 2)
    for t in threads + more:
        t.join(60)
    out = first + rest
    assert isinstance(out[1], InputError) and "row refused" in str(out[1])
    want = real(["a good one"], preset="sd3")[0]
    assert out[0][0][0].tobytes() == want.tobytes() == out[2][0][0].tobytes()
    # the leader's pass; the shared one failed (not counted), rerun: the good request's pass
    # (the bad one's fails again)
    assert passes.passes == 2 and passes.requests == 2
