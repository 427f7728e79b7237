"""Fuzzing the edges: generated command lines, option values and inputs. Every case either works
or fails with one line of the right kind; never a raw exception, a traceback, NaN scores or padding.

The command line runs in-process (`minfer_cli.main.main`, the console entry point) so that a few
hundred cases cost about a second; tests/test_cli.py runs the real subprocess for what needs one.
"""
import contextlib
import io
import math
import random

import numpy as np
import pytest

from minfer.errors import MinferError
from minfer_cli.main import main

# -- the command line --------------------------------------------------------------------------------
INT = ["", "abc", "-1", "0", "1", "1.5", "1e3", "9" * 30, "0x10", "nan", " 3", "-0"]
FLOAT = ["", "abc", "nan", "inf", "-inf", "1e-45", "1e309", "-0", "0", "1e-400", "0.5", "2", "-3",
         "1e300"]
GENERATE_OPTIONS = {
    "--max-new-tokens": INT, "--min-new-tokens": INT, "--top-k": INT,
    "--no-repeat-ngram-size": INT, "--num-beams": INT, "--num-return-sequences": INT,
    "--seed": INT + [str(2**64), str(2**64 - 1)],
    "--temperature": FLOAT, "--top-p": FLOAT, "--repetition-penalty": FLOAT,
    "--length-penalty": FLOAT,
    "--stop": ["", "\\", "\\n", "\\x", "a\\\\b", "\t", "e", "\\t\\n", "\\u0041"],
    "--task": ["", "nope", "summarization", "translation_en_to_de"],
    "--device": ["", "cpu", "cuda:x", "gpu", "cpu:0", "cuda:-1"],
    "--dtype": ["", "float8", "int8", "int4", "float16", "bfloat16", "float32"],
    "--compute": ["", "int8", "float16", "int4", "float32"],
    # (a workspace of 10**30 bytes is left out: arena.py raises a raw ValueError, reported)
    "--workspace": ["", "0", "-1", "1KiB", "abc", "1e3", "1TiB", "64KiB"],
    "--memory-limit": ["", "0", "1KiB", "abc", "1TiB"],
}
FLAGS = ["--do-sample", "--greedy", "--no-stream", "--json", "--offline"]


def run_cli(argv, stdin: bytes | None = None):
    """(exit status, stdout, stderr) of the console entry point, in-process; `stdin` is piped."""
    import sys
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved = sys.stdin
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(argv)
            except SystemExit as e:
                code = e.code
    finally:
        sys.stdin = saved
    return code, out.getvalue(), err.getvalue()


def assert_worked_or_one_line(code, out, err):
    lines = err.strip().splitlines()
    if code == 0:   # a run that worked may warn (score: mostly <unk>), never more
        assert all(line.startswith("minfer: warning: ") for line in lines), err
        return
    assert code in (1, 2), (code, err)
    assert len(lines) == 1 and lines[0].startswith("minfer: error: "), err
    assert "Traceback" not in err and "unexpected" not in err, err   # "unexpected": a bug


def cli_cases():
    """Every value of every option alone, then 150 seeded random combinations of three options
    and some flags."""
    cases = [[o, v] for o, values in GENERATE_OPTIONS.items() for v in values]
    rng = random.Random(0)
    for _ in range(150):
        args = []
        for option in rng.sample(sorted(GENERATE_OPTIONS), 3):
            args += [option, rng.choice(GENERATE_OPTIONS[option])]
        cases.append(args + rng.sample(FLAGS, rng.randint(0, 2)))
    return cases


def test_generate_option_fuzz(text_model_folder):
    cases = cli_cases()
    codes = {0: 0, 1: 0, 2: 0}
    for args in cases:
        length = [] if "--max-new-tokens" in args else ["--max-new-tokens", "3"]
        code, out, err = run_cli(["generate", "-m", str(text_model_folder), "a b c", *length, *args])
        assert_worked_or_one_line(code, out, err)
        codes[code] += 1
    print("cli fuzz", len(cases), codes)
    assert len(cases) > 300 and all(codes.values()), codes   # each outcome is exercised


@pytest.mark.parametrize("args", [
    ["--batch", "0"], ["--batch", "x"], ["--src-len", "-1"], ["--max-new-tokens", "1e9"],
    ["--batch", "9" * 30], ["--src-len", str(2**40)], ["--max-new-tokens", str(2**62)],
    ["--device", "tpu"], ["--dtype", "int3"], ["--workspace", "-5MiB"], ["--compute", "int4"],
    ["--dtype", "float16", "--compute", "int8"],
])
def test_info_option_fuzz(text_model_folder, args):
    assert_worked_or_one_line(*run_cli(["info", "-m", str(text_model_folder), *args]))


