"""Transformer-XL on CPU: minfer against Hugging Face transformers (PyTorch), and cached memory
against recomputing the context.

    python benchmarks/bench_transfo_xl.py [--runs 5] [--threads 2] [--json OUT] [--rounds 1]
                                          [--engines minfer,transformers] [--profile]

The model is shaped like transfo-xl-wt103 but only 4 layers deep and 512 wide: the full adaptive
vocabulary (267735 words, clusters at 20000 / 40000 / 200000, div_val 4), segments of 128,
mem_len 512, clamp_len 1000, same_length, untied u/v biases, post-norm, float32, batch 1. Its
weights are random (no network): on first use a subprocess builds it with transformers, redraws
the weights at a scale where the outputs are far from uniform (`randomise_weights`), and saves it
into benchmarks/checkpoints/transfo-xl-4l/ (gitignored).

Three measurements, each one warm-up call then `--runs` timed calls, per engine:

* scoring: the log-likelihood of a fixed random sequence of 12 * 128 + 1 ids, fed in segments
  of 128 with the memory carried from segment to segment and starting EMPTY (for transformers,
  `mems` = per-layer tensors of length 0; its mems=None would start from mem_len zero vectors).
  Both engines compute the full log-probabilities of every position. Tokens/s = 1536 predicted
  tokens / wall time. The two totals must agree within 1e-4 relative.
* cached generation: greedy continuation of a fixed random 512-id prompt by 33 tokens; the first
  one comes out of the prompt's pass, each of the other 32 costs one step with the memory
  carried. Reported: milliseconds per step (the prompt excluded). The engines' 33 ids are
  compared.
* recompute (minfer only): the same 32 predictions made the way a model without a segment
  memory must make them: for each, the last 512 tokens (= mem_len, the cached model's attention
  span) of prompt + tokens so far go through the whole model from an empty memory, and only the
  last position's log-probs are computed (`generate(window, max_new_tokens=1)`). It is fed the
  cached run's tokens, so both work on the same contexts.

Each engine runs in its own subprocess whose environment sets OMP_NUM_THREADS,
OPENBLAS_NUM_THREADS and MKL_NUM_THREADS to `--threads` before NumPy or torch is imported; torch
also gets torch.set_num_threads(). As in bench_t5.py, the driver warns when other processes used
a notable share of the CPUs before or while an engine ran.

`--profile` instead runs minfer's scoring alone under cProfile and times the matrix products of
one layer and of the output layer at the scoring shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
# The machine-load and environment helpers are shared with the T5 benchmark (stdlib only there).
from bench_t5 import (background_load, cpu_ticks, machine_info,  # noqa: E402
                      others_share, thread_env)

CHECKPOINTS = HERE / "checkpoints"
MODEL_NAME = "transfo-xl-4l"

# transfo-xl-wt103's configuration with fewer, narrower layers (wt103: 18 layers, d_model 1024,
# n_head 16, d_inner 4096, mem_len 1600); the vocabulary and its clusters are the real ones.
MODEL_CONFIG = dict(
    vocab_size=267735, cutoffs=[20000, 40000, 200000], div_val=4,
    d_model=512, d_embed=512, n_head=8, d_head=64, d_inner=2048, n_layer=4,
    tgt_len=128, mem_len=512, clamp_len=1000, same_length=True, untie_r=True, pre_lnorm=False,
    adaptive=True, attn_type=0, tie_word_embeddings=True, dropout=0.0, dropatt=0.0,
    eos_token_id=0,
)
# The weight redraw (see randomise_weights); the mark file records it with the config, so
# changing either rebuilds the checkpoint.
WEIGHT_SEED = 4242
EMB_GAIN = 2.0       # embedding / output-layer scale: logits of standard deviation ~EMB_GAIN
LINEAR_GAIN = 1.0    # transformer matrices: N(0, LINEAR_GAIN^2 / fan_in)
CLUSTER_BIAS = 2.0   # mean of the tail-cluster logit biases (tail words get picked now and then)
BUILT_MARK = "benchmark_build.json"

SEGMENT = 128
SCORE_SEGMENTS = 12            # the scored sequence has SCORE_SEGMENTS * SEGMENT + 1 ids
PROMPT_LEN = 512
STEPS = 32                     # cached steps per generation (33 new tokens, see the docstring)
WINDOW = MODEL_CONFIG["mem_len"]  # context length of the recompute baseline
SCORE_SEED, PROMPT_SEED = 20240611, 20240612
LL_TOLERANCE = 1e-4            # relative difference allowed between the engines' log-likelihoods
RESULT_MARK = "BENCH_RESULT "  # a worker's last stdout line: this mark, then JSON

ENGINES = ("minfer", "transformers")


def random_ids(seed: int, n: int) -> list[int]:
    """n ids drawn uniformly from the whole vocabulary (so every cluster is exercised)."""
    rng = random.Random(seed)
    return [rng.randrange(MODEL_CONFIG["vocab_size"]) for _ in range(n)]


def score_ids() -> list[int]:
    return random_ids(SCORE_SEED, SCORE_SEGMENTS * SEGMENT + 1)


def prompt_ids() -> list[int]:
    return random_ids(PROMPT_SEED, PROMPT_LEN)


# =================================================================================================
# The checkpoint (built in a subprocess: the driver itself never imports torch)
# =================================================================================================
def build_recipe() -> dict:
    return {"config": MODEL_CONFIG, "seed": WEIGHT_SEED, "emb_gain": EMB_GAIN,
            "linear_gain": LINEAR_GAIN, "cluster_bias": CLUSTER_BIAS}


def ensure_checkpoint(threads: int) -> Path:
    folder = CHECKPOINTS / MODEL_NAME
    mark = folder / BUILT_MARK
    if mark.is_file() and json.loads(mark.read_text()) == build_recipe():
        return folder
    print(f"writing a random Transformer-XL checkpoint to {folder} ...", flush=True)
    CHECKPOINTS.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "build",
               "--model", str(folder), "--threads", str(threads)]
    subprocess.run(command, env={**os.environ, **thread_env(threads)}, check=True)
    mark.write_text(json.dumps(build_recipe()) + "\n")
    return folder


def patch_type_as() -> None:
    """transformers 4.57's TransfoXL calls `tensor.type_as(dtype=...)`, which current torch
    rejects (type_as takes a tensor). Accept the keyword as a plain cast; other calls unchanged."""
    import torch

    original = torch.Tensor.type_as
    if getattr(original, "_bench_patched", False):
        return

    def type_as(self, other=None, dtype=None):
        if other is None and dtype is not None:
            return self.to(dtype)
        return original(self, other)

    type_as._bench_patched = True
    torch.Tensor.type_as = type_as


def randomise_weights(model, seed: int) -> None:
    """Redraw every parameter so the random model's predictions are far from uniform.

    HF's initialisation (std 0.02, projections 0.01) gives almost flat log-probs over 267735
    words, which makes the log-likelihood check weak and greedy ties likely. Instead:
    embedding tables N(0, EMB_GAIN^2 / width) (the tied output layers share them), every
    projection and the cluster weights about unit gain, so inputs and logits come out at
    ~EMB_GAIN whatever the cluster; transformer matrices N(0, LINEAR_GAIN^2 / fan_in), their
    biases N(0, 0.1^2); LayerNorm gains U(0.6, 1.4), biases N(0, 0.1^2); u and v biases
    N(0, 0.5^2); output biases N(0, 0.5^2), tail-cluster biases N(CLUSTER_BIAS, 0.5^2).
    Parameters shared by tying are drawn once. Speed does not depend on any of this.
    """
    import torch

    torch.manual_seed(seed)
    d_model = model.config.d_model
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied parameters appear once
            if p.numel() == 0:
                continue  # a zero-width embedding (not the case here)
            if ".emb_layers." in name:
                p.normal_(0.0, EMB_GAIN / math.sqrt(p.shape[1]))
            elif ".emb_projs." in name or ".out_projs." in name:
                p.normal_(0.0, 1.0 / math.sqrt(d_model))
            elif name == "crit.cluster_weight":
                p.normal_(0.0, EMB_GAIN / math.sqrt(p.shape[1]))
            elif name == "crit.cluster_bias":
                p.normal_(CLUSTER_BIAS, 0.5)
            elif name.startswith("crit.out_layers.") and name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith(("r_w_bias", "r_r_bias")):
                p.normal_(0.0, 0.5)
            elif "layer_norm" in name:
                if name.endswith(".weight"):
                    p.uniform_(0.6, 1.4)
                else:
                    p.normal_(0.0, 0.1)
            elif name.endswith(".weight"):  # qkv_net, r_net, o_net, CoreNet linears
                p.normal_(0.0, LINEAR_GAIN / math.sqrt(p.shape[1]))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            else:
                raise RuntimeError(f"randomise_weights: no rule for parameter {name}")


def build_checkpoint(folder: Path) -> None:
    import torch
    import transformers
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    transformers.logging.set_verbosity_error()
    config = TransfoXLConfig(**MODEL_CONFIG)
    torch.manual_seed(WEIGHT_SEED)
    model = TransfoXLLMHeadModel(config).eval()
    randomise_weights(model, WEIGHT_SEED)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        old.unlink()
    # untie_r is true, so the only shared tensors are the ones HF ties itself (output layers and
    # projections): save_pretrained leaves those copies out and minfer takes them from word_emb.
    model.save_pretrained(folder, safe_serialization=True)
    for extra in folder.iterdir():  # e.g. generation_config.json: only the weights and config
        if extra.name not in ("config.json", "model.safetensors"):
            extra.unlink()


# =================================================================================================
# Workers: one engine each, in a subprocess with the thread environment already set
# =================================================================================================
def same_output(a, b) -> bool:
    """Equal ids; log-likelihoods equal up to float64 summation-order noise."""
    if isinstance(a, float):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def timed_runs(call, runs: int) -> tuple[object, list]:
    """One warm-up call, then `runs` timed ones; each call returns (output, timing). Returns the
    warm-up's output and the timings; the output must not change between calls."""
    first, _ = call()
    timings = []
    for _ in range(runs):
        again, timing = call()
        if not same_output(again, first):
            raise RuntimeError(f"output changed between runs: {first!r} then {again!r}")
        timings.append(timing)
    return first, timings


