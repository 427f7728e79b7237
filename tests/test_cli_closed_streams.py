"""A process started with stdout (or stderr) closed (`>&-`, not /dev/null: Python sets the stream
to None): a command that has something to print fails in one line naming stdout, one that has
nothing to print (bulk output to a file) works, and with stderr closed too the status alone says
it (issue 30, hostile pass)."""
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

WEIGHTS = Path(__file__).resolve().parent.parent / "weights"
DATES = WEIGHTS / "tiny-t5-dates"
ST = WEIGHTS / "family" / "st_prompts"


def closed(args, redirect=">&-", cwd=None):
    """(status, stdout, stderr) of `python -m minfer ARGS` run by bash with `redirect`."""
    line = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "minfer", *map(str, args)])
    proc = subprocess.run(["bash", "-c", f"{line} {redirect}"], capture_output=True, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=300, cwd=cwd)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("closed") / "in.txt"
    path.write_text("a b c\nx y\nhello world\n")
    return path


@pytest.mark.parametrize("args", [
    ["generate", "-m", DATES, "--max-new-tokens", "2", "x"],
    ["generate", "-m", DATES, "--max-new-tokens", "2", "--json", "x"],
    ["embed", "-m", ST, "x"],
    ["info", "-m", DATES],
    ["generate", "-m", DATES, "--max-new-tokens", "2", "-i", "PROMPTS"],
    ["embed", "-m", ST, "-i", "PROMPTS"],
    ["--version"],
    ["generate", "--help"],
    [],
], ids=lambda a: " ".join(str(x) for x in a if not isinstance(x, Path)) or "bare")
def test_a_closed_stdout_is_one_line(prompts, args):
    args = [prompts if a == "PROMPTS" else a for a in args]
    status, _, err = closed(args)
    assert status == 1 and err == "minfer: error: stdout is closed (nowhere to print the " \
                                  "output)\n", err
    # stderr closed too: nowhere to say it, the status alone (no traceback anywhere)
    status, out, _ = closed(args, ">&- 2>&-")
    assert status == 1 and out == ""


def test_nothing_to_print_needs_no_stdout(prompts, tmp_path):
    # bulk output to a file prints nothing on stdout: the run works, its file whole
    for command, model in (("generate", DATES), ("embed", ST)):
        out = tmp_path / f"{command}.jsonl"
        status, _, err = closed([command, "-m", model, "-i", prompts, "-o", out])
        assert status == 0 and err.startswith("minfer: 3 rows -> "), err
        assert len(out.read_text().splitlines()) == 3
        out.unlink()
        status, _, _ = closed([command, "-m", model, "-i", prompts, "-o", out], ">&- 2>&-")
        assert status == 0 and len(out.read_text().splitlines()) == 3


def test_a_closed_stderr_alone_keeps_the_output_and_the_status(prompts):
    status, out, _ = closed(["generate", "-m", DATES, "--max-new-tokens", "2", "x"], "2>&-")
    assert status == 0 and out.strip()
    status, out, _ = closed(["generate", "-m", DATES / "missing", "x"], "2>&-")
    assert status == 1 and out == ""
