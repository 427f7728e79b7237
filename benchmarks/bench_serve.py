"""`minfer serve` under load: 1 / 8 / 32 / 64 concurrent clients against offline `generate`.

    python benchmarks/bench_serve.py [--models tiny,t5-small] [--clients 1,8,32,64]
                                     [--requests 128] [--new-tokens 32] [--seconds 60]
                                     [--threads N] [--json out.json] [--chart out.png]

For each model a server is started (`minfer serve --port 0`, a subprocess) and, per client count,
that many clients (asyncio tasks over httpx, one connection each) take requests from a shared
list and send them streamed (`stream: true` with usage), so each request gives its latency
(sent -> last byte), its time to first token (sent -> first text piece) and its token counts.
A level stops issuing requests after --seconds (and waits for those in flight), so a run is
bounded in time. Reported per level: requests/s, completion tokens/s, latency p50/p95/p99, time
to first token p50/p95/p99, and the throughput ratio to one client. The same requests are then
run offline in this process (`model.generate(prompts, ...)` with the same threads: batched, no
HTTP) for the ceiling the server's batching can approach. Greedy texts are checked equal to the
offline ones.

Models: `tiny` is the shipped weights/tiny-t5-dates with its held-out prompts and its natural
output lengths; `t5-small` is a random checkpoint with t5-small's exact config, written with
NumPy (tests/factories.py) into benchmarks/checkpoints/t5-small-serve/ with the public T5
tokenizer from --tokenizer (default /work/shared/t5-tokenizer; never committed), sent 32-token
random-text prompts and forced to --new-tokens tokens (ignore_eos). Needs the [test] extra
(httpx); --chart needs matplotlib.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import bench_t5 as b5  # noqa: E402

DATES = b5.REPO / "weights" / "tiny-t5-dates"
T5_SMALL = dict(vocab_size=32128, d_model=512, d_kv=64, num_heads=8, d_ff=2048, num_layers=6,
                num_decoder_layers=6, relative_attention_num_buckets=32,
                relative_attention_max_distance=128, feed_forward_proj="relu",
                tie_word_embeddings=True)


# -- models and their requests ------------------------------------------------------------------------
def t5_small_folder(tokenizer: Path) -> Path:
    folder = b5.CHECKPOINTS / "t5-small-serve"
    if not (folder / "model.safetensors").is_file():
        print(f"writing a random t5-small-shaped checkpoint to {folder} ...", flush=True)
        from factories import write_t5
        write_t5(folder, seed=0, **T5_SMALL)
    for name in b5.TOKENIZER_FILES:
        if not (tokenizer / name).is_file():
            raise SystemExit(f"--tokenizer {tokenizer}: no {name} (the public T5 tokenizer)")
        shutil.copyfile(tokenizer / name, folder / name)
    return folder


def requests_for(model_name: str, count: int, new_tokens: int, tokenizer: Path) -> tuple[Path, list[dict]]:
    """The model's folder and its request bodies (without stream fields)."""
    if model_name == "tiny":
        prompts = [json.loads(line)["prompt"] for line in open(DATES / "heldout.jsonl")]
        return DATES, [{"prompt": prompts[i % len(prompts)]} for i in range(count)]
    folder = t5_small_folder(tokenizer)
    import numpy as np
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rng = np.random.default_rng(0)
    bodies = []
    for _ in range(count):   # 31 random pieces (ids 3..31999), decoded to text
        text = vocab.decode([int(t) for t in rng.integers(3, 32000, 31)]).strip() or "x"
        bodies.append({"prompt": text, "max_tokens": new_tokens, "ignore_eos": True})
    return folder, bodies


# -- the server -------------------------------------------------------------------------------------
def start_server(folder: Path, threads: int, max_running: int):
    from serve_process import Server   # tests/serve_process.py: port 0, waits for /health
    return Server(folder, "--threads", str(threads), "--max-running", str(max_running),
                  "--max-waiting", str(4 * max_running), startup=300)


# -- the clients ------------------------------------------------------------------------------------
async def one_request(client, body: dict) -> dict:
    """One streamed request: its text, latency, time to first piece and usage."""
    sent = time.perf_counter()
    first = None
    text, usage = [], None
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"error": event["error"]["message"]}
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice.get("text"):
                    first = first if first is not None else time.perf_counter()
                    text.append(choice["text"])
    done = time.perf_counter()
    return {"text": "".join(text), "latency": done - sent,
            "ttft": (first if first is not None else done) - sent,
            "tokens": usage["completion_tokens"] if usage else 0}


async def level(url: str, bodies: list[dict], clients: int, seconds: float) -> dict:
    import httpx
    results: list = [None] * len(bodies)
    next_index = 0
    stop_at = time.perf_counter() + seconds

    async def client_loop() -> None:
        nonlocal next_index
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            while next_index < len(bodies) and time.perf_counter() < stop_at:
                i, next_index = next_index, next_index + 1
                results[i] = await one_request(client, bodies[i])
    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    wall = time.perf_counter() - start
    done = [r for r in results if r is not None and "error" not in r]
    errors = [r["error"] for r in results if r is not None and "error" in r]
    return {"clients": clients, "wall": wall, "requests": len(done), "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "tokens": sum(r["tokens"] for r in done),
            "latency": [r["latency"] for r in done], "ttft": [r["ttft"] for r in done],
            "texts": [r["text"] if r is not None and "error" not in r else None for r in results]}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def offline(folder: Path, bodies: list[dict], threads: int) -> dict:
    """The same requests through model.generate in this process (one batched call)."""
    import minfer
    model = minfer.load(folder, num_threads=threads)
    options = {k: v for k, v in bodies[0].items() if k != "prompt"}
    extra = {"max_new_tokens": options["max_tokens"],
             "min_new_tokens": options["max_tokens"]} if options.get("ignore_eos") else {}
    prompts = [b["prompt"] for b in bodies]
    model.generate(prompts[:2], **extra)                    # warm-up
    start = time.perf_counter()
    results = model.generate(prompts, return_details=True, **extra)
    wall = time.perf_counter() - start
    return {"wall": wall, "requests": len(prompts),
            "tokens": sum(row[0].new_tokens for row in results),
            "texts": [row[0].text for row in results]}


