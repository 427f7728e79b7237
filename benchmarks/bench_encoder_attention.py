"""One encoder layer's self-attention, float32 against bfloat16 and int8 products (issue 26).

    python benchmarks/bench_encoder_attention.py [--shapes 16x128,8x256] [--heads 12] [--dim 64]
                                                 [--rounds 5] [--threads 2]

For each batch x length: ms per call of ops.float_distance_attention (float32,
kernels/pass_attention_float.py: keys transposed per head, float32 panel products, no score
tensor), of ops.distance_attention (float32 in array ops, what CUDA and MINFER_KERNELS=numpy run:
BLAS products per head, NumPy's softmax, the (B, H, T, T) scores), of
ops.rounded_distance_attention (kernels/pass_attention.py: each head's q|k|v packed, bfloat16 panel
products, no score tensor), and of the latter's packing phase alone, of
ops.quantised_distance_attention (kernels/pass_attention_int8.py: each head's q|k|v quantised,
int8 panel products, no score tensor); interleaved rounds in one
process (medians), t5-base's 12 heads of 64 by default, random q|k|v, a random bias table and
no padding. Prints the CPU line of product_timing.cpu() first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
from numba import njit, prange

from minfer import kernels, ops
from minfer.kernels import pass_attention
from minfer.kernels.attention_layout import AttentionShape
from product_timing import cpu


@njit(parallel=True, cache=False)
def _pack_only(qkv, qx, kp, vp, rounded):
    """The bfloat16 kernel's packing of every (batch row, head), each thread into its parts."""
    B, H = qkv.shape[0], qkv.shape[3]
    threads = qx.shape[0]
    for t in prange(threads):
        for task in range(t, B * H, threads):
            pass_attention._pack_head(qkv, task // H, task % H, qx[t], kp[t], vp[t], rounded[t])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="16x128,8x256", help="batch x length, comma-separated")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    kernels.set_threads(args.threads)
    if kernels.active() is None:
        raise SystemExit("the compiled kernels are off (MINFER_KERNELS=numpy, or no numba)")
    print(cpu(), f"; {args.threads} threads")
    for shape in args.shapes.split(","):
        B, T = (int(n) for n in shape.split("x"))
        times = time_shape(B, T, args.heads, args.dim, args.rounds)
        print(f"\n{B} x {T} tokens, {args.heads} heads of {args.dim}: ms per call, median of "
              f"{args.rounds} rounds")
        for name, ts in times.items():
            print(f"  {name:40s} {statistics.median(ts):8.2f}")


def time_shape(B: int, T: int, H: int, D: int, rounds: int) -> dict[str, list[float]]:
    """ms per call of each attention, `rounds` interleaved rounds of 5 calls."""
    rng = np.random.default_rng(0)
    qkv = (rng.standard_normal((B, T, 3, H, D)) * 0.5).astype(np.float32)
    table = rng.standard_normal((H, 2 * T - 1)).astype(np.float32)
    bias = ops.DistanceBias(table, np.zeros((B, T), np.float32))
    ctx = np.empty((B, T, H, D), np.float32)
    scores = np.empty(ops.distance_scores(B, H, T, T), np.float32)
    stats = tuple(np.empty((B, H, T, 1), np.float32) for _ in range(2))
    layout = AttentionShape(B, H, T, T, D, numba.get_num_threads())
    work = np.empty(layout.nbytes(), np.uint8)
    parts = layout.carve(work)
    floats = np.empty(AttentionShape(B, H, T, T, D, numba.get_num_threads(), "float32").nbytes(),
                      np.uint8)
    quantised = np.empty(AttentionShape(B, H, T, T, D, numba.get_num_threads(), "int8").nbytes(),
                         np.uint8)
    q, k, v = (qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3))
    calls = {
        "float32 (float_distance_attention)":
            lambda: ops.float_distance_attention(np, qkv, bias, floats, ctx, stats),
        "float32 in array ops (distance_attention)":
            lambda: ops.distance_attention(np, q, k, v, bias, scores, ctx, stats),
        "bfloat16 (rounded_distance_attention)":
            lambda: ops.rounded_distance_attention(np, qkv, bias, work, ctx, stats),
        "  its packing alone":
            lambda: _pack_only(qkv, parts["queries"], parts["keys"], parts["values"],
                               parts["rounded"]),
        "int8 (quantised_distance_attention)":
            lambda: ops.quantised_distance_attention(np, qkv, bias, quantised, ctx, stats),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()                                   # compile / warm up
    for _ in range(rounds):
        for name, call in calls.items():
            t0 = time.perf_counter()
            for _ in range(5):
                call()
            times[name].append((time.perf_counter() - t0) / 5 * 1e3)
    return times

if __name__ == "__main__":
    main()
