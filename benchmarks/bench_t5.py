"""Greedy-decoding speed of minfer against Hugging Face transformers and CTranslate2 on CPU.

    python benchmarks/bench_t5.py [--shape t5-small|t5-base] [--runs 5] [--threads 2] [--json OUT]
                                  [--rounds 1] [--engines minfer,transformers,...] [--profile]

The task is the same for every engine: batch 1, a source of 32 random token ids (fixed seed, ids
in 2..31999 followed by eos id 1), exactly 64 new tokens of greedy decoding (eos is suppressed
until then, so no engine can stop early), float32 (CTranslate2 int8 is an extra row). One
warm-up call, then `--runs` timed calls; a call's speed is 64 / wall time of the whole generate
call, encoder included. The table shows median, min and max tokens/s and minfer's median speed
divided by each engine's. With `--rounds R` the engines are measured R times round-robin and the
runs pooled. The machine may be shared: the driver reports when other processes used a notable
share of the CPUs before or while an engine ran.

Weights are random (no network): on first use the script writes a checkpoint with the exact
config of t5-small or t5-base into benchmarks/checkpoints/<shape>/ (gitignored) through
weights/make_t5_fixtures.py, rescales two groups of weights so that greedy decoding is not
degenerate (see `rescale_weights`), and converts it for CTranslate2 into <shape>-ct2/ and
<shape>-ct2-int8/. The CTranslate2 converter needs a tokenizer in the model folder; the public
T5 tokenizer files are copied there from --tokenizer (default /work/shared/t5-tokenizer). When
ctranslate2 or the tokenizer is missing the CTranslate2 rows are skipped.

Each engine is measured in its own subprocess whose environment sets OMP_NUM_THREADS,
OPENBLAS_NUM_THREADS and MKL_NUM_THREADS to `--threads` before NumPy or torch are imported;
torch additionally gets torch.set_num_threads() and CTranslate2 intra_threads. Every engine's
64 generated ids are compared with transformers' ids (the reference), and the first mismatch,
if any, is reported.

`--profile` instead runs minfer alone under cProfile and prints where a generate call spends
its time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FIXTURE_SCRIPT = REPO / "weights" / "make_t5_fixtures.py"
CHECKPOINTS = HERE / "checkpoints"
DEFAULT_TOKENIZER = Path("/work/shared/t5-tokenizer")
TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "tokenizer_config.json",
                   "special_tokens_map.json")

SHAPES = ("t5-small", "t5-base", "t5-v1_1-base")
SOURCE_LEN = 32
NEW_TOKENS = 64
INPUT_SEED = 20240601
EOS_ID = 1
RESULT_MARK = "BENCH_RESULT "  # a worker's last stdout line: this mark, then JSON

# How the random weights are rescaled after writing (see rescale_weights), per shape:
# (embedding scale, attention / feed-forward gain), picked by trying a few values
RESCALE = {"t5-small": (0.1, 2.0), "t5-base": (0.03, 2.0), "t5-v1_1-base": (0.03, 2.0)}
LINEAR_SUFFIXES = tuple(f".{w}.weight" for w in ("q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo"))
RESCALED_MARK = "benchmark_rescaled.json"

# engine name -> the worker that measures it
ENGINES = {
    "transformers": "transformers",
    "minfer": "minfer",
    "ctranslate2-fp32": "ctranslate2",
    "ctranslate2-int8": "ctranslate2",
}
REFERENCE = "transformers"  # every other engine's ids are compared with this one's


def source_ids() -> list[int]:
    """The benchmark's source sentence: SOURCE_LEN - 1 random ids, then eos."""
    rng = random.Random(INPUT_SEED)
    return [rng.randrange(2, 32000) for _ in range(SOURCE_LEN - 1)] + [EOS_ID]


# =================================================================================================
# Workers: one engine each, run in a subprocess with the thread environment already set
# =================================================================================================
def time_calls(generate, runs: int) -> tuple[list[int], list[float]]:
    """One warm-up call (its output is returned), then `runs` timed calls (seconds each)."""
    new_ids = generate()
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        again = generate()
        seconds.append(time.perf_counter() - start)
        if again != new_ids:
            raise RuntimeError("greedy output changed between runs")
    return new_ids, seconds


