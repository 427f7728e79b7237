"""The trained checkpoints shipped in weights/ do what their EVAL.md says, through minfer only.

weights/tiny-t5-dates (made by weights/train_tiny_t5.py): `date: ...` -> ISO date, `spell: N` ->
English words; a sample of its held-out set must come out exactly right, through the Python API
and through the CLI, and the README quickstart must print 1976-07-04.
weights/tiny-xl-recall (weights/train_tiny_xl.py): a key stated 2-3 segments before the question
is recalled when the memory is carried across segments, and not when it is reset.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import minfer

WEIGHTS = Path(__file__).resolve().parent.parent / "weights"
T5_DIR = WEIGHTS / "tiny-t5-dates"
XL_DIR = WEIGHTS / "tiny-xl-recall"
QUICKSTART = ("date: 4th of July 1976", "1976-07-04")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minfer", *args], capture_output=True, text=True,
                          timeout=120)


# =====================================================================================================
# T5
# =====================================================================================================
@pytest.fixture(scope="module")
def t5():
    return minfer.load(T5_DIR)


@pytest.fixture(scope="module")
def t5_heldout() -> list[dict]:
    return read_jsonl(T5_DIR / "heldout.jsonl")


def test_t5_folder_is_self_contained_and_recorded():
    names = {p.name for p in T5_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "spiece.model", "tokenizer_config.json", "special_tokens_map.json", "heldout.jsonl",
            "eval.json", "EVAL.md"} <= names
    assert json.loads((T5_DIR / "generation_config.json").read_text())["max_new_tokens"] == 24
    ev = json.loads((T5_DIR / "eval.json").read_text())
    n = sum(ev["heldout_examples"].values())
    assert ev["hf_equals_minfer"] == n
    for task in ("date", "spell"):
        assert ev["hf_accuracy"][task] >= 0.95 and ev["minfer_accuracy"][task] >= 0.95


def test_t5_heldout_sample_is_exactly_right(t5, t5_heldout):
    sample = t5_heldout[::20]                     # 20 dates (every surface form) and 20 numbers
    assert {r["task"] for r in sample} == {"date", "spell"} and len(sample) == 40
    got = t5.generate([r["prompt"] for r in sample])
    wrong = [(r["prompt"], r["target"], g) for r, g in zip(sample, got) if g != r["target"]]
    assert not wrong


def test_t5_quickstart_is_held_out_and_right(t5, t5_heldout):
    # the README's example date never occurred in training, in any surface form
    assert {"task": "date", "prompt": QUICKSTART[0], "target": QUICKSTART[1]} in t5_heldout
    assert t5.generate(QUICKSTART[0]) == QUICKSTART[1]
    assert "".join(t5.generate(QUICKSTART[0], stream=True)) == QUICKSTART[1]


def test_t5_cli_prints_the_answers(t5_heldout):
    rows = [{"prompt": QUICKSTART[0], "target": QUICKSTART[1]}] + t5_heldout[7::97]
    proc = run_cli("generate", "--model", str(T5_DIR), *[r["prompt"] for r in rows])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [r["target"] for r in rows]


# =====================================================================================================
# Transformer-XL
# =====================================================================================================
@pytest.fixture(scope="module")
def xl():
    return minfer.load(XL_DIR)


@pytest.fixture(scope="module")
def xl_heldout(xl) -> list[dict]:
    rows = read_jsonl(XL_DIR / "heldout.jsonl")[:160]
    for r in rows:
        r["ids"] = xl.tokenizer.encode(r["text"], add_eos=False)
    return rows


def recall(xl, rows: list[dict], reset: bool) -> float:
    """Feed each sequence segment by segment up to its ASK; the share of rows whose argmax at ASK
    is the key. With reset, the memory is emptied just before the ASK's segment."""
    return float(np.mean([p == r["answer"] for p, r in zip(predictions(xl, rows, reset), rows)]))


def predictions(xl, rows: list[dict], reset: bool = False) -> list[str]:
    """Each row's argmax token at its ASK position (see `recall`), in the rows' order."""
    S = xl.config.tgt_len
    got = {}
    for seg in sorted({r["ask_position"] // S for r in rows}):
        group = [r for r in rows if r["ask_position"] // S == seg]
        ids = np.array([r["ids"][:(seg + 1) * S] for r in group])     # (B, (seg + 1) * S)
        memory = xl.new_memory(len(group))
        try:
            for k in range(seg + 1):
                if reset and k == seg:
                    memory.reset()
                log_probs, memory = xl.forward(ids[:, k * S:(k + 1) * S], memory)  # (B, S, V)
        finally:
            memory.release()
        pred = log_probs[np.arange(len(group)), [r["ask_position"] % S for r in group]].argmax(-1)
        got.update({id(r): xl.tokenizer.id_to_token(int(p)) for p, r in zip(pred, group)})
    return [got[id(r)] for r in rows]


def test_xl_checkpoint_and_vocab(xl, xl_heldout):
    assert xl.config.tgt_len == 16 and xl.config.mem_len >= 48
    assert xl.tokenizer.id_to_token(0) == "<eos>"
    r = xl_heldout[0]
    # the key sits 2-3 segments before the question: out of the question's segment
    key_at = r["text"].split().index("KEY") + 1
    assert r["ask_position"] // 16 - key_at // 16 >= 2
    assert xl.tokenizer.decode(r["ids"]) == r["text"]
    ev = json.loads((XL_DIR / "eval.json").read_text())
    assert ev["minfer_recall_with_memory"] >= 0.9 and ev["minfer_recall_memory_reset"] <= 0.2


def test_xl_recall_needs_the_memory(xl, xl_heldout):
    assert recall(xl, xl_heldout, reset=False) >= 0.9
    assert recall(xl, xl_heldout, reset=True) <= 0.2       # chance is 1/16


def test_xl_generate_answers_through_ids_and_text(xl, xl_heldout):
    rows = xl_heldout[:8]
    for r in rows:
        prompt = r["ids"][:r["ask_position"] + 1]
        assert xl.generate([prompt], max_new_tokens=1) == [[xl.tokenizer.token_to_id(r["answer"])]]
    r = rows[0]
    prompt = " ".join(r["text"].split()[:r["ask_position"] + 1])
    assert xl.generate(prompt).strip() == r["answer"]        # generation_config: max_new_tokens 1
    proc = run_cli("generate", "--model", str(XL_DIR), prompt)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == r["answer"]


# =====================================================================================================
# Compressed weight formats keep every held-out answer
# =====================================================================================================
@pytest.mark.parametrize("dtype", ["int8", "float16", "bfloat16"])
def test_t5_compressed_formats_give_float32s_output_on_every_heldout_prompt(t5, dtype):
    prompts = [r["prompt"] for r in read_jsonl(T5_DIR / "heldout.jsonl")]
    assert len(prompts) == 800
    m = minfer.load(T5_DIR, dtype=dtype)
    assert m.backend.weight_format == dtype
    got, want = m.generate(prompts), t5.generate(prompts)
    assert [p for p, g, w in zip(prompts, got, want) if g != w] == []


@pytest.mark.parametrize("dtype", ["int8", "float16", "bfloat16"])
def test_xl_compressed_formats_predict_float32s_keys_on_every_heldout_row(xl, dtype):
    rows = read_jsonl(XL_DIR / "heldout.jsonl")
    for r in rows:
        r["ids"] = xl.tokenizer.encode(r["text"], add_eos=False)
    m = minfer.load(XL_DIR, dtype=dtype)
    assert m.backend.weight_format == dtype
    assert predictions(m, rows) == predictions(xl, rows)