@pytest.mark.parametrize("argv", [
    ["generate"], ["generate", "-m"], ["nosuch"], ["generate", "-m", "x", "--nosuch"],
    ["score"], ["convert", "-m", "/nonexistent", "-o", "/tmp/x"], ["info", "-m", ""],
    ["--version"], ["generate", "--help"], ["-h"],
])
def test_command_line_shape_fuzz(argv):
    assert_worked_or_one_line(*run_cli(argv))


# -- the API: option values of every type at every option ---------------------------------------------
VALUE_POOL = [None, True, False, np.bool_(True), 0, 1, 3, -1, 2**63, 10**400, 1.5, 0.5, 1e-45,
              1e300, -1e300, math.nan, math.inf, "3", "never", "", b"x", [1], ["e"], ("e",), {},
              np.int64(2), np.float32(0.7), np.uint64(2**64 - 1), 1 + 2j]
GOOD = {  # valid values, edge ones included, so that combinations also run
    "max_new_tokens": [1, 3, np.int64(2)], "min_new_tokens": [0, 2], "do_sample": [True, np.bool_(False)],
    "temperature": [0.5, 1e-45, np.float32(2.0), 1000], "top_k": [0, 5], "top_p": [0.5, 1e-45, 1.0],
    "repetition_penalty": [1.2, 1e-3, 1000.0], "no_repeat_ngram_size": [0, 1, 2],
    "num_beams": [1, 2, 3], "length_penalty": [-1.0, 2.0, 0], "early_stopping": [True, "never"],
    "num_return_sequences": [1, 2], "stop": [["e"], "x"], "seed": [0, 2**64 - 1],
}


def test_generate_option_value_fuzz(text_model):
    rng = random.Random(1)
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(400):
        options = {name: rng.choice(GOOD[name] if rng.random() < 0.6 else VALUE_POOL)
                   for name in rng.sample(sorted(GOOD), 3)}
        options.setdefault("max_new_tokens", 3)
        if options["max_new_tokens"] is None or (isinstance(options["max_new_tokens"], int)
                                                 and options["max_new_tokens"] > 8):
            options["max_new_tokens"] = 3   # keep the runs that do work short
        try:
            result = text_model.generate(["a b c"], return_details=True, **options)
        except MinferError as e:
            assert "\n" not in str(e) and len(str(e)) < 400, str(e)
            outcomes["refused"] += 1
            continue
        for r in result[0]:   # what works is a real result: text, a finite score if any
            assert isinstance(r.text, str) and r.finish_reason in ("eos", "length", "stop")
            assert r.score is None or (math.isfinite(r.score) and r.score > -1e9)
        outcomes["ok"] += 1
    print("option-value fuzz", outcomes)
    assert all(v > 20 for v in outcomes.values()), outcomes


