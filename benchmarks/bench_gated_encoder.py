"""A gated-GELU (T5 v1.1 / flan / UMT5-shaped) encoder pass with the FF's activation compiled
(kernels/activations.py) against the same pass with NumPy's activation, in the same process.

    python benchmarks/bench_gated_encoder.py [--shape base|xxl] [--layers N] [--batch B]
                                             [--tokens T] [--rounds 5] [--threads 2]
                                             [--modes int8,bfloat16,float32]

base: t5-v1_1-base's encoder (d_model 768, 12 heads, d_ff 2048, 12 layers), default 16 x 128
tokens; xxl: T5-v1.1-XXL's (the Flux / SD3 text encoder: d_model 4096, 64 heads, d_ff 10240),
default 2 of its 24 layers and 1 x 512 tokens, the way Flux calls it. Random bfloat16 weights
in one file under /tmp/minfer-gated/ (reused), loaded per mode (int8: quantised at load,
compute="int8"; bfloat16: compute="bfloat16"; float32). Each round times the compiled and the
NumPy activation in turn (the NumPy one: the kernels' ACTIVATION_KINDS emptied, so
`ops.activate` takes its NumPy path); the table gives per-variant medians and the median of the
per-round ratios (NumPy / compiled: above 1, the compiled one is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from product_timing import machine

SHAPES = {"base": dict(d_model=768, num_heads=12, d_ff=2048, layers=12, batch=16, tokens=128),
          "xxl": dict(d_model=4096, num_heads=64, d_ff=10240, layers=2, batch=1, tokens=512)}
FOLDER = Path("/tmp/minfer-gated")
MODES = {"int8": dict(dtype="int8", compute="int8"),
         "bfloat16": dict(dtype="bfloat16", compute="bfloat16"),
         "float32": dict(dtype="float32", compute="float32")}


def write_file(shape: str, layers: int) -> Path:
    """The encoder's tensors in Hugging Face's names, random, stored as BF16 (a T5 encoder file
    as diffusion users hold them: its config inferred from the shapes)."""
    from safetensors.numpy import save_file
    s = SHAPES[shape]
    path = FOLDER / f"{shape}-{layers}l.safetensors"
    if path.exists():
        return path
    FOLDER.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    C, H, F = s["d_model"], s["num_heads"], s["d_ff"]

    def bf16(a: np.ndarray) -> np.ndarray:   # nearest-even bfloat16 bits, as uint16 -> BF16 below
        b = a.astype(np.float32).view(np.uint32)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)

    def matrix(n: int, k: int) -> np.ndarray:
        return bf16(rng.standard_normal((n, k), np.float32) * k ** -0.5)
    t = {"shared.weight": bf16(rng.standard_normal((32128, C), np.float32) * 0.05),
         "encoder.final_layer_norm.weight": bf16(np.ones(C, np.float32)),
         "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight":
             bf16(rng.standard_normal((32, H), np.float32))}
    for i in range(layers):
        b = f"encoder.block.{i}.layer"
        for p in "qkvo":
            t[f"{b}.0.SelfAttention.{p}.weight"] = matrix(C, C)
        t[f"{b}.0.layer_norm.weight"] = bf16(np.ones(C, np.float32))
        t[f"{b}.1.layer_norm.weight"] = bf16(np.ones(C, np.float32))
        t[f"{b}.1.DenseReluDense.wi_0.weight"] = matrix(F, C)
        t[f"{b}.1.DenseReluDense.wi_1.weight"] = matrix(F, C)
        t[f"{b}.1.DenseReluDense.wo.weight"] = matrix(C, F)
    save_file(t, str(path))
    # safetensors.numpy writes uint16 as U16: mark the tensors BF16 (same bytes)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].replace(b'"U16"', b'"BF16"')     # (offsets count from its end)
    path.write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + n:])
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="base")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="int8,bfloat16,float32")
    args = ap.parse_args()
    import minfer
    from minfer import kernels
    s = SHAPES[args.shape]
    layers = args.layers or s["layers"]
    B, T = args.batch or s["batch"], args.tokens or s["tokens"]
    path = write_file(args.shape, layers)
    registry = kernels.compiled()
    compiled_kinds = dict(registry.ACTIVATION_KINDS)
    ids = np.random.default_rng(1).integers(2, 32000, (B, T))
    print(machine("the activations: kernels/activations.py"))
    print(f"{args.shape}-shaped gated-GELU encoder, {layers} layers, {B} x {T} tokens, "
          f"{args.threads} threads, {args.rounds} rounds")
    print("| mode | compiled activation (ms) | NumPy activation (ms) | NumPy / compiled |")
    print("|---|---:|---:|---:|")

    def use(variant: str) -> None:     # the compiled activations, or none (NumPy's)
        registry.ACTIVATION_KINDS.clear()
        if variant == "compiled":
            registry.ACTIVATION_KINDS.update(compiled_kinds)
    for mode in args.modes.split(","):
        model = minfer.load(str(path), num_threads=args.threads, **MODES[mode])
        times: dict[str, list[float]] = {"compiled": [], "numpy": []}
        for variant in times:                                  # (warm both up)
            use(variant)
            model.encode(ids)
        for _ in range(args.rounds):
            for variant in times:
                use(variant)
                t0 = time.perf_counter()
                model.encode(ids)
                times[variant].append(time.perf_counter() - t0)
        use("compiled")
        ratio = statistics.median(n / c for c, n in zip(times["compiled"], times["numpy"]))
        print(f"| {mode} | {statistics.median(times['compiled']) * 1e3:.1f} | "
              f"{statistics.median(times['numpy']) * 1e3:.1f} | {ratio:.2f} |", flush=True)
        del model


if __name__ == "__main__":
    main()
