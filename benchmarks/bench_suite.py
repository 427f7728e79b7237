"""The whole CPU comparison in one command: minfer vs HF transformers, CTranslate2, ONNX Runtime
and llama.cpp.

    python benchmarks/bench_suite.py [--shapes t5-small,t5-base] [--runs 5] [--rounds 1]
                                     [--threads 2] [--tasks decode,batch16,encoder,beam4]
                                     [--engines ...] [--no-xl] [--json OUT] [--markdown OUT]
                                     [--chart PNG]
    python benchmarks/bench_suite.py --chart PNG --from-json SAVED.json
    python benchmarks/bench_suite.py --profile batch16 [--shapes t5-small] [--runs 3]

Tasks (float32 unless the engine says int8; random weights with the exact t5-small / t5-base
config, see bench_t5.py):
  decode   batch 1, 32 source tokens, 64 forced new tokens, greedy      (new tokens / s)
  batch16  16 sources of 32 tokens, 64 forced new tokens each, greedy   (new tokens / s, all rows)
  encoder  16 x 128 source tokens through the encoder only              (source tokens / s)
  encoder-8x256  8 x 256 source tokens through the encoder only         (source tokens / s)
  beam4    batch 1, beam search with 4 beams, 64 forced new tokens     (new tokens / s)
  xl       Transformer-XL scoring, run by bench_transfo_xl.py --json    (tokens / s)

Engines: minfer (float32), minfer-float16 / -bfloat16 / -int8 / -int4 (`minfer.load(folder,
dtype=...)`, computed in float32), minfer-int8-int8 / minfer-int4-int8 (the same weights with
`compute="int8"`: int8 x int8 products), minfer-bfloat16-bfloat16 (`compute="bfloat16"`:
bfloat16 x bfloat16 products), transformers (torch CPU, inference mode, float32) and
transformers-bfloat16 (the model in torch.bfloat16: oneDNN's bfloat16 products),
ctranslate2-fp32 / -int8, onnxruntime-fp32 / -int8 (Optimum's export with past key values and
its dynamic VNNI quantisation, run by ORTModelForSeq2SeqLM) and llama.cpp-f32 / -f16 / -q8_0 /
-q4_0 (llama_t5_driver.cpp over llama.h: llama_encode, then llama_decode per token; decode and
encoder only: llama.cpp runs one T5 sequence at a time and has no beam search). The ONNX and
llama.cpp files come from setup_peers.py (benchmarks/peers/); a peer it has not prepared is
skipped with a note.
"Forced" means eos is suppressed until the 64th token (min = max new tokens), so no engine stops
early. CTranslate2 4.x has no encoder-only call for T5 (`Translator` has none, and
`ctranslate2.Encoder` refuses a converted T5: "This model cannot be used as a sequence encoder"),
so its encoder row times `translate_batch` with one decoding step (encoder + 1 step, a little
pessimistic for it) and the notes add an estimate with that step's cost subtracted.

Every engine runs in its own subprocess with OMP/OPENBLAS/MKL threads set before imports (torch
also gets set_num_threads, CTranslate2 intra_threads); one warm-up call, then --runs timed calls
(--rounds R repeats all engines R times round-robin and pools the runs); median, min and max,
and minfer's median over each engine's. Greedy and beam ids are checked against transformers'
(first mismatch with transformers' top-1/top-2 logit margin there for greedy; int8 engines are
expected to drift); minfer's encoder output is compared with transformers'. Checkpoints and
CTranslate2 conversions are made on first use by bench_t5.py's helpers. When other processes
used more than 10% of the CPUs while an engine ran, its row is marked.

--profile TASK runs minfer alone on TASK under cProfile (first shape of --shapes).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_t5 as b5  # noqa: E402

TASKS = ("decode", "batch16", "encoder", "encoder-8x256", "beam4")
ENCODER_TASKS = ("encoder", "encoder-8x256")
# minfer engine -> (dtype, compute)
MINFER_MODES = {"minfer": (None, None), "minfer-float16": ("float16", None),
                "minfer-bfloat16": ("bfloat16", "float32"), "minfer-int8": ("int8", None),
                "minfer-bfloat16-bfloat16": ("bfloat16", "bfloat16"),
                "minfer-int8-int8": ("int8", "int8"), "minfer-int4": ("int4", None),
                "minfer-int4-int8": ("int4", "int8")}
ONNX_ENGINES = {"onnxruntime-fp32": "fp32", "onnxruntime-int8": "int8"}
LLAMA_ENGINES = {f"llama.cpp-{t}": t for t in ("f32", "f16", "q8_0", "q4_0")}
ENGINES = (*MINFER_MODES, "transformers", "transformers-bfloat16", "ctranslate2-fp32", "ctranslate2-int8", *ONNX_ENGINES,
           *LLAMA_ENGINES)
LLAMA_TASKS = ("decode", *ENCODER_TASKS)      # llama.cpp: one T5 sequence at a time, no beam search
NEW = 64
RESULT_MARK = "SUITE_RESULT "
BUSY_LIMIT = 0.1  # others' share of the CPUs above which a row is marked unreliable
# Issue 13's targets, for every shape: (task, minfer engine, peer engine, minimum ratio).
TARGETS = (("decode", "minfer-int8", "ctranslate2-fp32", 2.0),
           ("decode", "minfer-int8", "ctranslate2-int8", 2.0),
           ("decode", "minfer-float16", "ctranslate2-fp32", 1.5),
           ("decode", "minfer", "ctranslate2-fp32", 1.15),
           ("beam4", "minfer", "ctranslate2-fp32", 1.5),
           ("beam4", "minfer-int8", "ctranslate2-int8", 1.5),
           ("batch16", "minfer", "ctranslate2-fp32", 1.5),
           ("batch16", "minfer-int8", "ctranslate2-int8", 1.5),
           ("encoder", "minfer", "ctranslate2-fp32", 1.0))
# Issue 21's, for every shape: (task, label, minfer engines, peer engines, minimum ratio of the
# fastest of the first to the fastest of the second)
EIGHT_BIT = ("minfer-int8", "minfer-int8-int8")
PEER_TARGETS = (
    ("decode", "8-bit", EIGHT_BIT, ("onnxruntime-int8", "llama.cpp-q8_0", "ctranslate2-int8"), 1.25),
    ("decode", "4-bit", ("minfer-int4", "minfer-int4-int8"), ("llama.cpp-q4_0",), 1.25),
    ("decode", "float32", ("minfer",), ("onnxruntime-fp32", "llama.cpp-f32", "ctranslate2-fp32",
                                         "transformers"), 1.1),
    ("batch16", "int8", EIGHT_BIT, ("onnxruntime-int8",), 1.25),
    ("batch16", "int8", EIGHT_BIT, ("ctranslate2-int8",), 1.5),
    ("encoder", "int8", EIGHT_BIT, ("onnxruntime-int8",), 1.25),
    ("encoder", "int8", EIGHT_BIT, ("ctranslate2-int8",), 1.5),
    ("beam4", "float32", ("minfer",), ("ctranslate2-fp32",), 1.5),
    # issue 26's, on both encoder shapes
    *((task, label, ours, peers, ratio) for task in ENCODER_TASKS for label, ours, peers, ratio in (
        ("fastest", tuple(MINFER_MODES), ("onnxruntime-int8", "onnxruntime-fp32", "transformers",
                                          "transformers-bfloat16", "ctranslate2-int8"), 1.25),
        ("float32", ("minfer",), ("onnxruntime-fp32",), 1.0),
        ("bfloat16", ("minfer-bfloat16-bfloat16",), ("transformers-bfloat16",), 1.25))))
XL_TARGET = 4.0   # Transformer-XL scoring: minfer / transformers


def sources(task: str) -> list[list[int]]:
    """The task's token-id sources (fixed seeds; eos last)."""
    rows, length = {"decode": (1, 32), "beam4": (1, 32), "batch16": (16, 32),
                    "encoder": (16, 128), "encoder-8x256": (8, 256)}[task]
    rng = random.Random(b5.INPUT_SEED + rows * 1000 + length)
    return [[rng.randrange(2, 32000) for _ in range(length - 1)] + [b5.EOS_ID] for _ in range(rows)]


