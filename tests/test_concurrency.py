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
from minfer.generation.batcher import batcher_of

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
    batcher = batcher_of(model)
    steps, stepped = batcher.steps, batcher.stepped

    def work(k):
        barrier.wait()
        model.generate(PROMPTS[k * 7], max_new_tokens=12, min_new_tokens=12)
    run_threads(6, work)
    assert max(sizes) >= 3 and len(sizes) < 6 * 12   # fewer steps than requests x tokens
    # the batcher's counts (a server's metrics): every step, and the requests each took
    assert (batcher.steps - steps, batcher.stepped - stepped) == (len(sizes), sum(sizes))


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


class StubModel:
    """What the batcher calls on a model: one joint step (no scores)."""
    def step_together(self, states, feeds):
        return [None] * len(states)


def StubRequest(runs_ahead=True, broken=False):
    """A batcher Request with the Decoding parts it calls; `broken`: ready() fails."""
    from minfer.generation.batcher import Request

    class Stub(Request):
        def __init__(self):
            super().__init__(runs_ahead)
            self.state, self.steps = None, 0

        def ready(self):
            if broken:
                raise MemoryError("reorder scratch")
            return True

        def feed(self):
            return None

        def advance(self, scores):
            self.steps += 1
            return self.steps

    return Stub()


def test_a_request_with_stop_strings_waits_until_its_consumer_handled_its_event():
    # Between taking an event and reporting the rows it stopped, a consumer must not see its
    # request stepped by another thread's leader: a stopped row would get one more token.
    from minfer.generation.batcher import Batcher

    model, stops, free = StubModel(), StubRequest(runs_ahead=False), StubRequest(runs_ahead=True)
    batcher = Batcher(model)
    batcher.join(stops)
    batcher.join(free)
    assert batcher.next_event(stops) == 1          # it led the first step for both
    batcher._step()                                # another thread leads while it handles event 1
    assert (stops.steps, free.steps) == (1, 2)
    assert batcher.next_event(stops) == 2          # back for more: stepped again
    assert stops.steps == 2