def run_minfer(model_dir: Path, ids: list[int], runs: int, threads: int) -> dict:
    import minfer

    start = time.perf_counter()
    model = minfer.load(model_dir)
    load_s = time.perf_counter() - start

    def generate() -> list[int]:
        row = model.generate([ids], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)[0]
        return [int(t) for t in row[1:]]  # drop the decoder start token

    new_ids, seconds = time_calls(generate, runs)
    return {"ids": new_ids, "seconds": seconds, "load_s": load_s}


def run_transformers(model_dir: Path, ids: list[int], runs: int, threads: int) -> dict:
    import torch
    import transformers
    from transformers import T5ForConditionalGeneration

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    model = T5ForConditionalGeneration.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    load_s = time.perf_counter() - start
    input_ids = torch.tensor([ids], dtype=torch.long)

    def generate() -> list[int]:
        with torch.inference_mode():
            out = model.generate(input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, num_beams=1)
        return [int(t) for t in out[0, 1:]]  # drop the decoder start token

    new_ids, seconds = time_calls(generate, runs)
    # Untimed: how close each greedy decision was (top-1 minus top-2 logit), to tell a rounding
    # flip from a bug when another engine disagrees.
    with torch.inference_mode():
        scored = model.generate(input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, num_beams=1, output_scores=True,
                                return_dict_in_generate=True)
    top2 = [step[0].topk(2).values for step in scored.scores]
    margins = [float(v[0] - v[1]) for v in top2]
    return {"ids": new_ids, "seconds": seconds, "load_s": load_s, "margins": margins,
            "torch_threads": torch.get_num_threads()}


def run_ctranslate2(model_dir: Path, ids: list[int], runs: int, threads: int) -> dict:
    import ctranslate2

    vocab = read_ct2_vocabulary(model_dir)
    token_to_id = {token: i for i, token in enumerate(vocab)}
    source = [vocab[i] for i in ids]
    start = time.perf_counter()
    translator = ctranslate2.Translator(str(model_dir), device="cpu", inter_threads=1,
                                        intra_threads=threads)
    load_s = time.perf_counter() - start

    def generate() -> list[int]:
        result = translator.translate_batch([source], beam_size=1, max_decoding_length=NEW_TOKENS,
                                            min_decoding_length=NEW_TOKENS)
        return [token_to_id[t] for t in result[0].hypotheses[0]]  # no start token in the output

    new_ids, seconds = time_calls(generate, runs)
    return {"ids": new_ids, "seconds": seconds, "load_s": load_s,
            "compute_type": translator.compute_type}


WORKERS = {"minfer": run_minfer, "transformers": run_transformers, "ctranslate2": run_ctranslate2}


def worker_main(args: argparse.Namespace) -> int:
    ids = [int(t) for t in args.source.split(",")]
    if args.profile:
        return profile_minfer(Path(args.model), ids, args.runs, args.threads)
    result = WORKERS[args.worker](Path(args.model), ids, args.runs, args.threads)
    result["env_threads"] = {k: os.environ.get(k) for k in thread_env(args.threads)}
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


def profile_minfer(model_dir: Path, ids: list[int], runs: int, threads: int) -> int:
    """cProfile over `runs` minfer generate calls (after a warm-up), top entries by own time.

    NumPy ufuncs such as matmul are not profiled as calls of their own: their time appears as
    the own time (tottime) of the Python function that called them, so e.g. `lm_head`'s
    tottime is essentially the vocabulary projection.
    """
    import cProfile
    import pstats

    import minfer

    model = minfer.load(model_dir)
    model.generate([ids], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)  # warm-up
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(runs):
        model.generate([ids], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    profiler.disable()
    wall = time.perf_counter() - start
    print(f"minfer: {runs} generate calls of {NEW_TOKENS} tokens in {wall:.3f} s "
          f"({runs * NEW_TOKENS / wall:.1f} tok/s under the profiler)")
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(15)
    return 0


# =================================================================================================
# Preparation: checkpoints and CTranslate2 conversions
# =================================================================================================
def thread_env(threads: int) -> dict[str, str]:
    return {name: str(threads) for name in
            ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def ensure_checkpoint(shape: str) -> Path:
    """The random checkpoint of `shape`, written and rescaled on first use."""
    folder = CHECKPOINTS / shape
    embedding_scale, linear_gain = RESCALE[shape]
    wanted = {"embedding_scale": embedding_scale, "linear_gain": linear_gain}
    mark = folder / RESCALED_MARK
    if mark.is_file() and json.loads(mark.read_text()) == wanted:
        return folder
    print(f"writing a random {shape}-shaped checkpoint to {folder} ...", flush=True)
    CHECKPOINTS.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(FIXTURE_SCRIPT), f"--{shape}-shaped", str(folder)],
                   check=True)
    rescale_weights(folder, embedding_scale, linear_gain)
    mark.write_text(json.dumps(wanted) + "\n")
    for stale in CHECKPOINTS.glob(f"{shape}-ct2*"):  # converted from the previous weights
        shutil.rmtree(stale)
    return folder


