"""What the product benchmarks (bench_bfloat16_products.py, bench_int8_products.py) share: the
CPU line every table names, and the interleaved timing of several products of one shape."""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from typing import Any, Callable

# the flags that decide which instructions the products run on
FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16",
            "amx_bf16", "amx_int8")


def cpu() -> str:
    """The CPU's name and the features that decide these products' instructions."""
    name = platform.processor() or "?"
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name in ("?", "x86_64", ""):
                    name = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return f"{name}; " + " ".join(f for f in FEATURES if f in flags)


def arguments(description: str, shapes: list[str]) -> argparse.ArgumentParser:
    """The options both benchmarks take: threads, rounds, shapes (M,K,N)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", nargs="*", default=shapes, help="M,K,N")
    return ap


def machine(tiles_line: str) -> str:
    """The date, the CPU, numba / LLVM and the tiles the products run on (every table's head)."""
    import llvmlite.binding as ll
    import numba
    import numpy as np
    return (f"{datetime.date.today().isoformat()}  {cpu()}\nnumba {numba.__version__}, LLVM "
            f"{'.'.join(map(str, ll.llvm_version_info))}, target {ll.get_host_cpu_name()}; "
            f"{tiles_line}; NumPy {np.__version__}")


def thread_counts(spec: str) -> Any:
    """Each thread count of `spec` ("2,1") in turn, numba's and BLAS's set to it; yields
    (threads, whether BLAS's could be set)."""
    import numba
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        threadpool_limits = None
    for threads in (int(t) for t in spec.split(",")):
        numba.set_num_threads(threads)
        if threadpool_limits is not None:
            threadpool_limits(threads)
        yield threads, threadpool_limits is not None


def time_shape(calls: dict[str, Callable[[], object]], rounds: int, reference: str,
               settle_s: float) -> dict[str, list[float]]:
    """Seconds of each call, per round: the median of a few calls (as many as `reference` runs
    in ~30 ms, at least 3) after one untimed call, each product in turn, settle_s apart (BLAS's
    idle threads spin a while after a call, taking the cores from the next product's)."""
    for call in calls.values():
        call()                                                # compile / warm caches
    start = time.perf_counter()
    calls[reference]()
    repeat = max(3, int(0.03 / max(time.perf_counter() - start, 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            time.sleep(settle_s)
            call()
            each = []
            for _ in range(repeat):
                start = time.perf_counter()
                call()
                each.append(time.perf_counter() - start)
            times[name].append(statistics.median(each))
    return times
