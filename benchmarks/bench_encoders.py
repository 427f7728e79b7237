"""T5 encoders on the CPU: the T5-v1.1-XXL encoder under a 2 GiB memory limit, encoder throughput
against transformers, and sentence embeddings against sentence-transformers (issue 18).

    python benchmarks/bench_encoders.py --part xxl [--limit 2GiB] [--runs 3] [--threads 2]
    python benchmarks/bench_encoders.py --part throughput [--runs 3] [--threads 2]
    python benchmarks/bench_encoders.py --part embeddings [--runs 3] [--threads 2]
    python benchmarks/bench_encoders.py --part all --tiny        # every part on tiny shapes

Needs the [dev] extra (torch, transformers, sentence-transformers) for the throughput and
embedding parts; the xxl part uses minfer alone. Every measurement runs in a fresh subprocess
with OMP/OPENBLAS/MKL threads set to --threads before NumPy or torch load; one warm-up call,
then --runs timed calls (median reported).

xxl: writes (once) benchmarks/checkpoints/t5-v1_1-xxl-encoder-bf16/ (gitignored): the encoder of
google/t5-v1_1-xxl as a T5EncoderModel saves it (d_model 4096, d_ff 10240, 64 heads x 64, 24
layers, gated-gelu, vocab 32128), random bfloat16 weights, one shard per layer (~9.5 GB), and its
`minfer convert --dtype int8` copy. For each weight format (bfloat16, int8) and limit (none,
--limit) it encodes one 512-token prompt and a batch of 8 (random ids, fixed seed) and reports
seconds, peak RSS (VmHWM, the whole process: load included) and whether the states equal the
unlimited run's (max abs difference). Under the limit, the workspace is the largest of 4/8, 3/8,
2/8, 1/8 of the limit that the planner accepts; `encode` runs the batch of 8 in as many rows at
a time as it holds.

throughput: a t5-base-shaped T5EncoderModel (random float32 weights, written once), batch 8 x
512 tokens: seconds per batch for minfer (float32) and transformers' T5EncoderModel (torch CPU,
float32, same threads), the ratio, and the max relative difference of the states.

embeddings: a sentence-t5-base-shaped sentence-transformers folder (the t5-base encoder, mean
pooling, Dense 768 -> 768 without bias, Normalize; random weights; the public T5 tokenizer from
/work/shared/t5-tokenizer, else the project's tiny one) and 256 synthetic sentences of 8 to 40
words: sentences/s of `model.embed` and `SentenceTransformer.encode` (batch 32 both) and the
max abs difference of the embeddings.

--tiny runs every part on shapes a hundred times smaller (a check that the script works, not a
measurement). Results go to benchmarks/README.md ("T5 encoders").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHECKPOINTS = HERE / "checkpoints"
MARK = "ENCODER_RESULT "
PUBLIC_TOKENIZER = Path("/work/shared/t5-tokenizer")
TINY_TOKENIZER = REPO / "weights" / "tokenizers" / "tiny-t5"
TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "tokenizer_config.json",
                   "special_tokens_map.json")

# google/t5-v1_1-xxl's encoder as T5EncoderModel saves it (the Flux / SD3 text_encoder_2)
XXL = {"architectures": ["T5EncoderModel"], "model_type": "t5", "d_model": 4096, "d_kv": 64,
       "num_heads": 64, "d_ff": 10240, "num_layers": 24, "vocab_size": 32128,
       "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
       "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
       "layer_norm_epsilon": 1e-6, "pad_token_id": 0, "eos_token_id": 1,
       "decoder_start_token_id": 0}
T5_BASE = dict(XXL, d_model=768, d_kv=64, num_heads=12, d_ff=3072, num_layers=12,
               feed_forward_proj="relu", tie_word_embeddings=True)
TINY = {"d_model": 64, "d_kv": 16, "num_heads": 4, "d_ff": 160, "num_layers": 2, "vocab_size": 600}
LENGTH, BATCH = 512, 8


def status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def thread_env(threads: int) -> dict[str, str]:
    return {**os.environ, **{k: str(threads) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                       "MKL_NUM_THREADS")},
            "OMP_WAIT_POLICY": "PASSIVE"}


def timed(call, runs: int) -> tuple[object, float]:
    """(the warm-up call's result, median seconds of `runs` calls)."""
    out = call()
    seconds = []
    for _ in range(runs):
        t0 = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t0)
    return out, statistics.median(seconds)


