"""Structured output's cost per token against a t5-small-shaped decode step (issue 29: < 10%).

    python benchmarks/bench_structured.py [--tokenizer /work/shared/t5-tokenizer] [--rows 1,8]
                                          [--rounds 3] [--threads 2]

The model: random weights in t5-small's exact shape (32128-row vocabulary), written once into
benchmarks/checkpoints/t5-small-structured/ (gitignored) with tests/factories.py; its tokenizer
is T5's real one (the 32k vocabulary is what the mask costs) with "{" and "}" added as ids
32100 and 32101, as a JSON fine-tune of T5 adds them (T5's own vocabulary cannot write them).

Two measures, interleaved over --rounds, per row count (sampled rows of one prompt):
- the grammar's own work per token and row: the allowed-token mask (llguidance's bitmask,
  unpacked to the model's ids), applying it to the scores and consuming the chosen token,
  timed around those calls alone during real structured generations;
- a decode step: a plain generation of 64 forced tokens (min_new_tokens = max_new_tokens)
  minus a 1-token one (the encoder), divided by 63.
The ratio of the two is the overhead. The machine may be shared: the script prints the load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

T5_SMALL = dict(vocab_size=32128, d_model=512, d_kv=64, num_heads=8, d_ff=2048, num_layers=6,
                num_decoder_layers=6, relative_attention_num_buckets=32,
                relative_attention_max_distance=128, feed_forward_proj="relu",
                tie_word_embeddings=True)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "colour": {"enum": ["red", "green", "blue"]},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "zip": {"type": "integer", "minimum": 1000, "maximum": 99999}},
        "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "colour", "address"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


def ensure_model(tokenizer: Path) -> Path:
    folder = HERE / "checkpoints" / "t5-small-structured"
    if not (folder / "model.safetensors").is_file():
        from factories import write_t5
        print(f"writing a random t5-small-shaped checkpoint to {folder} ...", flush=True)
        write_t5(folder, **T5_SMALL)
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    spec = json.loads((tokenizer / "tokenizer.json").read_text())
    for k, text in enumerate("{}"):
        spec["added_tokens"].append({"id": 32100 + k, "content": text, "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False,
                                     "special": False})
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def grammar_cost(model, rows: int, seed: int) -> tuple[float, int]:
    """Seconds of grammar work per token and row, and the tokens, in one structured call."""
    from minfer.generation import structured
    spent = [0.0, 0]
    real_allowed, real_advance = structured.RowGrammars.allowed, structured.RowGrammars.advance

    def allowed(self, *a, **k):
        t = time.perf_counter()
        out = real_allowed(self, *a, **k)
        spent[0] += time.perf_counter() - t
        return out

    def advance(self, tokens, step):
        t = time.perf_counter()
        real_advance(self, tokens, step)
        spent[0] += time.perf_counter() - t
        spent[1] += len(tokens)
    structured.RowGrammars.allowed, structured.RowGrammars.advance = allowed, advance
    try:
        import numpy as np
        scores = np.zeros((rows, 32128), np.float32)
        ok = np.ones((rows, 32128), bool)
        model.generate("a person", response_format=FORMAT, do_sample=True, seed=seed,
                       num_return_sequences=rows, max_new_tokens=128)
        t = time.perf_counter()   # the mask's application: one np.where over the rows' scores
        for _ in range(20):
            np.where(ok, scores, np.float32(-np.inf))
        apply = (time.perf_counter() - t) / 20
    finally:
        structured.RowGrammars.allowed, structured.RowGrammars.advance = real_allowed, real_advance
    steps = spent[1] / rows
    return (spent[0] + apply * steps) / max(spent[1], 1), spent[1]


def step_time(model, rows: int) -> float:
    def call(n):
        t = time.perf_counter()
        model.generate("a person", do_sample=True, seed=0, num_return_sequences=rows,
                       max_new_tokens=n, min_new_tokens=n)
        return time.perf_counter() - t
    return (call(64) - call(1)) / 63


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", type=Path, default=Path("/work/shared/t5-tokenizer"))
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not (args.tokenizer / "tokenizer.json").is_file():
        print(f"no T5 tokenizer at {args.tokenizer}: nothing to measure", file=sys.stderr)
        return 1
    import minfer
    model = minfer.load(str(ensure_model(args.tokenizer)), num_threads=args.threads)
    model.generate("warm up", response_format=FORMAT, max_new_tokens=8)
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for rows in map(int, args.rows.split(",")):
        grammar, step = [], []
        for r in range(args.rounds):
            cost, _ = grammar_cost(model, rows, seed=r)
            grammar.append(cost)
            step.append(step_time(model, rows) / rows)
        g, s = statistics.median(grammar), statistics.median(step)
        print(f"rows {rows}: grammar {g * 1e6:.0f} us per token and row, decode step "
              f"{s * 1e6:.0f} us per row: overhead {100 * g / s:.1f}%")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
