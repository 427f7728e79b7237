"""Peak RSS over `memory_limit`: `minfer serve` with N concurrent prompts, N threads offline, and
a first run on a cold numba cache (issue 30, items 6 and 7).

    python benchmarks/bench_limit_memory.py [--model DIR] [--clients 32] [--limit 400MiB]
                                            [--workspace 160MiB] [--prompt-tokens 480]

Without --model a t5-base-shaped float32 checkpoint with random weights is written once to
benchmarks/checkpoints/t5-base-random/ (gitignored) by tests/factories.write_t5 (no torch needed),
with the tiny committed tokenizer (its ids are valid in a 32,128 vocabulary). Each measurement is a
fresh process; the peak is its VmHWM. Reported in MiB over the limit:
- serve: one request alone, then `--clients` concurrent completions (greedy, 4 new tokens);
- offline: one generate call, then `--clients` threads each making one;
- cold: `--limit 256MiB`, load and generate 16 tokens, with NUMBA_CACHE_DIR an empty folder (the
  first run of an installation) and again on the filled cache.
Targets (issue 30): serve / offline under 32 concurrent requests <= limit + 170 MiB; the 256 MiB
run <= limit + 150 MiB, cold and cached.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MARK = "@@ "
T5_BASE = dict(vocab_size=32128, d_model=768, d_kv=64, num_heads=12, d_ff=3072, num_layers=12,
               num_decoder_layers=12, relative_attention_num_buckets=32,
               relative_attention_max_distance=128)
WORDS = "date: 1999 and more words spell: 1234 hello world x".split()


def ensure_model() -> Path:
    folder = HERE / "checkpoints" / "t5-base-random"
    if not (folder / "model.safetensors").is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from factories import write_t5
        write_t5(folder, seed=0, **T5_BASE)
        for name in ("tokenizer.json", "spiece.model", "tokenizer_config.json",
                     "special_tokens_map.json"):
            shutil.copy(ROOT / "weights" / "tokenizers" / "tiny-t5" / name, folder / name)
    return folder


def peak_mib(pid: int | str = "self") -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    return 0


def prompt_text(tokens: int) -> str:
    """About `tokens` tokens of the tiny vocabulary (~3.2 tokens a word)."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(int(tokens / 3.2)))


def serve(model: Path, args) -> dict:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([sys.executable, "-m", "minfer", "serve", "--model", str(model),
                             "--memory-limit", args.limit, "--workspace", args.workspace,
                             "--port", str(port), "--max-running", "64", "--max-waiting", "64"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1500):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        body = json.dumps({"prompt": prompt_text(args.prompt_tokens), "max_tokens": 4}).encode()

        def ask() -> None:
            request = urllib.request.Request(url + "/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as r:
                r.read()
        ask()
        one = peak_mib(proc.pid)
        threads = [threading.Thread(target=ask) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return {"one": one, "concurrent": peak_mib(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(60)


def offline_worker(model: str, limit: str, workspace: str, clients: int, tokens: int) -> None:
    import minfer
    m = minfer.load(model, memory_limit=limit, workspace=workspace)
    prompt = prompt_text(tokens)
    m.generate(prompt, max_new_tokens=4, min_new_tokens=4)
    one = peak_mib()
    threads = [threading.Thread(target=lambda: m.generate(prompt, max_new_tokens=4,
                                                          min_new_tokens=4))
               for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(MARK + json.dumps({"one": one, "concurrent": peak_mib()}), flush=True)


def small_worker(model: str) -> None:
    import minfer
    m = minfer.load(model, memory_limit="256MiB")
    m.generate([list(range(5, 37)) + [1]], max_new_tokens=16, min_new_tokens=16)
    print(MARK + json.dumps({"peak": peak_mib()}), flush=True)


def worker(args: list[str], env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         env=env)
    lines = [l for l in out.stdout.splitlines() if l.startswith(MARK)]
    if not lines:
        raise SystemExit(f"worker failed: {out.stderr.strip()[-500:]}")
    return json.loads(lines[-1][len(MARK):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--limit", default="400MiB")
    p.add_argument("--workspace", default="160MiB")
    p.add_argument("--prompt-tokens", type=int, default=480)
    p.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--small-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.offline_worker:
        offline_worker(args.model, args.limit, args.workspace, args.clients, args.prompt_tokens)
        return 0
    if args.small_worker:
        small_worker(args.model)
        return 0
    model = Path(args.model) if args.model else ensure_model()
    from minfer.arena import parse_bytes
    limit = parse_bytes(args.limit) >> 20
    served = serve(model, args)
    offline = worker(["--offline-worker", "--model", str(model), "--limit", args.limit,
                      "--workspace", args.workspace, "--clients", str(args.clients),
                      "--prompt-tokens", str(args.prompt_tokens)])
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        cold = worker(["--small-worker", "--model", str(model)], env)
        cached = worker(["--small-worker", "--model", str(model)], env)
    print(f"over --memory-limit {args.limit}, MiB (peak RSS - limit):")
    print(f"  serve:   one request {served['one'] - limit:+d}, {args.clients} concurrent "
          f"{served['concurrent'] - limit:+d}")
    print(f"  offline: one call {offline['one'] - limit:+d}, {args.clients} threads "
          f"{offline['concurrent'] - limit:+d}")
    print(f"  memory_limit 256MiB: cold numba cache {cold['peak'] - 256:+d}, cached "
          f"{cached['peak'] - 256:+d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