def work_units(task: str) -> int:
    """What one call produces: new tokens (generation) or source tokens (encoder)."""
    srcs = sources(task)
    return sum(map(len, srcs)) if task in ENCODER_TASKS else len(srcs) * NEW


# =================================================================================================
# Workers (in a subprocess)
# =================================================================================================
def timed(call, runs: int, compare: bool = True):
    """One warm-up call (its output is returned), then `runs` timed calls (seconds each)."""
    out = call()
    seconds = []
    for _ in range(runs):
        t0 = time.perf_counter()
        again = call()
        seconds.append(time.perf_counter() - t0)
        if compare and again != out:
            raise RuntimeError("output changed between runs")
    return out, seconds


def work_minfer(model_dir: Path, task: str, runs: int, threads: int, mode: tuple,
                dump: str | None) -> dict:
    import numpy as np

    import minfer
    dtype, compute = mode
    model = minfer.load(model_dir, dtype=dtype, compute=compute, num_threads=threads)
    srcs = sources(task)
    if task in ENCODER_TASKS:
        out, seconds = timed(lambda: model.encode(srcs), runs, compare=False)
        if dump:
            np.save(dump, np.asarray(out, np.float32))
        return {"seconds": seconds}
    beams = 4 if task == "beam4" else 1

    def call():
        rows = model.generate(srcs, max_new_tokens=NEW, min_new_tokens=NEW, num_beams=beams,
                              early_stopping=True)
        return [[int(t) for t in r[1:]] for r in rows]  # drop the decoder start token
    out, seconds = timed(call, runs)
    return {"seconds": seconds, "ids": out}


