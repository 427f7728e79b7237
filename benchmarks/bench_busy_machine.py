"""Decoding speed when other processes share the cores: thread count and OpenMP spin settings.

    python benchmarks/bench_busy_machine.py [--shape t5-small] [--dtype float32] [--loads 0,1]
                                            [--rounds 2] [--runs 3]

For each load L in --loads, L busy processes (`while True: pass`) run beside the measurement;
with them running, every configuration below decodes in its own subprocess (the OpenMP settings
are read when libgomp loads, so they need a fresh process): 64 forced new tokens from a 32-token
source (bench_t5.py's task), batch 1 and batch 16, --runs timed calls after a warm-up; median
tokens/s. Configurations are interleaved over --rounds and the medians of the rounds printed.

Configurations: 2 threads with minfer's default (GOMP_SPINCOUNT=1000, set by the kernels module
unless the user set GOMP_SPINCOUNT or OMP_WAIT_POLICY), with libgomp's own default (300,000
spins), with OMP_WAIT_POLICY=passive (no spinning), and 1 thread.
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
sys.path.insert(0, str(HERE))
import bench_t5 as b5  # noqa: E402

CONFIGS = {  # name: (threads, environment added)
    "2 threads, minfer default (1,000 spins)": (2, {}),
    "2 threads, libgomp default (300,000 spins)": (2, {"GOMP_SPINCOUNT": "300000"}),
    "2 threads, OMP_WAIT_POLICY=passive": (2, {"OMP_WAIT_POLICY": "passive"}),
    "1 thread": (1, {}),
}
BATCHES = (1, 16)


def worker(folder: str, threads: int, dtype: str, runs: int) -> None:
    import minfer
    model = minfer.load(folder, num_threads=threads, dtype=dtype)
    ids = b5.source_ids()
    out = {}
    for batch in BATCHES:
        rows = [ids] * batch
        model.generate(rows, max_new_tokens=b5.NEW_TOKENS, min_new_tokens=b5.NEW_TOKENS)
        seconds = []
        for _ in range(runs):
            t = time.perf_counter()
            model.generate(rows, max_new_tokens=b5.NEW_TOKENS, min_new_tokens=b5.NEW_TOKENS)
            seconds.append(time.perf_counter() - t)
        out[batch] = b5.NEW_TOKENS * batch / statistics.median(seconds)
    print(json.dumps(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="t5-small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--loads", default="0,1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--worker", nargs=2, metavar=("FOLDER", "THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.dtype, args.runs)
        return 0
    folder = str(b5.ensure_checkpoint(args.shape))
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    results: dict[tuple[int, str], list[dict]] = {}
    for _ in range(args.rounds):
        for load in [int(x) for x in args.loads.split(",")]:
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(load)]
            try:
                for name, (threads, env) in CONFIGS.items():
                    done = subprocess.run(
                        [sys.executable, __file__, "--worker", folder, str(threads),
                         "--dtype", args.dtype, "--runs", str(args.runs)],
                        env={**clean, **env}, capture_output=True, text=True, check=True)
                    got = json.loads(done.stdout.strip().splitlines()[-1])
                    results.setdefault((load, name), []).append(got)
                    print(f"  load {load}  {name:44s} " + "  ".join(
                        f"b{b} {got[str(b)]:7.1f}" for b in BATCHES), file=sys.stderr)
            finally:
                for h in hogs:
                    h.kill()
    print(f"{args.shape} {args.dtype}: tokens/s, median of {args.rounds} rounds")
    print(f"{'busy processes':>14}  {'configuration':44s}" + "".join(f"{'batch ' + str(b):>10}"
                                                               for b in BATCHES))
    for (load, name), runs in sorted(results.items()):
        print(f"{load:>14}  {name:44s}" + "".join(
            f"{statistics.median(r[str(b)] for r in runs):10.1f}" for b in BATCHES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
