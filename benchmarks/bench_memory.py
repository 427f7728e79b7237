"""Peak memory and speed of minfer under a memory limit: t5-base-shaped, float32 and int8.

    python benchmarks/bench_memory.py [--shape t5-base] [--runs 3] [--threads 2] [--json OUT]

For each dtype (float32, int8) and each limit (none, 50% and 25% of the float32 weight bytes) a
fresh subprocess loads the model (random weights, written by bench_t5.py's helper on first use)
and greedily decodes bench_t5's task (batch 1, 32 source tokens, 64 forced new tokens): one
warm-up, then --runs timed calls. Reported: peak RSS (VmHWM; ru_maxrss would carry the parent's
peak across exec), RSS after imports, load time, tokens/s, resident/streamed layers, and whether
the ids equal the unlimited run of the same dtype (int8: also how many of 64 match float32).
A limit the planner refuses is reported with its message.
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

MARK = "MEMORY_RESULT "


def status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def worker(args) -> int:
    import minfer
    before = status("VmRSS")
    ids = b5.source_ids()
    t0 = time.perf_counter()
    try:
        model = minfer.load(args.model, dtype=args.dtype,
                            memory_limit=int(args.limit) if args.limit != "none" else None)
    except minfer.MinferError as e:
        print(MARK + json.dumps({"refused": str(e)}), flush=True)
        return 0
    load_s = time.perf_counter() - t0

    def call():
        return [int(t) for t in model.generate([ids], max_new_tokens=b5.NEW_TOKENS,
                                               min_new_tokens=b5.NEW_TOKENS)[0][1:]]
    out = call()
    seconds = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t0)
    plan = model.weight_plan
    print(MARK + json.dumps({
        "rss_after_imports": before, "peak_rss": status("VmHWM"), "load_s": load_s,
        "tok_s": [b5.NEW_TOKENS / s for s in seconds], "ids": out,
        "resident": len(plan.resident), "streamed": len(plan.streamed),
        "weights_bytes": sum(plan.unit_bytes.values()) + plan.fixed,
        "arena_peak": model.backend.arena.stats().peak}), flush=True)
    return 0


def run(model_dir: Path, dtype: str, limit, runs: int, threads: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", str(model_dir),
           "--dtype", dtype, "--limit", str(limit), "--runs", str(runs)]
    proc = subprocess.run(cmd, env={**os.environ, **b5.thread_env(threads)}, capture_output=True,
                          text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(MARK)]
    if not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(lines[-1][len(MARK):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="t5-base", choices=b5.SHAPES)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--limit", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    model_dir = b5.ensure_checkpoint(args.shape)
    f32_bytes = (model_dir / "model.safetensors").stat().st_size
    rows, ref = [], {}
    for dtype in ("float32", "int8"):
        for label, share in (("none", None), ("50%", 0.5), ("25%", 0.25)):
            limit = "none" if share is None else int(f32_bytes * share)
            print(f"{dtype:<8} limit {label:<5} ...", flush=True)
            r = run(model_dir, dtype, limit, args.runs, args.threads)
            r.update(dtype=dtype, limit=label, limit_bytes=None if share is None else limit)
            if "ids" in r:
                ref.setdefault(dtype, r["ids"])
                r["ids_equal_unlimited"] = r["ids"] == ref[dtype]
                if "float32" in ref:
                    r["match_float32"] = sum(a == b for a, b in zip(r["ids"], ref["float32"]))
            rows.append(r)
    mib = 2 ** 20
    print(f"\n{args.shape} (random weights, float32 file {f32_bytes / mib:.0f} MiB), batch 1, "
          f"32 -> 64 tokens greedy, {args.threads} threads, median of {args.runs} runs\n")
    print("| dtype | limit | peak RSS | RSS after imports | load s | tok/s (median, min-max) | "
          "resident / streamed layers | ids |")
    print("|---|---|---:|---:|---:|---|---|---|")
    for r in rows:
        limit = r["limit"] + (f" ({r['limit_bytes'] / mib:.0f} MiB)" if r["limit_bytes"] else "")
        if "refused" in r or "error" in r:
            print(f"| {r['dtype']} | {limit} | refused: {r.get('refused', r.get('error'))} |||||")
            continue
        speeds = r["tok_s"]
        ids = "equal to unlimited" if r["ids_equal_unlimited"] else "DIFFER from unlimited"
        if r["dtype"] == "int8":
            ids += f"; {r['match_float32']}/64 = float32"
        print(f"| {r['dtype']} | {limit} | {r['peak_rss'] / mib:.0f} MiB | "
              f"{r['rss_after_imports'] / mib:.0f} MiB | {r['load_s']:.1f} | "
              f"{statistics.median(speeds):.1f} ({min(speeds):.1f}-{max(speeds):.1f}) | "
              f"{r['resident']} / {r['streamed']} | {ids} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": b5.machine_info(), "rows": rows},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
