"""The `minfer` command line, run as a user would: in a subprocess."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import T5_FIXTURES


def run(*args, stdin=None, tmp_path=None, timeout=120):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
    if tmp_path is not None:
        env["HF_HOME"] = str(tmp_path / "hf-home")
    return subprocess.run([sys.executable, "-m", "minfer", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=timeout)


def assert_one_line_error(proc, code, needle):
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minfer: error: "), proc.stderr
    assert needle in lines[0]
    assert "Traceback" not in proc.stderr


def test_generate_streams_the_api_text(text_model_folder, text_model):
    prompt = "date: March 5, 2021"
    proc = run("generate", "--model", str(text_model_folder), prompt, "--max-new-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == text_model.generate(prompt, max_new_tokens=12) + "\n"


def test_generate_reads_stdin_lines_and_prints_one_result_per_line(text_model_folder, text_model):
    prompts = ["a b c", "date: 1999", "one two three"]
    proc = run("generate", "-m", str(text_model_folder), "--no-stream", "--max-new-tokens", "6",
               stdin="\n".join(prompts) + "\n")
    assert proc.returncode == 0, proc.stderr
    expected = text_model.generate(prompts, max_new_tokens=6)
    assert proc.stdout.split("\n")[:-1] == expected


def test_generate_json(text_model_folder, text_model):
    proc = run("generate", "-m", str(text_model_folder), "--json", "--max-new-tokens", "5",
               "--num-beams", "2", "a b c", "x y")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["a b c", "x y"]
    for r in rows:
        assert r["token_ids"][0] == 0 and r["new_tokens"] == len(r["token_ids"]) - 1
        assert r["text"] == text_model.tokenizer.decode(r["token_ids"])
        assert r["finish_reason"] in ("eos", "length") and r["batch_seconds"] >= 0 and "score" in r


def test_sampling_options_are_reproducible(text_model_folder):
    args = ["generate", "-m", str(text_model_folder), "a b c", "--max-new-tokens", "10",
            "--temperature", "1.3", "--top-p", "0.9", "--seed", "4"]
    first, second = run(*args), run(*args)
    assert first.returncode == 0 and first.stdout == second.stdout


def test_info(text_model_folder):
    proc = run("info", "-m", str(text_model_folder), "--batch", "2", "--src-len", "64")
    assert proc.returncode == 0, proc.stderr
    assert "parameters" in proc.stdout and "60,608" in proc.stdout
    assert "batch 2 x 64" in proc.stdout and "tokenizer.json" in proc.stdout


def test_threads_option_reaches_the_model_and_bad_counts_are_refused(text_model_folder):
    proc = run("info", "-m", str(text_model_folder), "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[-1] for line in proc.stdout.splitlines()
            if line.startswith("cpu threads")] == ["1"]
    bad = run("generate", "-m", str(text_model_folder), "--threads", "0", "x")
    assert bad.returncode == 2 and "--threads" in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_convert_writes_every_dtype_load_offers(tmp_path, text_model_folder):
    # the CLI's choices are convert's own table (bfloat16 was missing from them)
    from minfer.convert import _CODES
    want = run("generate", "-m", str(text_model_folder), "--dtype", "bfloat16", "--no-stream",
               "hello", "--max-new-tokens", "5")
    assert want.returncode == 0, want.stderr
    for dtype in _CODES:
        out = tmp_path / dtype
        proc = run("convert", "-m", str(text_model_folder), "-o", str(out), "--dtype", dtype)
        assert proc.returncode == 0, (dtype, proc.stderr)
    got = run("generate", "-m", str(tmp_path / "bfloat16"), "--dtype", "auto", "--no-stream",
              "hello", "--max-new-tokens", "5")
    assert got.returncode == 0 and got.stdout == want.stdout


@pytest.mark.parametrize("command", [[], ["generate"], ["info"]])
def test_help_documents_defaults(command):
    proc = run(*command, "--help")
    assert proc.returncode == 0 and "Usage:" in proc.stdout
    if command == ["generate"]:
        for option in ("--max-new-tokens", "--temperature", "--top-k", "--top-p", "--num-beams",
                       "--seed", "--task", "--device", "--dtype", "--revision", "--no-stream",
                       "--json", "default: cpu"):
            assert option in proc.stdout


def test_bad_option_value(text_model_folder):
    assert_one_line_error(run("generate", "-m", str(text_model_folder), "x", "--top-p", "2"), 2,
                          "--top-p")
    assert_one_line_error(run("generate", "-m", str(text_model_folder), "x", "--device", "tpu"), 2,
                          "--device 'tpu'")
    assert_one_line_error(run("generate", "-m", str(text_model_folder), "x", "--task", "poetry"), 2,
                          "--task 'poetry'")
    assert_one_line_error(run("generate", "x"), 2, "--model")


def test_unknown_model_offline(tmp_path):
    assert_one_line_error(run("generate", "-m", "t5-small", "hello", tmp_path=tmp_path), 1,
                          "not in the local cache")
    assert_one_line_error(run("generate", "-m", "./no/such/folder", "hello"), 1, "no such folder")


def test_bad_checkpoint(tmp_path):
    import shutil
    folder = tmp_path / "broken"
    shutil.copytree(T5_FIXTURES / "v1_0_relu_tied", folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_one_line_error(run("info", "-m", str(folder)), 1, "model.safetensors")


def test_empty_input(text_model_folder):
    assert_one_line_error(run("generate", "-m", str(text_model_folder), stdin=""), 2, "no prompt")
    # blank lines are prompts (rows that fail), not nothing
    assert_one_line_error(run("generate", "-m", str(text_model_folder), stdin="\n\n"), 1,
                          "2 of 2 prompts failed (first: stdin: line 1: empty prompt")
    assert_one_line_error(run("generate", "-m", str(text_model_folder), "  "), 1, "empty prompt")


def test_model_without_tokenizer(tmp_path):
    assert_one_line_error(run("generate", "-m", str(T5_FIXTURES / "v1_0_relu_tied"), "hi"), 1,
                          "no tokenizer")


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "minfer"
    if not script.exists():
        pytest.skip("console script not next to this interpreter (not a venv install)")
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "generate" in proc.stdout


# -- Transformer-XL through the CLI (the .bin fixture carries a real HF vocab.pkl) -------------------
XL_BIN = T5_FIXTURES.parent / "transfo_xl" / "adaptive_div4_bin"
XL_TEXT = "the game began in the city .\nit was played by the team .\n"


@pytest.mark.skipif(not (XL_BIN / "pytorch_model.bin").is_file(), reason="no XL .bin fixture")
def test_score_prints_perplexity_matching_the_api(tmp_path):
    import minfer
    (tmp_path / "text.txt").write_text(XL_TEXT)
    proc = run("score", "-m", str(XL_BIN), str(tmp_path / "text.txt"), "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    want = minfer.load(XL_BIN).score(XL_TEXT)
    assert got["tokens"] == want["tokens"] > 10
    assert abs(got["perplexity"] - want["perplexity"]) < 1e-6 * want["perplexity"]
    plain = run("score", "-m", str(XL_BIN), "-", stdin=XL_TEXT)
    assert plain.returncode == 0 and "perplexity" in plain.stdout and "tokens/s" in plain.stdout


@pytest.mark.skipif(not (XL_BIN / "pytorch_model.bin").is_file(), reason="no XL .bin fixture")
def test_generate_and_convert_transfo_xl(tmp_path):
    proc = run("generate", "-m", str(XL_BIN), "the game", "--max-new-tokens", "6")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    out = tmp_path / "converted"
    proc = run("convert", "-m", str(XL_BIN), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").is_file() and (out / "vocab.txt").is_file()
    same = run("generate", "-m", str(out), "the game", "--max-new-tokens", "6")
    assert same.stdout == run("generate", "-m", str(XL_BIN), "the game", "--max-new-tokens", "6").stdout
    assert_one_line_error(run("score", "-m", str(T5_FIXTURES / "v1_0_relu_tied"), "-", stdin="x"), 1,
                          "Transformer-XL")


def test_malicious_checkpoint_is_refused(tmp_path):
    import pickle
    import zipfile
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "transfo-xl"}))
    with zipfile.ZipFile(folder / "pytorch_model.bin", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": Evil()}, protocol=2))
        z.writestr("archive/version", "3\n")
    assert_one_line_error(run("info", "-m", str(folder)), 1, "refuses to unpickle global")
    assert not marker.exists()


# -- the command line's own edges --------------------------------------------------------------------
from test_fuzz_inputs import run_cli  # noqa: E402  (in-process: generated families cost ~ms each)


def test_bare_minfer_prints_the_help_not_an_error_line():
    bare, helped = run(), run("--help")
    assert bare.returncode == 2 and bare.stderr == ""          # click's status for no command
    assert bare.stdout == helped.stdout and "Usage: minfer" in bare.stdout
    assert "Commands:" in bare.stdout and "generate" in bare.stdout


ESCAPES = {"a": "a", "\\n": "\n", "\\t": "\t", "\\\\": "\\", "é": "é"}


@pytest.mark.parametrize("pieces", [p for p in __import__("itertools").product(ESCAPES, repeat=3)])
def test_stop_reads_backslash_escapes(pieces):
    from minfer_cli.main import cli
    ctx = cli.commands["generate"].make_context("generate", ["-m", "x", "--stop", "".join(pieces)])
    assert ctx.params["stop"] == ("".join(ESCAPES[p] for p in pieces),)


@pytest.mark.parametrize("stop", ["\\x", "\\", "a\\", "\\0", "\\u000a", "\\N", "a\\rb", ""])
def test_stop_refuses_unknown_escapes_and_empty_strings(text_model_folder, stop):
    code, _, err = run_cli(["generate", "-m", str(text_model_folder), "a", "--stop", stop])
    assert code == 2 and err.startswith("minfer: error: Invalid value for '--stop'")
    assert len(err.strip().splitlines()) == 1


def test_stop_newline_reaches_the_model_as_a_newline(text_model_folder, monkeypatch):
    import minfer.models.base as base
    seen = {}
    real = base.Model.generate
    monkeypatch.setattr(base.Model, "generate",
                        lambda self, *a, **kw: (seen.update(kw), real(self, *a, **kw))[1])
    code, out, err = run_cli(["generate", "-m", str(text_model_folder), "a b", "--stop", "\\n",
                              "--stop", "x\\ty", "--max-new-tokens", "2"])
    assert code == 0 and seen["stop"] == ["\n", "x\ty"], err


# invalid UTF-8: each kind of bad sequence, at the start, inside a later line and at the end
BAD_UTF8 = [b"\xff", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80",
            b"\x80"]


def utf8_cases():
    for bad in BAD_UTF8:
        for before, after in ((b"", b" x\n"), (b"a b\nc d ", b" e\n"), ("date: é ".encode(), b"")):
            yield pytest.param(before + bad + after, len(before), id=f"{bad!r}@{len(before)}")


@pytest.mark.parametrize("data,offset", list(utf8_cases()))
def test_invalid_utf8_on_stdin_is_named_with_its_byte_offset(text_model_folder, data, offset):
    code, out, err = run_cli(["generate", "-m", str(text_model_folder)], stdin=data)
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"minfer: error: stdin: not valid UTF-8 at byte {offset} ")


@pytest.mark.skipif(not (XL_BIN / "pytorch_model.bin").is_file(), reason="no XL .bin fixture")
@pytest.mark.parametrize("data,offset", list(utf8_cases())[::3])
def test_invalid_utf8_in_a_score_file_is_named_with_its_byte_offset(tmp_path, data, offset):
    path = tmp_path / "text.txt"
    path.write_bytes(data)
    code, _, err = run_cli(["score", "-m", str(XL_BIN), str(path)])
    assert code == 1 and err.startswith(f"minfer: error: {path}: not valid UTF-8 at byte {offset} ")
    code, _, err = run_cli(["score", "-m", str(XL_BIN), "-"], stdin=data)
    assert code == 1 and err.startswith(f"minfer: error: stdin: not valid UTF-8 at byte {offset} ")


def test_invalid_utf8_as_a_real_process_sees_it(text_model_folder):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "minfer", "generate", "-m", str(text_model_folder)],
                          input=b"a b\n\xff c\n", capture_output=True, env=env, timeout=120)
    assert proc.returncode == 1 and b"Traceback" not in proc.stderr
    assert proc.stderr.decode() == "minfer: error: stdin: not valid UTF-8 at byte 4 (b'\\xff': invalid start byte)\n"


@pytest.mark.parametrize("args", [["--seed", "-1"], ["--seed", str(2**64)]])
def test_seed_range_is_checked_by_the_command_line(text_model_folder, args):
    code, _, err = run_cli(["generate", "-m", str(text_model_folder), "a", *args])
    assert code == 2 and "'--seed'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("mode", [[], ["--no-stream"], ["--json"]])
def test_a_reader_closing_the_pipe_ends_the_run_quietly(text_model_folder, mode):
    """`minfer generate ... | head -1`: the exit status is 0 and nothing is said on stderr."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "minfer", "generate", "-m", str(text_model_folder),
                             "--max-new-tokens", "8", *mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdin.write(b"a b c\nx y\n" * 300)   # far more output than one line
    proc.stdin.close()
    assert proc.stdout.readline()
    proc.stdout.close()                        # what `head -1` does after its line
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and err == b""