def work_transformers(model_dir: Path, task: str, runs: int, threads: int, precision: str,
                      dump: str | None) -> dict:
    import numpy as np
    import torch
    import transformers
    from transformers import T5ForConditionalGeneration
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[precision]
    model = T5ForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
    ids = torch.tensor(sources(task), dtype=torch.long)  # equal lengths: no padding needed
    if task in ENCODER_TASKS:
        def enc():
            with torch.inference_mode():
                return model.encoder(input_ids=ids).last_hidden_state
        out, seconds = timed(enc, runs, compare=False)
        if dump:
            np.save(dump, out.float().numpy())
        return {"seconds": seconds, "torch_threads": torch.get_num_threads()}
    beams = 4 if task == "beam4" else 1

    def generate(**extra):
        with torch.inference_mode():
            return model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                  num_beams=beams, early_stopping=True, **extra)

    def call():
        return [[int(t) for t in r[1:]] for r in generate()]  # drop the decoder start token
    out, seconds = timed(call, runs)
    result = {"seconds": seconds, "ids": out, "torch_threads": torch.get_num_threads()}
    if beams == 1:  # untimed: each greedy decision's top-1 minus top-2 logit, per row and step
        scored = generate(output_scores=True, return_dict_in_generate=True)
        top2 = torch.stack([s.topk(2, dim=-1).values for s in scored.scores], 1)  # (B, steps, 2)
        result["margins"] = (top2[..., 0] - top2[..., 1]).tolist()
    return result


def work_ctranslate2(model_dir: Path, task: str, runs: int, threads: int, int8: bool,
                     dump: str | None) -> dict:
    import ctranslate2
    vocab = b5.read_ct2_vocabulary(model_dir)
    token_to_id = {t: i for i, t in enumerate(vocab)}
    translator = ctranslate2.Translator(str(model_dir), device="cpu", inter_threads=1,
                                        intra_threads=threads)
    srcs = [[vocab[i] for i in row] for row in sources(task)]
    steps = 1 if task in ENCODER_TASKS else NEW
    beams = 4 if task == "beam4" else 1

    def translate(batch):
        res = translator.translate_batch(batch, beam_size=beams, max_decoding_length=steps,
                                         min_decoding_length=steps, max_batch_size=0)
        return [[token_to_id[t] for t in r.hypotheses[0]] for r in res]
    out, seconds = timed(lambda: translate(srcs), runs)
    result = {"seconds": seconds, "compute_type": translator.compute_type}
    if task in ENCODER_TASKS:
        # No encoder-only API: the row above is encoder + 1 decoding step. The same call on
        # 2-token sources (first token, eos) costs about that step plus a negligible encoder.
        # (An eos-only source returns at once without decoding, so it cannot serve.)
        short = [[row[0], vocab[b5.EOS_ID]] for row in srcs]
        _, step_seconds = timed(lambda: translate(short), runs)
        result.update(note="encoder + 1 decoding step", step_seconds=step_seconds)
    else:
        result["ids"] = out
    return result


def onnx_file_names(folder: Path) -> dict[str, str]:
    """The encoder / decoder / decoder-with-past graphs Optimum wrote (quantised ones carry a
    suffix), as ORTModelForSeq2SeqLM.from_pretrained's file-name arguments."""
    names = {}
    for key, stem in (("encoder_file_name", "encoder_model"), ("decoder_file_name", "decoder_model"),
                      ("decoder_with_past_file_name", "decoder_with_past_model")):
        found = sorted(f.name for f in folder.glob(f"{stem}*.onnx")
                       if stem != "decoder_model" or not f.name.startswith(("decoder_model_merged",)))
        if found:
            names[key] = found[0]
    return names


def work_onnxruntime(model_dir: Path, task: str, runs: int, threads: int, option: str,
                     dump: str | None) -> dict:
    import numpy as np
    import onnxruntime as ort
    import torch
    from optimum.onnxruntime import ORTModelForSeq2SeqLM
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    torch.set_num_threads(threads)   # (the search's own tensors)
    model = ORTModelForSeq2SeqLM.from_pretrained(model_dir, session_options=options,
                                                 provider="CPUExecutionProvider", use_cache=True,
                                                 **onnx_file_names(model_dir))
    ids = torch.tensor(sources(task), dtype=torch.long)
    if task in ENCODER_TASKS:
        mask = torch.ones_like(ids)

        def enc():
            return model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        out, seconds = timed(enc, runs, compare=False)
        if dump:
            np.save(dump, np.asarray(out, np.float32))
        return {"seconds": seconds, "onnxruntime": ort.__version__}
    beams = 4 if task == "beam4" else 1

    def call():
        rows = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              num_beams=beams, early_stopping=True)
        return [[int(t) for t in r[1:]] for r in rows]  # drop the decoder start token
    out, seconds = timed(call, runs)
    return {"seconds": seconds, "ids": out, "onnxruntime": ort.__version__}