def run_minfer(model_dir: Path, runs: int, threads: int) -> dict:
    import minfer

    start = time.perf_counter()
    model = minfer.load(model_dir)
    load_s = time.perf_counter() - start
    ids = score_ids()

    def score():
        t0 = time.perf_counter()
        r = model.score(ids, segment_len=SEGMENT)
        return r["log_likelihood"], time.perf_counter() - t0

    ll, score_s = timed_runs(score, runs)

    prompt = prompt_ids()

    def cached():
        t0 = time.perf_counter()
        out, t_first = [], None
        for token in model.generate([prompt], max_new_tokens=STEPS + 1, stream=True):
            out.append(int(token))
            if t_first is None:
                t_first = time.perf_counter()  # the prompt's pass is done
        t_end = time.perf_counter()
        return out, {"prompt_s": t_first - t0, "step_s": (t_end - t_first) / STEPS}

    new_ids, cached_t = timed_runs(cached, runs)

    def recompute():
        context = prompt + new_ids
        out = []
        t0 = time.perf_counter()
        for t in range(1, STEPS + 1):
            window = context[:PROMPT_LEN + t][-WINDOW:]
            out.append(int(model.generate([window], max_new_tokens=1)[0][0]))
        return out, (time.perf_counter() - t0) / STEPS

    recompute_ids, recompute_s = timed_runs(recompute, runs)
    agree = sum(a == b for a, b in zip(recompute_ids, new_ids[1:]))
    return {"load_s": load_s,
            "score": {"log_likelihood": ll, "tokens": len(ids) - 1, "seconds": score_s},
            "cached": {"ids": new_ids, "step_s": [c["step_s"] for c in cached_t],
                       "prompt_s": [c["prompt_s"] for c in cached_t]},
            "recompute": {"step_s": recompute_s, "window": WINDOW,
                          "same_as_cached": agree}}


