"""`minfer embed`, and the parts / subfolder options and `info`'s parts line, run as a user
would, in a subprocess, on the committed sentence-transformers and encoder fixtures."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


FAMILY = Path(__file__).resolve().parent.parent / "weights" / "family"
ST = FAMILY / "st_prompts"
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8", NUMBA_NUM_THREADS="1")
TEXTS = ["A quick brown fox jumps over the lazy dog.", "Hello world", "x", "one two three"]


def assert_one_line_error(run, pattern, code=1):
    """One line on stderr, matching the regex `pattern`, and the exit status."""
    lines = run.stderr.strip().splitlines()
    assert run.returncode == code and len(lines) == 1, run.stderr
    assert lines[0].startswith("minfer: error: ") and re.search(pattern, lines[0]), lines[0]


def close(got, want):
    """Equal up to float32 rounding: rows batched with other rows pad to other widths."""
    return got.shape == want.shape and np.abs(got - want).max() <= 1e-5


def minfer(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "minfer", *args], input=stdin,
                          capture_output=True, text=True, env=ENV, timeout=300)


@pytest.fixture(scope="module")
def expected():
    import minfer as mf
    m = mf.load(ST)
    return {"default": m.embed(TEXTS), "passage": m.embed(TEXTS, prompt_name="passage")}


def test_texts_as_arguments_print_json_lines(expected):
    run = minfer("embed", "-m", str(ST), *TEXTS[:2], "--prompt-name", "passage")
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["text"] for r in rows] == TEXTS[:2]
    assert close(np.array([r["embedding"] for r in rows], np.float32), expected["passage"][:2])


def test_bulk_jsonl_keeps_fields_and_order_and_reports_bad_rows(tmp_path, expected):
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(TEXTS)]
    lines.insert(2, '{"id": "bad", "text": 5}')
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    run = minfer("embed", "-m", str(ST), "-i", str(src), "-o", str(out))
    assert run.returncode == 1
    assert_one_line_error(run, r"1 of 5 rows failed.* field 'text' is a number, not a string")
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == [0, 1, "bad", 2, 3]
    assert recs[2]["embedding"] is None and "not a string" in recs[2]["error"]
    got = np.array([r["embedding"] for r in recs if r["id"] != "bad"], np.float32)
    assert close(got, expected["default"])


def test_bulk_npy_output_and_resume(tmp_path, expected):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "out.npy"
    run = minfer("embed", "-m", str(ST), "-i", str(src), "-o", str(out))
    assert run.returncode == 0, run.stderr
    assert close(np.load(out), expected["default"])
    # an interrupted run: two whole rows and half of a third; --resume keeps the two
    data = out.read_bytes()
    row = 4 * expected["default"].shape[1]
    out.write_bytes(data[:128 + 2 * row + row // 2])
    run = minfer("embed", "-m", str(ST), "-i", str(src), "-o", str(out), "--resume")
    assert run.returncode == 0, run.stderr
    assert "after the 2 already in" in run.stderr
    assert close(np.load(out), expected["default"])


def test_npy_rows_that_fail_are_nan(tmp_path, expected):
    src = tmp_path / "in.txt"
    src.write_bytes(b"Hello world\n\xff\xfe\nx\n")
    out = tmp_path / "out.npy"
    run = minfer("embed", "-m", str(ST), "-i", str(src), "-o", str(out))
    assert run.returncode == 1
    assert_one_line_error(run, r"1 of 3 rows failed.* NaN rows .* not valid UTF-8")
    got = np.load(out)
    assert np.isnan(got[1]).all() and close(got[[0, 2]], expected["default"][[1, 2]])


def test_resume_refuses_a_foreign_npy(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("a\n")
    np.save(tmp_path / "out.npy", np.zeros((2, 3), np.float32))
    run = minfer("embed", "-m", str(ST), "-i", str(src), "-o", str(tmp_path / "out.npy"), "--resume")
    assert_one_line_error(run, "not a \\(rows, 8\\) float32 file written by minfer embed")


def test_generate_on_an_encoder_only_folder_is_one_line():
    run = minfer("generate", "-m", str(FAMILY / "t5_encoder_sharded"), "hello")
    assert run.returncode == 1
    assert_one_line_error(run, "loaded as an encoder only .* not generate")


def parts_line(run) -> str:
    assert run.returncode == 0, run.stderr
    return next(line for line in run.stdout.splitlines() if line.startswith("parts")).split(None, 1)[1]


def test_info_names_the_parts():
    run = minfer("info", "-m", str(ST))
    assert parts_line(run) == "encoder, pooling" and "sentence embedding" in run.stdout
    assert parts_line(minfer("info", "-m", str(FAMILY / "umt5_seq2seq"))) == "encoder, decoder, head"
    assert parts_line(minfer("info", "-m", str(FAMILY / "umt5_seq2seq"), "--parts", "encoder")) \
        == "encoder"


def test_subfolder_options(tmp_path):
    import shutil
    repo = tmp_path / "repo"
    shutil.copytree(FAMILY / "t5_encoder_sharded", repo / "text_encoder_2")
    (repo / "tokenizer_2").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "spiece.model"):
        (repo / "text_encoder_2" / name).rename(repo / "tokenizer_2" / name)
    run = minfer("embed", "-m", str(repo), "--subfolder", "text_encoder_2", "hello")
    assert_one_line_error(run, "has no tokenizer")
    run = minfer("embed", "-m", str(repo), "--subfolder", "text_encoder_2",
                 "--tokenizer-subfolder", "tokenizer_2", "hello")
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout)["embedding"]) == 16
    run = minfer("embed", "-m", str(repo), "--subfolder", "../x", "hello")
    assert_one_line_error(run, "--subfolder='../x': expected a folder inside", code=2)
