"""fp8 weights kept as their codes (dtype float8_e4m3, issue 28) against the same weights widened to
bfloat16 (dtype="bfloat16": exact, as every fp8 value is a bfloat16), both computing in float32:
the layers' bytes, a t5-base-shaped encoder pass and the decode-sized products (M <= 8) the
kernels take (matmul_e4m3 / matmul_bf16, widening in registers), in the same run.

    python benchmarks/bench_fp8.py [--layers 4] [--tokens 256] [--rounds 5] [--threads 2]
                                   [--limit 48MiB]

With --limit, each model also loads and encodes once under that memory_limit in a fresh process:
its peak RSS (VmHWM) over the limit, and how many layers stayed resident.

The file is written by this script (random weights rounded to the nearest E4M3 code, a
float32 scale per tensor, ComfyUI's scaled layout). Every round times each variant in turn, so
a machine that others share slows them alike; the table gives per-round medians and the median
of the per-round ratios (bf16 / fp8: above 1, fp8 is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import tempfile
import time
from pathlib import Path

import sys

import numpy as np
from product_timing import machine, thread_counts, time_shape

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from factories import encode_fp8  # noqa: E402   (the nearest E4M3 code, from the definition)

# t5-base's encoder (v1.1's gated FF: two input projections)
BASE = dict(model_type="t5", feed_forward_proj="gated-gelu", vocab_size=32128, d_model=768,
            d_kv=64, num_heads=12, d_ff=2048, relative_attention_num_buckets=32,
            relative_attention_max_distance=128, layer_norm_epsilon=1e-6)
DECODE_SHAPES = [(1, 768, 3072), (4, 768, 3072), (8, 768, 3072), (8, 3072, 768),
                 (1, 768, 32128), (8, 768, 32128)]


def write_file(path: Path, layers: int, rng) -> Path:
    """A scaled-fp8 single file of a t5-base-shaped encoder, in Hugging Face's names."""
    C, H, D, F = BASE["d_model"], BASE["num_heads"], BASE["d_kv"], BASE["d_ff"]
    shapes = {"shared.weight": (BASE["vocab_size"], C), "encoder.final_layer_norm.weight": (C,),
              "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": (32, H)}
    for i in range(layers):
        b = f"encoder.block.{i}.layer"
        shapes.update({f"{b}.0.SelfAttention.{p}.weight": (H * D, C) for p in "qkv"})
        shapes.update({f"{b}.0.SelfAttention.o.weight": (C, H * D), f"{b}.0.layer_norm.weight": (C,),
                       f"{b}.1.DenseReluDense.wi_0.weight": (F, C),
                       f"{b}.1.DenseReluDense.wi_1.weight": (F, C),
                       f"{b}.1.DenseReluDense.wo.weight": (C, F), f"{b}.1.layer_norm.weight": (C,)})
    header, blobs, offset = {}, [], 0

    def add(name, code, a):
        nonlocal offset
        data = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    for name, shape in shapes.items():
        if len(shape) == 1 or "relative_attention_bias" in name:
            add(name, "F32", (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        w = rng.standard_normal(shape).astype(np.float32) * shape[1] ** -0.5
        scale = np.float32(2.0 ** np.ceil(np.log2(np.abs(w).max() / 448)))   # (power of two)
        add(name, "F8_E4M3", encode_fp8(w / scale, "F8_E4M3"))
        add(name[:-len(".weight")] + ".scale_weight", "F32", np.array(scale, np.float32))
    add("scaled_fp8", "F8_E4M3", np.zeros(0, np.uint8))
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return path


def decode_products(M: int, K: int, N: int, rng) -> dict:
    """The two small-M products of one shape, each a call with its arguments bound."""
    from minfer.io.tensors import fp8_to_bfloat16_bits
    from minfer.kernels.float_products import matmul_bf16, matmul_e4m3
    x = rng.standard_normal((M, K)).astype(np.float32)
    codes = encode_fp8(rng.standard_normal((N, K)) * 8, "F8_E4M3")
    scale = np.full(N, 1 / 8, np.float32)
    bits = fp8_to_bfloat16_bits(codes, "F8_E4M3")          # the same values, as bfloat16
    out = np.empty((M, N), np.float32)
    return {"fp8": lambda: matmul_e4m3(x, codes, scale, out),
            "bf16": lambda: matmul_bf16(x, bits, out)}


LIMITED_RUN = """
import sys, numpy as np, minfer
from minfer.arena import parse_bytes
path, dtype, limit, tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
m = minfer.load(path, dtype=None if dtype == "auto" else dtype, compute="float32", memory_limit=limit)
m.encode(np.random.default_rng(0).integers(2, 32000, (1, tokens)))
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
print(m.backend.weight_format, len(m.weight_plan.resident), len(m.weight_plan.unit_bytes),
      (peak - parse_bytes(limit)) / 2**20)
"""


def limited_runs(path: Path, limit: str, tokens: int) -> None:
    """Peak RSS over the limit of one load + encode per weight format, each a fresh process."""
    import subprocess
    import sys
    for dtype in ("auto", "bfloat16"):
        out = subprocess.run([sys.executable, "-c", LIMITED_RUN, str(path), dtype, limit, str(tokens)],
                             capture_output=True, text=True, timeout=300)
        if out.returncode:
            print(f"memory_limit {limit}, {dtype}: {out.stderr.strip().splitlines()[-1]}")
            continue
        fmt, resident, layers, over = out.stdout.split()
        print(f"memory_limit {limit}: {fmt} {resident} of {layers} layers resident, peak RSS "
              f"limit {float(over):+.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="2")
    ap.add_argument("--limit", default=None, help="a memory_limit for one run per format")
    args = ap.parse_args()
    import minfer
    print(machine("float32 products"))
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_file(Path(tmp) / "t5_base_fp8_scaled.safetensors", args.layers, rng)
        # power-of-two scales: the bfloat16 model holds exactly the same weights
        fp8 = minfer.load(path, compute="float32")
        bf16 = minfer.load(path, dtype="bfloat16", compute="float32")
        ids = rng.integers(2, BASE["vocab_size"], (1, args.tokens))
        layer = {m.backend.weight_format: sum(m.weight_plan.unit_bytes.values()) for m in (fp8, bf16)}
        print(f"layer bytes: float8_e4m3 {layer['float8_e4m3'] / 2**20:.1f} MiB, bfloat16 "
              f"{layer['bfloat16'] / 2**20:.1f} MiB (ratio {layer['bfloat16'] / layer['float8_e4m3']:.2f})")
        a, b = fp8.encode(ids), bf16.encode(ids)
        print(f"states: largest difference / largest state {np.abs(a - b).max() / np.abs(b).max():.1e}")
        if args.limit:
            limited_runs(path, args.limit, args.tokens)
        for threads, _ in thread_counts(args.threads):
            times = {"fp8": [], "bf16": []}
            for m in (fp8, bf16):
                m.encode(ids)                                   # warm
            for _ in range(args.rounds):
                for name, m in (("fp8", fp8), ("bf16", bf16)):
                    start = time.perf_counter()
                    m.encode(ids)
                    times[name].append(time.perf_counter() - start)
            ratio = statistics.median(b / f for f, b in zip(times["fp8"], times["bf16"]))
            print(f"encoder pass 1 x {args.tokens}, {args.layers} layers, {threads} threads: fp8 "
                  f"{statistics.median(times['fp8']) * 1e3:.1f} ms, bf16 "
                  f"{statistics.median(times['bf16']) * 1e3:.1f} ms, bf16 / fp8 {ratio:.2f}")
            print("M,K,N       fp8 ms   bf16 ms  bf16 / fp8")
            for M, K, N in DECODE_SHAPES:
                t = time_shape(decode_products(M, K, N, rng), args.rounds, "fp8", 0.05)
                r = statistics.median(b / f for f, b in zip(t["fp8"], t["bf16"]))
                print(f"{M},{K},{N:<8} {statistics.median(t['fp8']) * 1e3:7.3f}  "
                      f"{statistics.median(t['bf16']) * 1e3:7.3f}  {r:9.2f}")


if __name__ == "__main__":
    main()