def run_transformers(model_dir: Path, runs: int, threads: int) -> dict:
    import numpy as np
    import torch
    import transformers
    from transformers import TransfoXLLMHeadModel

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    patch_type_as()
    start = time.perf_counter()
    model, info = TransfoXLLMHeadModel.from_pretrained(model_dir, dtype=torch.float32,
                                                       output_loading_info=True)
    model.eval()
    load_s = time.perf_counter() - start
    if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")):
        raise RuntimeError(f"transformers loading info: {info}")
    cfg = model.config

    def empty_mems() -> list:
        # one tensor per layer (distinct objects): HF runs its own code with mlen = 0
        return [torch.empty(0, 1, cfg.d_model) for _ in range(cfg.n_layer)]

    ids = torch.tensor([score_ids()], dtype=torch.long)
    n = ids.shape[1] - 1
    entropy = []

    def score():
        total = 0.0
        t0 = time.perf_counter()
        with torch.inference_mode():
            mems = empty_mems()
            for s in range(0, n, SEGMENT):
                e = min(s + SEGMENT, n)
                out = model(input_ids=ids[:, s:e], mems=mems)
                mems = out.mems
                lp = out.prediction_scores[0]                                  # (T, V) log-probs
                total += float(lp[torch.arange(e - s), ids[0, s + 1:e + 1]].double().sum())
                if not entropy:  # warm-up only: how far from uniform the predictions are
                    entropy.append(float(-(lp.exp() * lp).sum(-1).mean()))
        return total, time.perf_counter() - t0

    ll, score_s = timed_runs(score, runs)

    prompt = torch.tensor([prompt_ids()], dtype=torch.long)
    margins = []

    def margin(last) -> float:
        top2 = last.topk(2).values
        return float(top2[0] - top2[1])

    def cached():
        record = not margins  # the warm-up call records the greedy margins
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model(input_ids=prompt, mems=empty_mems())
            last, mems = out.prediction_scores[0, -1], out.mems
            tokens = [int(last.argmax())]
            t_first = time.perf_counter()
            for _ in range(STEPS):
                if record:
                    margins.append(margin(last))
                out = model(input_ids=torch.tensor([[tokens[-1]]]), mems=mems)
                last, mems = out.prediction_scores[0, -1], out.mems
                tokens.append(int(last.argmax()))
            t_end = time.perf_counter()
            if record:
                margins.append(margin(last))
        return tokens, {"prompt_s": t_first - t0, "step_s": (t_end - t_first) / STEPS}

    new_ids, cached_t = timed_runs(cached, runs)
    return {"load_s": load_s, "torch_threads": torch.get_num_threads(),
            "score": {"log_likelihood": ll, "tokens": n, "seconds": score_s,
                      "entropy_fraction": entropy[0] / math.log(cfg.vocab_size)},
            "cached": {"ids": new_ids, "step_s": [c["step_s"] for c in cached_t],
                       "prompt_s": [c["prompt_s"] for c in cached_t], "margins": margins},
            "numpy_version": np.__version__, "torch_version": torch.__version__,
            "transformers_version": transformers.__version__}


