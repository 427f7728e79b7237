"""Batching inside generate (generation/text.py): prompts of any number and length run in batches
bounded by max_batch_size and the memory plan, grouped by length, and come back in input order;
per-row errors; truncation; string columns of every kind."""
import collections
import itertools

import numpy as np
import pytest

import minfer
from conftest import XL_FIXTURES, make_text_model_folder
from minfer.errors import ArenaExhausted, InputError
from minfer.generation.planning import BadRow, plan_batches
from minfer.generation.text import run_iter

# lengths differ on purpose: sorting by length must not change which output belongs to which
PROMPTS = ["a b c", "date: 1999 and more words here", "x", "one two three four five six seven",
           "hello world", "spell: 1234", "date: March 5, 2021 was a Friday", "y z"]


def batch_shapes(model, monkeypatch):
    """Record the (rows, length) of every batch the model decodes."""
    shapes = []
    real = model.start_decoding

    def spy(ids, mask, *args, **kwargs):
        shapes.append(ids.shape)
        return real(ids, mask, *args, **kwargs)
    monkeypatch.setattr(model, "start_decoding", spy)
    return shapes


# -- the pure planner ---------------------------------------------------------------------------------
def test_plan_batches_groups_by_length_and_keeps_input_order_within_a_batch():
    lengths = [5, 1, 9, 1, 5, 3, 9, 2]
    batches = plan_batches(lengths, lambda n: 3)
    assert sorted(i for b in batches for i in b) == list(range(8))   # every row exactly once
    assert all(len(b) <= 3 and b == sorted(b) for b in batches)
    assert [sorted(lengths[i] for i in b) for b in batches] == [[1, 1, 2], [3, 5, 5], [9, 9]]
    assert plan_batches([4, 2, 7], lambda n: 8) == [[0, 1, 2]]        # one batch: as given


def test_plan_batches_shrinks_for_long_rows_and_groups_exact_lengths():
    lengths = [1, 1, 1, 1, 8, 8, 8]
    batches = plan_batches(lengths, lambda n: 4 if n < 8 else 1)    # the memory plan says so
    assert batches == [[0, 1, 2, 3], [4], [5], [6]]
    exact = plan_batches([3, 4, 3, 4, 4], lambda n: 8, exact_length=True)
    assert exact == [[0, 2], [1, 3, 4]]


# -- generate -----------------------------------------------------------------------------------------
def test_results_come_back_in_input_order_whatever_the_batches(text_model, monkeypatch):
    one_by_one = [text_model.generate(p, max_new_tokens=6) for p in PROMPTS]
    shapes = batch_shapes(text_model, monkeypatch)
    for size in (1, 3, 32):
        shapes.clear()
        assert text_model.generate(PROMPTS, max_new_tokens=6, max_batch_size=size) == one_by_one
        assert sum(rows for rows, _ in shapes) == len(PROMPTS)
        assert all(rows <= size for rows, _ in shapes)
    assert len(shapes) == 1   # 8 prompts fit one default batch


def test_batches_are_bounded_by_a_small_workspace(tmp_path, monkeypatch):
    folder = make_text_model_folder(tmp_path / "m")
    model = minfer.load(folder, workspace="120KiB")
    arena = model.backend.arena
    longest = max(len(model.tokenizer.encode(p)) for p in PROMPTS)
    fits = max(b for b in range(1, 33) if model.plan(b, longest, 8)["peak"] <= arena.capacity)
    assert 1 <= fits < len(PROMPTS)                      # the workspace, not the option, bounds it
    shapes = batch_shapes(model, monkeypatch)
    got = model.generate(PROMPTS * 3, max_new_tokens=8)
    assert got == minfer.load(folder).generate(PROMPTS * 3, max_new_tokens=8)
    assert all(model.plan(rows, n, 8)["peak"] <= arena.capacity for rows, n in shapes)
    assert max(rows for rows, _ in shapes) > fits        # short prompts share bigger batches
    assert arena.stats().peak <= arena.capacity and arena.used == 0


def test_a_prompt_too_big_for_the_workspace_is_a_row_error_naming_the_bytes(tmp_path):
    model = minfer.load(make_text_model_folder(tmp_path / "m"), workspace="120KiB")
    prompts = ["a b c", " ".join(["word"] * 300), "x"]
    with pytest.raises(ArenaExhausted, match=r"inputs: prompt 1 \(\d+ prompt tokens.*bytes available"):
        model.generate(prompts, max_new_tokens=8)
    rows = model.generate(prompts, max_new_tokens=8, return_details=True)
    assert [r[0].error is None for r in rows] == [True, False, True]
    assert "prompt 1" in rows[1][0].error and rows[1][0].finish_reason == "error"
    assert rows[0][0].text == model.generate("a b c", max_new_tokens=8)