def rescale_weights(folder: Path, embedding_scale: float, linear_gain: float) -> None:
    """Make the random model's greedy output varied and robust to float32 rounding.

    With the stock initialisation the tied embedding dominates the residual stream, so the
    model keeps predicting its previous token and greedy decoding emits id 0 (the start token)
    64 times: any two engines "agree" without that proving anything. Shrinking the embedding
    and enlarging the attention / feed-forward weights gives a more varied output whose
    top-1/top-2 logit margins stay far above float32 noise (larger gains make the random network
    chaotic, and then float32 engines legitimately disagree). Shapes, and so speed, are unchanged.
    """
    import numpy as np
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name, value in tensors.items():
        if name in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                    "lm_head.weight"):
            tensors[name] = value * np.float32(embedding_scale)
        elif name.endswith(LINEAR_SUFFIXES):
            tensors[name] = value * np.float32(linear_gain)
    save_file(tensors, path, metadata={"format": "pt"})


def have_ctranslate2() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import ctranslate2"], capture_output=True)
    return probe.returncode == 0


def ensure_ct2(model_dir: Path, quantization: str, tokenizer_dir: Path) -> Path:
    """Convert `model_dir` for CTranslate2 (once) and return the converted folder."""
    suffix = "-ct2" if quantization == "float32" else f"-ct2-{quantization}"
    out = model_dir.with_name(model_dir.name + suffix)
    if (out / "model.bin").is_file():
        return out
    # The converter loads a tokenizer from the model folder. It goes into a separate folder that
    # links to the weights, so the folder minfer and transformers read stays tokenizer-free
    # (minfer loads a tokenizer it finds there and detokenizes as it generates: cheap, but work
    # the other engines do not do).
    source = model_dir.with_name(model_dir.name + "-ct2-source")
    source.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        if not (source / name).exists():
            (source / name).symlink_to(model_dir.resolve() / name)
    for name in TOKENIZER_FILES:
        if not (source / name).is_file():
            shutil.copyfile(tokenizer_dir / name, source / name)
    converter = Path(sys.executable).with_name("ct2-transformers-converter")
    command = [str(converter) if converter.exists() else "ct2-transformers-converter",
               "--model", str(source), "--output_dir", str(out), "--force",
               "--quantization", quantization]
    print(f"converting for CTranslate2 ({quantization}) -> {out} ...", flush=True)
    subprocess.run(command, check=True)
    make_vocabulary_unique(out)
    return out


def read_ct2_vocabulary(folder: Path) -> list[str]:
    path = folder / "shared_vocabulary.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    path = folder / "shared_vocabulary.txt"
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def make_vocabulary_unique(folder: Path) -> None:
    """Rename repeated token strings in a converted model's vocabulary.

    The T5 tokenizer has 32100 pieces but the model 32128 rows; the converter names the 28 extra
    rows "<extra_id_0>".."<extra_id_27>" again, so those strings occur twice and an output
    token could not be mapped back to its id. The extra rows get unique names instead (they are
    never in our source, which only uses ids below 32000).
    """
    path = folder / "shared_vocabulary.json"
    if not path.is_file():
        raise SystemExit(f"{folder}: expected shared_vocabulary.json from the converter")
    vocab = json.loads(path.read_text(encoding="utf-8"))
    seen: set[str] = set()
    renamed = 0
    for i, token in enumerate(vocab):
        if token in seen:
            vocab[i] = f"<unused_row_{i}>"
            renamed += 1
        seen.add(vocab[i])
    if renamed:
        path.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        print(f"{path}: renamed {renamed} repeated token strings", flush=True)