WORKERS = {"minfer": run_minfer, "transformers": run_transformers}


def worker_main(args: argparse.Namespace) -> int:
    if args.worker == "build":
        build_checkpoint(Path(args.model))
        return 0
    if args.profile:
        return profile_minfer(Path(args.model), args.runs)
    result = WORKERS[args.worker](Path(args.model), args.runs, args.threads)
    result["env_threads"] = {k: os.environ.get(k) for k in thread_env(args.threads)}
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


def best_seconds(fn, repeats: int = 5) -> float:
    """Fastest of `repeats` calls of fn (after one untimed call)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def profile_minfer(model_dir: Path, runs: int) -> int:
    """cProfile over `runs` scoring calls, then the pieces of one segment timed in isolation.

    NumPy ufuncs (matmul, exp, ...) are not calls cProfile sees: their time is the own time
    (tottime) of the Python function that called them. `forward_hidden`'s tottime is thus the
    transformer body's matrix products, `logits` (inside log_probs) the output layer's, and
    `log_softmax` / `log_probs` the adaptive softmax's elementwise work and copies. The second
    part splits the body into attention and feed-forward by timing each product at the scoring
    shapes (segment 128, memory 512) with the model's own weights.
    """
    import cProfile
    import pstats

    import numpy as np

    import minfer
    from minfer import ops
    from minfer.models.transfo_xl import math as xl

    model = minfer.load(model_dir)
    ids = score_ids()
    model.score(ids, segment_len=SEGMENT)  # warm-up
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(runs):
        model.score(ids, segment_len=SEGMENT)
    profiler.disable()
    wall = time.perf_counter() - start
    n = (len(ids) - 1) * runs
    print(f"minfer: {runs} scoring calls of {len(ids) - 1} tokens in {wall:.3f} s "
          f"({n / wall:.1f} tok/s under the profiler)")
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("tottime").print_stats(20)
    stats.sort_stats("cumulative").print_stats(12)

    be, cfg, params = model.backend, model.config, model.params
    T, M = SEGMENT, cfg.mem_len
    K, H, D, C = T + M, cfg.n_head, cfg.d_head, cfg.d_model
    rng = np.random.default_rng(0)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    p = params["layers"][0].params  # a resident layer's weights as the math sees them
    x, pos = rand(1, T, C), rand(K, C)
    q, k, v = rand(1, H, T, D), rand(1, H, K, D), rand(1, H, K, D)
    r, probs = rand(H, D, K), rand(1, H, T, K)
    body = {  # one layer
        "qkv projection of the segment": lambda: ops.linear(np, x, p["w_qkv"]),
        "r_net (position projection)": lambda: ops.linear(np, pos, p["w_r"]),
        "AC + BD score products": lambda: (q @ k.swapaxes(-1, -2), q @ r),
        "rel_shift": lambda: xl.rel_shift(np, probs),
        "softmax": lambda: ops.softmax_(np, probs.copy()),
        "probs @ v": lambda: probs @ v,
        "o_net": lambda: ops.linear(np, x, p["w_o"]),
        "feed-forward (2 products, relu)": lambda: ops.linear(np, ops.relu_(np, ops.linear(np, x, p["w1"]) + p["b1"]), p["w2"]),
        "layer norms (2)": lambda: (ops.layer_norm(np, x, p["ln_attn_w"], p["ln_attn_b"], cfg.eps),
                                    ops.layer_norm(np, x, p["ln_ff_w"], p["ln_ff_b"], cfg.eps)),
    }
    h = rand(T, C)
    head = {"log_probs (whole adaptive softmax)": lambda: xl.log_probs(be, cfg, params, h)}
    for i in range(cfg.n_clusters):
        def logits(i=i):
            return xl.cluster_logits(np, params, i, h)
        head[f"  cluster {i} logits ({params[f'cluster.{i}.w'].shape[1]} columns)"] = logits
        z = logits()
        head[f"  cluster {i} log_softmax"] = lambda z=z: ops.log_softmax_(np, z.copy())

    memory = model.new_memory(1)
    seg = np.asarray([ids[:T]])
    def segment():
        with be.arena.scope():
            xl.forward_hidden(be, cfg, params, seg, memory.live(), memory.length)
            memory.advance(T)
    for _ in range(M // T):
        segment()  # fill the memory
    whole = best_seconds(segment)
    memory.release()
    per_segment = wall / runs / SCORE_SEGMENTS
    print(f"one segment of {T} tokens with {M} in memory, timed in isolation "
          f"(fastest of 5); the profiled scoring took {per_segment * 1e3:.1f} ms per segment")
    print(f"  {'forward_hidden (whole body, ' + str(cfg.n_layer) + ' layers)':<44} "
          f"{whole * 1e3:8.2f} ms")
    for name, fn in body.items():
        s = best_seconds(fn) * cfg.n_layer
        print(f"  {name + ' x' + str(cfg.n_layer):<44} {s * 1e3:8.2f} ms")
    for name, fn in head.items():
        print(f"  {name:<44} {best_seconds(fn) * 1e3:8.2f} ms")
    return 0


# =================================================================================================
# Driver
# =================================================================================================
def measure(engine: str, model_dir: Path, runs: int, threads: int) -> dict:
    """Run one engine's worker in a subprocess; its result dict (or {"error": ...})."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", engine,
               "--model", str(model_dir), "--runs", str(runs), "--threads", str(threads)]
    busy = background_load()
    note = f" (other processes were using {busy:.0%} of the CPUs)" if busy and busy > 0.1 else ""
    print(f"measuring {engine} ...{note}", flush=True)
    ticks, children = cpu_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, env={**os.environ, **thread_env(threads)},
                          capture_output=True, text=True)
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
    result["worker_wall_s"] = wall
    return result


