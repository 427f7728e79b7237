"""The GPU checklist of shared/gpu.md in one script, for the day a GPU is lent.

    python3 benchmarks/gpu_check.py [--quick] [--out DIR]

On the lent machine (cupy-cuda13x, torch with CUDA, transformers 5.x, no network): runs every
step below, each with its own time limit, and writes everything to $OUT (or --out):
gpu_check.log (what it saw, as it goes) and gpu_check.json (the numbers). Without a GPU (or
without CuPy / torch) it says so and exits 0: on a developer machine it is an import check.

1. tests: `pytest tests/test_cuda.py tests/test_cuda_standin.py` and the T5 parity tests
   (the stand-in tests also run on the GPU machine: they must still pass there).
2. parity against transformers on the same GPU: random-weight T5 configs (t5-small-shaped v1.0,
   flan-t5-shaped gated v1.1 untied, odd shapes) saved with save_pretrained and loaded by
   minfer: teacher-forced logits and greedy / beam ids, float32 and float16 (transformers keeps
   `wo` in float32 there, as minfer does). Transformer-XL: transformers 5 has no TransfoXL, so
   the committed fixtures' references (transformers 4.57, weights/transfo_xl/*/reference.npz)
   and minfer's CPU run are the oracles.
3. memory: a t5-large-shaped random model under a memory_limit about 4x smaller than its
   weights: arena peak and CuPy's pool within the limit, `nvidia-smi`'s process memory logged,
   ids equal to the unlimited run; float16 and int8.
4. speed: t5-base-shaped greedy decode, batch 1 and 16, and beam 4 (64 new tokens, eos
   suppressed), minfer against transformers (same GPU, same dtype): tokens/s and ratios;
   Transformer-XL scoring tokens/s (no transformers peer).
Then copy the summary into benchmarks/README.md by hand (device, versions, numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))          # minfer from this checkout, installed or not
sys.path.insert(0, str(ROOT / "tests"))

RESULTS: dict = {}
LOG = None


def log(*parts: object) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    if LOG is not None:
        LOG.write(line + "\n")
        LOG.flush()


def step(name: str):
    """Run a checklist step, log its failure instead of stopping the others."""
    def wrap(fn):
        def run(*args, **kwargs):
            log(f"\n== {name}")
            t0 = time.perf_counter()
            try:
                RESULTS[name] = fn(*args, **kwargs)
                status = "ok"
            except Exception as e:  # noqa: BLE001  (every failure is a finding to report)
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}",
                                 "traceback": traceback.format_exc()}
                log(traceback.format_exc())
                status = "FAILED"
            log(f"== {name}: {status} ({time.perf_counter() - t0:.1f} s)")
        return run
    return wrap


def gpu_present() -> str | None:
    """None when the checklist can run, else why not."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy finds no CUDA device"
    except Exception as e:  # noqa: BLE001
        return f"CuPy unavailable ({type(e).__name__}: {e})"
    try:
        import torch
        if not torch.cuda.is_available():
            return "torch has no CUDA"
    except Exception as e:  # noqa: BLE001
        return f"torch unavailable ({type(e).__name__}: {e})"
    return None


