"""GOPS of the int8 x int8 products (issue 26: compute="int8", `qmatmul_i8` for int8 weights and
`qmatmul_i4` for int4 ones) against NumPy's float32 product (OpenBLAS sgemm on float32 copies of
the same weights) and the bfloat16 x bfloat16 kernel (`bmatmul_bf16`), same shapes, same run.

    python benchmarks/bench_int8_products.py [--threads 2,1] [--rounds 5] [--shapes M,K,N ...]
                                             [--fallback] [--json PATH]

out (M, N) = x (M, K) @ w (N, K).T; an operation is a multiply or an add (2 M N K per product,
GFLOP/s for the float products, GOPS for the integer ones). Every round times each product on
each shape in turn (the median of a few calls), so a machine that others share slows all of them
alike; the table gives each product's median rate over rounds and the median of the per-round
time ratios (sgemm / i8 and bf16 / i8: above 1, the int8 kernel is faster). numba's threads and
BLAS's threads (threadpoolctl) are both set to each --threads in turn. The default shapes:
t5-base's encoder over 16 x 128 tokens (M = 2048; d_model 768, d_ff 3072, the fused q/k/v
projection 768 -> 2304) and decoding steps of 1-16 rows, with the weights in L3 (a repeated
product of 2.4 MB of weights) and streamed from memory (32768 rows: larger than L3, as a model's
weights are by the time a decoding step comes back to a layer). `--fallback` adds the builds a CPU
without VNNI runs (vpmaddubsw + vpmaddwd).
"""

from __future__ import annotations

import json
import statistics

import numpy as np
from product_timing import arguments, machine, thread_counts, time_shape

DEFAULT_SHAPES = ["2048,768,3072", "2048,3072,768", "2048,768,2304", "2048,768,768",
                  "16,768,3072", "8,768,3072", "4,768,3072", "1,768,3072", "8,3072,768",
                  "1,3072,768", "4,768,32768", "1,768,32768"]
SETTLE_S = 0.5   # pause between two products: OpenBLAS's idle threads spin for a while after a
                 # call, taking the cores from the next product's threads



def products(M: int, K: int, N: int, rng, fallback: bool) -> dict:
    """The products to time on one shape, each a call with its arguments bound."""
    from minfer import kernels
    from minfer.io.formats import quantise_int4, quantise_int8
    from minfer.kernels import bfloat16_products as bp
    from minfer.kernels import quantised_products as qp
    x = rng.standard_normal((M, K)).astype(np.float32)
    wf = rng.standard_normal((N, K)).astype(np.float32)
    q8, s8 = quantise_int8(wf)
    q4, s4 = quantise_int4(wf)
    wb = (wf.view(np.uint32) >> 16).astype(np.uint16)
    out = np.empty((M, N), np.float32)
    work8 = np.empty(kernels.quantised_bytes(M, K, 1), np.uint8)
    work4 = np.empty(kernels.quantised_bytes(M, K, s4.shape[1]), np.uint8)
    workb = np.empty(bp.bmatmul_work_bytes(M, K), np.uint8)
    calls = {"i8": lambda: qp.qmatmul_i8(x, q8, s8, out, work8),
             "i4": lambda: qp.qmatmul_i4(x, q4, s4, out, work4),
             "sgemm": lambda: np.matmul(x, wf.T, out=out),
             "bf16": lambda: bp.bmatmul_bf16(x, wb, out, workb)}
    if fallback:
        calls["i8 fallbk"] = lambda: qp.qmatmul_i8_fallback(x, q8, s8, out, work8)
        calls["i4 fallbk"] = lambda: qp.qmatmul_i4_fallback(x, q4, s4, out, work4)
    return calls



def ratio(times: dict[str, list[float]], slower: str, faster: str = "i8") -> float:
    """The median over rounds of `slower`'s time / `faster`'s."""
    return statistics.median(a / b for a, b in zip(times[slower], times[faster]))


def main() -> int:
    ap = arguments(__doc__.split("\n")[0], DEFAULT_SHAPES)
    ap.add_argument("--fallback", action="store_true", help="also time the builds without VNNI")
    ap.add_argument("--json", help="write the medians here")
    args = ap.parse_args()
    from minfer import kernels
    if kernels.active() is None:
        print("the compiled kernels are off (MINFER_KERNELS=numpy or no numba)")
        return 1
    from minfer.kernels import tiles
    head = machine(f"int8 tiles: {tiles.describe()}")
    print("# " + head.replace("\n", "\n# "))
    rng = np.random.default_rng(0)
    rows = []
    for threads, blas in thread_counts(args.threads):
        print(f"\n## {threads} thread(s){'' if blas else ' (BLAS: its own threads)'}")
        extra = "  i8 fb   i4 fb" if args.fallback else ""
        print(f"{'M':>5} {'K':>5} {'N':>6}  {'i8':>6} {'i4':>6} {'sgemm':>6} {'bf16':>6}{extra}"
              f"  {'sgemm/i8':>8} {'bf16/i8':>7} {'sgemm/i4':>8}   (GOPS, GFLOP/s)")
        for shape in args.shapes:
            M, K, N = (int(v) for v in shape.split(","))
            ops = 2.0 * M * N * K
            times = time_shape(products(M, K, N, rng, args.fallback), args.rounds, "i8", SETTLE_S)
            rate = {n: ops / statistics.median(t) / 1e9 for n, t in times.items()}
            fb = (f" {rate['i8 fallbk']:>6.0f} {rate['i4 fallbk']:>6.0f}" if args.fallback
                  else "")
            print(f"{M:>5} {K:>5} {N:>6}  {rate['i8']:>6.0f} {rate['i4']:>6.0f} "
                  f"{rate['sgemm']:>6.0f} {rate['bf16']:>6.0f}{fb}  "
                  f"{ratio(times, 'sgemm'):>8.2f} {ratio(times, 'bf16'):>7.2f} "
                  f"{ratio(times, 'sgemm', 'i4'):>8.2f}", flush=True)
            rows.append({"threads": threads, "M": M, "K": K, "N": N, "rate": rate,
                         "sgemm/i8": ratio(times, "sgemm"), "bf16/i8": ratio(times, "bf16"),
                         "sgemm/i4": ratio(times, "sgemm", "i4")})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": head, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