# =================================================================================================
# Driver
# =================================================================================================
def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat; None where it does not exist."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def background_load(seconds: float = 1.0) -> float | None:
    """Fraction of the machine's CPU time used by others while we sleep for `seconds`.

    The machine may be shared; other processes running during a measurement slow it down
    unpredictably, so the driver samples this before each engine and warns when it is high.
    """
    before = cpu_ticks()
    time.sleep(seconds)
    after = cpu_ticks()
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def others_share(ticks_before: tuple[int, int] | None, children_before: resource.struct_rusage,
                 wall: float) -> float | None:
    """Fraction of all CPUs' time over the last `wall` seconds used by processes other than
    our (finished) children: all busy time minus the children's user + system time."""
    ticks_after = cpu_ticks()
    if ticks_before is None or ticks_after is None or wall <= 0:
        return None
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    ours = (children.ru_utime - children_before.ru_utime
            + children.ru_stime - children_before.ru_stime)
    busy = (ticks_after[0] - ticks_before[0]) / os.sysconf("SC_CLK_TCK")
    return max(0.0, busy - ours) / (wall * (os.cpu_count() or 1))


def measure(engine: str, model_dir: Path, ids: list[int], runs: int, threads: int) -> dict:
    """Run one engine's worker in a subprocess and return its result dict."""
    kind = ENGINES[engine]
    env = {**os.environ, **thread_env(threads)}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", kind,
               "--model", str(model_dir), "--runs", str(runs), "--threads", str(threads),
               "--source", ",".join(map(str, ids))]
    busy = background_load()
    note = f" (other processes were using {busy:.0%} of the CPUs)" if busy and busy > 0.1 else ""
    print(f"measuring {engine} ...{note}", flush=True)
    ticks, children = cpu_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    others = others_share(ticks, children, wall)
    if others is not None and others > 0.1:
        print(f"  ... other processes used {others:.0%} of the CPUs while {engine} ran: "
              "its numbers are unreliable", flush=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout + proc.stderr)
        return {"error": f"worker exited with status {proc.returncode}"}
    result = json.loads(lines[-1][len(RESULT_MARK):])
    result["background_load_before"] = busy
    result["background_load_during"] = others
    return result


def measure_all(folders: dict[str, Path], ids: list[int], runs: int, threads: int,
                rounds: int) -> dict[str, dict]:
    """Measure every engine `rounds` times, round-robin, pooling the timed runs: a slow drift of
    the machine's speed then affects all engines alike instead of whichever ran last."""
    results: dict[str, dict] = {}
    for round_no in range(rounds):
        if rounds > 1:
            print(f"round {round_no + 1} of {rounds}", flush=True)
        for engine, folder in folders.items():
            if "error" in results.get(engine, {}):
                continue
            r = measure(engine, folder, ids, runs, threads)
            if engine not in results or "error" in r:
                results[engine] = r
                continue
            pooled = results[engine]
            if r["ids"] != pooled["ids"]:
                pooled["error"] = "greedy output changed between rounds"
            pooled["seconds"] += r["seconds"]
            for key in ("background_load_before", "background_load_during"):
                values = [v for v in (pooled[key], r[key]) if v is not None]
                pooled[key] = max(values) if values else None
    for r in results.values():
        if "error" not in r:
            speeds = [NEW_TOKENS / s for s in r["seconds"]]
            r.update(median=statistics.median(speeds), min=min(speeds), max=max(speeds))
    return results


def compare_ids(reference: list[int], ids: list[int]) -> dict:
    """Equality of two id lists; the first mismatch when they differ."""
    for i, (a, b) in enumerate(zip(reference, ids)):
        if a != b:
            return {"equal": False, "first_mismatch": i, "reference": a, "got": b}
    if len(reference) != len(ids):
        return {"equal": False, "first_mismatch": min(len(reference), len(ids)),
                "reference_len": len(reference), "got_len": len(ids)}
    return {"equal": True}


def print_table(results: dict[str, dict]) -> None:
    base = results.get("minfer", {}).get("median")
    print(f"\n{'engine':<18} {'median tok/s':>12} {'min':>8} {'max':>8} {'minfer/engine':>14}")
    for engine, r in results.items():
        if "error" in r:
            print(f"{engine:<18} {r['error']}")
            continue
        ratio = f"{base / r['median']:.2f}" if base else "-"
        print(f"{engine:<18} {r['median']:>12.1f} {r['min']:>8.1f} {r['max']:>8.1f} {ratio:>14}")


