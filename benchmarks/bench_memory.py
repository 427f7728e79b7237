"""Peak memory and speed of minfer under a memory limit: t5-base-shaped, float32 and int8; a
flan-t5-xl-shaped model (2.85B parameters) in int8 under 2 GiB; a flan-t5-xxl-shaped one (11.3B)
in int4 under 4 GiB (issue 21: BMInf's headline, 4.4 tokens/s for an 11B model on a GTX 1060).

    python benchmarks/bench_memory.py [--shape t5-base] [--runs 3] [--threads 2] [--json OUT]
    python benchmarks/bench_memory.py --large [--limit 2GiB] [--runs 3]
    python benchmarks/bench_memory.py --large xxl-int4 --limit 4GiB [--compute int8] [--runs 3]
    python benchmarks/bench_memory.py --large xxl-int4 --layers 2 --limit 700MiB --runs 1   # smoke

For each dtype (float32, int8) and each limit (none, 50% and 25% of the float32 weight bytes) a
fresh subprocess loads the model (random weights, written by bench_t5.py's helper on first use)
and greedily decodes bench_t5's task (batch 1, 32 source tokens, 64 forced new tokens): one
warm-up, then --runs timed calls. Reported: peak RSS (VmHWM; ru_maxrss would carry the parent's
peak across exec), RSS after imports, load time, tokens/s, resident/streamed layers, and whether
the ids equal the unlimited run of the same dtype (int8: also how many of 64 match float32).
A limit the planner refuses is reported with its message.

`--large` (`--large xl-int8`) writes (once, into benchmarks/checkpoints/flan-t5-xl-int8/,
gitignored) a checkpoint with flan-t5-xl's exact config whose weights are random int8 with
per-row scales, as `minfer convert --dtype int8` stores them (2.85B parameters in 2.9 GB; float32
would be 11.4 GB), and runs it int8 without a limit and under `--limit`: peak RSS, tokens/s, ids
equal. `--large xxl-int4` does the same with flan-t5-xxl's config in int4 as `minfer convert
--dtype int4` stores it (11.3B parameters in 5.7 GB; written a tensor at a time, so writing
needs no more memory than its largest tensor), run with `--compute` (default int8: the int8 x
int8 products); its targets: peak RSS <= limit + 150 MiB, ids equal to the unlimited int4 run,
>= 5 new tokens/s. `--layers N` keeps N encoder and N decoder layers (a quick check of the
path on a small file).
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
XXL_TARGETS = {"over_limit_mib": 150, "tok_s": 5.0}
# google/flan-t5-xl's config.json, minus what minfer does not read
FLAN_T5_XL = {"model_type": "t5", "d_model": 2048, "d_kv": 64, "num_heads": 32, "d_ff": 5120,
              "num_layers": 24, "num_decoder_layers": 24, "vocab_size": 32128,
              "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
              "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
              "layer_norm_epsilon": 1e-6, "pad_token_id": 0, "eos_token_id": 1,
              "decoder_start_token_id": 0}


# google/flan-t5-xxl's: 11.3B parameters
FLAN_T5_XXL = {**FLAN_T5_XL, "d_model": 4096, "num_heads": 64, "d_ff": 10240}


def new_checkpoint(name: str, config: dict):
    """(folder, its T5 weight table) of a benchmark checkpoint to write, its config.json written;
    (folder, None) when its weights are there already."""
    from minfer.models.t5.config import T5Config
    from minfer.models.t5.weights import weight_table
    folder = b5.CHECKPOINTS / name
    if (folder / "model.safetensors").is_file():
        return folder, None
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder, weight_table(T5Config.from_hf(config))


def write_xxl_int4_checkpoint(layers: int | None) -> Path:
    """flan-t5-xxl-shaped random int4 weights (each output about a unit-variance input's gain),
    written once as `minfer convert --dtype int4` stores them, a tensor at a time."""
    import numpy as np

    from minfer.convert import _header
    from minfer.io.tensors import STORAGE
    from minfer.io.formats import FORMATS, SCALE_SUFFIX
    config = dict(FLAN_T5_XXL)
    if layers:
        config.update(num_layers=layers, num_decoder_layers=layers)
    folder, table = new_checkpoint("flan-t5-xxl-int4" + (f"-{layers}l" if layers else ""), config)
    if table is None:
        return folder
    matrices = table.linear_sources()
    fmt = FORMATS["int4"]
    code_of = {dt: code for code, dt in STORAGE.items()}
    plan = []                                   # (name, code, shape, what to write)
    for name, shape in table.tensors.items():
        if name in matrices:
            for key, (stored, dtype) in fmt.stored(name, shape).items():
                plan.append((key, code_of[np.dtype(dtype)], stored, name))
        else:
            plan.append((name, "F32", shape, None))
    rng = np.random.default_rng(0)
    print(f"writing {folder} ...", flush=True)
    path = folder / "model.safetensors"
    with open(path.with_suffix(".partial"), "wb") as f:
        f.write(_header([(n, c, s) for n, c, s, _ in plan], {"format": "pt",
                                                           "minfer.quantisation": fmt.quantisation}))
        for key, code, shape, matrix in plan:
            if matrix is not None and key.endswith(SCALE_SUFFIX):
                gain = 0.05 if matrix in ("shared.weight", "lm_head.weight") else 1.0
                K = table.tensors[matrix][1]   # nibbles uniform in 0..15: q has std 4.6
                data = np.full(shape, gain / (4.6 * K ** 0.5), np.float32)
            elif matrix is not None:
                data = rng.integers(0, 256, shape, dtype=np.uint8)
            elif key.endswith("layer_norm.weight"):
                data = np.ones(shape, np.float32)
            else:
                data = rng.standard_normal(shape).astype(np.float32)
            f.write(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    path.with_suffix(".partial").rename(path)
    return folder


def write_large_checkpoint() -> Path:
    """flan-t5-xl-shaped random int8 weights (per-row scales giving each output a unit-variance
    input's gain of about 1), written once; other tensors float32."""
    import numpy as np
    from safetensors.numpy import save_file

    from minfer.io.formats import SCALE_SUFFIX
    folder, table = new_checkpoint("flan-t5-xl-int8", FLAN_T5_XL)
    if table is None:
        return folder
    matrices = table.linear_sources()
    rng = np.random.default_rng(0)
    tensors = {}
    print(f"writing {folder} ...", flush=True)
    for name, shape in table.tensors.items():
        if name in matrices:
            tensors[name] = rng.integers(-127, 128, shape, dtype=np.int8)
            gain = 0.05 if name in ("shared.weight", "lm_head.weight") else 1.0
            tensors[name + SCALE_SUFFIX] = np.full(shape[0], gain / (73 * shape[1] ** 0.5),
                                                   np.float32)  # 73 ~ std of uniform int8
        elif name.endswith("layer_norm.weight"):
            tensors[name] = np.ones(shape, np.float32)
        else:
            tensors[name] = rng.standard_normal(shape).astype(np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


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
        model = minfer.load(args.model, dtype=args.dtype, compute=args.compute,
                            memory_limit=args.limit if args.limit != "none" else None)
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
    # a random model may repeat one token, so the ids alone are a weak check: the logits of
    # the first 16 decoder positions (teacher-forced with the ids) must be equal bit for bit
    import hashlib

    import numpy as np
    logits = np.ascontiguousarray(model.forward([ids], [[0] + out[:15]]), dtype=np.float32)
    plan = model.weight_plan
    print(MARK + json.dumps({
        "rss_after_imports": before, "peak_rss": status("VmHWM"), "load_s": load_s,
        "tok_s": [b5.NEW_TOKENS / s for s in seconds], "ids": out,
        "logits_sha256": hashlib.sha256(logits.tobytes()).hexdigest(),
        "resident": len(plan.resident), "streamed": len(plan.streamed),
        "weights_bytes": sum(plan.unit_bytes.values()) + plan.fixed,
        "arena_peak": model.backend.arena.stats().peak}), flush=True)
    return 0


def run(model_dir: Path, dtype: str, limit, runs: int, threads: int,
        compute: str | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", str(model_dir),
           "--dtype", dtype, "--limit", str(limit), "--runs", str(runs)]
    if compute:
        cmd += ["--compute", compute]
    proc = subprocess.run(cmd, env={**os.environ, **b5.thread_env(threads)}, capture_output=True,
                          text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(MARK)]
    if not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(lines[-1][len(MARK):])


def large(args) -> int:
    from minfer.arena import parse_bytes
    xxl = args.large == "xxl-int4"
    folder = write_xxl_int4_checkpoint(args.layers) if xxl else write_large_checkpoint()
    dtype, compute = ("int4", args.compute) if xxl else ("int8", None)
    mib = 2 ** 20
    limit = parse_bytes(args.limit)
    rows = {}
    for label, lim in (("none", "none"), (args.limit, str(limit))):
        print(f"{dtype} limit {label} ...", flush=True)
        rows[label] = run(folder, dtype, lim, args.runs, args.threads, compute)
    shape = folder.name.replace("-int4", "").replace("-int8", "")
    print(f"\n{shape}-shaped {dtype}{' x int8' if compute == 'int8' else ''} "
          f"({(folder / 'model.safetensors').stat().st_size / mib:.0f} MiB file), batch 1, "
          f"32 -> 64 tokens greedy, {args.threads} threads\n")
    print("| limit | peak RSS | over the limit | RSS after imports | load s | tok/s (median) | "
          "resident / streamed layers | ids | logits (16 positions) | distinct ids |")
    print("|---|---:|---:|---:|---:|---:|---|---|---|---:|")
    for label, r in rows.items():
        if "refused" in r or "error" in r:
            print(f"| {label} | refused: {r.get('refused', r.get('error'))} |||||||||")
            continue
        over = (f"{(r['peak_rss'] - limit) / mib:+.0f} MiB" if label != "none" else "")
        same = r["ids"] == rows["none"].get("ids")
        same_logits = r["logits_sha256"] == rows["none"].get("logits_sha256")
        peak, imports, load, layers = measured_cells(r)
        print(f"| {label} | {peak} | {over} | {imports} | {load} | "
              f"{statistics.median(r['tok_s']):.2f} | {layers} | "
              f"{'equal to unlimited' if same else 'DIFFER'} | "
              f"{'equal to unlimited' if same_logits else 'DIFFER'} | {len(set(r['ids']))} |")
    if xxl and "peak_rss" in rows.get(args.limit, {}):
        r = rows[args.limit]
        over = (r["peak_rss"] - limit) / mib
        speed = statistics.median(r["tok_s"])
        print(f"\ntargets: peak RSS - limit = {over:+.0f} MiB (<= {XXL_TARGETS['over_limit_mib']}: "
              f"{'met' if over <= XXL_TARGETS['over_limit_mib'] else 'MISSED'}); ids "
              f"{'equal to' if r['ids'] == rows['none'].get('ids') else 'DIFFER from'} the "
              f"unlimited run (logits "
              f"{'equal' if r['logits_sha256'] == rows['none'].get('logits_sha256') else 'DIFFER'}"
              f"); {speed:.2f} tok/s (>= {XXL_TARGETS['tok_s']}: "
              f"{'met' if speed >= XXL_TARGETS['tok_s'] else 'MISSED'})")
    save_json(args.json, "large", rows)
    return 0


def measured_cells(r: dict) -> tuple[str, str, str, str]:
    """A measured run's table cells: peak RSS, RSS after imports, load seconds, layers."""
    mib = 2 ** 20
    return (f"{r['peak_rss'] / mib:.0f} MiB", f"{r['rss_after_imports'] / mib:.0f} MiB",
            f"{r['load_s']:.1f}", f"{r['resident']} / {r['streamed']}")


def save_json(path: str | None, key: str, rows: object) -> None:
    if path:
        Path(path).write_text(json.dumps({"machine": b5.machine_info(), key: rows}, indent=1) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="t5-base", choices=b5.SHAPES)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--large", nargs="?", const="xl-int8", choices=("xl-int8", "xxl-int4"),
                   help="flan-t5-xl-shaped int8 (2.85B parameters) or flan-t5-xxl-shaped int4 "
                        "(11.3B) without and with --limit")
    p.add_argument("--layers", type=int, help="with --large xxl-int4: N encoder and N decoder "
                                               "layers instead of 24 (a quick check)")
    p.add_argument("--compute", default=None,
                   help="compute= of the runs (--large xxl-int4: default int8)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--limit", default="2GiB",
                   help="with --large: the memory limit (default 2GiB)")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.large:
        if args.large == "xxl-int4" and args.compute is None:
            args.compute = "int8"
        return large(args)
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
        peak, imports, load, layers = measured_cells(r)
        print(f"| {r['dtype']} | {limit} | {peak} | {imports} | {load} | "
              f"{statistics.median(speeds):.1f} ({min(speeds):.1f}-{max(speeds):.1f}) | "
              f"{layers} | {ids} |")
    save_json(args.json, "rows", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
