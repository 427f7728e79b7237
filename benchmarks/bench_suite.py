"""The whole CPU comparison in one command: minfer vs HF transformers vs CTranslate2.

    python benchmarks/bench_suite.py [--shapes t5-small,t5-base] [--runs 5] [--threads 2]
                                     [--tasks decode,batch16,encoder,beam4] [--no-xl]
                                     [--json OUT] [--markdown OUT]

Tasks (float32 unless the engine says int8; random weights, see bench_t5.py):
  decode   batch 1, 32 source tokens, 64 forced new tokens, greedy      (new tokens / s)
  batch16  16 sources of 32 tokens, 64 forced new tokens each, greedy   (new tokens / s, all rows)
  encoder  16 x 128 source tokens through the encoder only              (source tokens / s)
  beam4    batch 1, beam search with 4 beams, 64 forced new tokens     (new tokens / s)
  xl       Transformer-XL scoring from bench_transfo_xl.py              (tokens / s)

Engines: minfer, minfer-int8, transformers (torch CPU, inference mode), ctranslate2-fp32,
ctranslate2-int8. CTranslate2 has no encoder-only call for T5 models, so its encoder row runs
`translate_batch` with one decoding step (encoder + 1 step: slightly pessimistic for it) and is
marked so. Every engine runs in its own subprocess with OMP/OPENBLAS/MKL threads set before
imports; one warm-up, then --runs timed calls; median, min, max. Greedy and beam ids are checked
against transformers' (the first mismatch is reported; int8 engines are expected to drift).
Checkpoints and CTranslate2 conversions are made on first use by bench_t5.py's helpers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_t5 as b5  # noqa: E402

TASKS = ("decode", "batch16", "encoder", "beam4")
ENGINES = ("minfer", "minfer-int8", "transformers", "ctranslate2-fp32", "ctranslate2-int8")
NEW = 64
RESULT_MARK = "SUITE_RESULT "


def sources(task: str) -> list[list[int]]:
    """The task's token-id sources (fixed seeds; eos last)."""
    rows, length = {"decode": (1, 32), "beam4": (1, 32), "batch16": (16, 32),
                    "encoder": (16, 128)}[task]
    rng = random.Random(b5.INPUT_SEED + rows * 1000 + length)
    return [[rng.randrange(2, 32000) for _ in range(length - 1)] + [b5.EOS_ID] for _ in range(rows)]


def work_units(task: str) -> int:
    """What one call produces: new tokens (generation) or source tokens (encoder)."""
    srcs = sources(task)
    return len(srcs) * (sum(map(len, srcs)) // len(srcs) if task == "encoder" else NEW)


# =================================================================================================
# Workers (in a subprocess)
# =================================================================================================
def timed(call, runs: int):
    out = call()
    seconds = []
    for _ in range(runs):
        t0 = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t0)
    return out, seconds


def work_minfer(model_dir: Path, task: str, runs: int, threads: int, int8: bool) -> dict:
    import minfer
    model = minfer.load(model_dir, dtype="int8" if int8 else None)
    srcs = sources(task)
    if task == "encoder":
        out, seconds = timed(lambda: model.encode(srcs), runs)
        return {"seconds": seconds, "checksum": float(abs(out).sum())}
    beams = 4 if task == "beam4" else 1

    def call():
        rows = model.generate(srcs, max_new_tokens=NEW, min_new_tokens=NEW, num_beams=beams,
                              early_stopping=True)
        return [[int(t) for t in r[1:]] for r in rows]
    out, seconds = timed(call, runs)
    return {"seconds": seconds, "ids": out}


def work_transformers(model_dir: Path, task: str, runs: int, threads: int, int8: bool) -> dict:
    import torch
    import transformers
    from transformers import T5ForConditionalGeneration
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    model = T5ForConditionalGeneration.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    srcs = sources(task)
    ids = torch.tensor(srcs, dtype=torch.long)  # equal lengths: no padding needed
    if task == "encoder":
        def enc():
            with torch.inference_mode():
                return model.encoder(input_ids=ids).last_hidden_state
        out, seconds = timed(enc, runs)
        return {"seconds": seconds, "checksum": float(out.abs().sum())}
    beams = 4 if task == "beam4" else 1

    def call():
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 num_beams=beams, early_stopping=True)
        return [[int(t) for t in r[1:]] for r in out]
    out, seconds = timed(call, runs)
    return {"seconds": seconds, "ids": out}


def work_ctranslate2(model_dir: Path, task: str, runs: int, threads: int, int8: bool) -> dict:
    import ctranslate2
    vocab = b5.read_ct2_vocabulary(model_dir)
    token_to_id = {t: i for i, t in enumerate(vocab)}
    translator = ctranslate2.Translator(str(model_dir), device="cpu", inter_threads=1,
                                        intra_threads=threads)
    srcs = [[vocab[i] for i in row] for row in sources(task)]
    steps = 1 if task == "encoder" else NEW
    beams = 4 if task == "beam4" else 1

    def call():
        res = translator.translate_batch(srcs, beam_size=beams, max_decoding_length=steps,
                                         min_decoding_length=steps, max_batch_size=0)
        return [[token_to_id[t] for t in r.hypotheses[0]] for r in res]
    out, seconds = timed(call, runs)
    return {"seconds": seconds, "ids": None if task == "encoder" else out,
            "compute_type": translator.compute_type,
            **({"note": "encoder + 1 decoding step"} if task == "encoder" else {})}


def worker(args) -> int:
    fn = {"minfer": work_minfer, "minfer-int8": work_minfer, "transformers": work_transformers,
          "ctranslate2-fp32": work_ctranslate2, "ctranslate2-int8": work_ctranslate2}[args.engine]
    result = fn(Path(args.model), args.task, args.runs, args.threads, args.engine.endswith("int8"))
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


