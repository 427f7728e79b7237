"""Many threads sharing one model: throughput against one thread sending the same prompts in turn.

    python benchmarks/bench_concurrency.py [--shape t5-small] [--prompts 32] [--threads 1,2,4,8]
                                           [--new-tokens 32] [--dtype float32] [--rounds 3]

Each of --prompts random 32-token sources (bench_t5.py's kind) is one `model.generate` call of
--new-tokens forced new tokens. With 1 thread the calls run in turn; with N threads, N workers
take prompts from a shared queue, so up to N requests decode at the same time and the model's
batcher takes their steps together (generation/batcher.py). Reported per thread count: prompts/s,
new tokens/s, and the ratio to one thread, measured in the same process and interleaved over
--rounds (the machine's speed drifts); every thread count's ids are checked equal to one
thread's.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_t5 as b5  # noqa: E402


def run(model, sources, n_threads: int, new: int) -> tuple[float, list]:
    todo: queue.Queue = queue.Queue()
    for i, s in enumerate(sources):
        todo.put((i, s))
    out = [None] * len(sources)

    def worker():
        while True:
            try:
                i, s = todo.get_nowait()
            except queue.Empty:
                return
            out[i] = model.generate([s], max_new_tokens=new, min_new_tokens=new)[0]
    threads = [threading.Thread(target=worker) for _ in range(n_threads)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="t5-small", choices=b5.SHAPES)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default=None)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    import numpy as np

    import minfer
    model = minfer.load(b5.ensure_checkpoint(args.shape), dtype=args.dtype)
    rng = np.random.default_rng(0)
    sources = [list(rng.integers(2, 32000, 32)) + [1] for _ in range(args.prompts)]
    counts = [int(n) for n in args.threads.split(",")]
    run(model, sources[:2], 1, 4)                       # warm-up (compile, caches)
    seconds = {n: [] for n in counts}
    reference = None
    for r in range(args.rounds):
        for n in (counts if r % 2 == 0 else counts[::-1]):
            s, out = run(model, sources, n, args.new_tokens)
            seconds[n].append(s)
            if n == 1:
                reference = out
            elif reference is not None and out != reference:
                print(f"WARNING: {n} threads gave other ids than 1 thread")
    base = statistics.median(seconds[counts[0]])
    print(f"{args.shape} {args.dtype or 'float32'}, {args.prompts} prompts x {args.new_tokens} "
          f"new tokens, median of {args.rounds} rounds\n")
    print("| threads | prompts/s | new tokens/s | vs 1 thread |")
    print("|---:|---:|---:|---:|")
    for n in counts:
        s = statistics.median(seconds[n])
        print(f"| {n} | {args.prompts / s:.2f} | {args.prompts * args.new_tokens / s:.1f} | "
              f"{base / s:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