def versions() -> dict:
    out = {"python": sys.version.split()[0], "numpy": np.__version__}
    for name in ("cupy", "torch", "transformers", "minfer"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001
            out[name] = f"missing ({type(e).__name__})"
    try:
        out["nvidia-smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as e:  # noqa: BLE001
        out["nvidia-smi"] = f"unavailable ({e})"
    return out


def device_memory_mib() -> float | None:
    """This process's device memory as nvidia-smi reports it (MiB), if it can."""
    try:
        rows = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=30).stdout.splitlines()
        for row in rows:
            pid, used = [c.strip() for c in row.split(",")]
            if int(pid) == os.getpid():
                return float(used)
    except Exception:  # noqa: BLE001
        pass
    return None


# =====================================================================================================
# 1. tests
# =====================================================================================================
@step("tests")
def run_tests(quick: bool) -> dict:
    files = ["tests/test_cuda.py", "tests/test_cuda_standin.py"]
    if not quick:
        files += ["tests/test_t5_parity.py", "tests/test_transfo_xl_model.py"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           *files], cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    log(proc.stdout[-6000:], proc.stderr[-2000:])
    return {"returncode": proc.returncode, "summary": proc.stdout.strip().splitlines()[-1:]}


# =====================================================================================================
# 2. parity against transformers
# =====================================================================================================
T5_SHAPES = {
    "t5-small-shaped": dict(d_model=512, d_kv=64, d_ff=2048, num_heads=8, num_layers=6,
                            feed_forward_proj="relu", tie_word_embeddings=True),
    "flan-t5-shaped": dict(d_model=512, d_kv=64, d_ff=1024, num_heads=6, num_layers=8,
                           num_decoder_layers=8, feed_forward_proj="gated-gelu",
                           tie_word_embeddings=False),
    "odd-shapes": dict(d_model=72, d_kv=20, d_ff=136, num_heads=5, num_layers=3,
                       num_decoder_layers=2, feed_forward_proj="gated-silu",
                       tie_word_embeddings=False),
}


def hf_t5(folder: Path, vocab: int, seed: int, **shape) -> None:
    """A random transformers T5 saved to `folder` (safetensors)."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=vocab, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                   **shape)
    model = T5ForConditionalGeneration(cfg)
    with torch.no_grad():   # trained-like scales: large enough that greedy decoding is not flat
        for name, p in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                p.normal_(1.0, 0.1)
    model.save_pretrained(folder)


def torch_t5(folder: Path, dtype: str):
    import torch
    from transformers import T5ForConditionalGeneration
    model = T5ForConditionalGeneration.from_pretrained(
        folder, dtype=getattr(torch, dtype)).to("cuda").eval()
    return model


@step("parity")
def parity(work: Path, quick: bool) -> dict:
    import torch

    import minfer
    out = {}
    rng = np.random.default_rng(0)
    vocab = 2000
    for name, shape in T5_SHAPES.items():
        folder = work / name
        hf_t5(folder, vocab, seed=1, **shape)
        src = rng.integers(2, vocab, (3, 17))
        src[1, 12:] = 0                                  # a padded row
        mask = (src != 0).astype(np.int64)
        mask[:, 0] = 1
        dec = np.concatenate([np.zeros((3, 1), np.int64), rng.integers(2, vocab, (3, 9))], 1)
        for dtype, tol in (("float32", 1e-3), ("float16", 3e-2)):
            ref = torch_t5(folder, dtype)
            with torch.no_grad():
                t = lambda a: torch.as_tensor(a, device="cuda")  # noqa: E731
                want = ref(input_ids=t(src), attention_mask=t(mask),
                           decoder_input_ids=t(dec)).logits.float().cpu().numpy()
                hf_greedy = ref.generate(input_ids=t(src), attention_mask=t(mask),
                                         max_new_tokens=20, do_sample=False).cpu().numpy()
                hf_beam = ref.generate(input_ids=t(src), attention_mask=t(mask), num_beams=4,
                                       max_new_tokens=20, do_sample=False).cpu().numpy()
            del ref
            torch.cuda.empty_cache()
            m = minfer.load(folder, device="cuda", dtype=dtype)
            got = m.forward(src, dec, attention_mask=mask)
            err = float(np.abs(got - want).max() / np.abs(want).max())
            from conftest import trim_hf_ids
            greedy = m.generate(src, attention_mask=mask, max_new_tokens=20)
            beam = m.generate(src, attention_mask=mask, max_new_tokens=20, num_beams=4)
            same_greedy = sum(g == trim_hf_ids(h) for g, h in zip(greedy, hf_greedy))
            same_beam = sum(g == trim_hf_ids(h) for g, h in zip(beam, hf_beam))
            handed = m.encode(src, attention_mask=mask, return_tensors="pt")   # DLPack, same device
            handed_equal = torch.equal(handed.cpu(), torch.from_numpy(m.encode(src, attention_mask=mask)))
            out[f"{name}/{dtype}"] = {"logits_rel_err": err, "tolerance": tol,
                                      "greedy_rows_equal": f"{same_greedy}/3",
                                      "beam_rows_equal": f"{same_beam}/3",
                                      "encode_pt": f"{handed.device}, equal: {handed_equal}",
                                      "pool_peak": m.backend.arena.pool_peak}
            log(name, dtype, out[f"{name}/{dtype}"])
            del m
        if quick:
            break
    # Transformer-XL: the committed transformers 4.57 references, and minfer on the CPU
    from conftest import XL_CASES, XL_FIXTURES, load_xl_reference
    for case in XL_CASES:
        ref = load_xl_reference(case)
        cpu = minfer.load(XL_FIXTURES / case)
        for dtype in ("float32", "float16"):
            m = minfer.load(XL_FIXTURES / case, device="cuda", dtype=dtype)
            ids, seg = ref["input_ids"], int(ref["segment_len"])
            mem, mem_cpu, worst_hf, worst_cpu = m.new_memory(len(ids)), cpu.new_memory(len(ids)), 0.0, 0.0
            for i, start in enumerate(range(0, ids.shape[1], seg)):
                got, mem = m.forward(ids[:, start:start + seg], mem)
                want, mem_cpu = cpu.forward(ids[:, start:start + seg], mem_cpu)
                worst_cpu = max(worst_cpu, float(np.abs(got - want).max()))
                if f"log_probs_{i}" in ref:
                    worst_hf = max(worst_hf, float(np.abs(got - ref[f"log_probs_{i}"]).max()))
            row = {"max_abs_vs_cpu": worst_cpu, "max_abs_vs_transformers_4_57": worst_hf}
            if dtype == "float32" and "greedy_ids" in ref:
                prompt = ref["greedy_prompt"]
                new = int(ref["greedy_max_new_tokens"])
                got_ids = m.generate(prompt, max_new_tokens=new, min_new_tokens=new)
                row["greedy_equal"] = [list(map(int, r)) for r in ref["greedy_ids"]] == [
                    list(prompt[i]) + list(g) for i, g in enumerate(got_ids)] or got_ids == [
                    list(map(int, r))[-new:] for r in ref["greedy_ids"]]
            out[f"xl/{case}/{dtype}"] = row
            log("xl", case, dtype, row)
    return out


# =====================================================================================================
# 3. memory under a limit
# =====================================================================================================
T5_LARGE = dict(vocab_size=32128, d_model=1024, d_kv=64, num_heads=16, d_ff=4096, num_layers=24,
                num_decoder_layers=24)


@step("memory")
def memory(work: Path, quick: bool) -> dict:
    import cupy

    import minfer
    from factories import write_t5
    folder = work / "t5-large-shaped"
    shape = dict(T5_LARGE, num_layers=6, num_decoder_layers=6) if quick else T5_LARGE
    write_t5(folder, seed=2, **shape)
    prompts = [[5 + (i * 7 + j) % 3000 for j in range(48)] for i in range(4)]
    out = {}
    for dtype in ("float16", "int8"):
        full = minfer.load(folder, device="cuda", dtype=dtype)
        want = full.generate(prompts, max_new_tokens=24, num_beams=2)
        weights = full.weight_plan.fixed + sum(full.weight_plan.unit_bytes.values())
        del full
        limit = weights // 4 + (256 << 20)
        pool = cupy.get_default_memory_pool()
        m = minfer.load(folder, device="cuda", dtype=dtype, memory_limit=limit, workspace="256MiB")
        t0 = time.perf_counter()
        got = m.generate(prompts, max_new_tokens=24, num_beams=2)
        seconds = time.perf_counter() - t0
        row = {"weights": weights, "limit": limit, "streamed": len(m.weight_plan.streamed),
               "arena_peak": m.backend.arena.stats().peak, "pool_total_bytes": pool.total_bytes(),
               "temporaries_peak": m.backend.arena.pool_peak,
               "nvidia_smi_mib": device_memory_mib(), "ids_equal": got == want,
               "seconds": seconds}
        row["within_limit"] = row["arena_peak"] <= limit
        out[dtype] = row
        log("memory", dtype, row)
        del m
    return out


# =====================================================================================================
# 4. speed
# =====================================================================================================
T5_BASE = dict(vocab_size=32128, d_model=768, d_kv=64, num_heads=12, d_ff=3072, num_layers=12,
               num_decoder_layers=12, feed_forward_proj="relu", tie_word_embeddings=True)


def timed(fn, runs: int) -> float:
    fn()                                          # warm-up (kernels compiled, caches built)
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@step("speed")
def speed(work: Path, quick: bool) -> dict:
    import torch

    import minfer
    folder = work / "t5-base-shaped"
    hf_t5(folder, T5_BASE["vocab_size"], seed=3, **{k: v for k, v in T5_BASE.items()
                                                    if k != "vocab_size"})
    new, runs = 64, (2 if quick else 5)
    out = {}
    rng = np.random.default_rng(1)
    for dtype in ("float16", "float32"):
        ref = torch_t5(folder, dtype)
        m = minfer.load(folder, device="cuda", dtype=dtype)
        for batch, beams in ((1, 1), (16, 1), (1, 4)):
            src = rng.integers(2, 32000, (batch, 32))
            t = torch.as_tensor(src, device="cuda")

            def hf(ref=ref, t=t, beams=beams):
                with torch.no_grad():
                    ref.generate(input_ids=t, max_new_tokens=new, min_new_tokens=new,
                                 num_beams=beams, do_sample=False)
                torch.cuda.synchronize()

            def mine(m=m, src=src, beams=beams):
                m.generate(src, max_new_tokens=new, min_new_tokens=new, num_beams=beams)

            hf_s, mine_s = timed(hf, runs), timed(mine, runs)
            row = {"minfer_tok_s": batch * new / mine_s, "transformers_tok_s": batch * new / hf_s,
                   "ratio": hf_s / mine_s}
            out[f"t5-base/{dtype}/batch{batch}/beams{beams}"] = row
            log("speed", dtype, batch, beams, row)
        ref = m = None
        torch.cuda.empty_cache()
    from conftest import XL_CASES, XL_FIXTURES
    if XL_CASES:
        m = minfer.load(XL_FIXTURES / XL_CASES[0], device="cuda", dtype="float16")
        ids = list(np.arange(2, 4002) % m.config.vocab_size)
        seconds = timed(lambda: m.score(ids), runs)
        out["xl/score"] = {"case": XL_CASES[0], "tok_s": len(ids) / seconds}
        log("speed xl", out["xl/score"])
    return out


def main() -> int:
    global LOG
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--quick", action="store_true", help="smaller models, fewer runs")
    ap.add_argument("--steps", default="tests,parity,memory,speed")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import minfer  # noqa: F401  (the import check a CPU machine does)
    why = gpu_present()
    if why is not None:
        print(f"gpu_check: no GPU here ({why}); nothing to check. minfer imports fine.")
        return 0
    LOG = open(out / "gpu_check.log", "w")
    RESULTS["versions"] = versions()
    log(json.dumps(RESULTS["versions"], indent=1))
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        steps = args.steps.split(",")
        if "tests" in steps:
            run_tests(args.quick)
        if "parity" in steps:
            parity(work, args.quick)
        if "memory" in steps:
            memory(work, args.quick)
        if "speed" in steps:
            speed(work, args.quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))
        LOG.close()
    failed = [k for k, v in RESULTS.items() if isinstance(v, dict) and "error" in v]
    print(f"gpu_check: done; failed steps: {failed or 'none'}; results in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
