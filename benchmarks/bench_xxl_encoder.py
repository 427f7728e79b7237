"""A T5-v1.1-XXL-shaped text encoder from one file, under a memory limit (issue 28's target).

    python benchmarks/bench_xxl_encoder.py [--format fp8|fp8-scaled|q8_0|q4_0] [--limit 2GiB]
                                           [--tokens 512] [--layers 24] [--keep]

Writes a random T5-v1.1-XXL-shaped encoder (d_model 4096, 64 heads of 64, gated-GELU d_ff 10240,
24 layers, vocabulary 32,128) as the single files diffusion users hold: `fp8` like ComfyUI's
t5xxl_fp8_e4m3fn.safetensors (every matrix and the embedding F8_E4M3, norms F32), `fp8-scaled`
like t5xxl_fp8_e4m3fn_scaled.safetensors (plus a float32 `scale_weight` per matrix and the
`scaled_fp8` mark; the embedding F16), `q8_0` like city96's t5-v1_1-xxl-encoder-Q8_0.gguf (the `gguf` package
must be installed), `q4_0` the same in Q4_0 blocks (loaded as int4g32: half a byte a weight). The file goes to /tmp/minfer-xxl/ and is reused (about 4.8 GB for fp8).

Then, each in a fresh process: `encode` of 1 x `--tokens` token ids the way Flux's pipeline calls
its T5 (padding to the length, no attention mask) under `memory_limit=--limit`, and the same
without a limit. Reported: peak RSS (VmHWM) minus the limit (target <= 150 MiB), seconds, and the
largest difference of the two runs' states over the largest state (target: equal).
The fp8 codes are drawn with exponents that keep weights in [2^-6, 0.24] (uniform codes reach
448 and the random network overflows); that changes nothing about memory or speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MARK = "@@ "
XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, num_heads=64, d_ff=10240, num_layers=24,
           buckets=32)
FOLDER = Path("/tmp/minfer-xxl")
GGUF_KINDS = {"q8_0": "Q8_0", "q4_0": "Q4_0"}     # --format -> the GGUF block type written


def tensors(layers: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(HF name, shape, is a matrix stored in fp8) of an XXL encoder with `layers` blocks."""
    C, F, H, V = XXL["d_model"], XXL["d_ff"], XXL["num_heads"], XXL["vocab_size"]
    inner = H * XXL["d_kv"]
    out = [("shared.weight", (V, C), True)]
    for i in range(layers):
        p = f"encoder.block.{i}.layer."
        out += [(p + f"0.SelfAttention.{w}.weight", (inner, C), True) for w in "qkv"]
        out.append((p + "0.SelfAttention.o.weight", (C, inner), True))
        if i == 0:
            out.append((p + "0.SelfAttention.relative_attention_bias.weight",
                        (XXL["buckets"], H), False))
        out.append((p + "0.layer_norm.weight", (C,), False))
        out += [(p + f"1.DenseReluDense.{w}.weight", (F, C), True) for w in ("wi_0", "wi_1")]
        out.append((p + "1.DenseReluDense.wo.weight", (C, F), True))
        out.append((p + "1.layer_norm.weight", (C,), False))
    out.append(("encoder.final_layer_norm.weight", (C,), False))
    return out