TIMING_LISTS = (("score", "seconds"), ("cached", "step_s"), ("cached", "prompt_s"),
                ("recompute", "step_s"))


def pool(into: dict, r: dict) -> None:
    """Add round `r`'s timed runs to the pooled result `into`."""
    if r["cached"]["ids"] != into["cached"]["ids"]:
        into["error"] = "greedy output changed between rounds"
    if not same_output(r["score"]["log_likelihood"], into["score"]["log_likelihood"]):
        into["error"] = "log-likelihood changed between rounds"
    for part, key in TIMING_LISTS:
        if part in r:
            into[part][key] += r[part][key]
    for key in ("background_load_before", "background_load_during"):
        values = [v for v in (into[key], r[key]) if v is not None]
        into[key] = max(values) if values else None


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(results: dict[str, dict]) -> dict:
    """Per engine: tokens/s of scoring, ms per cached step, ms per recomputed token; and the
    comparisons (ratios, log-likelihood agreement, id equality)."""
    for r in results.values():
        if "error" in r:
            continue
        r["score"]["tokens_per_s"] = spread([r["score"]["tokens"] / s
                                             for s in r["score"]["seconds"]])
        r["cached"]["ms_per_token"] = spread([1e3 * s for s in r["cached"]["step_s"]])
        r["cached"]["prompt_ms"] = spread([1e3 * s for s in r["cached"]["prompt_s"]])
        if "recompute" in r:
            r["recompute"]["ms_per_token"] = spread([1e3 * s for s in r["recompute"]["step_s"]])
    ok = {e: r for e, r in results.items() if "error" not in r}
    summary: dict = {}
    mf, hf = ok.get("minfer"), ok.get("transformers")
    if mf:
        summary["recompute_over_cached"] = (mf["recompute"]["ms_per_token"]["median"]
                                            / mf["cached"]["ms_per_token"]["median"])
    if mf and hf:
        summary["scoring_speedup"] = (mf["score"]["tokens_per_s"]["median"]
                                      / hf["score"]["tokens_per_s"]["median"])
        summary["cached_step_speedup"] = (hf["cached"]["ms_per_token"]["median"]
                                          / mf["cached"]["ms_per_token"]["median"])
        a, b = mf["score"]["log_likelihood"], hf["score"]["log_likelihood"]
        summary["log_likelihood"] = {"minfer": a, "transformers": b,
                                     "relative_difference": abs(a - b) / abs(b),
                                     "tolerance": LL_TOLERANCE,
                                     "agree": abs(a - b) <= LL_TOLERANCE * abs(b)}
        ref, got = hf["cached"]["ids"], mf["cached"]["ids"]
        mismatch = next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), None)
        summary["generated_ids"] = {"equal": ref == got, "first_mismatch": mismatch,
                                    "count": len(ref)}
    return summary