@pytest.mark.parametrize("bad", [b"\xff", b"\xc3(", b"\xed\xa0\x80"])
def test_a_prompt_argument_that_is_not_utf8_is_named(text_model_folder, bad):
    env = dict(os.environ, HF_HUB_OFFLINE="1", LC_ALL="C.UTF-8")
    proc = subprocess.run([sys.executable, "-m", "minfer", "generate", "-m", str(text_model_folder),
                           b"ok", b"a " + bad], capture_output=True, env=env, timeout=120)
    assert proc.returncode == 2 and b"Traceback" not in proc.stderr
    assert proc.stderr.startswith(b"minfer: error: PROMPT 2: not valid UTF-8 at character 2 ")


def test_no_stream_under_a_memory_limit_batches_what_fits(text_model_folder, text_model):
    """Every stdin line in one batch used to ask the arena for MBs under a 400 KB limit and print
    nothing; batches now follow the memory plan, and every prompt gets its line."""
    prompts = [f"date: {n} and {'more ' * (n % 7)}words" for n in range(120)]
    proc = run("generate", "-m", str(text_model_folder), "--no-stream", "--max-new-tokens", "6",
               "--memory-limit", "400KB", "--workspace", "200KB", stdin="\n".join(prompts) + "\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:-1] == text_model.generate(prompts, max_new_tokens=6)


# -- a full disk: every output names itself ---------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
DATES = ROOT / "weights" / "tiny-t5-dates"
EMBEDDER = ROOT / "weights" / "family" / "st_sentence_t5"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("args, name", [
    (["generate", "-m", str(DATES), "date: 4th of July 1976"], "stdout"),
    (["generate", "-m", str(DATES), "--no-stream", "date: 4th of July 1976"], "stdout"),
    (["generate", "-m", str(DATES), "--json", "date: 4th of July 1976"], "stdout"),
    (["generate", "-m", str(DATES), "-i", "{input}", "-o", "-"], "stdout"),
    (["generate", "-m", str(DATES), "-i", "{input}", "-o", "/dev/full"], "/dev/full"),
    (["info", "-m", str(DATES)], "stdout"),
    (["embed", "-m", str(EMBEDDER), "a sentence"], "stdout"),
    (["embed", "-m", str(EMBEDDER), "-i", "{input}", "-o", "/dev/full"], "/dev/full"),
])
def test_a_full_output_is_a_one_line_error_naming_it(tmp_path, args, name):
    source = tmp_path / "in.txt"
    source.write_text("date: 4th of July 1976\nspell: 12\n")
    args = [a.replace("{input}", str(source)) for a in args]
    env = dict(os.environ, HF_HUB_OFFLINE="1", NUMBA_NUM_THREADS="1")
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "minfer", *args], stdout=full,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert_one_line_error(proc, 1, f"{name}: cannot write: No space left on device")