def fp8_codes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random F8_E4M3 codes with exponent fields 1..4: magnitudes in [2^-6, 0.234]."""
    c = rng.integers(0, 256, size=shape, dtype=np.uint8)
    return (c & 0x87) | ((((c >> 3) & 3) + 1) << 3).astype(np.uint8)


def small_floats(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if "relative_attention_bias" in name:
        return rng.normal(0, 1, shape).astype(np.float32)
    return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)   # norm weights


def write_safetensors(path: Path, layers: int, scaled: bool) -> None:
    """Streams the file: header first, then one tensor at a time (the writer holds one)."""
    rng = np.random.default_rng(0)
    header: dict = {"__metadata__": {"format": "pt"}}
    plan, at = [], 0
    for name, shape, matrix in tensors(layers):
        if scaled and name == "shared.weight":   # scaled files keep the embedding in 16 bits
            matrix = "F16"
        size = int(np.prod(shape)) * {True: 1, False: 4, "F16": 2}[matrix]
        header[name] = {"dtype": {True: "F8_E4M3", False: "F32", "F16": "F16"}[matrix],
                        "shape": list(shape), "data_offsets": [at, at + size]}
        plan.append((name, shape, matrix))
        at += size
        if matrix is True and scaled:
            scale_name = name[:-len("weight")] + "scale_weight"
            header[scale_name] = {"dtype": "F32", "shape": [], "data_offsets": [at, at + 4]}
            plan.append((scale_name, (), None))
            at += 4
    if scaled:
        header["scaled_fp8"] = {"dtype": "F8_E4M3", "shape": [0], "data_offsets": [at, at]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_suffix(".partial")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape, matrix in plan:
            if matrix is None:     # a scale: powers of two and not, as real files have
                f.write(np.float32(rng.choice([0.5, 1.0, 0.8125, 1.375])).tobytes())
            elif matrix == "F16":
                f.write(fp8_weights(rng, shape).astype(np.float16).tobytes())
            elif matrix:
                f.write(fp8_codes(rng, shape).tobytes())
            else:
                f.write(small_floats(rng, name, shape).tobytes())
    tmp.rename(path)


def write_gguf(path: Path, layers: int, kind: str = "Q8_0") -> None:
    """llama.cpp's t5encoder layout, matrices in `kind` (gguf's own quantiser), the rest F32."""
    import gguf
    qtype = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(0)
    names = {"shared.weight": "token_embd.weight",
             "encoder.final_layer_norm.weight": "enc.output_norm.weight"}
    per_block = {"0.SelfAttention.q.weight": "attn_q", "0.SelfAttention.k.weight": "attn_k",
                 "0.SelfAttention.v.weight": "attn_v", "0.SelfAttention.o.weight": "attn_o",
                 "0.SelfAttention.relative_attention_bias.weight": "attn_rel_b",
                 "0.layer_norm.weight": "attn_norm", "1.DenseReluDense.wi_0.weight": "ffn_gate",
                 "1.DenseReluDense.wi_1.weight": "ffn_up", "1.DenseReluDense.wo.weight": "ffn_down",
                 "1.layer_norm.weight": "ffn_norm"}
    w = gguf.GGUFWriter(str(path), "t5encoder")
    w.add_context_length(512)
    w.add_embedding_length(XXL["d_model"])
    w.add_feed_forward_length(XXL["d_ff"])
    w.add_block_count(layers)
    w.add_head_count(XXL["num_heads"])
    w.add_key_length(XXL["d_kv"])
    w.add_value_length(XXL["d_kv"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_relative_attn_buckets_count(XXL["buckets"])
    for name, shape, matrix in tensors(layers):
        if name in names:
            target = names[name]
        else:
            i, rest = name[len("encoder.block."):].split(".layer.")
            target = f"enc.blk.{i}.{per_block[rest]}.weight"
        if matrix:
            values = fp8_weights(rng, shape)
            w.add_tensor(target, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(target, small_floats(rng, name, shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def fp8_weights(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Float32 weights of the same distribution as fp8_codes (for the Q8_0 file)."""
    from minfer.io.tensors import fp8_to_float32
    return fp8_to_float32(fp8_codes(rng, shape), "F8_E4M3")


def model_file(fmt: str, layers: int) -> Path:
    FOLDER.mkdir(exist_ok=True)
    suffix = ".gguf" if fmt in GGUF_KINDS else ".safetensors"
    path = FOLDER / f"t5xxl-{layers}-{fmt}{suffix}"
    if not path.is_file():
        t0 = time.perf_counter()
        if fmt in GGUF_KINDS:
            write_gguf(path, layers, GGUF_KINDS[fmt])
        else:
            write_safetensors(path, layers, scaled=fmt == "fp8-scaled")
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    return path


def peak_mib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    return 0


def worker(path: str, limit: str | None, tokens: int, out: str) -> None:
    import minfer
    t0 = time.perf_counter()
    model = minfer.load(path, memory_limit=limit)
    loaded, loaded_peak = time.perf_counter() - t0, peak_mib()
    ids = np.random.default_rng(1).integers(2, XXL["vocab_size"], size=(1, tokens))
    ids[0, -1] = 1                                           # </s> last, as the tokenizer ends
    t0 = time.perf_counter()
    states = model.encode(ids, use_attention_mask=False)     # Flux's call: no mask
    seconds = time.perf_counter() - t0
    np.save(out, states)
    print(MARK + json.dumps({"peak": peak_mib(), "load": loaded, "encode": seconds,
                             "loaded_peak": loaded_peak}), flush=True)


def run(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        raise SystemExit(f"worker failed: {out.stderr.strip()[-800:]}")
    return json.loads(lines[-1][len(MARK):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", choices=["fp8", "fp8-scaled", *GGUF_KINDS], default="fp8")
    p.add_argument("--limit", default="2GiB")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--layers", type=int, default=XXL["num_layers"])
    p.add_argument("--keep", action="store_true", help="keep the states' .npy files")
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        path, limit, tokens, out = args.worker
        worker(path, None if limit == "none" else limit, int(tokens), out)
        return 0
    path = model_file(args.format, args.layers)
    from minfer.arena import parse_bytes
    limit_mib = parse_bytes(args.limit) >> 20
    limited_out, free_out = FOLDER / "limited.npy", FOLDER / "unlimited.npy"
    limited = run(["--worker", str(path), args.limit, str(args.tokens), str(limited_out)])
    free = run(["--worker", str(path), "none", str(args.tokens), str(free_out)])
    a, b = np.load(limited_out), np.load(free_out)
    diff = float(np.abs(a - b).max() / np.abs(b).max())
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    print(f"{path.name}: 1 x {args.tokens} tokens, {os.cpu_count()} cores ({cpu})")
    print(f"  memory_limit {args.limit}: peak RSS {limited['peak']} MiB "
          f"({limited['peak'] - limit_mib:+d} over; {limited['loaded_peak']} MiB once loaded), "
          f"load {limited['load']:.1f} s, "
          f"encode {limited['encode']:.1f} s")
    print(f"  no limit:          peak RSS {free['peak']} MiB, load {free['load']:.1f} s, "
          f"encode {free['encode']:.1f} s")
    print(f"  states: largest difference / largest state {diff:.2e}")
    if not args.keep:
        limited_out.unlink()
        free_out.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