# -- report ----------------------------------------------------------------------------------------
def report(model_name: str, levels: list[dict], base: dict) -> list[dict]:
    rows = []
    one = levels[0]["tokens"] / levels[0]["wall"] if levels and levels[0]["wall"] else None
    print(f"\n{model_name}: offline generate {base['requests'] / base['wall']:.1f} req/s, "
          f"{base['tokens'] / base['wall']:.0f} tok/s ({base['requests']} requests in one batched call)")
    print(f"{'clients':>7} {'req/s':>7} {'tok/s':>7} {'x 1':>5} {'x off':>6} {'p50 s':>7} "
          f"{'p95 s':>7} {'p99 s':>7} {'ttft50':>7} {'ttft95':>7} {'ttft99':>7} {'same':>6} {'err':>4}")
    for lv in levels:
        rate = lv["tokens"] / lv["wall"] if lv["wall"] else 0.0
        same = sum(t == w for t, w in zip(lv["texts"], base["texts"]) if t is not None)
        row = {"model": model_name, "clients": lv["clients"], "requests": lv["requests"],
               "requests_per_s": lv["requests"] / lv["wall"], "tokens_per_s": rate,
               "vs_one_client": rate / one if one else None,
               "vs_offline": rate / (base["tokens"] / base["wall"]),
               **{f"latency_p{q}": percentile(lv["latency"], q) for q in (50, 95, 99)},
               **{f"ttft_p{q}": percentile(lv["ttft"], q) for q in (50, 95, 99)},
               "same_as_offline": same, "errors": lv["errors"], "first_error": lv["first_error"]}
        rows.append(row)
        print(f"{row['clients']:>7} {row['requests_per_s']:>7.1f} {rate:>7.0f} "
              f"{row['vs_one_client'] or 0:>5.2f} {row['vs_offline']:>6.2f} "
              f"{row['latency_p50']:>7.3f} {row['latency_p95']:>7.3f} {row['latency_p99']:>7.3f} "
              f"{row['ttft_p50']:>7.3f} {row['ttft_p95']:>7.3f} {row['ttft_p99']:>7.3f} "
              f"{same:>3}/{lv['requests']:<3} {lv['errors']:>3}")
        if lv["first_error"]:
            print(f"        first error: {lv['first_error']}")
    return rows


def chart(rows: list[dict], offline_rates: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in models:
        mine = [r for r in rows if r["model"] == name]
        clients = [r["clients"] for r in mine]
        line, = axes[0].plot(clients, [r["tokens_per_s"] for r in mine], "o-", label=name)
        axes[0].axhline(offline_rates[name], color=line.get_color(), ls=":",
                        label=f"{name} offline generate")
        axes[1].plot(clients, [r["latency_p50"] for r in mine], "o-", color=line.get_color(),
                     label=f"{name} p50")
        axes[1].plot(clients, [r["latency_p99"] for r in mine], "s--", color=line.get_color(),
                     label=f"{name} p99")
    axes[0].set(xscale="log", xlabel="concurrent clients", ylabel="completion tokens/s",
                title="throughput")
    axes[1].set(xscale="log", yscale="log", xlabel="concurrent clients",
                ylabel="request latency (s)", title="latency")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.set_xticks(sorted({r["clients"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"chart: {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,t5-small")
    p.add_argument("--clients", default="1,8,32,64")
    p.add_argument("--requests", type=int, default=128, help="requests per level")
    p.add_argument("--new-tokens", type=int, default=32, help="t5-small: tokens per request")
    p.add_argument("--seconds", type=float, default=60.0,
                   help="a level stops issuing requests after this long")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--tokenizer", type=Path, default=b5.DEFAULT_TOKENIZER)
    p.add_argument("--json", default=None)
    p.add_argument("--chart", default=None)
    args = p.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    rows, offline_rates = [], {}
    for name in args.models.split(","):
        if name not in ("tiny", "t5-small"):
            raise SystemExit(f"--models: unknown model {name!r} (tiny, t5-small)")
        folder, bodies = requests_for(name, args.requests, args.new_tokens, args.tokenizer)
        server = start_server(folder, args.threads, max(counts))
        try:
            asyncio.run(level(server.url, bodies[:4], 2, args.seconds))   # warm-up
            levels = [asyncio.run(level(server.url, bodies, c, args.seconds)) for c in counts]
        finally:
            server.stop()
        base = offline(folder, bodies, args.threads)
        offline_rates[name] = base["tokens"] / base["wall"]
        rows += report(name, levels, base)
    print(f"\n{args.threads} threads; machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "offline_tokens_per_s": offline_rates,
                                               "threads": args.threads}, indent=1) + "\n")
    if args.chart:
        chart(rows, offline_rates, args.chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