def input_ids(batch: int, length: int, vocab: int) -> np.ndarray:
    ids = np.random.default_rng(20261124).integers(2, min(vocab, 32000), (batch, length))
    ids[:, -1] = 1
    return ids


# =====================================================================================================
# Checkpoints (random weights, written once; bfloat16 without torch)
# =====================================================================================================
def _bf16_bits(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Normal(0, scale) values as bfloat16 bit patterns (uint16), rounded to nearest."""
    x = (rng.standard_normal(shape, np.float32) * np.float32(scale)).view(np.uint32)
    return ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16)


def _write_bf16_shard(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file of BF16 tensors given as uint16 bits (safetensors.numpy has no bf16)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": "BF16", "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a, "<u2").tobytes())


def write_encoder(folder: Path, config: dict) -> Path:
    """A T5EncoderModel-layout checkpoint with random bfloat16 weights, one shard per layer
    (so that writing holds one layer in memory), unless already there."""
    if (folder / "model.safetensors.index.json").is_file():
        return folder
    from minfer.models.t5.config import T5Config
    from minfer.models.t5.weights import weight_table
    folder.mkdir(parents=True, exist_ok=True)
    table = weight_table(T5Config.from_hf(config).with_parts((), "encoder", str(folder)))
    groups: dict[str, list[str]] = {}
    for name in table.tensors:
        key = name.split(".layer.")[0] if ".block." in name else "fixed"
        groups.setdefault(key, []).append(name)
    rng = np.random.default_rng(0)
    weight_map = {}
    print(f"writing {folder} ({len(groups)} shards) ...", flush=True)
    for k, (key, names) in enumerate(groups.items()):
        shard = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            shape = table.tensors[name]
            if name.endswith("layer_norm.weight"):
                tensors[name] = np.full(shape, 0x3F80, np.uint16)   # 1.0 in bfloat16
            else:   # fan-in scaling keeps activations O(1) through 24 layers
                tensors[name] = _bf16_bits(rng, shape, 1.0 if name == "shared.weight"
                                           or "relative_attention" in name else shape[-1] ** -0.5)
            weight_map[name] = shard
        _write_bf16_shard(folder / shard, tensors)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def int8_copy(folder: Path) -> Path:
    out = folder.with_name(folder.name + "-int8")
    if not (out / "model.safetensors").is_file():
        from minfer.convert import convert
        print(f"converting to {out} ...", flush=True)
        convert(folder, out, "int8")
    return out


def with_tokenizer(folder: Path, tiny: bool) -> Path:
    public = (PUBLIC_TOKENIZER / "tokenizer.json").is_file() and not tiny
    source = PUBLIC_TOKENIZER if public else TINY_TOKENIZER
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder


# =====================================================================================================
# Workers (one measurement each, in a fresh process)
# =====================================================================================================
def worker_xxl(args) -> dict:
    import minfer
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    limit = None if args.limit == "none" else args.limit
    model, workspace = None, None
    from minfer.arena import parse_bytes
    candidates = [parse_bytes(limit) * k // 8 for k in (4, 3, 2, 1)] if limit else [None]
    for workspace in candidates:   # the largest part of the limit the planner accepts
        try:
            model = minfer.load(args.model, dtype=args.dtype, memory_limit=limit, workspace=workspace)
            break
        except minfer.ConfigError as e:
            refused = str(e)
    if model is None:
        return {"refused": refused}
    out = {"workspace": workspace, "streamed": len(model.weight_plan.streamed)}
    for batch in (1, BATCH):
        ids = input_ids(batch, args.length, cfg["vocab_size"])
        states, seconds = timed(lambda ids=ids: model.encode(ids), args.runs)
        np.save(Path(args.save) / f"states-{batch}.npy", states)
        out[f"seconds_{batch}"] = seconds
    out["peak_rss"] = status("VmHWM")
    return out


def worker_throughput(args) -> dict:
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    ids = input_ids(BATCH, args.length, vocab)
    if args.engine == "minfer":
        import minfer
        model = minfer.load(args.model, num_threads=args.threads)
        states, seconds = timed(lambda: model.encode(ids), args.runs)
    else:
        import torch
        from transformers import T5EncoderModel
        torch.set_num_threads(args.threads)
        model = T5EncoderModel.from_pretrained(args.model, dtype=torch.float32).eval()
        with torch.inference_mode():
            t = torch.from_numpy(ids)
            states, seconds = timed(lambda: model(t).last_hidden_state.numpy(), args.runs)
    np.save(Path(args.save) / f"states-{args.engine}.npy", states)
    return {"seconds": seconds}


def sentences(n: int) -> list[str]:
    rng = np.random.default_rng(7)
    words = ("the a of to and in model text encoder memory layer weights token sentence quick "
             "brown fox jumps over lazy dog river city music light paper stream batch").split()
    return [" ".join(rng.choice(words, rng.integers(8, 41))).capitalize() + "." for _ in range(n)]


def worker_embeddings(args) -> dict:
    texts = sentences(args.sentences)
    if args.engine == "minfer":
        import minfer
        model = minfer.load(args.model, num_threads=args.threads)
        out, seconds = timed(lambda: model.embed(texts, batch_size=32), args.runs)
    else:
        import torch
        from sentence_transformers import SentenceTransformer
        torch.set_num_threads(args.threads)
        model = SentenceTransformer(args.model, device="cpu")
        out, seconds = timed(lambda: model.encode(texts, batch_size=32, convert_to_numpy=True),
                             args.runs)
    np.save(Path(args.save) / f"emb-{args.engine}.npy", out)
    return {"sentences_per_s": len(texts) / seconds}


def run_worker(part: str, threads: int, **options) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", part, "--threads",
           str(threads), *[x for k, v in options.items() for x in (f"--{k.replace('_', '-')}", str(v))]]
    proc = subprocess.run(cmd, env=thread_env(threads), capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(lines[-1][len(MARK):])


# =====================================================================================================
# Parts
# =====================================================================================================
def part_xxl(args, scratch: Path) -> dict:
    from minfer.arena import format_bytes, parse_bytes
    # tiny: enough layers that the limit streams some
    config = dict(XXL, **(dict(TINY, num_layers=4, d_ff=512) if args.tiny else {}))
    folder = write_encoder(CHECKPOINTS / ("tiny-xxl-encoder" if args.tiny
                                          else "t5-v1_1-xxl-encoder-bf16"), config)
    limit = "1MiB" if args.tiny and args.limit == "2GiB" else args.limit
    rows = []
    for dtype, model in (("bfloat16", folder), ("int8", int8_copy(folder))):
        runs = {}
        for lim in ("none", limit):
            save = scratch / f"{dtype}-{lim}"
            save.mkdir()
            print(f"xxl {dtype} limit {lim} ...", flush=True)
            runs[lim] = run_worker("xxl", args.threads, model=model, dtype=dtype, limit=lim,
                                   runs=args.runs, length=args.length, save=save)
            runs[lim]["save"] = save
        for lim, r in runs.items():
            if "peak_rss" in r:
                diffs = [float(np.abs(np.load(r["save"] / f"states-{b}.npy")
                                      - np.load(runs["none"]["save"] / f"states-{b}.npy")).max())
                         for b in (1, BATCH)]
                over = r["peak_rss"] - parse_bytes(lim) if lim != "none" else None
                ws = r.get("workspace")
                rows.append([dtype, lim, format_bytes(ws) if ws else "-", str(r["streamed"]),
                             f"{r['seconds_1']:.2f}", f"{r[f'seconds_{BATCH}']:.2f}",
                             format_bytes(r["peak_rss"]),
                             "-" if over is None else f"{over / 2**20:+.0f} MiB",
                             " / ".join("equal" if d == 0 else f"max diff {d:.1e}" for d in diffs)])
            else:
                rows.append([dtype, lim, r.get("refused") or r.get("error"), *[""] * 6])
    print_table(f"T5-v1.1-XXL encoder ({'tiny ' if args.tiny else ''}random weights), "
                f"{args.length} tokens, {args.threads} threads",
                ["weights", "limit", "workspace", "streamed layers", "1 prompt s",
                 f"batch {BATCH} s", "peak RSS", "over the limit",
                 f"states vs unlimited (1 / {BATCH} rows)"], rows)
    return {"xxl": rows}


def part_throughput(args, scratch: Path) -> dict:
    config = dict(T5_BASE, **(TINY if args.tiny else {}))
    folder = CHECKPOINTS / ("tiny-base-encoder" if args.tiny else "t5-base-encoder")
    if not (folder / "model.safetensors").is_file():
        import torch
        from transformers import T5Config, T5EncoderModel
        torch.manual_seed(0)
        T5EncoderModel(T5Config(**{k: v for k, v in config.items() if k != "architectures"})
                       ).save_pretrained(folder)
    res = {e: run_worker("throughput", args.threads, engine=e, model=folder, runs=args.runs,
                         length=args.length, save=scratch) for e in ("minfer", "transformers")}
    failed = {e: r["error"] for e, r in res.items() if "error" in r}
    if failed:
        print(f"throughput: failed: {failed}")
        return {"throughput": res}
    a, b = (np.load(scratch / f"states-{e}.npy") for e in ("minfer", "transformers"))
    rel = float(np.abs(a - b).max() / np.abs(b).max())
    rows = [[e, f"{r.get('seconds', float('nan')):.3f}", r.get("error", "")] for e, r in res.items()]
    ratio = res["transformers"]["seconds"] / res["minfer"]["seconds"]
    print_table(f"t5-base-shaped encoder, batch {BATCH} x {args.length}, float32, {args.threads} "
                f"threads: minfer {ratio:.2f}x transformers, states max rel diff {rel:.1e}",
                ["engine", "seconds / batch", "error"], rows)
    return {"throughput": res, "ratio": ratio, "max_rel_diff": rel}


def part_embeddings(args, scratch: Path) -> dict:
    config = dict(T5_BASE, **(TINY if args.tiny else {}))
    folder = CHECKPOINTS / ("tiny-sentence-t5" if args.tiny else "sentence-t5-base-shaped")
    if not (folder / "modules.json").is_file():
        import torch
        from sentence_transformers import SentenceTransformer, models
        from transformers import T5Config, T5EncoderModel
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as tmp:
            T5EncoderModel(T5Config(**{k: v for k, v in config.items() if k != "architectures"})
                           ).save_pretrained(tmp)
            with_tokenizer(Path(tmp), args.tiny)
            word = models.Transformer(tmp, max_seq_length=256)
            d = config["d_model"]
            st = SentenceTransformer(modules=[word, models.Pooling(d), models.Dense(
                d, d, bias=False, activation_function=torch.nn.Identity()), models.Normalize()],
                device="cpu")
            st.save(str(folder))
    res = {e: run_worker("embeddings", args.threads, engine=e, model=folder, runs=args.runs,
                         sentences=args.sentences, save=scratch)
           for e in ("minfer", "sentence-transformers")}
    failed = {e: r["error"] for e, r in res.items() if "error" in r}
    if failed:
        print(f"embeddings: failed: {failed}")
        return {"embeddings": res}
    diff = float(np.abs(np.load(scratch / "emb-minfer.npy")
                        - np.load(scratch / "emb-sentence-transformers.npy")).max())
    ratio = res["minfer"]["sentences_per_s"] / res["sentence-transformers"]["sentences_per_s"]
    rows = [[e, f"{r.get('sentences_per_s', float('nan')):.1f}", r.get("error", "")]
            for e, r in res.items()]
    print_table(f"sentence-t5-base-shaped embeddings, {args.sentences} sentences, batch 32, "
                f"{args.threads} threads: minfer {ratio:.2f}x, max abs diff {diff:.1e}",
                ["engine", "sentences/s", "error"], rows)
    return {"embeddings": res, "ratio": ratio, "max_abs_diff": diff}


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    print(flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["xxl", "throughput", "embeddings", "all"], default="all")
    p.add_argument("--limit", default="2GiB")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="tiny shapes: check the script works")
    p.add_argument("--json", default=None, help="also write the results here")
    # worker options
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    for name in ("--model", "--dtype", "--engine", "--save"):
        p.add_argument(name, default=None, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, default=LENGTH, help=argparse.SUPPRESS)
    p.add_argument("--sentences", type=int, default=256, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        work = {"xxl": worker_xxl, "throughput": worker_throughput,
                "embeddings": worker_embeddings}[args.worker]
        print(MARK + json.dumps(work(args)), flush=True)
        return 0
    if args.tiny:
        args.runs, args.length, args.sentences = 1, 32, 16
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for part, run in (("xxl", part_xxl), ("throughput", part_throughput),
                          ("embeddings", part_embeddings)):
            if args.part in (part, "all"):
                scratch = Path(tmp) / part
                scratch.mkdir()
                results.update(run(args, scratch))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