def print_report(results: dict[str, dict], summary: dict, args: argparse.Namespace) -> None:
    n_runs = args.runs * args.rounds
    print(f"\n{MODEL_NAME} (random weights; 4 layers, d_model 512, vocab 267735 adaptive, "
          f"mem_len 512), batch 1, float32, {args.threads} threads, median of {n_runs} runs"
          + (f" ({args.rounds} rounds of {args.runs})" if args.rounds > 1 else "")
          + " after 1 warm-up per process")
    scoring = f"scoring {SCORE_SEGMENTS * SEGMENT} tokens, seg {SEGMENT}"
    rows = [(scoring, e, r["score"]["tokens_per_s"], "tok/s") for e, r in results.items()
            if "error" not in r]
    rows += [(f"cached generation, {STEPS} steps", e, r["cached"]["ms_per_token"], "ms/token")
             for e, r in results.items() if "error" not in r]
    mf = results.get("minfer", {})
    if "error" not in mf and "recompute" in mf:
        rows.append((f"recompute {WINDOW}-token window", "minfer",
                     mf["recompute"]["ms_per_token"], "ms/token"))
    print(f"\n{'measurement':<34} {'engine':<13} {'median':>9} {'min':>9} {'max':>9} "
          f"{'unit':<9} {'minfer/engine':>13}")
    last_task = None
    for task, engine, s, unit in rows:
        ratio = "-"
        if engine != "minfer" and "error" not in mf:
            if unit == "tok/s":
                ratio = f"{mf['score']['tokens_per_s']['median'] / s['median']:.2f}"
            elif task.startswith("cached"):
                ratio = f"{s['median'] / mf['cached']['ms_per_token']['median']:.2f}"
        label = task if task != last_task else ""
        last_task = task
        print(f"{label:<34} {engine:<13} {s['median']:>9.1f} {s['min']:>9.1f} {s['max']:>9.1f} "
              f"{unit:<9} {ratio:>13}")
    for e, r in results.items():
        if "error" in r:
            print(f"{'':<34} {e:<13} {r['error']}")
    print("(minfer/engine: how many times faster minfer is; above 1 minfer wins)")

    if "recompute_over_cached" in summary:
        print(f"\ncached memory vs recompute: {summary['recompute_over_cached']:.1f}x less time "
              f"per token ({mf['recompute']['ms_per_token']['median']:.1f} vs "
              f"{mf['cached']['ms_per_token']['median']:.1f} ms); the recomputed windows "
              f"predicted {mf['recompute']['same_as_cached']} of {STEPS} tokens like the cached "
              "run (they see less context)")
    for e, r in results.items():
        if "error" not in r:
            print(f"prompt pass ({PROMPT_LEN} tokens, {e}): "
                  f"{r['cached']['prompt_ms']['median']:.0f} ms")
    ll = summary.get("log_likelihood")
    if ll:
        verdict = "agree" if ll["agree"] else "DISAGREE"
        n = results["minfer"]["score"]["tokens"]
        print(f"\nlog-likelihood of the {n} scored tokens: minfer {ll['minfer']:.6f}, "
              f"transformers {ll['transformers']:.6f}; relative difference "
              f"{ll['relative_difference']:.2e} (tolerance {LL_TOLERANCE:g}): {verdict}")
        frac = results["transformers"]["score"].get("entropy_fraction")
        print(f"  perplexity {math.exp(-ll['minfer'] / n):.4g}; mean entropy of the predictions "
              f"{frac:.2f} x log(vocab) (1 would be uniform)")
    ids = summary.get("generated_ids")
    if ids:
        margins = results["transformers"]["cached"]["margins"]
        distinct = len(set(results["transformers"]["cached"]["ids"]))
        if ids["equal"]:
            verdict = f"identical ({ids['count']} of {ids['count']})"
        else:
            i = ids["first_mismatch"]
            verdict = (f"first differ at new token {i} (transformers' top-1/top-2 margin there "
                       f"{margins[i]:.2g})")
        print(f"generated ids, minfer vs transformers: {verdict}; {distinct} distinct ids, "
              f"smallest greedy margin {min(margins):.2g}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5,
                        help="timed runs per measurement and engine (after 1 warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure the engines this many times round-robin and pool the runs")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"comma-separated subset of {', '.join(ENGINES)}")
    parser.add_argument("--profile", action="store_true",
                        help="profile minfer's scoring alone with cProfile instead")
    # internal: a worker measuring one engine, or building the checkpoint
    parser.add_argument("--worker", choices=[*WORKERS, "build"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.runs, args.threads, args.rounds) < 1:
        parser.error("--runs, --threads and --rounds must be at least 1")
    if args.worker:
        return worker_main(args)

    model_dir = ensure_checkpoint(args.threads)
    if args.profile:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "minfer",
                   "--profile", "--model", str(model_dir), "--runs", str(args.runs),
                   "--threads", str(args.threads)]
        return subprocess.run(command, env={**os.environ, **thread_env(args.threads)}).returncode

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        parser.error(f"--engines: choose from {', '.join(ENGINES)}")
    results: dict[str, dict] = {}
    for round_no in range(args.rounds):
        if args.rounds > 1:
            print(f"round {round_no + 1} of {args.rounds}", flush=True)
        for engine in engines:
            if "error" in results.get(engine, {}):
                continue
            r = measure(engine, model_dir, args.runs, args.threads)
            if engine in results and "error" not in r:
                pool(results[engine], r)
            else:
                results[engine] = r
    summary = summarise(results)
    print_report(results, summary, args)
    if args.json:
        report = {"model": MODEL_NAME, "build": build_recipe(), "batch": 1,
                  "score_tokens": SCORE_SEGMENTS * SEGMENT, "segment": SEGMENT,
                  "prompt_len": PROMPT_LEN, "cached_steps": STEPS, "recompute_window": WINDOW,
                  "seeds": {"score": SCORE_SEED, "prompt": PROMPT_SEED},
                  "threads": args.threads, "runs": args.runs, "rounds": args.rounds,
                  "machine": machine_info(), "summary": summary, "results": results}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    failed = [e for e, r in results.items() if "error" in r]
    ll = summary.get("log_likelihood")
    return 1 if failed or (ll and not ll["agree"]) else 0


if __name__ == "__main__":
    sys.exit(main())