def test_over_long_prompts_fail_by_row_or_are_truncated(text_model):
    long = " ".join(["word"] * 40)
    n = len(text_model.tokenizer.encode(long))
    with pytest.raises(InputError, match=rf"inputs: prompt 1: {n} tokens, more than max_input_tokens 10"):
        text_model.generate(["a b", long], max_new_tokens=3, max_input_tokens=10)
    with pytest.raises(InputError, match="inputs: .* more than max_input_tokens"):
        text_model.generate(long, max_new_tokens=3, max_input_tokens=10, stream=True)
    [[ok], [cut]] = text_model.generate(["a b", long], max_new_tokens=3, max_input_tokens=10,
                                        truncation=True, return_details=True)
    assert ok.error is None and cut.error is None and cut.prompt_tokens == 10
    ids = text_model.tokenizer.encode(long)
    kept = ids[:9] + ids[-1:]                         # the start, and the closing </s>
    assert text_model.generate([kept], max_new_tokens=3)[0] == cut.token_ids
    with pytest.raises(InputError, match="truncation=True needs max_input_tokens"):
        text_model.generate("a b", truncation=True)
    with pytest.raises(InputError, match="max_batch_size must be an integer"):
        text_model.generate("a b", max_batch_size=0)


def test_details_carry_row_errors_and_plain_generate_raises_the_first(text_model):
    prompts = ["a b c", "  ", None, "x y"]
    with pytest.raises(InputError, match="inputs: prompt 1: empty prompt"):
        text_model.generate(prompts, max_new_tokens=3)
    rows = text_model.generate(prompts, max_new_tokens=3, return_details=True)
    assert [r[0].finish_reason == "error" for r in rows] == [False, True, True, False]
    assert "prompt 2 is NoneType" in rows[2][0].error and rows[2][0].text is None
    assert rows[3][0].text == text_model.generate("x y", max_new_tokens=3)


def test_sampled_rows_of_different_batches_draw_differently_and_reproducibly(text_model):
    args = dict(do_sample=True, seed=3, max_new_tokens=8, max_batch_size=1)
    first = text_model.generate(["a b c"] * 4, **args)
    assert first == text_model.generate(["a b c"] * 4, **args)
    assert len(set(first)) > 1   # each batch continues the call's generator, not the seed again


# -- string columns of every kind ---------------------------------------------------------------------
def test_numpy_string_arrays_and_other_sequences_are_prompts(text_model):
    want = text_model.generate(PROMPTS[:3], max_new_tokens=4)
    for column in (np.array(PROMPTS[:3]), np.array(PROMPTS[:3], dtype=object), tuple(PROMPTS[:3]),
                   collections.deque(PROMPTS[:3])):
        assert text_model.generate(column, max_new_tokens=4) == want
    assert text_model.generate(np.array(PROMPTS[0]), max_new_tokens=4) == want[0]   # 0-d
    with pytest.raises(InputError, match="array of bytes"):
        text_model.generate(np.array([b"a b"]), max_new_tokens=4)
    rows = text_model.generate(np.array([None, "a b c"], dtype=object), max_new_tokens=4,
                               return_details=True)
    assert rows[0][0].error and rows[1][0].text == want[0]


def test_pandas_string_columns_are_prompts(text_model):
    pd = pytest.importorskip("pandas")
    want = text_model.generate(PROMPTS[:3], max_new_tokens=4)
    assert text_model.generate(pd.Series(PROMPTS[:3]), max_new_tokens=4) == want
    assert text_model.generate(pd.Series(PROMPTS[:3], dtype="string"), max_new_tokens=4) == want
    rows = text_model.generate(pd.Series([pd.NA, PROMPTS[0]], dtype="string"), max_new_tokens=4,
                               return_details=True)
    assert "prompt 0 is NAType" in rows[0][0].error and rows[1][0].text == want[0]


def test_arrow_string_columns_are_prompts(text_model):
    pa = pytest.importorskip("pyarrow")
    want = text_model.generate(PROMPTS[:3], max_new_tokens=4)
    assert text_model.generate(pa.array(PROMPTS[:3]), max_new_tokens=4) == want
    assert text_model.generate(pa.chunked_array([PROMPTS[:1], PROMPTS[1:3]]), max_new_tokens=4) == want
    assert text_model.generate(pa.array(PROMPTS[:3], pa.large_string()), max_new_tokens=4) == want


