"""LongT5 encoder time and peak memory against input length: minfer beside transformers.

    python benchmarks/bench_longt5.py [--shape base|tiny] [--attention transient-global|local]
                                      [--lengths 1024,2048,4096,8192,16384] [--runs 3]
                                      [--threads 2] [--engines minfer,transformers] [--json OUT]
                                      [--chart PNG] [--from-json JSON]

The task: encode one row of N random token ids (fixed seed, eos last), batch 1, float32, for
each N of --lengths. Each (engine, N) runs in its own subprocess, so its peak RSS (VmHWM) is
that run's alone: load, one warm-up encode of 256 tokens, then --runs timed encodes of N
tokens. Reported per row: median seconds, peak RSS, its growth over the RSS after the warm-up,
and for minfer the arena's peak and plan; then each doubling's ratio of seconds and of that
growth (linear growth: about 2; the transient-global attention's T x T/16 scores grow a little
faster in time, not in minfer's memory). The first 64 positions' states of each engine are
compared with transformers' (max relative difference).

Weights are random (no network, no torch needed for minfer): on first use the script writes
google/long-t5-tglobal-base's (or long-t5-local-base's) exact config and normal(0, 1/sqrt(in))
weights with NumPy into benchmarks/checkpoints/longt5-<attention>-<shape>/ (gitignored; 1.0 GB
for base). transformers loads the same folder as LongT5EncoderModel (its decoder tensors are
ignored). `--shape tiny` (d_model 16, 2 layers) checks that the script runs.

Threads: OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS are set to --threads before
NumPy or torch are imported; torch also gets torch.set_num_threads and minfer num_threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_t5 as b5  # noqa: E402  (thread_env, machine_info, the checkpoints folder)
from bench_memory import status  # noqa: E402  (a /proc/self/status field in bytes)

MARK = "LONGT5_RESULT "
SEED = 20240601
STATES_COMPARED = 64
# google/long-t5-tglobal-base's config.json, minus what neither engine reads
BASE = {"model_type": "longt5", "architectures": ["LongT5ForConditionalGeneration"],
        "d_model": 768, "d_kv": 64, "num_heads": 12, "d_ff": 2048, "num_layers": 12,
        "num_decoder_layers": 12, "vocab_size": 32128, "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False, "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6, "local_radius": 127,
        "global_block_size": 16, "encoder_attention_type": "transient-global", "pad_token_id": 0,
        "eos_token_id": 1, "decoder_start_token_id": 0, "dropout_rate": 0.0}
SHAPES = {"base": BASE,
          "tiny": {**BASE, "d_model": 16, "d_kv": 4, "num_heads": 4, "d_ff": 32, "num_layers": 2,
                   "num_decoder_layers": 1, "vocab_size": 128}}


def ensure_checkpoint(shape: str, attention: str) -> Path:
    """The random checkpoint of `shape` with `attention`, written on first use."""
    import numpy as np
    from safetensors.numpy import save_file

    from minfer.models.t5.config import T5Config
    from minfer.models.t5.weights import weight_table
    config = {**SHAPES[shape], "encoder_attention_type": attention}
    folder = b5.CHECKPOINTS / f"longt5-{attention}-{shape}"
    if (folder / "model.safetensors").is_file() and \
            json.loads((folder / "config.json").read_text()) == config:
        return folder
    print(f"writing a random {shape}-shaped LongT5 to {folder} ...", flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tensors = {}
    for name, shape_ in weight_table(T5Config.from_hf(config)).tensors.items():
        if name.endswith("layer_norm.weight"):
            tensors[name] = np.ones(shape_, np.float32)
        else:
            scale = 1.0 if "relative_attention_bias" in name else shape_[-1] ** -0.5
            tensors[name] = (rng.standard_normal(shape_, np.float32) * scale)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def input_ids(n: int, vocab: int):
    import numpy as np
    ids = np.random.default_rng(SEED).integers(2, vocab, (1, n))
    ids[0, -1] = 1
    return ids


def worker(args) -> int:
    """One engine, one length: load, warm up, time --runs encodes; print MARK + JSON."""
    import numpy as np
    config = json.loads((Path(args.model) / "config.json").read_text())
    ids = input_ids(args.length, config["vocab_size"])
    result: dict = {}
    if args.engine == "minfer":
        import minfer
        from minfer.models.t5.buffers import run_bytes
        from minfer.models.t5.config import T5Config
        cfg = T5Config.from_hf(config)
        result["plan"] = run_bytes(cfg, np.float32, 1, args.length, 1)["encoder_scratch"]
        model = minfer.load(args.model, workspace=result["plan"] + (64 << 20),
                            num_threads=args.threads)
        model.encode(ids[:, :256])
        model.backend.arena.reset_peak()

        def encode():
            return model.encode(ids)
    else:
        import torch
        from transformers import LongT5EncoderModel
        torch.set_num_threads(args.threads)
        model = LongT5EncoderModel.from_pretrained(args.model, dtype=torch.float32).eval()

        def encode(n=args.length):
            with torch.no_grad():
                return model(input_ids=torch.from_numpy(ids[:, :n])).last_hidden_state.numpy()
        encode(256)
    rss_ready = status("VmRSS")   # loaded, warmed up (compiled kernels, first allocations)
    seconds = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        states = encode()
        seconds.append(time.perf_counter() - t0)
    if args.engine == "minfer":
        result["arena_peak"] = model.backend.arena.stats().peak
    np.save(args.states, np.asarray(states[0, :STATES_COMPARED], np.float32))
    result.update(seconds=seconds, rss_ready=rss_ready, peak_rss=status("VmHWM"))
    print(MARK + json.dumps(result), flush=True)
    return 0


def run(engine: str, model_dir: Path, length: int, args, states: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--engine", engine,
           "--model", str(model_dir), "--length", str(length), "--runs", str(args.runs),
           "--threads", str(args.threads), "--states", str(states)]
    proc = subprocess.run(cmd, env={**os.environ, **b5.thread_env(args.threads)},
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(lines[-1][len(MARK):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="base", choices=sorted(SHAPES))
    p.add_argument("--attention", default="transient-global", choices=("transient-global", "local"))
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engines", default="minfer,transformers")
    p.add_argument("--json")
    p.add_argument("--chart", help="draw seconds and memory against length (matplotlib)")
    p.add_argument("--from-json", help="with --chart: draw a saved --json report, measure nothing")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--states", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.from_json:
        draw(json.loads(Path(args.from_json).read_text())["rows"], args.chart)
        return 0
    import numpy as np
    engines = [e for e in args.engines.split(",") if e]
    if "transformers" in engines and not _has_torch():
        print("torch / transformers not installed: minfer only")
        engines.remove("transformers")
    lengths = [int(n) for n in args.lengths.split(",")]
    model_dir = ensure_checkpoint(args.shape, args.attention)
    rows: dict[str, list[dict]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory() as tmp:
        for n in lengths:
            for engine in engines:
                print(f"{engine:<12} {n:>6} tokens ...", flush=True)
                states = Path(tmp) / f"{engine}-{n}.npy"
                r = run(engine, model_dir, n, args, states)
                r["length"] = n
                if states.is_file():
                    r["states"] = np.load(states)
                rows[engine].append(r)
            ref = rows.get("transformers", [{}])[-1].get("states")
            for engine in engines:
                got = rows[engine][-1].pop("states", None)
                if ref is not None and got is not None:
                    rows[engine][-1]["states_vs_transformers"] = float(
                        np.abs(got - ref).max() / np.abs(ref).max())
            rows.get("transformers", [{}])[-1].pop("states", None)
    mib = 2 ** 20
    print(f"\nLongT5-{args.attention} {args.shape} shape (random weights), batch 1, float32, "
          f"{args.threads} threads, median of {args.runs} encodes\n")
    print("| engine | input tokens | seconds | x per doubling | peak RSS | above the warmed-up model "
          "| x per doubling | arena peak / plan | states vs transformers |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for engine in engines:
        last = None
        for r in rows[engine]:
            if "error" in r:
                print(f"| {engine} | {r['length']} | error: {r['error']} |||||||")
                continue
            s = statistics.median(r["seconds"])
            grown = r["peak_rss"] - r["rss_ready"]
            ratio_s = f"{s / last[0]:.2f}" if last else ""
            ratio_m = f"{grown / last[1]:.2f}" if last and last[1] > 0 else ""
            arena = (f"{r['arena_peak'] / mib:.0f} / {r['plan'] / mib:.0f} MiB"
                     if r.get("plan") else "")
            diff = (f"{r['states_vs_transformers']:.1e}" if "states_vs_transformers" in r else "")
            print(f"| {engine} | {r['length']} | {s:.3f} | {ratio_s} | {r['peak_rss'] / mib:.0f} MiB "
                  f"| {grown / mib:.0f} MiB | {ratio_m} | {arena} | {diff} |")
            last = (s, grown)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": b5.machine_info(), "rows": rows},
                                              indent=1) + "\n")
    if args.chart:
        draw(rows, args.chart)
    return 0


def draw(rows: dict[str, list[dict]], png: str | None) -> None:
    """Two log-log panels, seconds and the memory a run adds over the warmed-up model, against
    input length, one line per engine; a dotted line of slope 1 marks linear growth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if not png:
        raise SystemExit("--from-json needs --chart PNG")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = (("seconds per encode", lambda r: statistics.median(r["seconds"])),
              ("MiB above the warmed-up model", lambda r: (r["peak_rss"] - r["rss_ready"]) / 2**20))
    for ax, (title, value) in zip(axes, panels):
        for engine, runs in rows.items():
            done = [r for r in runs if "seconds" in r]
            ax.plot([r["length"] for r in done], [value(r) for r in done], "o-", label=engine)
            if engine == "minfer" and done:       # linear growth from minfer's first point
                x0, y0 = done[0]["length"], value(done[0])
                ax.plot([r["length"] for r in done], [y0 * r["length"] / x0 for r in done], ":",
                        color="grey", label="linear")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("input tokens")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    print(f"wrote {png}")


def _has_torch() -> bool:
    import importlib.util
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


if __name__ == "__main__":
    sys.exit(main())