# -- what a server meets: abandoned streams, the garbage collector, a bounded arena ------------------
def run_bounded(work, seconds=60):
    """work() in a thread; a hang fails the test instead of hanging the suite."""
    box = {}

    def wrap():
        try:
            box["out"] = work()
        except BaseException as e:  # surfaced below
            box["error"] = e
    t = threading.Thread(target=wrap, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "hung"
    if "error" in box:
        raise box["error"]
    return box.get("out")


def abandon_in_a_cycle(stream):
    """Drop a stream that was read once inside a reference cycle: only the cyclic garbage
    collector finalises it, whenever it next runs."""
    next(stream)
    cycle = {"stream": stream}
    cycle["self"] = cycle


def test_a_stream_the_gc_finalises_while_its_thread_leads_a_step_does_not_hang(model, monkeypatch):
    import gc
    real = type(model).step_together

    abandoned = []

    def collecting(self, states, tokens):   # the GC runs inside this thread's step
        if abandoned:
            abandoned.pop()
            gc.collect()
        return real(self, states, tokens)
    monkeypatch.setattr(type(model), "step_together", collecting)
    before = model.backend.arena.used

    def work():
        for i in range(4):
            abandon_in_a_cycle(model.generate(PROMPTS[i], stream=True))
            abandoned.append(i)
            assert model.generate(PROMPTS[10:13]) == [model.generate(p) for p in PROMPTS[10:13]]
    run_bounded(work)
    gc.collect()
    assert model.backend.arena.used == before


def test_closing_a_stream_while_another_thread_steps_it_returns_and_frees_after_the_step(model):
    before = model.backend.arena.used
    entered, go = threading.Event(), threading.Event()
    real = type(model).step_together
    stream = model.generate(PROMPTS[0], stream=True, max_new_tokens=40, min_new_tokens=40)
    next(stream)

    def slow(states, tokens):   # a step in progress on another thread
        entered.set()
        go.wait(30)
        return real(model, states, tokens)
    model.step_together = slow
    try:
        leader = threading.Thread(target=lambda: model.generate(PROMPTS[1], max_new_tokens=3))
        leader.start()
        assert entered.wait(30)
        run_bounded(stream.close, seconds=10)          # returns while the step still runs
        assert model.backend.arena.used > before       # its state is in use: not freed yet
        go.set()
        leader.join(60)
    finally:
        del model.step_together
    assert model.backend.arena.used == before


@pytest.fixture(scope="module")
def wide_vocab(tmp_path_factory):
    """A T5 whose logits (V = 8192) dominate a step: stacking many requests' rows for one step
    needs more scratch than a small arena has free."""
    from factories import write_t5
    folder = write_t5(tmp_path_factory.mktemp("wide") / "m", seed=1, vocab_size=8192, d_model=32,
                      d_kv=8, num_heads=4, d_ff=64)
    free = minfer.load(folder)
    prompts = [[5 + (i * 37 + j * 11) % 8000 for j in range(6 + i % 5)] + [1] for i in range(48)]
    return folder, free, prompts


def bounded_model(folder, free, rows=4, length=11):
    """The same model under a memory limit: its weights plus room for `rows` one-row requests of
    `length` prompt tokens and 6 new ones."""
    plan = free.plan(1, length, 6)["peak"]
    weights = free.weight_plan.fixed + sum(free.weight_plan.unit_bytes.values()) + 4096
    return minfer.load(folder, memory_limit=int(weights + rows * plan), workspace=int(rows * plan))


def test_concurrent_requests_under_a_bounded_arena_wait_instead_of_failing(wide_vocab):
    folder, free, prompts = wide_vocab
    m = bounded_model(folder, free)
    want = {}
    for i, p in enumerate(prompts):
        kind = i % 3   # greedy, beam search, stream: all queue for the same memory
        want[i] = (free.generate([p], max_new_tokens=6, num_beams=2) if kind == 1
                   else free.generate([p], max_new_tokens=6))
    got = {}
    barrier = threading.Barrier(16)

    def work(k):
        barrier.wait()
        for i in range(k, len(prompts), 16):
            if i % 3 == 1:
                got[i] = m.generate([prompts[i]], max_new_tokens=6, num_beams=2)
            elif i % 3 == 2:
                got[i] = [[0] + list(m.generate([prompts[i]], max_new_tokens=6, stream=True))]
            else:
                got[i] = m.generate([prompts[i]], max_new_tokens=6)
    run_threads(16, work)
    assert got == want
    assert m.backend.arena.used == m.backend.arena.capacity - m.free_when_idle


def test_a_finished_request_gives_its_memory_back_before_its_consumer_reads(wide_vocab):
    folder, free, prompts = wide_vocab
    m = minfer.load(folder)
    idle = m.backend.arena.used
    short = m.generate([prompts[0]], stream=True, max_new_tokens=2, min_new_tokens=2)
    next(short)
    held = m.backend.arena.used
    longer = m.generate([prompts[1]], stream=True, max_new_tokens=6, min_new_tokens=6)
    list(longer)             # its steps ran the short one (no stop strings) to its end
    assert m.backend.arena.used == idle < held
    assert list(short) == free.generate([prompts[0]], max_new_tokens=2, min_new_tokens=2)[0][2:]


def test_one_thread_interleaving_streams_waits_for_its_own_running_stream(wide_vocab):
    folder, free, prompts = wide_vocab
    m = bounded_model(folder, free, rows=1)      # room for one request at a time

    def interleave():
        first = m.generate([prompts[0]], stream=True, max_new_tokens=6)
        next(first)
        # the second does not fit beside the first; the first runs ahead of its consumer, so
        # this thread drives it to its end, and the second runs in the memory it gave back
        second = list(m.generate([prompts[1]], stream=True, max_new_tokens=6))
        return second, list(first)
    second, rest = run_bounded(interleave)
    assert second == free.generate([prompts[1]], max_new_tokens=6)[0][1:]
    assert rest == free.generate([prompts[0]], max_new_tokens=6)[0][2:]


def one_room(tmp_path):
    """A text model (with stop strings: a tokenizer) and the same model under a limit that holds
    one request of 400 new tokens, not two (their decode states alone overflow it)."""
    from conftest import make_text_model_folder
    folder = make_text_model_folder(tmp_path / "m")
    free = minfer.load(folder)
    plan = free.plan(1, len(free.tokenizer.encode("a b c")), 400)
    room = plan["peak"] * 11 // 10
    assert 2 * plan["decode_state"] > room
    weights = free.weight_plan.fixed + sum(free.weight_plan.unit_bytes.values()) + 4096
    return free, minfer.load(folder, memory_limit=weights + room, workspace=room)


def held_by_another_thread(m):
    """A thread holding one 400-token request that advances only when that thread reads it
    (stop strings): (its stream, an event that makes it close the stream, the thread)."""
    box, taken, done = {}, threading.Event(), threading.Event()

    def hold():
        box["stream"] = m.generate("a b c", stream=True, max_new_tokens=400, stop=["never"])
        next(box["stream"])
        taken.set()
        done.wait(30)
        box["stream"].close()
    owner = threading.Thread(target=hold)
    owner.start()
    assert taken.wait(30)
    return box["stream"], done, owner


def test_one_thread_whose_own_stream_waits_for_it_fails_at_once_not_hangs(tmp_path):
    from minfer.errors import ArenaExhausted
    free, m = one_room(tmp_path)

    def interleave():
        first = m.generate("a b c", stream=True, max_new_tokens=400, stop=["never"])
        next(first)          # stop strings: it advances only when this thread reads it
        try:
            with pytest.raises(ArenaExhausted, match="cannot hand out"):
                list(m.generate("d e f", stream=True, max_new_tokens=400))
        finally:
            first.close()
    run_bounded(interleave, 20)
    assert m.generate("d e f", max_new_tokens=6) == free.generate("d e f", max_new_tokens=6)


# -- streams: what they report, and cancelling one from another thread ---------------------------------
def test_a_stream_reports_how_it_ended_and_its_token_counts(model):
    prompt = PROMPTS[3]
    want = model.generate(prompt, return_details=True)[0]
    s = model.generate(prompt, stream=True)
    assert s.finish_reason is None
    assert "".join(s) == want.text
    assert (s.finish_reason, s.prompt_tokens, s.new_tokens) == (want.finish_reason,
                                                              want.prompt_tokens, want.new_tokens)
    short = model.generate(prompt, stream=True, max_new_tokens=2, min_new_tokens=2)
    list(short)
    assert (short.finish_reason, short.new_tokens) == ("length", 2)


def test_cancelling_a_stream_from_another_thread_stops_it_within_a_step(model):
    before = model.backend.arena.used
    s = model.generate(PROMPTS[5], stream=True, max_new_tokens=200, min_new_tokens=200)
    next(s)
    steps = []
    real = type(model).step_together

    def counting(self, states, tokens):
        steps.append(len(states))
        if len(steps) == 3:
            s.cancel()              # a connection handler, while the consumer waits for a step
        return real(self, states, tokens)
    type(model).step_together = counting
    try:
        rest = run_bounded(lambda: list(s), 30)
    finally:
        type(model).step_together = real
    assert s.finish_reason == "cancelled" and len(rest) <= 4 and len(steps) <= 4
    assert model.backend.arena.used == before


def test_cancelling_a_batched_call_from_another_thread_stops_it_within_a_step(model):
    """generation.run(cancel=event): a server's non-streamed request whose client went away. The
    call raises Cancelled within a step, tries no row again, and gives every state back."""
    from minfer.generation import run
    before = model.backend.arena.used
    cancel = threading.Event()
    steps = []
    real = type(model).step_together

    def counting(self, states, tokens):
        steps.append(len(states))
        if len(steps) == 3:
            cancel.set()            # a connection handler, while the caller decodes
        return real(self, states, tokens)
    type(model).step_together = counting
    try:
        with pytest.raises(minfer.Cancelled):
            run_bounded(lambda: run(model, PROMPTS[:40], cancel=cancel, max_batch_size=8,
                                    max_new_tokens=200, min_new_tokens=200), 30)
    finally:
        type(model).step_together = real
    assert len(steps) <= 4          # neither the batch's rows nor the later batches ran on
    assert model.backend.arena.used == before
    # an event never set changes nothing
    _, results = run(model, PROMPTS[:3], cancel=threading.Event())
    assert [r[0].text for r in results] == [model.generate(p) for p in PROMPTS[:3]]


def test_cancelling_a_request_that_waits_for_memory_ends_its_wait(tmp_path):
    _, m = one_room(tmp_path)
    _, done, owner = held_by_another_thread(m)
    try:
        waiting = m.generate("d e f", stream=True, max_new_tokens=400)
        threading.Timer(0.3, waiting.cancel).start()
        assert run_bounded(lambda: list(waiting), 30) == []
        assert waiting.finish_reason == "cancelled"
    finally:
        done.set()
        owner.join(30)
    assert m.backend.arena.used == m.backend.arena.capacity - m.free_when_idle


def test_a_request_waiting_for_memory_gets_the_memory_of_one_cancelled_meanwhile(tmp_path):
    # the cancelled request stopped counting as one that frees memory before it had: the waiter
    # failed at once (ArenaExhausted) while the memory was on its way back
    free, m = one_room(tmp_path)
    holder, done, owner = held_by_another_thread(m)
    try:
        threading.Timer(0.5, holder.cancel).start()   # its client goes away; its consumer is slow
        got = run_bounded(lambda: m.generate("d e f", max_new_tokens=400), 60)
        assert got == free.generate("d e f", max_new_tokens=400)
    finally:
        done.set()
        owner.join(30)


def test_requests_waiting_for_memory_wait_quietly(tmp_path, monkeypatch):
    # a failed start counted as memory given back: two waiters woke each other ~20,000 times a
    # second, each retrying start_decoding (a core spent, the model's lock fought over)
    import time
    _, m = one_room(tmp_path)
    starts = []
    real = type(m).start_decoding
    monkeypatch.setattr(type(m), "start_decoding",
                        lambda self, *a, **k: (starts.append(1), real(self, *a, **k))[1])
    _, done, owner = held_by_another_thread(m)
    waiters = [threading.Thread(target=lambda: m.generate("d e f", max_new_tokens=400))
               for _ in range(2)]
    try:
        before = len(starts)
        for w in waiters:
            w.start()
        time.sleep(1.5)
        assert len(starts) - before <= 4
    finally:
        done.set()
        owner.join(30)
        for w in waiters:
            w.join(60)
    assert not any(w.is_alive() for w in waiters)



def test_cancelling_a_beam_search_from_another_thread_stops_it_and_frees_its_memory(model,
                                                                                   monkeypatch):
    import minfer.generation as generation
    from minfer.models.t5.model import T5DecodeState
    before = model.backend.arena.used
    cancel, steps = threading.Event(), []
    real = T5DecodeState.step

    def counting(self, tokens):
        steps.append(1)
        if len(steps) == 3:
            cancel.set()               # a server's event loop, while the search runs
        return real(self, tokens)
    monkeypatch.setattr(T5DecodeState, "step", counting)
    with pytest.raises(minfer.Cancelled):
        run_bounded(lambda: generation.run(model, [PROMPTS[4]], cancel=cancel, num_beams=3,
                                           max_new_tokens=200, min_new_tokens=200), 30)
    assert len(steps) <= 4
    assert model.backend.arena.used == before


def test_a_requests_failure_to_get_ready_is_its_own_not_the_leaders():
    # ready() (rows that stopped leave the state: a reorder) ran outside the per-request guard:
    # its exception reached whichever thread led the step, and the failing request stayed active
    from minfer.generation.batcher import Batcher

    model = StubModel()                             # (the batcher holds it weakly)
    batcher = Batcher(model)
    broken, fine = StubRequest(broken=True), StubRequest()
    batcher.join(broken)
    batcher.join(fine)
    assert batcher.next_event(fine) == 1            # the healthy one's consumer leads: no error
    assert isinstance(broken.error, MemoryError) and not broken.active
    with pytest.raises(MemoryError):
        batcher.next_event(broken)                  # the broken one's consumer gets its own
