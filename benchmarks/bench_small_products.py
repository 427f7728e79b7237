"""The float-compute products of a few input rows (decoding steps, beams, small batches:
`kernels/float_products.matmul_*`), with their weights streamed from memory: milliseconds a
product and the weights' GB/s, per stored format, rows and shape.

    python benchmarks/bench_small_products.py [--rows 1,2,4,8,16] [--rounds 9]
                                              [--shapes N,K ...] [--formats f32,f16,bf16,i8]

Each shape takes 16 distinct weight matrices (t5-base's 768 x 3072 and 2304 x 768: 150 and 113
MB in float32, more than L3), each product once per round; the table gives the median over
rounds. To compare two trees (a constant of the kernels is compiled in), run it under each in
turn, e.g. with PYTHONPATH=<other checkout> and NUMBA_CACHE_DIR=<its own cache>: the first line
names the tree that ran.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

MATRICES = 16


def stored(fmt: str, w: np.ndarray) -> tuple:
    """The kernel's weight arguments for float32 weights w in format `fmt`."""
    if fmt == "f32":
        return (w,)
    if fmt == "f16":
        return (w.astype(np.float16).view(np.uint16),)
    if fmt == "bf16":
        return ((w.view(np.uint32) >> 16).astype(np.uint16),)
    scale = np.abs(w).max(axis=1) / 127
    return (np.round(w / scale[:, None]).astype(np.int8), scale.astype(np.float32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--shapes", nargs="*", default=["768,3072", "2304,768"])
    ap.add_argument("--formats", default="f32,f16,bf16,i8")
    args = ap.parse_args()
    import minfer
    from minfer.kernels import float_products as fp
    kernel = {"f32": fp.matmul_f32, "f16": fp.matmul_f16, "bf16": fp.matmul_bf16,
              "i8": fp.matmul_i8}
    rng = np.random.default_rng(0)
    print(f"tree: {minfer.__file__}")
    print("| N x K | rows | format | ms a product | GB/s |")
    print("|---|---:|---|---:|---:|")
    for shape in args.shapes:
        N, K = (int(v) for v in shape.split(","))
        dense = [rng.standard_normal((N, K)).astype(np.float32) for _ in range(MATRICES)]
        for fmt in args.formats.split(","):
            weights = [stored(fmt, w) for w in dense]
            nbytes = sum(a.nbytes for a in weights[0])
            for M in (int(v) for v in args.rows.split(",")):
                x = rng.standard_normal((M, K)).astype(np.float32)
                out = np.empty((M, N), np.float32)
                kernel[fmt](x, *weights[0], out)          # compiled (or loaded) before timing
                times = []
                for _ in range(args.rounds):
                    t = time.perf_counter()
                    for w in weights:
                        kernel[fmt](x, *w, out)
                    times.append((time.perf_counter() - t) / MATRICES)
                t = float(np.median(times))
                print(f"| {N} x {K} | {M} | {fmt} | {t * 1e3:.3f} | {nbytes / t / 1e9:.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