# -- decoder-only: equal lengths only -----------------------------------------------------------------
def test_transformer_xl_batches_only_equal_lengths(monkeypatch):
    model = minfer.load(XL_FIXTURES / "adaptive_div4")
    rows = [[3, 4, 5], [6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [17, 18, 19]]
    alone = [model.generate([r], max_new_tokens=3)[0] for r in rows]
    shapes = batch_shapes(model, monkeypatch)
    assert model.generate(rows, max_new_tokens=3) == alone
    assert sorted(shapes) == [(2, 4), (3, 3)]


# -- run_iter: any number of prompts, a window at a time ----------------------------------------------
def test_run_iter_reads_a_window_ahead_at_most_and_names_rows(text_model):
    read = []

    def prompts():
        for i in itertools.count():
            if i == 50:
                return
            read.append(i)
            yield BadRow(f"line {i}: broken") if i == 7 else PROMPTS[i % len(PROMPTS)]

    out = run_iter(text_model, prompts(), max_new_tokens=2, max_batch_size=2,
                   name_row=lambda i: f"row {i}")
    first = next(out)
    assert first[0].error is None and len(read) == 2 * 16   # one window: max_batch_size * 16
    rest = list(out)
    assert len(rest) == 49 and rest[6][0].error == "line 7: broken"
    assert all(r[0].error is None for i, r in enumerate(rest) if i != 6)
    with pytest.raises(InputError, match="unknown generation option"):
        run_iter(text_model, ["a"], max_new_token=2)   # checked at the call, not at next()


def test_run_iter_windows_are_bounded_whatever_the_batch_size(text_model, monkeypatch):
    # a batch size of 65536 read a million prompts ahead; over an endless source nothing came out
    from minfer.generation import planning
    monkeypatch.setattr(planning, "WINDOW_ROWS", 64)
    monkeypatch.setattr(planning, "WINDOW_CHARS", 10**6)
    read = []

    def endless(length):
        for i in itertools.count():
            read.append(i)
            yield (PROMPTS[i % len(PROMPTS)] + " ") * length

    first = next(run_iter(text_model, endless(1), max_new_tokens=1, max_batch_size=65536))
    assert first[0].error is None and len(read) == 64            # the row bound
    monkeypatch.setattr(planning, "WINDOW_CHARS", 1000)
    read.clear()
    out = run_iter(text_model, endless(60), max_new_tokens=1, max_batch_size=65536,
                   max_input_tokens=16, truncation=True)
    next(out)
    assert 1 <= len(read) <= 1000 // 60 + 1                       # the character bound


# -- prompts far longer than their limit: tokenized only as far as the limit reaches ---------------------
def test_a_long_prompt_is_cut_as_its_full_encoding_would_be(text_model):
    tok = text_model.tokenizer
    words = ["date:", "1999", "and", "more", "words", "spell:", "1234", "hello", "world", "x"]
    prompt = " ".join(words[(i * 7) % len(words)] for i in range(6000))     # ~30k characters
    full = tok.encode(prompt)
    for limit in (16, 64):
        got = text_model.generate(prompt, max_new_tokens=3, max_input_tokens=limit,
                                  truncation=True, return_details=True)[0]
        cut = full[:limit - 1] + full[-1:]        # the start, and the closing </s>
        assert got.prompt_tokens == limit
        assert got.token_ids == text_model.generate([cut], max_new_tokens=3)[0]


def test_a_huge_prompt_costs_what_its_limit_allows(text_model, monkeypatch):
    from minfer.errors import ArenaExhausted
    tok = text_model.tokenizer
    longest = []
    real = type(tok)._encode
    monkeypatch.setattr(type(tok), "_encode", lambda self, text: (longest.append(len(text)),
                                                                   real(self, text))[1])
    prompt = "date: 4th of July 1976 and more words " * (8_000_000 // 38)  # 8 MB
    got = text_model.generate(prompt, max_new_tokens=2, max_input_tokens=32, truncation=True,
                              return_details=True)[0]
    assert got.error is None and got.prompt_tokens == 32
    with pytest.raises(InputError, match="more than 32 tokens, more than max_input_tokens 32"):
        text_model.generate(prompt, max_new_tokens=2, max_input_tokens=32)
    with pytest.raises(ArenaExhausted, match=r"more than \d+ prompt tokens"):
        text_model.generate(prompt, max_new_tokens=2)     # the arena's own bound
    assert max(longest) < 100_000        # pieces near the limit, never the 8 MB text


def test_a_start_cancelled_while_another_start_holds_admission_never_runs():
    """A request cancelled while another request's start (an encoder pass) holds the admission
    lock gives up when it gets the lock, without starting (it used to run its own encode)."""
    import threading

    from minfer.errors import Cancelled
    from minfer.generation.batcher import Batcher

    class Owner:   # the batcher keeps only a weak reference to its model
        pass

    owner = Owner()
    batcher = Batcher(owner)
    inside, leave = threading.Event(), threading.Event()

    def slow_start():
        inside.set()
        assert leave.wait(10)
        return "first"

    results = {}
    first = threading.Thread(target=lambda: results.setdefault("first", batcher.admit(slow_start)))
    first.start()
    assert inside.wait(10)
    cancel, started = threading.Event(), []

    def second():
        try:
            results["second"] = batcher.admit(lambda: started.append(1) or "second", cancel)
        except Cancelled as e:
            results["second"] = e

    waiter = threading.Thread(target=second)
    waiter.start()
    waiter.join(0.2)             # now waiting for the admission lock
    cancel.set()
    leave.set()
    first.join(10)
    waiter.join(10)
    assert results["first"] == "first"
    assert isinstance(results["second"], Cancelled) and started == []
    assert len(batcher.starting) == 1   # the first only (it never joined); the second left