def work_llama(model_path: Path, task: str, runs: int, threads: int, option: str,
               dump: str | None) -> dict:
    """llama_t5_driver (setup_peers.py builds it) on the task's sources: it times its own calls
    after a warm-up, so the model's load is not counted."""
    import setup_peers
    rows = sources(task)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("".join(" ".join(map(str, r)) + "\n" for r in rows))
    try:
        proc = subprocess.run([str(setup_peers.PEERS / "llama_t5_driver"), str(model_path),
                               "decode" if task == "decode" else "encoder", str(threads),
                               str(runs), str(NEW), f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["llama_t5_driver failed"])[-1])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if task != "decode":
        result.pop("ids", None)
    return result


WORKERS = {**{engine: work_minfer for engine in MINFER_MODES}, "transformers": work_transformers,
           "transformers-bfloat16": work_transformers,
           "ctranslate2-fp32": work_ctranslate2, "ctranslate2-int8": work_ctranslate2,
           **{engine: work_onnxruntime for engine in ONNX_ENGINES},
           **{engine: work_llama for engine in LLAMA_ENGINES}}


def worker(args) -> int:
    if args.profile:
        return profile_minfer(Path(args.model), args.profile, args.runs)
    if args.engine in MINFER_MODES:
        option = MINFER_MODES[args.engine]
    elif args.engine.startswith("transformers"):
        option = "bfloat16" if args.engine == "transformers-bfloat16" else "float32"
    else:
        option = (ONNX_ENGINES.get(args.engine) or LLAMA_ENGINES.get(args.engine)
                  or args.engine.endswith("int8"))
    result = WORKERS[args.engine](Path(args.model), args.task, args.runs, args.threads, option,
                                  args.dump)
    result["env_threads"] = {k: os.environ.get(k) for k in b5.thread_env(args.threads)}
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


def profile_minfer(model_dir: Path, task: str, runs: int) -> int:
    """cProfile over `runs` minfer calls of `task` after a warm-up. NumPy ufuncs (matmul,
    exp, ...) are not calls of their own: their time is the tottime of the Python function that
    called them."""
    import cProfile
    import pstats

    import minfer
    model = minfer.load(model_dir)
    srcs = sources(task)
    if task in ENCODER_TASKS:
        def call():
            model.encode(srcs)
    else:
        def call():
            model.generate(srcs, max_new_tokens=NEW, min_new_tokens=NEW,
                           num_beams=4 if task == "beam4" else 1, early_stopping=True)
    call()
    t0 = time.perf_counter()
    for _ in range(runs):
        call()
    plain = (time.perf_counter() - t0) / runs
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(runs):
        call()
    profiler.disable()
    print(f"minfer {task} on {model_dir.name}: {plain * 1e3:.1f} ms per call "
          f"({work_units(task) / plain:.1f} tok/s) without the profiler")
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(20)
    return 0


# =================================================================================================
# Driver
# =================================================================================================
def run_engine(engine: str, folder: Path, task: str, runs: int, threads: int,
               dump: str | None) -> dict:
    env = {**os.environ, **b5.thread_env(threads)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--engine", engine,
           "--model", str(folder), "--task", task, "--runs", str(runs), "--threads", str(threads)]
    if dump:
        cmd += ["--dump", dump]
    busy = b5.background_load(0.5)
    print(f"  {task:<8} {engine:<17}" + (f" (others busy {busy:.0%} before)"
                                         if busy and busy > BUSY_LIMIT else ""), flush=True)
    ticks, children = b5.cpu_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    others = b5.others_share(ticks, children, time.perf_counter() - start)
    if others is not None and others > BUSY_LIMIT:
        print(f"    other processes used {others:.0%} of the CPUs meanwhile: unreliable",
              flush=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"worker failed: {tail[:200]}"}
    r = json.loads(lines[-1][len(RESULT_MARK):])
    r["others_busy"] = max(v for v in (busy, others, 0.0) if v is not None)
    return r


def pool(into: dict, r: dict) -> None:
    """Add another round's runs of the same engine and task."""
    if "error" in r or "unavailable" in r:
        into.clear()
        into.update(r)
        return
    if r.get("ids") != into.get("ids"):
        into.clear()
        into["error"] = "output changed between rounds"
        return
    for key in ("seconds", "step_seconds"):
        if key in r:
            into[key] += r[key]
    into["others_busy"] = max(into["others_busy"], r["others_busy"])


def summarise(task: str, r: dict) -> None:
    units = work_units(task)
    speeds = [units / s for s in r["seconds"]]
    r.update(median=statistics.median(speeds), min=min(speeds), max=max(speeds))
    if "step_seconds" in r:  # CTranslate2's encoder: subtract the median 1-step call
        step = statistics.median(r["step_seconds"])
        r["encoder_only_estimate"] = units / (statistics.median(r["seconds"]) - step)
        r["step_ms"] = 1e3 * step


def compare_ids(ref: list[list[int]], got: list[list[int]],
                margins: list[list[float]] | None) -> str:
    if len(ref) != len(got) or any(len(a) != len(b) for a, b in zip(ref, got)):
        return "lengths differ"
    same = sum(a == b for a, b in zip(ref, got))
    if same == len(ref):
        return "equal" if len(ref) == 1 else f"equal ({same}/{len(ref)} rows)"
    notes = []
    for row, (a, b) in enumerate(zip(ref, got)):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is not None:
            m = f", margin {margins[row][i]:.2g}" if margins else ""
            notes.append(f"row {row} from token {i}{m}")
    head = "differ" if len(ref) == 1 else f"{same}/{len(ref)} rows equal"
    return f"{head}; " + "; ".join(notes[:2]) + ("; ..." if len(notes) > 2 else "")


