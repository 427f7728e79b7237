"""GFLOP/s of the bfloat16 x bfloat16 products (issue 26: compute="bfloat16") against NumPy's
float32 product (OpenBLAS sgemm, float32 copies of the same weights) and the float32-compute
kernel for bfloat16 weights (`matmul_bf16`, small M only), on the same shapes in the same run.

    python benchmarks/bench_bfloat16_products.py [--threads 2,1] [--rounds 5] [--shapes M,K,N ...]

out (M, N) = x (M, K) @ w (N, K).T. Every round times each product on each shape in turn (the
median of a few calls), so a machine that others share slows all of them alike; the table gives
each product's median GFLOP/s over rounds and the median of the per-round time ratios
(sgemm / bf16: above 1, the bfloat16 kernel is faster). numba's threads and BLAS's threads (threadpoolctl) are both set to
each --threads in turn. The default shapes: t5-base's encoder (8 x 256 tokens, d_model 768,
d_ff 3072), decoding steps of 1-8 rows with the weights in L3 and streamed from memory (a
weight matrix larger than L3), and 16 / 64 rows.
"""

from __future__ import annotations

import statistics

import numpy as np
from product_timing import arguments, machine, thread_counts, time_shape

DEFAULT_SHAPES = ["2048,768,3072", "2048,3072,768", "64,768,3072", "16,768,3072",
                  "8,768,3072", "4,768,3072", "2,768,3072", "1,768,3072", "8,3072,768",
                  "1,3072,768", "8,768,32768", "4,768,32768", "1,768,32768"]
STREAM_MAX_ROWS = 64        # matmul_bf16 is timed up to this many rows (the kernels' range)



def products(M: int, K: int, N: int, rng) -> dict:
    """The products to time on one shape, each a call with its arguments bound."""
    from minfer.kernels import bfloat16_products as bp
    from minfer.kernels.float_products import matmul_bf16
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    wf = (w.astype(np.uint32) << 16).view(np.float32)        # the same weights in float32
    out = np.empty((M, N), np.float32)
    work = np.empty(bp.bmatmul_work_bytes(M, K), np.uint8)
    calls = {"sgemm": lambda: np.matmul(x, wf.T, out=out),
             "bf16": lambda: bp.bmatmul_bf16(x, w, out, work),
             "bf16 fallback": lambda: bp.bmatmul_bf16_fallback(x, w, out, work)}
    if M <= STREAM_MAX_ROWS:
        calls["matmul_bf16"] = lambda: matmul_bf16(x, w, out)
    return calls


SETTLE_S = 0.2   # pause between two products: OpenBLAS's idle threads spin for a while after
                 # a call (about 2^28 cycles), taking the cores from the next product's threads
                 # (a 2-thread bf16 product right after sgemm ran at half its speed)



def ratio(times: dict[str, list[float]], slower: str) -> str:
    """The median over rounds of `slower`'s time / bf16's ("-" when it was not timed)."""
    if slower not in times:
        return "-"
    return f"{statistics.median(a / b for a, b in zip(times[slower], times['bf16'])):.2f}"


def main() -> int:
    args = arguments(__doc__.split("\n")[0], DEFAULT_SHAPES).parse_args()
    from minfer import kernels
    if kernels.active() is None:
        print("the compiled kernels are off (MINFER_KERNELS=numpy or no numba)")
        return 1
    from minfer.kernels import bfloat16_tiles
    print("# " + machine(f"bf16 tiles: {bfloat16_tiles.describe()}").replace("\n", "\n# "))
    rng = np.random.default_rng(0)
    for threads, blas in thread_counts(args.threads):
        print(f"\n## {threads} thread(s){'' if blas else ' (BLAS: its own threads)'}")
        print(f"{'M':>5} {'K':>5} {'N':>6}  {'sgemm':>7} {'bf16':>7} {'fallbk':>7} "
              f"{'mm_bf16':>7}  {'bf16/sgemm':>10} {'bf16/mm_bf16':>12}   (GFLOP/s)")
        for shape in args.shapes:
            M, K, N = (int(v) for v in shape.split(","))
            flops = 2.0 * M * N * K
            times = time_shape(products(M, K, N, rng), args.rounds, "bf16", SETTLE_S)
            rate = {n: flops / statistics.median(t) / 1e9 for n, t in times.items()}

            print(f"{M:>5} {K:>5} {N:>6}  {rate['sgemm']:>7.1f} {rate['bf16']:>7.1f} "
                  f"{rate['bf16 fallback']:>7.1f} {rate.get('matmul_bf16', float('nan')):>7.1f}  "
                  f"{ratio(times, 'sgemm'):>10} {ratio(times, 'matmul_bf16'):>12}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