def describe_ids(results: dict[str, dict]) -> None:
    """Print, per engine, whether its ids equal the reference's, with the decision margin."""
    ref = results[REFERENCE]
    margins = ref["margins"]  # the reference's top-1 minus top-2 logit at each step
    print(f"\ngenerated ids vs {REFERENCE}: {REFERENCE} emitted {len(set(ref['ids']))} distinct "
          f"ids, smallest top-1/top-2 logit margin {min(margins):.2g}")
    for engine, r in results.items():
        if "error" in r or engine == REFERENCE:
            continue
        check = r["id_check"]
        if check["equal"]:
            verdict = f"identical ({NEW_TOKENS} of {NEW_TOKENS})"
        elif "got" in check:
            step = check["first_mismatch"]
            verdict = (f"first differs at new token {step}: {REFERENCE} {check['reference']}, "
                       f"{engine} {check['got']} ({REFERENCE}'s margin there {margins[step]:.2g})")
        else:
            verdict = f"lengths differ ({check['reference_len']} vs {check['got_len']})"
        print(f"  {engine:<18} {verdict}")


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "git_commit": git("rev-parse", "HEAD"),
            "minfer_modified": bool(git("status", "--porcelain", "minfer"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="t5-small")
    parser.add_argument("--runs", type=int, default=5,
                        help="timed runs per engine (after 1 warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure the engines this many times round-robin and pool the runs")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"comma-separated subset of {', '.join(ENGINES)}")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER,
                        help="folder with the T5 tokenizer files (for the CTranslate2 converter)")
    parser.add_argument("--profile", action="store_true",
                        help="profile minfer alone with cProfile instead of benchmarking")
    # internal: a worker measuring one engine
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.runs, args.threads, args.rounds) < 1:
        parser.error("--runs, --threads and --rounds must be at least 1")

    if args.worker:
        return worker_main(args)

    ids = source_ids()
    model_dir = ensure_checkpoint(args.shape)
    if args.profile:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "minfer",
                   "--profile", "--model", str(model_dir), "--runs", str(args.runs),
                   "--threads", str(args.threads), "--source", ",".join(map(str, ids))]
        return subprocess.run(command, env={**os.environ, **thread_env(args.threads)}).returncode

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        parser.error(f"unknown engine {unknown[0]!r} (choose from {', '.join(ENGINES)})")
    folders = {}
    for engine in engines:
        kind = ENGINES[engine]
        if kind != "ctranslate2":
            folders[engine] = model_dir
        elif not have_ctranslate2():
            print(f"skipping {engine}: ctranslate2 is not importable")
        elif not all((args.tokenizer / f).is_file() for f in TOKENIZER_FILES):
            print(f"skipping {engine}: no T5 tokenizer files in {args.tokenizer}")
        else:
            quantization = {"ctranslate2-fp32": "float32", "ctranslate2-int8": "int8"}[engine]
            folders[engine] = ensure_ct2(model_dir, quantization, args.tokenizer)

    results = measure_all(folders, ids, args.runs, args.threads, args.rounds)
    reference = results.get(REFERENCE, {}).get("ids")
    for engine, r in results.items():
        if "error" not in r:
            if len(r["ids"]) != NEW_TOKENS:
                r["error"] = f"produced {len(r['ids'])} tokens instead of {NEW_TOKENS}"
            elif reference is not None:
                r["id_check"] = compare_ids(reference, r["ids"])

    print(f"\n{args.shape} (random weights), batch 1, source {SOURCE_LEN} tokens, "
          f"{NEW_TOKENS} new tokens greedy, float32 unless noted, {args.threads} threads, "
          f"median of {args.runs * args.rounds} runs"
          + (f" ({args.rounds} rounds of {args.runs})" if args.rounds > 1 else "")
          + " after 1 warm-up per process")
    print_table(results)
    if reference is not None and "error" not in results[REFERENCE]:
        describe_ids(results)
    if args.json:
        report = {"shape": args.shape, "batch": 1, "source_len": SOURCE_LEN,
                  "new_tokens": NEW_TOKENS, "threads": args.threads, "runs": args.runs,
                  "rounds": args.rounds,
                  "source_ids": ids, "machine": machine_info(), "results": results}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    failed = [e for e, r in results.items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
