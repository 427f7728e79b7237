"""`minfer encode` run as a user would, in a subprocess: prompts -> one safetensors file, bulk
input -> a folder of parts with --resume, one-line errors."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from factories import write_t5
from safetensors import safe_open
from safetensors.numpy import load_file

import minfer

ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8", NUMBA_NUM_THREADS="1")
PROMPTS = ["a cat sat on the mat", "hi", "one two three four five six seven eight nine ten"]


def run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "minfer", "encode", *args], input=stdin,
                          capture_output=True, text=True, env=ENV, timeout=300)


def one_line_error(done, pattern, code=1):
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code and len(lines) == 1, done.stderr
    assert re.search(pattern, lines[0]), lines[0]


@pytest.fixture(scope="module")
def folder(text_model_folder):   # (conftest's: the session's small T5 with the tiny tokenizer)
    return text_model_folder


@pytest.fixture(scope="module")
def model(folder):
    return minfer.load(folder)


def test_prompts_to_one_file_with_a_preset(folder, model, tmp_path):
    out = tmp_path / "x.safetensors"
    done = run("-m", str(folder), "--preset", "chroma", "--max-length", "12", *PROMPTS, "-o", str(out))
    assert done.returncode == 0, done.stderr
    got = load_file(str(out))
    states, mask = model.encode(PROMPTS, preset="chroma", max_length=12, return_mask=True)
    assert sorted(got) == sorted([f"states.{i}" for i in range(3)] + [f"mask.{i}" for i in range(3)])
    for i in range(3):
        np.testing.assert_allclose(got[f"states.{i}"], states[i], rtol=0, atol=1e-5)
        np.testing.assert_array_equal(got[f"mask.{i}"], mask[i])
    with safe_open(str(out), "np") as f:
        assert f.metadata()["preset"] == "chroma" and f.metadata()["max_length"] == "12"


def test_without_a_preset_each_prompt_keeps_its_own_tokens(folder, model, tmp_path):
    out = tmp_path / "y.safetensors"
    done = run("-m", str(folder), "-o", str(out), stdin="\n".join(PROMPTS) + "\n")
    assert done.returncode == 0, done.stderr
    got = load_file(str(out))
    for i, text in enumerate(PROMPTS):
        n = len(model.tokenizer.encode(text))
        assert got[f"states.{i}"].shape == (n, 32) and got[f"mask.{i}"].tolist() == [1] * n
        np.testing.assert_allclose(got[f"states.{i}"], model.encode(text)[0], rtol=0, atol=1e-5)


def test_bulk_parts_and_resume(folder, model, tmp_path):
    lines = [json.dumps({"text": f"prompt number {i} " + "word " * (i % 5), "id": i})
             for i in range(70)]
    lines[3] = json.dumps({"id": 3})                    # a row without its prompt
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines[:66]) + "\n")
    out = tmp_path / "parts"
    done = run("-m", str(folder), "--preset", "sd3", "--max-length", "8", "-i", str(src), "-o", str(out))
    one_line_error(done, r"1 of 66 rows failed .*line 4: no 'text' field")
    assert sorted(os.listdir(out)) == ["part-00000.safetensors", "part-00001.safetensors"]
    src.write_text("\n".join(lines) + "\n")             # more rows: resume after the parts
    refused = run("-m", str(folder), "--preset", "sd3", "--max-length", "8", "-i", str(src), "-o", str(out))
    one_line_error(refused, r"already holds parts", 2)
    done = run("-m", str(folder), "--preset", "sd3", "--max-length", "8", "-i", str(src), "-o",
               str(out), "--resume")
    assert done.returncode == 0 and "4 rows after the 66 already there" in done.stderr, done.stderr
    got = {}
    for name in sorted(os.listdir(out)):
        got.update(load_file(str(out / name)))
    assert len(got) == 2 * 69 and "states.3" not in got
    texts = [json.loads(line).get("text") for line in lines]
    want = model.encode([t for t in texts if t], preset="sd3", max_length=8)
    rows = [i for i, t in enumerate(texts) if t]
    for k, i in zip(range(len(rows)), rows):
        np.testing.assert_allclose(got[f"states.{i}"], want[k], rtol=0, atol=1e-5)
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(reversed(lines)) + "\n")
    refused = run("-m", str(folder), "--preset", "sd3", "-i", str(other), "-o", str(out), "--resume")
    one_line_error(refused, r"does not answer .*other.jsonl line 1")


def test_errors_are_one_line(folder, tmp_path):
    one_line_error(run("-m", str(folder), "x", "-o", str(tmp_path / "x.npy")), r"name a \.safetensors", 2)
    one_line_error(run("-m", str(folder), "x", "--resume", "-o", str(tmp_path / "x.safetensors")),
                   r"--resume needs --input", 2)
    one_line_error(run("-m", str(folder), "--preset", "dalle", "x", "-o", str(tmp_path / "x.safetensors")),
                   r"dalle", 2)
    bare = write_t5(tmp_path / "bare")
    one_line_error(run("-m", str(bare), "x", "-o", str(tmp_path / "z.safetensors")),
                   r"has no tokenizer: give --tokenizer")
    assert not (tmp_path / "z.safetensors").exists()