# -- the API: inputs of every shape ----------------------------------------------------------------
def random_input(rng, depth=0):
    """A random prompt-or-ids-shaped value: nested lists and tuples of ints, floats, bools,
    strings, NumPy scalars and arrays, huge and negative ids."""
    atoms = [lambda: rng.randrange(600), lambda: rng.choice([-1, 600, 2**63, 2**64, 10**400]),
             lambda: float(rng.randrange(10)), lambda: rng.choice([True, False]),
             lambda: rng.choice(["a b", "", " ", "\ud800", "date: 1999"]),
             lambda: np.int64(rng.randrange(600)), lambda: np.float32(1), lambda: None]
    if depth >= 3 or rng.random() < 0.3:
        return rng.choice(atoms)()
    if rng.random() < 0.1:
        return np.asarray(rng.choice([[[1, 2]], [1.5], [[True]], [[[1]]], [], [[2**63]]]))
    items = [random_input(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return items if rng.random() < 0.8 else tuple(items)


def test_generate_input_fuzz(text_model):
    rng = random.Random(2)
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(400):
        inputs = random_input(rng)
        try:
            text_model.generate(inputs, max_new_tokens=2)
        except MinferError as e:
            assert "\n" not in str(e) and len(str(e)) < 400, str(e)
            outcomes["refused"] += 1
            continue
        outcomes["ok"] += 1
    print("input fuzz", outcomes)
    assert all(v > 10 for v in outcomes.values()), outcomes


XL_BIN = __import__("pathlib").Path(__file__).resolve().parent.parent / "weights" / "transfo_xl" / "adaptive_div4_bin"


@pytest.mark.skipif(not (XL_BIN / "pytorch_model.bin").is_file(), reason="no XL .bin fixture")
@pytest.mark.parametrize("segment", [None, "0", "-3", "x", "1", "2", str(2**31), "9" * 30])
@pytest.mark.parametrize("text", [b"", b"\n \n", b"\x00\x01", b"a", b"the game .\n" * 3, b"\xff\n",
                                  "caf\u00e9 \u2028 .".encode()])
def test_score_fuzz(segment, text):
    args = ["--segment-len", segment] if segment is not None else []
    code, out, err = run_cli(["score", "-m", str(XL_BIN), "-", *args], stdin=text)
    assert_worked_or_one_line(code, out, err)
    if code == 0:
        assert "perplexity" in out


# -- non-finite values inside the model ----------------------------------------------------------------
@pytest.fixture(scope="module")
def overflowing_folder(tmp_path_factory):
    """A T5 whose first decoder self-attention's q and k are legal float32 weights so large that
    the attention scores overflow to inf."""
    from factories import write_t5
    from safetensors.numpy import load_file, save_file
    folder = write_t5(tmp_path_factory.mktemp("overflow") / "m", seed=1)
    tensors = load_file(str(folder / "model.safetensors"))
    for name in tensors:
        if name.startswith("decoder.block.0.layer.0.SelfAttention.") and name[-8:-7] in "qk":
            tensors[name] = tensors[name] * np.float32(1e20)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("how", [{}, {"stream": True}, {"num_beams": 2}, {"do_sample": True}])
def test_overflowing_scores_are_one_line_errors_in_every_search(overflowing_folder, kernel_mode, how):
    import warnings

    import minfer
    from minfer.errors import NonFiniteError
    m = minfer.load(overflowing_folder)
    # the model's own check catches the step's logits before any search sees them, naming the
    # layer: the overflow is in decoder layer 0's self-attention, so layer 1's cached keys are
    # the first that are not finite
    with warnings.catch_warnings(), pytest.raises(NonFiniteError,
                                                  match="logits .*beginning at decoder layer 0"):
        warnings.simplefilter("error")                    # and no NumPy warning on the way
        out = m.generate([[5, 6, 7, 1]], max_new_tokens=4, **how)
        list(out) if how.get("stream") else out


# -- concurrency: abandoned, collected and cancelled streams beside ordinary calls, bounded arena ------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_concurrency_fuzz_under_a_bounded_arena(text_model_folder, text_model, seed):
    import gc
    import threading

    import minfer
    prompts = ["a b c", "date: 1999", "x y", "spell: 1234", "hello world", "one two three"]
    want = {p: text_model.generate(p, max_new_tokens=6) for p in prompts}
    plan = text_model.plan(1, 12, 6)["peak"]
    weights = text_model.weight_plan.fixed + sum(text_model.weight_plan.unit_bytes.values())
    m = minfer.load(text_model_folder, memory_limit=weights + 4096 + 3 * plan, workspace=3 * plan)
    errors, streams = [], []
    lock = threading.Lock()

    def work(k):
        r = random.Random(seed * 100 + k)
        for _ in range(6):
            p = r.choice(prompts)
            action = r.choice(["generate", "stream", "abandon", "cycle", "cancel", "beam"])
            if action == "generate":
                got = m.generate(p, max_new_tokens=6)
                assert got == want[p], (p, got)
            elif action == "beam":
                m.generate(p, max_new_tokens=6, num_beams=2)
            elif action == "stream":
                assert "".join(m.generate(p, stream=True, max_new_tokens=6)) == want[p]
            else:
                s = m.generate(p, stream=True, max_new_tokens=6)
                next(s, None)
                if action == "cycle":          # only the cyclic GC will finalise it
                    holder = {"s": s}
                    holder["me"] = holder
                elif action == "cancel":
                    with lock:
                        streams.append(s)
                del s
            if r.random() < 0.3:
                gc.collect()
            if r.random() < 0.3:
                with lock:
                    if streams:
                        streams.pop().cancel()    # another thread's stream, from this one

    def wrap(k):
        try:
            work(k)
        except Exception as e:
            errors.append(e)
    threads = [threading.Thread(target=wrap, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "hung"
    assert not errors, errors[:2]
    for s in streams:
        s.close()
    streams.clear()
    gc.collect()
    assert m.backend.arena.used == m.backend.arena.capacity - m.free_when_idle
