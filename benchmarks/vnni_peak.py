"""The CPU's int8 dot-product ceiling: `vpdpbusd` on 512-bit vectors (AVX-512 VNNI), as many
independent accumulators as the int8 panel tile holds (4 input rows x 4 vectors of weights, the
weights loaded and the inputs broadcast from L1 every step), on 1 thread and on N.

    python benchmarks/vnni_peak.py [--threads 2] [--seconds 1]

Prints multiply-adds per second (64 a `vpdpbusd`): what the int8 x int8 products' rate
(`bench_int8_products.py`, a pass's profile) is a share of. Needs AVX-512 VNNI (exits saying so
otherwise). No minfer code runs: the loop is written in LLVM IR here.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from llvmlite import binding, ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

ROWS, VECTORS = 4, 4          # the panel tile's shape (tiles.make_panel_tile: C x P accumulators)
I32, I64 = ir.IntType(32), ir.IntType(64)


@intrinsic
def _steps(typingctx, n, buf):
    """n steps of ROWS x VECTORS vpdpbusd over 64 spots of buf (L1); returns a lane of the sum
    (so that nothing is dropped as dead)."""
    sig = types.int32(types.int64, buf)

    def codegen(context, builder, signature, args):
        v16 = ir.VectorType(I32, 16)
        dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16] * 3),
                                             "llvm.x86.avx512.vpdpbusd.512")
        data = context.make_array(signature.args[1])(context, builder, args[1]).data
        words, vectors = builder.bitcast(data, I32.as_pointer()), builder.bitcast(data, v16.as_pointer())
        entry = builder.block
        loop, done = builder.append_basic_block("loop"), builder.append_basic_block("done")
        builder.branch(loop)
        builder.position_at_end(loop)
        i = builder.phi(I64)
        accs = [builder.phi(v16) for _ in range(ROWS * VECTORS)]
        i.add_incoming(ir.Constant(I64, 0), entry)
        for acc in accs:
            acc.add_incoming(ir.Constant(v16, None), entry)
        spot = builder.and_(i, ir.Constant(I64, 63))
        weights = [builder.load(builder.gep(vectors, [builder.add(
            builder.mul(spot, ir.Constant(I64, VECTORS)), ir.Constant(I64, p))]), align=1)
            for p in range(VECTORS)]
        inputs = []
        for c in range(ROWS):
            word = builder.load(builder.gep(words, [builder.add(
                builder.mul(spot, ir.Constant(I64, 16)), ir.Constant(I64, 4096 + c))]))
            lane = builder.insert_element(ir.Constant(v16, None), word, ir.Constant(I32, 0))
            inputs.append(builder.shuffle_vector(lane, ir.Constant(v16, None),
                                                 ir.Constant(v16, [0] * 16)))
        new = [builder.call(dot, [accs[c * VECTORS + p], weights[p], inputs[c]])
               for c in range(ROWS) for p in range(VECTORS)]
        step = builder.add(i, ir.Constant(I64, 1))
        i.add_incoming(step, loop)
        for acc, value in zip(accs, new):
            acc.add_incoming(value, loop)
        builder.cbranch(builder.icmp_signed("<", step, args[0]), loop, done)
        builder.position_at_end(done)
        total = new[0]
        for value in new[1:]:
            total = builder.add(total, value)
        return builder.extract_element(total, ir.Constant(I32, 0))
    return sig, codegen


@njit(parallel=True)
def _run(n, buf):
    out = np.zeros(buf.shape[0], np.int32)
    for t in prange(buf.shape[0]):
        out[t] = _steps(n, buf[t])
    return out.sum()


def rate(threads: int, seconds: float) -> float:
    """Multiply-adds a second over `threads` threads (best of 3 runs of about `seconds`)."""
    numba.set_num_threads(threads)
    buf = np.ones((threads, 64 << 10), np.uint8)
    _run(10, buf)
    n, best = 1 << 20, 0.0
    while True:                                      # a run of about `seconds`
        t0 = time.perf_counter()
        _run(n, buf)
        if time.perf_counter() - t0 > seconds / 4:
            break
        n *= 2
    per = n * ROWS * VECTORS * 64 * threads
    for _ in range(3):
        t0 = time.perf_counter()
        _run(n, buf)
        best = max(best, per / (time.perf_counter() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    if "avx512vnni" not in binding.get_host_cpu_features().flatten():
        raise SystemExit("this CPU has no AVX-512 VNNI")
    one = rate(1, args.seconds)
    many = rate(args.threads, args.seconds)
    print(f"{binding.get_host_cpu_name()}: vpdpbusd (512-bit) {one / 1e9:.0f} G multiply-adds/s "
          f"on 1 thread ({one / 64 / 1e9:.2f} G instructions/s), {many / 1e9:.0f} G on "
          f"{args.threads}")


if __name__ == "__main__":
    main()