def encoder_check(dumps: dict[str, str], engine: str) -> str:
    import numpy as np
    if engine not in dumps or "transformers" not in dumps:
        return ""
    try:
        a, ref = np.load(dumps[engine]), np.load(dumps["transformers"])
    except OSError:
        return ""
    return f"max abs diff {np.abs(a - ref).max() / np.abs(ref).max():.1e} of max abs state"


def engine_folders(shape: str, engines: list[str], tokenizer: Path) -> dict[str, Path]:
    import importlib.util

    import setup_peers
    model_dir = b5.ensure_checkpoint(shape)
    folders = {}
    for e in engines:
        if e in ONNX_ENGINES:
            if importlib.util.find_spec("optimum.onnxruntime") is None:
                print(f"skipping {e}: pip install 'optimum-onnx[onnxruntime]' (see setup_peers.py)")
            else:
                folders[e] = setup_peers.ensure_onnx(shape)[ONNX_ENGINES[e]]
        elif e in LLAMA_ENGINES:
            path = setup_peers.gguf_files(shape)[LLAMA_ENGINES[e]]
            if not path.is_file() or not (setup_peers.PEERS / "llama_t5_driver").is_file():
                print(f"skipping {e}: run benchmarks/setup_peers.py --peers llama.cpp first")
            else:
                folders[e] = path
        elif not e.startswith("ctranslate2"):
            folders[e] = model_dir
        elif not b5.have_ctranslate2():
            print(f"skipping {e}: ctranslate2 is not importable")
        elif not all((tokenizer / f).is_file() for f in b5.TOKENIZER_FILES):
            print(f"skipping {e}: no T5 tokenizer files in {tokenizer}")
        else:
            quantization = {"ctranslate2-fp32": "float32", "ctranslate2-int8": "int8"}[e]
            folders[e] = b5.ensure_ct2(model_dir, quantization, tokenizer)
    return folders


