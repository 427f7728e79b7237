"""Time of a decoding step outside the weight products (issue 13: <= 0.3 ms for t5-small).

    python benchmarks/bench_step_overhead.py [--shape t5-small] [--dtypes float32,int8,int4/int8]
                                             [--rounds 5]

Greedy decoding of bench_t5.py's task (batch 1, 32-token source, 64 forced new tokens), timed
twice in the same process, interleaved over --rounds: as is, and with every product replaced by
one that leaves its output as it is (`ops.linear` returns the existing buffer). The second time,
divided by the steps, is what a step costs besides its products: embedding, norms, attention,
activations, the head's softmax and the search, and Python's dispatch. The encoder runs in both;
a 1-token call of the same kind (the encoder and the first step) is subtracted from both.
A mode is a dtype, or dtype/compute (int8/int8: int8 weights with compute="int8").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_t5 as b5  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="t5-small")
    ap.add_argument("--dtypes", default="float32,int8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import minfer
    from minfer import ops
    real_linear = ops.linear

    def no_product(xp, x, w, out=None, relu=False):
        # (x may be the QuantisedRows of a fused norm: its float rows give the shape)
        rows = getattr(x, "rows", x)
        return out if out is not None else xp.zeros((*rows.shape[:-1], w.shape[0]), rows.dtype)

    ids = b5.source_ids()
    folder = b5.ensure_checkpoint(args.shape)
    print(f"{args.shape}, batch 1, {b5.NEW_TOKENS} new tokens, {args.threads} threads; "
          f"median of {args.rounds} rounds, ms")
    print(f"{'mode':>9} {'step':>8} {'step, no products':>18} {'products':>9}")
    for dtype in args.dtypes.split(","):
        weights, _, compute = dtype.partition("/")
        model = minfer.load(folder, dtype=weights, compute=compute or None,
                            num_threads=args.threads)

        def run(new: int, model=model) -> float:
            t = time.perf_counter()
            model.generate([ids], max_new_tokens=new, min_new_tokens=new)
            return time.perf_counter() - t

        full, full1, bare, bare1 = [], [], [], []
        run(b5.NEW_TOKENS)
        for _ in range(args.rounds):
            ops.linear = real_linear
            full.append(run(b5.NEW_TOKENS))
            full1.append(run(1))
            ops.linear = no_product
            run(1)
            bare.append(run(b5.NEW_TOKENS))
            bare1.append(run(1))
        ops.linear = real_linear
        steps = b5.NEW_TOKENS - 1
        # minus a 1-token call (the encoder and the first step) of the same kind
        per_step = (statistics.median(bare) - statistics.median(bare1)) / steps * 1e3
        step = (statistics.median(full) - statistics.median(full1)) / steps * 1e3
        print(f"{dtype:>9} {step:8.3f} {per_step:18.3f} {step - per_step:9.3f}")
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