# =================================================================================================
# Driver
# =================================================================================================
def run_engine(engine: str, folder: Path, task: str, runs: int, threads: int) -> dict:
    env = {**os.environ, **b5.thread_env(threads)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--engine", engine,
           "--model", str(folder), "--task", task, "--runs", str(runs), "--threads", str(threads)]
    busy = b5.background_load(0.5)
    print(f"  {task:<8} {engine:<17}" + (f" (others busy {busy:.0%})" if busy and busy > 0.1 else ""),
          flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"worker failed: {tail[:200]}"}
    r = json.loads(lines[-1][len(RESULT_MARK):])
    speeds = [work_units(task) / s for s in r["seconds"]]
    r.update(median=statistics.median(speeds), min=min(speeds), max=max(speeds), busy_before=busy)
    return r


def first_mismatch(ref: list[list[int]], got: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(ref, got))
    if same == len(ref):
        return "ids equal"
    for row, (a, b) in enumerate(zip(ref, got)):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"{same}/{len(ref)} rows equal; row {row} differs at token {i}"
    return f"{same}/{len(ref)} rows equal"


def engine_folders(shape: str, engines: list[str], tokenizer: Path) -> dict[str, Path]:
    model_dir = b5.ensure_checkpoint(shape)
    folders = {}
    for e in engines:
        if not e.startswith("ctranslate2"):
            folders[e] = model_dir
        elif b5.have_ctranslate2() and all((tokenizer / f).is_file() for f in b5.TOKENIZER_FILES):
            folders[e] = b5.ensure_ct2(model_dir, e.rsplit("-", 1)[1].replace("fp32", "float32"),
                                       tokenizer)
    return folders


def run_xl(runs: int, threads: int) -> dict | None:
    out = HERE / "checkpoints" / "suite-xl.json"
    cmd = [sys.executable, str(HERE / "bench_transfo_xl.py"), "--runs", str(runs),
           "--threads", str(threads), "--json", str(out)]
    print("  xl       minfer, transformers (bench_transfo_xl.py)", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if not out.is_file():
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(out.read_text())


def xl_rows(report: dict) -> list[tuple]:
    rows = []
    try:
        res = report["results"]
        for engine in ("minfer", "transformers"):
            s = res[engine]["score"]["tokens_per_s"]
            rows.append(("xl scoring", engine, s["median"], s["min"], s["max"]))
    except (KeyError, TypeError):
        pass
    return rows


def table(results: dict, xl: dict | None) -> list[str]:
    lines = ["| shape | task | engine | median | min | max | unit | minfer / engine | ids vs transformers |",
             "|---|---|---|---:|---:|---:|---|---:|---|"]
    for shape, tasks in results.items():
        for task, engines in tasks.items():
            unit = "src tok/s" if task == "encoder" else "new tok/s"
            base = engines.get("minfer", {}).get("median")
            ref = engines.get("transformers", {}).get("ids")
            for engine, r in engines.items():
                if "error" in r:
                    lines.append(f"| {shape} | {task} | {engine} | {r['error']} | | | | | |")
                    continue
                ratio = "" if engine == "minfer" or not base else f"{base / r['median']:.2f}"
                if engine == "minfer-int8":
                    int8_peer = engines.get("ctranslate2-int8", {}).get("median")
                    ratio = f"{r['median'] / int8_peer:.2f} vs ct2-int8" if int8_peer else ""
                check = ("" if engine == "transformers" or ref is None or r.get("ids") is None
                         else first_mismatch(ref, r["ids"]))
                name = engine + (" (enc+1 step)" if r.get("note") else "")
                lines.append(f"| {shape} | {task} | {name} | {r['median']:.1f} | {r['min']:.1f} | "
                             f"{r['max']:.1f} | {unit} | {ratio} | {check} |")
    if xl is not None:
        rows = xl_rows(xl)
        base = rows[0][2] if rows else None
        for task, engine, med, lo, hi in rows:
            ratio = "" if engine == "minfer" else f"{base / med:.2f}"
            lines.append(f"| transfo-xl-4l | scoring | {engine} | {med:.1f} | {lo:.1f} | {hi:.1f} | "
                         f"tok/s | {ratio} | |")
        if not rows:
            lines.append(f"| transfo-xl-4l | scoring | - | {xl.get('error', 'no result')} | | | | | |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="t5-small,t5-base")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-xl", action="store_true")
    p.add_argument("--tokenizer", type=Path, default=b5.DEFAULT_TOKENIZER)
    p.add_argument("--json")
    p.add_argument("--markdown")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--task", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    engines = [e for e in args.engines.split(",") if e]
    results: dict = {}
    for shape in [s for s in args.shapes.split(",") if s]:
        print(f"{shape}:", flush=True)
        folders = engine_folders(shape, engines, args.tokenizer)
        results[shape] = {}
        for task in [t for t in args.tasks.split(",") if t]:
            results[shape][task] = {e: run_engine(e, f, task, args.runs, args.threads)
                                    for e, f in folders.items()}
    xl = None if args.no_xl else run_xl(args.runs, args.threads)
    machine = b5.machine_info()
    head = (f"Machine: {machine['cpu']}, {machine['cores']} cores, Python {machine['python']}, "
            f"minfer at {machine['git_commit'][:7]}{' (modified)' if machine['minfer_modified'] else ''}; "
            f"{args.threads} threads, median of {args.runs} runs after 1 warm-up.")
    lines = [head, ""] + table(results, xl)
    print("\n" + "\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "results": results, "xl": xl},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
