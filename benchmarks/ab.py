"""Interleaved A/B timing of minfer variants: robust on a machine whose speed drifts.

    python benchmarks/ab.py --model benchmarks/checkpoints/t5-small \\
        --variant before:path=/path/to/old/checkout --variant after \\
        [--variant numpy:env=MINFER_KERNELS=numpy] [--variant int8:dtype=int8] [--calls 30]

Each variant is a worker process (its own checkout on PYTHONPATH, its own environment, its own
load options) that loads the model once and then times one call per request: bench_t5.py's task
(batch 1, 32 source tokens, 64 forced new greedy tokens) or, with --task encode, one encoder pass.
The driver asks every worker in turn, alternating the order, so a neighbour that slows the
machine for a while slows every variant alike; the report gives each variant's median tokens/s
and the median of its per-round speed ratio to the first variant (the paired ratio), which is
what to quote. Separate runs of bench_t5.py on this shared machine drift by tens of percent.

A variant is NAME[:key=value,...] with keys path (a checkout to import minfer from), env
(VAR=VALUE, repeatable), threads, dtype, memory_limit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import bench_t5 as b5
import minfer
options = json.loads(sys.argv[3])
task = options.pop("task")
m = minfer.load(sys.argv[2], **options)
ids = b5.source_ids()
call = (lambda: m.encode([ids])) if task == "encode" else (
    lambda: m.generate([ids], max_new_tokens=b5.NEW_TOKENS, min_new_tokens=b5.NEW_TOKENS))
for _ in range(2):
    call()
print("ready", flush=True)
for _ in sys.stdin:
    t = time.perf_counter()
    call()
    print(time.perf_counter() - t, flush=True)
"""


def parse_variant(text: str) -> dict:
    name, _, rest = text.partition(":")
    v = {"name": name, "path": None, "env": {}, "load": {}}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key == "path":
            v["path"] = value
        elif key == "env":
            var, _, val = value.partition("=")
            v["env"][var] = val
        elif key in ("threads", "dtype", "memory_limit"):
            v["load"]["num_threads" if key == "threads" else key] = (
                int(value) if key == "threads" else value)
        else:
            raise SystemExit(f"variant {name}: unknown key {key!r}")
    return v


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--variant", action="append", required=True, type=parse_variant)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--threads", type=int, default=2, help="BLAS / OpenMP threads of every worker")
    p.add_argument("--task", choices=("decode", "encode"), default="decode")
    p.add_argument("--gap", type=float, default=0.3,
                   help="seconds between calls: the last worker's idle threads (BLAS spins for "
                        "~0.1 s after a call) must not slow the next")
    p.add_argument("--json")
    args = p.parse_args()
    workers = []
    for v in args.variant:
        env = {**os.environ, "OPENBLAS_NUM_THREADS": str(args.threads),
               "OMP_NUM_THREADS": str(args.threads), **v["env"]}
        if v["path"]:
            env["PYTHONPATH"] = v["path"]
        w = subprocess.Popen([sys.executable, "-c", WORKER, str(HERE), args.model,
                              json.dumps({**v["load"], "task": args.task})],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if w.stdout.readline().strip() != "ready":
            raise SystemExit(f"variant {v['name']}: the worker failed to start")
        workers.append(w)
    seconds = [[] for _ in workers]
    for i in range(args.calls):
        for j in (range(len(workers)) if i % 2 == 0 else reversed(range(len(workers)))):
            time.sleep(args.gap)
            workers[j].stdin.write("go\n")
            workers[j].stdin.flush()
            seconds[j].append(float(workers[j].stdout.readline()))
    for w in workers:
        w.stdin.close()
        w.wait()
    unit = 64 if args.task == "decode" else 1
    rows = []
    for v, s in zip(args.variant, seconds):
        paired = statistics.median(a / b for a, b in zip(seconds[0], s))
        rows.append({"variant": v["name"], "median": unit / statistics.median(s),
                     "min": unit / max(s), "max": unit / min(s), "paired_ratio": paired})
    label = "tokens/s" if args.task == "decode" else "encoder calls/s"
    print(f"| variant | {label} median (min-max) | paired ratio to {rows[0]['variant']} |")
    print("|---|---|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['median']:.1f} ({r['min']:.1f}-{r['max']:.1f}) | "
              f"{r['paired_ratio']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"calls": args.calls, "task": args.task,
                                               "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
