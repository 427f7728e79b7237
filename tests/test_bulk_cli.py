"""Bulk mode of `minfer generate` (--input / --output), and --json / --no-stream over many lines:
run as a user would, in a subprocess."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli import assert_one_line_error

DATES = Path(__file__).resolve().parent.parent / "weights" / "tiny-t5-dates"
# prompts of different lengths, so that length sorting reorders them inside a window
PROMPTS = ["a b c", "date: 1999 and more words here", "x", "one two three four five six seven",
           "hello world", "spell: 1234", "date: March 5, 2021 was a Friday", "y z"]

# the CLI in a child that reports its peak resident memory (VmHWM) to a file when it exits
HWM_WRAPPER = """
import atexit, os, sys
def report():
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM"))
    with open(os.environ["HWM_FILE"], "w") as out:
        out.write(hwm.split()[1])
atexit.register(report)
from minfer_cli.main import main
main(sys.argv[1:])
"""


# These runs check reading, order, records and memory, not threading: one kernel thread keeps
# them fast where the machine's cores are shared (two threads that each wait on the other spin;
# measured 20x slower on a busy 2-core machine).
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8", NUMBA_NUM_THREADS="1")


def bulk(folder, *args, stdin=None):
    return subprocess.run([sys.executable, "-m", "minfer", "generate", "-m", str(folder), *args],
                          input=stdin, capture_output=True, text=True, env=ENV, timeout=300)


def records(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def peak_rss_kib(folder, tmp_path, *args):
    hwm = tmp_path / "hwm"
    env = dict(ENV, HWM_FILE=str(hwm))
    proc = subprocess.run([sys.executable, "-c", HWM_WRAPPER, "generate", "-m", str(folder), *args],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return int(hwm.read_text())


@pytest.fixture(scope="module")
def expected(text_model):
    """What the API gives each of PROMPTS, one at a time, at 1 and 3 new tokens."""
    return {n: [text_model.generate(p, max_new_tokens=n) for p in PROMPTS] for n in (1, 3)}


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc (Linux)")
def test_twenty_thousand_lines_in_input_order_with_flat_memory(text_model_folder, tmp_path, expected):
    small, big = tmp_path / "2k.txt", tmp_path / "20k.txt"
    small.write_text("".join(PROMPTS[i % 8] + "\n" for i in range(1_024)))
    big.write_text("".join(PROMPTS[i % 8] + "\n" for i in range(20_000)))
    args = ["--max-new-tokens", "1", "--batch-size", "64", "--output"]
    rss_small = peak_rss_kib(text_model_folder, tmp_path, "--input", str(small), *args, tmp_path / "a")
    rss_big = peak_rss_kib(text_model_folder, tmp_path, "--input", str(big), *args, tmp_path / "b")
    out = records(tmp_path / "b")
    assert len(out) == 20_000
    assert all(r["text"] == expected[1][i % 8] and r["new_tokens"] == 1 for i, r in enumerate(out))
    assert all(r["finish_reason"] in ("eos", "length") and r["prompt_tokens"] > 0 for r in out)
    # 10x the rows, the same memory: rows are read, decoded and written a window at a time
    assert rss_big - rss_small < 20 * 1024, (rss_small, rss_big)


def test_resume_continues_after_the_complete_records(text_model_folder, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("".join(PROMPTS[i % 8] + "\n" for i in range(300)))
    full = tmp_path / "full.jsonl"
    proc = bulk(text_model_folder, "--input", str(source), "--output", str(full),
                "--max-new-tokens", "3")
    assert proc.returncode == 0 and "300 rows" in proc.stderr, proc.stderr
    lines = full.read_bytes().splitlines(keepends=True)
    part = tmp_path / "part.jsonl"
    part.write_bytes(b"".join(lines[:120]) + lines[120][:17])   # killed while writing row 121
    proc = bulk(text_model_folder, "--input", str(source), "--output", str(part),
                "--max-new-tokens", "3", "--resume")
    assert proc.returncode == 0, proc.stderr
    assert "after the 120 already in" in proc.stderr and "incomplete record" in proc.stderr
    assert part.read_bytes() == full.read_bytes()
    proc = bulk(text_model_folder, "--input", str(source), "--output", str(part),
                "--max-new-tokens", "3", "--resume")   # nothing left to do
    assert proc.returncode == 0 and "0 rows after the 300" in proc.stderr, proc.stderr
    assert part.read_bytes() == full.read_bytes()


def test_resume_refuses_a_stray_line_and_a_longer_output_leaving_them_as_they_were(
        text_model_folder, tmp_path):
    # a stray line another process appended used to be cut off with every record after it;
    # an output longer than the input reported success
    source = tmp_path / "in.txt"
    source.write_text("".join(PROMPTS[i % 8] + "\n" for i in range(12)))
    full = tmp_path / "full.jsonl"
    assert bulk(text_model_folder, "--input", str(source), "--output", str(full),
                "--max-new-tokens", "2").returncode == 0
    lines = full.read_bytes().splitlines(keepends=True)
    part = tmp_path / "part.jsonl"
    stray = b"".join(lines[:5]) + b'{"note": "appended by something else"}\n' + lines[5]
    part.write_bytes(stray)
    proc = bulk(text_model_folder, "--input", str(source), "--output", str(part),
                "--max-new-tokens", "2", "--resume")
    assert_one_line_error(proc, 1, f"{part} line 6 does not answer {source} line 6 (it is not a "
                                   "record minfer writes)")
    assert part.read_bytes() == stray
    longer = tmp_path / "longer.jsonl"
    longer.write_bytes(b"".join(lines) + b"".join(lines[:3]))      # 15 records, 12 lines
    proc = bulk(text_model_folder, "--input", str(source), "--output", str(longer),
                "--max-new-tokens", "2", "--resume")
    assert_one_line_error(proc, 1, "holds 15 lines but")
    assert "has only 12:" in proc.stderr
    assert longer.read_bytes() == b"".join(lines) + b"".join(lines[:3])


def test_bad_text_rows_become_error_records_and_the_run_goes_on(text_model_folder, tmp_path,
                                                                 expected):
    source = tmp_path / "in.txt"
    long = " ".join(["word"] * 30)
    source.write_bytes(b"a b c\n\n   \n" + long.encode() + b"\nx \xff y\nhello world\r\n")
    out = tmp_path / "out.jsonl"
    proc = bulk(text_model_folder, "--input", str(source), "--output", str(out),
                "--max-new-tokens", "3", "--max-input-tokens", "12")
    assert_one_line_error(proc, 1, f"4 of 6 rows failed, each written with an 'error' field to {out}")
    got = records(out)
    assert [r.get("error") is None for r in got] == [True, False, False, False, False, True]
    assert got[0]["text"] == expected[3][0] and got[5]["text"] == expected[3][4]
    assert "line 2: empty prompt" in got[1]["error"] and "line 3: empty prompt" in got[2]["error"]
    assert "line 4: " in got[3]["error"] and "more than --max-input-tokens 12" in got[3]["error"]
    assert "(--truncate cuts it)" in got[3]["error"]      # the flag, not the Python option
    at = source.read_bytes().index(b"\xff")                     # counted in the whole file
    assert f"line 5: not valid UTF-8 at byte {at} (b'\\xff'" in got[4]["error"]
    assert all(r["finish_reason"] == "error" and r["text"] is None for r in got[1:5])
    proc = bulk(text_model_folder, "--input", str(source), "--output", str(out),
                "--max-new-tokens", "3", "--max-input-tokens", "12", "--truncate")
    assert proc.returncode == 1 and "3 of 6 rows failed" in proc.stderr   # the long one is cut
    assert records(out)[3]["prompt_tokens"] == 12


def test_json_lines_copy_fields_and_bad_objects_are_rows(text_model_folder, tmp_path, expected):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([
        json.dumps({"id": 1, "text": PROMPTS[0], "meta": {"k": [1, 2]}}),
        '{"id": 2, "text": ',
        json.dumps([PROMPTS[1]]),
        json.dumps({"id": 4}),
        json.dumps({"id": 5, "text": 7}),
        "",
        json.dumps({"id": 7, "text": PROMPTS[2], "finish_reason": "theirs"}),
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    proc = bulk(text_model_folder, "--input", str(source), "--output", str(out),
                "--max-new-tokens", "3")
    assert_one_line_error(proc, 1, "5 of 7 rows failed")
    got = records(out)
    assert got[0] == {"id": 1, "meta": {"k": [1, 2]}, "prompt": PROMPTS[0], "text": expected[3][0],
                      "finish_reason": got[0]["finish_reason"], "prompt_tokens": got[0]["prompt_tokens"],
                      "new_tokens": got[0]["new_tokens"]}
    assert "line 2: not valid JSON" in got[1]["error"]
    assert "line 3: expected a JSON object, got an array" in got[2]["error"]
    assert got[3]["id"] == 4 and "line 4: no 'text' field" in got[3]["error"]
    assert got[4]["id"] == 5 and "field 'text' is a number" in got[4]["error"]
    assert "line 6: empty line" in got[5]["error"]
    # each record names the prompt it answers (null for a row that has none)
    assert [r["prompt"] for r in got] == [PROMPTS[0], None, None, None, None, None, PROMPTS[2]]
    assert got[6]["id"] == 7 and got[6]["text"] == expected[3][2] and got[6]["finish_reason"] != "theirs"
    # another field, from stdin to stdout
    lines = "".join(json.dumps({"prompt": p, "n": i}) + "\n" for i, p in enumerate(PROMPTS))
    proc = bulk(text_model_folder, "--input", "-", "--input-field", "prompt", "--max-new-tokens", "3",
                stdin=lines)
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["n"], r["text"]) for r in got] == list(enumerate(expected[3]))
    assert [r["prompt"] for r in got] == PROMPTS[:len(got)]


def test_shipped_model_answers_every_row_in_input_order(tmp_path):
    rows = [json.loads(line) for line in (DATES / "heldout.jsonl").read_text().splitlines()][:200]
    source = tmp_path / "heldout.jsonl"
    source.write_text("".join(json.dumps({"target": r["target"], "text": r["prompt"]}) + "\n"
                              for r in rows))
    proc = bulk(DATES, "--input", str(source), "--batch-size", "8", "--output", "-")
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["text"] for r in got] == [r["target"] for r in got] == [r["target"] for r in rows]


def test_json_and_no_stream_over_stdin_batch_in_input_order(text_model_folder, text_model, expected):
    lines = [PROMPTS[i % 8] for i in range(100)]
    long = " ".join(["word"] * 30)
    stdin = "\n".join(lines[:50] + ["", long] + lines[50:]) + "\n"
    proc = bulk(text_model_folder, "--json", "--max-new-tokens", "3", "--batch-size", "4",
                "--max-input-tokens", "20", stdin=stdin)
    assert_one_line_error(proc, 1, "2 of 102 prompts failed (first: stdin: line 51: empty prompt")
    got = [json.loads(line) for line in proc.stdout.splitlines()]
    assert got[50] == {"prompt": "", "error": "stdin: line 51: empty prompt (nothing but whitespace)"}
    assert got[51]["prompt"] == long and "more than --max-input-tokens 20" in got[51]["error"]
    del got[50:52]
    assert [r["prompt"] for r in got] == lines
    assert [r["text"] for r in got] == [expected[3][i % 8] for i in range(100)]
    proc = bulk(text_model_folder, "--no-stream", "--max-new-tokens", "3", "--batch-size", "3",
                stdin="\n".join(lines) + "\n")
    assert proc.returncode == 0 and proc.stdout.split("\n")[:-1] == [expected[3][i % 8] for i in range(100)]


@pytest.mark.parametrize("args,needle", [
    (["--output", "x.jsonl", "a"], "--output needs --input"),
    (["--resume", "a"], "--resume needs --input"),
    (["--input", "-", "--resume"], "--resume needs --output PATH"),
    (["--input", "IN", "a"], "either as PROMPT arguments or with --input"),
    (["--input", "IN", "--output", "IN"], "is the input file"),
    (["--input", "missing.txt"], "--input missing.txt: no such file"),
    (["--input", "IN", "--input-field", "q", "--input-format", "text"], "--input-field applies to"),
    (["--input", "IN", "--truncate"], "--truncate needs --max-input-tokens"),
])
def test_bulk_command_line_mistakes_are_one_line_usage_errors(text_model_folder, tmp_path, args, needle):
    source = tmp_path / "in.txt"
    source.write_text("a b\n")
    args = [str(source) if a == "IN" else a for a in args]
    proc = subprocess.run([sys.executable, "-m", "minfer", "generate", "-m", str(text_model_folder),
                           *args], input="a b\n", capture_output=True, text=True, cwd=tmp_path,
                          env=ENV, timeout=120)
    assert_one_line_error(proc, 2, needle)


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_progress_bar_only_on_a_terminal(text_model_folder, tmp_path):
    import fcntl
    import pty
    import struct
    import termios
    source = tmp_path / "in.txt"
    source.write_text("".join(p + "\n" for p in PROMPTS * 4))
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # tqdm needs a width
    proc = subprocess.Popen([sys.executable, "-m", "minfer", "generate", "-m", str(text_model_folder),
                             "--input", str(source), "--output", str(tmp_path / "o.jsonl"),
                             "--max-new-tokens", "2"], stderr=child, stdout=subprocess.DEVNULL,
                            env=ENV)
    os.close(child)
    seen = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:   # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(timeout=120) == 0
    os.close(main)
    assert b"prompt/s" in seen and b"tokens/s" in seen and b"32/32" in seen, seen
    proc = bulk(text_model_folder, "--input", str(source), "--output", str(tmp_path / "o.jsonl"),
                "--max-new-tokens", "2")   # not a terminal: the summary line only
    assert proc.returncode == 0 and proc.stderr.startswith("minfer: 32 rows -> ")
    assert proc.stderr.count("\n") == 1 and "prompt/s" not in proc.stderr