def run_xl(runs: int, rounds: int, threads: int, out: Path) -> dict:
    """bench_transfo_xl.py (minfer and transformers) with --json; its report, or an error."""
    cmd = [sys.executable, str(HERE / "bench_transfo_xl.py"), "--runs", str(runs),
           "--rounds", str(rounds), "--threads", str(threads), "--json", str(out)]
    print("transfo-xl: bench_transfo_xl.py (minfer, transformers) ...", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if "unreliable" in line or "other processes" in line:
            print("  " + line.strip(), flush=True)
    if not out.is_file():
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    report = json.loads(out.read_text())
    report["exit_status"] = proc.returncode
    return report


def xl_rows(report: dict) -> list[str]:
    res = report.get("results", {})
    rows = []
    try:
        mf = res["minfer"]["score"]["tokens_per_s"]["median"]
    except (KeyError, TypeError):
        mf = None
    ll = report.get("summary", {}).get("log_likelihood")
    check = (f"log-likelihood rel. diff {ll['relative_difference']:.1e}"
             + ("" if ll["agree"] else " (DISAGREE)")) if ll else ""
    for engine in ("minfer", "transformers"):
        r = res.get(engine, {})
        if "error" in r or "score" not in r:
            rows.append(f"| transfo-xl-4l | scoring | {engine} | "
                        f"{r.get('error', report.get('error', 'no result'))} | | | | | |")
            continue
        s = r["score"]["tokens_per_s"]
        flag = " *" if (r.get("background_load_during") or 0) > BUSY_LIMIT else ""
        ratio = "" if engine == "minfer" or mf is None else f"{mf / s['median']:.2f}"
        rows.append(f"| transfo-xl-4l | scoring 12x128 | {engine}{flag} | {s['median']:.1f} | "
                    f"{s['min']:.1f} | {s['max']:.1f} | tok/s | {ratio} | "
                    f"{check if engine == 'transformers' else ''} |")
    return rows


def table(results: dict, dumps: dict, xl: dict | None) -> list[str]:
    lines = ["| shape | task | engine | median | min | max | unit | minfer / engine "
             "| output vs transformers |",
             "|---|---|---|---:|---:|---:|---|---:|---|"]
    for shape, tasks in results.items():
        for task, engines in tasks.items():
            unit = "src tok/s" if task in ENCODER_TASKS else "new tok/s"
            base = engines.get("minfer", {}).get("median")
            ref = engines.get("transformers", {})
            for engine, r in engines.items():
                name = engine + (" (enc+1 step)" if r.get("note") else "")
                if "unavailable" in r:
                    lines.append(f"| {shape} | {task} | {name} | n/a | | | | | "
                                 f"{r['unavailable'].replace('|', '/')} |")
                    continue
                if "error" in r:
                    lines.append(f"| {shape} | {task} | {name} | {r['error']} | | | | | |")
                    continue
                if r["others_busy"] > BUSY_LIMIT:
                    name += " *"
                ratio = "" if engine == "minfer" or not base else f"{base / r['median']:.2f}"
                if engine in COMPARED:             # a quantised minfer mode: to its peer
                    peer = engines.get(COMPARED[engine], {}).get("median")
                    short = COMPARED[engine].replace("ctranslate2", "ct2")
                    ratio = f"{r['median'] / peer:.2f} vs {short}" if peer else ""
                if engine == "transformers":
                    check = "reference"
                elif task in ENCODER_TASKS:
                    check = encoder_check(dumps.get((shape, task), {}), engine)
                elif ref.get("ids") is not None and r.get("ids") is not None:
                    check = compare_ids(ref["ids"], r["ids"], ref.get("margins"))
                else:
                    check = ""
                lines.append(f"| {shape} | {task} | {name} | {r['median']:.1f} | {r['min']:.1f} | "
                             f"{r['max']:.1f} | {unit} | {ratio} | {check} |")
    if xl is not None:
        lines += xl_rows(xl)
    return lines


# a quantised minfer row gives its speed over this peer's (others: minfer float32's over theirs)
COMPARED = {"minfer-int8": "ctranslate2-int8", "minfer-int8-int8": "onnxruntime-int8",
            "minfer-int4": "llama.cpp-q4_0", "minfer-int4-int8": "llama.cpp-q4_0"}


def notes(results: dict) -> list[str]:
    out = []
    for shape, tasks in results.items():
        r = tasks.get("encoder", {}).get("ctranslate2-fp32", {})
        if "encoder_only_estimate" in r:
            base = tasks["encoder"].get("minfer", {}).get("median")
            ratio = f"; minfer / that = {base / r['encoder_only_estimate']:.2f}" if base else ""
            out.append(f"- {shape} encoder, CTranslate2 fp32: its 1-step call on 2-token sources "
                       f"takes {r['step_ms']:.1f} ms; subtracting it, the encoder alone would run "
                       f"at ~{r['encoder_only_estimate']:.0f} src tok/s{ratio}.")
    return out


def target_lines(results: dict, xl: dict | None) -> list[str]:
    out = []
    for shape, tasks in results.items():
        for task, mine_engine, peer, want in TARGETS:
            rows = tasks.get(task, {})
            mine, theirs = rows.get(mine_engine, {}).get("median"), rows.get(peer, {}).get("median")
            if mine is None or theirs is None:
                continue
            ratio = mine / theirs
            verdict = "met" if ratio >= want else f"MISSED by {(want - ratio) / want:.0%}"
            out.append(f"- {shape} {task}: {mine_engine} / {peer} = {ratio:.2f} "
                       f"(target >= {want:g}): {verdict}")
    return out


def fastest(rows: dict, engines: tuple[str, ...]) -> tuple[str, float] | None:
    """The engine of `engines` with the highest median in `rows`, and that median."""
    got = [(e, rows[e]["median"]) for e in engines if "median" in rows.get(e, {})]
    return max(got, key=lambda g: g[1]) if got else None


def peer_target_lines(results: dict, xl: dict | None) -> list[str]:
    """Issue 21's targets: the fastest minfer mode of a kind over the fastest peer of the kind."""
    out = []
    for shape, tasks in results.items():
        for task, label, mine, peers, want in PEER_TARGETS:
            rows = tasks.get(task, {})
            a, b = fastest(rows, mine), fastest(rows, peers)
            if a is None or b is None:
                continue
            ratio = a[1] / b[1]
            verdict = "met" if ratio >= want else f"MISSED by {(want - ratio) / want:.0%}"
            out.append(f"- {shape} {task} {label}: {a[0]} / {b[0]} = {ratio:.2f} "
                       f"(target >= {want:g}): {verdict}")
    return out + xl_target_lines(xl)


def xl_target_lines(xl: dict | None) -> list[str]:
    out = []
    try:
        res = xl["results"]
        ratio = (res["minfer"]["score"]["tokens_per_s"]["median"]
                 / res["transformers"]["score"]["tokens_per_s"]["median"])
        verdict = "met" if ratio >= XL_TARGET else f"MISSED by {(XL_TARGET - ratio) / XL_TARGET:.0%}"
        out.append(f"- transfo-xl-4l scoring: minfer / transformers = {ratio:.2f} "
                   f"(target >= {XL_TARGET:g}): {verdict}")
    except (KeyError, TypeError):
        pass
    return out


CHART_ENGINES = ("minfer", "minfer-float16", "minfer-bfloat16", "minfer-int8", "minfer-int8-int8",
                 "minfer-int4", "minfer-int4-int8", "ctranslate2-fp32", "ctranslate2-int8",
                 "onnxruntime-fp32", "onnxruntime-int8", "llama.cpp-f32", "llama.cpp-f16",
                 "llama.cpp-q8_0", "llama.cpp-q4_0", "transformers")
CHART_COLOURS = {"minfer": "#1f5fa8", "minfer-float16": "#4f8fd6", "minfer-bfloat16": "#86b6ea",
                 "minfer-int8": "#0b3366", "minfer-int8-int8": "#16478a", "minfer-int4": "#2c7bd1",
                 "minfer-int4-int8": "#07224a", "ctranslate2-fp32": "#d9822b",
                 "ctranslate2-int8": "#a65a12", "onnxruntime-fp32": "#5aa05a",
                 "onnxruntime-int8": "#2e6b2e", "llama.cpp-f32": "#b06ab3",
                 "llama.cpp-f16": "#9a4e9d", "llama.cpp-q8_0": "#7d3580",
                 "llama.cpp-q4_0": "#5c1f5e", "transformers": "#8c8c8c"}


def write_chart(report: dict, path: Path) -> None:
    """One panel per (shape, task): the median speed of each engine as a bar with its min-max
    range; the Transformer-XL scoring as a last panel. matplotlib (a dev dependency) draws it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for shape, tasks in report["results"].items():
        for task, rows in tasks.items():
            bars = [(e, rows[e]) for e in CHART_ENGINES if "median" in rows.get(e, {})]
            if bars:
                unit = "source tokens/s" if task in ENCODER_TASKS else "new tokens/s"
                panels.append((f"{shape} {task}", unit, bars))
    xl = (report.get("xl") or {}).get("results", {})
    bars = [(e, xl[e]["score"]["tokens_per_s"]) for e in ("minfer", "transformers")
            if "score" in xl.get(e, {})]
    if bars:
        panels.append(("transfo-xl-4l scoring", "tokens/s", bars))
    if not panels:
        raise SystemExit("no results to chart")
    cols = min(4, len(panels))
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False)
    for ax, (title, unit, bars) in zip(axes.flat, panels):
        names = [e for e, _ in bars]
        med = [r["median"] for _, r in bars]
        err = [[r["median"] - r["min"] for _, r in bars], [r["max"] - r["median"] for _, r in bars]]
        ax.bar(range(len(bars)), med, yerr=err, capsize=3,
               color=[CHART_COLOURS.get(e, "#555555") for e in names])
        ax.set_xticks(range(len(bars)), [n.replace("ctranslate2", "ct2") for n in names],
                      rotation=40, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit, fontsize=8)
        for i, (m, (_, r)) in enumerate(zip(med, bars)):   # above the error bar
            ax.text(i, r["max"], f"{m:.0f}", ha="center", va="bottom", fontsize=7)
        ax.margins(y=0.12)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(report.get("machine_line", ""), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def blas_info() -> str:
    """NumPy's BLAS as built, and the OpenBLAS kernel it picked on this CPU (when visible)."""
    import numpy as np
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        text = f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:
        text = "unknown BLAS"
    for lib in glob.glob(str(Path(np.__file__).parent.parent / "numpy.libs" / "*openblas*")):
        try:
            handle = ctypes.CDLL(lib)
            for name in ("scipy_openblas_get_corename64_", "openblas_get_corename64_",
                         "openblas_get_corename"):
                if hasattr(handle, name):
                    fn = getattr(handle, name)
                    fn.restype = ctypes.c_char_p
                    return f"{text} (kernel {fn().decode()})"
        except OSError:
            pass
    return text


def machine_line(args) -> str:
    import numpy as np
    m = b5.machine_info()
    flags = ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        fields = dict(l.split(":", 1) for l in cpuinfo.splitlines()[:30] if ":" in l)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        flags = fields.get("flags", "").split()
        flags = ", ".join(x for x in (
            f"family {fields['cpu family']} model {fields['model']}" if "model" in fields else "",
            "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else ""),
            *(name for flag, name in (("avx512_vnni", "AVX512_VNNI"), ("avx512_bf16", "AVX512_BF16"),
                                      ("avx512_fp16", "AVX512_FP16"), ("amx_tile", "AMX"))
              if flag in flags),
            "no AMX" if "amx_tile" not in flags else "") if x)
    except (OSError, KeyError):
        pass

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "absent"
    return (f"Machine: {m['cpu']}{' (' + flags + ')' if flags else ''}, {m['cores']} cores; "
            f"Python {m['python']}, NumPy {np.__version__} with {blas_info()}, "
            f"torch {version('torch')}, transformers {version('transformers')}, "
            f"ctranslate2 {version('ctranslate2')}; minfer at {m['git_commit'][:7]}"
            f"{' (modified)' if m['minfer_modified'] else ''}. {args.threads} threads per engine, "
            f"median of {args.runs * args.rounds} runs"
            + (f" ({args.rounds} rounds of {args.runs})" if args.rounds > 1 else "")
            + " after 1 warm-up per process.")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="t5-small,t5-base")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--runs", type=int, default=5, help="timed runs per process (after 1 warm-up)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure all engines this many times round-robin and pool the runs")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-xl", action="store_true", help="skip the Transformer-XL rows")
    p.add_argument("--tokenizer", type=Path, default=b5.DEFAULT_TOKENIZER,
                   help="folder with the T5 tokenizer files (for the CTranslate2 converter)")
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--markdown", metavar="OUT")
    p.add_argument("--chart", metavar="PNG", help="draw the results as a bar chart (matplotlib)")
    p.add_argument("--from-json", metavar="JSON", type=Path,
                   help="with --chart: draw a saved --json report instead of measuring")
    p.add_argument("--profile", choices=TASKS, help="profile minfer alone on this task")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--task", help=argparse.SUPPRESS)
    p.add_argument("--dump", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.from_json:
        if not args.chart:
            p.error("--from-json needs --chart")
        write_chart(json.loads(args.from_json.read_text()), Path(args.chart))
        print(f"wrote {args.chart}")
        return 0
    if min(args.runs, args.rounds, args.threads) < 1:
        p.error("--runs, --rounds and --threads must be at least 1")
    shapes = [s for s in args.shapes.split(",") if s]
    tasks = [t for t in args.tasks.split(",") if t]
    engines = [e for e in args.engines.split(",") if e]
    bad = [x for x in shapes if x not in b5.SHAPES] + [x for x in tasks if x not in TASKS] \
        + [x for x in engines if x not in ENGINES]
    if bad:
        p.error(f"unknown shape, task or engine {bad[0]!r}")
    if args.profile:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker",
               "--model", str(b5.ensure_checkpoint(shapes[0])), "--runs", str(args.runs),
               "--profile", args.profile]
        return subprocess.run(cmd, env={**os.environ, **b5.thread_env(args.threads)}).returncode

    commit_before = b5.machine_info()["git_commit"]  # minfer may change under a long run
    scratch = tempfile.TemporaryDirectory(prefix="bench_suite_")
    results: dict = {}
    dumps: dict = {}
    for shape in shapes:
        print(f"{shape}:", flush=True)
        folders = engine_folders(shape, engines, args.tokenizer)
        results[shape] = {t: {} for t in tasks}
        for round_no in range(args.rounds):
            if args.rounds > 1:
                print(f" round {round_no + 1} of {args.rounds}", flush=True)
            for task in tasks:
                for engine, folder in folders.items():
                    done = results[shape][task].get(engine)
                    if done is not None and ("error" in done or "unavailable" in done):
                        continue
                    if engine in LLAMA_ENGINES and task not in LLAMA_TASKS:
                        results[shape][task][engine] = {
                            "unavailable": "llama.cpp runs one T5 sequence at a time and has no "
                                           "beam search"}
                        continue
                    dump = None
                    if task in ENCODER_TASKS and engine in (
                            "minfer", "minfer-int8", "minfer-int8-int8", "minfer-bfloat16-bfloat16",
                            "onnxruntime-fp32", "transformers", "transformers-bfloat16"):
                        dump = str(Path(scratch.name) / f"{shape}-{engine}.npy")
                        dumps.setdefault((shape, task), {})[engine] = dump
                    r = run_engine(engine, folder, task, args.runs, args.threads, dump)
                    if done is None:
                        results[shape][task][engine] = r
                    else:
                        pool(done, r)
        for task, rows in results[shape].items():
            for r in rows.values():
                if "seconds" in r and "error" not in r:
                    summarise(task, r)
    xl = None if args.no_xl else run_xl(args.runs, args.rounds, args.threads,
                                        Path(scratch.name) / "xl.json")

    lines = [machine_line(args), "", *table(results, dumps, xl), ""]
    commit_after = b5.machine_info()["git_commit"]
    if commit_after != commit_before:
        lines += [f"WARNING: the repository moved from {commit_before[:7]} to {commit_after[:7]} "
                  "during the run; the minfer rows may mix both versions.", ""]
    lines.append("`*`: other processes used more than 10% of the CPUs while that engine ran "
                 "(unreliable). Ratios above 1: minfer is faster.")
    extra = notes(results)
    if extra:
        lines += ["", *extra]
    goals = target_lines(results, xl)
    if goals:
        lines += ["", "Targets (issue 13):", "", *goals]
    goals = peer_target_lines(results, xl)
    if goals:
        lines += ["", "Targets (issue 21; the fastest mode of each kind against the fastest peer "
                      "of the kind):", "", *goals]
    print("\n" + "\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
        print(f"\nwrote {args.markdown}")
    report = {"machine": b5.machine_info(), "machine_line": machine_line(args),
              "threads": args.threads, "runs": args.runs, "rounds": args.rounds,
              "new_tokens": NEW, "sources": {t: sources(t) for t in tasks},
              "results": {s: {t: dict(rows) for t, rows in ts.items()}
                          for s, ts in results.items()},
              "xl": xl}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.chart:
        write_chart(report, Path(args.chart))
        print(f"wrote {args.chart}")
    scratch.cleanup()
    failed = [1 for ts in results.values() for rows in ts.values() for r in rows.values()
              if "error" in r]
    return 1 if failed or (xl and (xl.get("error") or xl.get("exit_status"))) else 0


if __name__ == "__main__":
    sys.exit(main())
