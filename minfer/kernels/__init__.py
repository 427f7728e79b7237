"""The CPU kernels: hand-written loops compiled with numba (LLVM), for what NumPy does slowly, and
the policy of running them: which are selected, their threads, the pool that splits large
products, the first run's compilation.

The kernels, one module per job: `float_products` (small-M products in float32 for every
storage format: decoding reads each weight row once, widened in registers, where BLAS reaches
50-60% of the memory bandwidth and has no float16, bfloat16 or int8 product at all),
`quantised_products` (compute="int8": int8 x int8 on the CPU's dot-product instructions, built
in LLVM IR by `tiles`), `widening` (stored bits to float32, in registers and in blocks for
BLAS), `step_ops` (fused step functions: attention of one query over a KV cache, add + RMS
norm, relu, top-k, beam reorders). `registry` gathers them, by name and by storage format
(`BY_FORMAT`); `environment` holds the process settings made before numba loads. Products of
more rows (the encoder, a prompt) stay with BLAS: see `products.py` for the dispatch.

Everything here is optional: `MINFER_KERNELS=numpy` (or numba not importable) selects the pure
NumPy path, which computes the same functions; the parity tests run both ways. Compiled code is
cached on disk (numba's `cache=True`), so only the first run of an installation compiles.

Threads: numba's threading layer must be a fast one ("omp": GNU OpenMP, or "tbb"); its
"workqueue" fallback spins slowly. `set_threads(n)` sets how many threads the CPU work uses, and
`split` spreads a large product (BLAS at one thread per part) over this module's pool.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable

import numpy as np

from ..arena import align_up
from ..errors import ConfigError

MODES = ("numba", "numpy")
# The threading layers numba may be told to use (NUMBA_THREADING_LAYER), each with the layers
# that can serve it, by the module that loads each layer's library.
_LAYER_MODULES = {"omp": "omppool", "tbb": "tbbpool", "workqueue": "workqueue"}
_LAYER_CHOICES = {"default": ("omp", "tbb", "workqueue"), "safe": ("tbb",),
                  "threadsafe": ("tbb", "omp"), "forksafe": ("tbb", "omp", "workqueue"),
                  **{name: (name,) for name in _LAYER_MODULES}}


def _mode_from_env() -> str:
    mode = os.environ.get("MINFER_KERNELS", "numba").strip().lower() or "numba"
    if mode not in MODES:
        raise ConfigError(f"MINFER_KERNELS={mode!r}: expected one of {', '.join(MODES)}")
    return mode


# Read at first use, not at import: a bad value is then a one-line error of the call that needs
# it (the command line's handler catches it), not a traceback from `import minfer`.
_mode: str | None = None
_compiled: Any = None   # the module of compiled kernels, once built
_after_fork = False     # this process was forked from one whose OpenMP threads had started


def mode() -> str:
    global _mode
    if _mode is None:
        _mode = _mode_from_env()
    return _mode


def compiled() -> Any:
    """The compiled kernels (`kernels.registry`: every kernel by name, and BY_FORMAT) when they are
    selected and numba can be imported, else None; starts no threads (loading wraps the weights
    with it; see `active`)."""
    global _compiled
    if mode() != "numba" or _after_fork:
        return None
    if _compiled is None:
        try:
            from . import environment
            environment.configure()   # (before numba builds its target machine)
            from . import registry
        except ImportError:   # numba missing: the NumPy path, which computes the same things
            return None
        _check_threading_layer()
        _compile_ahead(registry)
        _compiled = registry
    return _compiled


# -- the first run: compiling in a child process ----------------------------------------------------
COMPILE_NOTICE = "minfer: compiling CPU kernels (first run only; up to a minute)"
_log = logging.getLogger("minfer")


def _compile_ahead(module: Any) -> None:
    """Before the first kernel call of an installation (numba's disk cache cold), compile every
    kernel in a child process that fills the cache, saying so on stderr (a logging warning:
    Python prints it when nothing else is configured). LLVM's compiler then never runs in this
    process: a cold first run otherwise peaks ~60 MiB higher than a cached one, outside any
    arena (a t5-base-shaped model under memory_limit=256MiB: 430 MiB, cached 371). This process
    then loads from the cache only the kernels its formats and modes call. A marker beside the
    cache, named after everything numba's cache depends on, says the child has run; if the
    child fails (a read-only cache, no interpreter), the kernels compile here on first use as
    before."""
    cache_dir = getattr(getattr(module.matmul_f32, "_cache", None), "cache_path", None)
    if not cache_dir or not os.path.isdir(cache_dir):
        return
    stamp = _kernel_stamp(module)
    marker = os.path.join(cache_dir, f"minfer-kernels-{stamp}.ready")
    failed = os.path.join(cache_dir, f"minfer-kernels-{stamp}.failed")   # tried once: not again
    if os.path.exists(marker) or os.path.exists(failed):
        return
    try:
        import fcntl
        lock = open(os.path.join(cache_dir, "minfer-kernels.lock"), "a+")
    except (ImportError, OSError):   # no flock (not POSIX), or a cache folder we cannot write
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # one compiling child at a time; the others wait
        if os.path.exists(marker) or os.path.exists(failed):
            return
        _log.warning(COMPILE_NOTICE)
        # the child imports the minfer this process runs: its own sys.path, set before the
        # import (the current folder first would find another checkout)
        path = [p or os.getcwd() for p in sys.path]
        code = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
                "from minfer.kernels import environment; environment.configure(); "
                "from minfer.kernels import registry; "
                "registry.warm_up(json.loads(sys.argv[2]))")
        children: list[subprocess.Popen] = []
        try:
            for share in module.shares(_compile_parts()):   # side by side: a share a child
                children.append(subprocess.Popen(
                    [sys.executable, "-c", code, json.dumps(path), json.dumps(share)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            deadline = time.monotonic() + 1800
            done = all(c.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
                       for c in children)
        except (OSError, subprocess.SubprocessError):
            done = False
        finally:
            for c in children:
                if c.poll() is None:
                    c.kill()
                    c.wait()
        with contextlib.suppress(OSError):
            open(marker if done else failed, "w").close()


COMPILE_PARTS = 4              # at most this many compiling children
COMPILE_CHILD_BYTES = 640 << 20   # what one compiling child may hold at its peak (LLVM)


def _compile_parts() -> int:
    """Children to compile the kernels in: one per processor this process may run on (the
    compile of one kernel is single-threaded: a 2-core machine halves its first run's wait), at
    most COMPILE_PARTS and no more than the memory free now holds."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        free = COMPILE_CHILD_BYTES
    return max(1, min(COMPILE_PARTS, cpus, free // COMPILE_CHILD_BYTES))


def _kernel_stamp(module: Any) -> str:
    """What the compiled kernels depend on: their sources, numba's version, the CPU and the
    instruction-set settings (numba keys its cache on these too)."""
    import numba
    from llvmlite import binding
    digest = hashlib.sha256()
    for path in module.SOURCES:
        digest.update(path.read_bytes())
    digest.update("|".join((numba.__version__, sys.version, binding.get_host_cpu_name(),
                            binding.get_host_cpu_features().flatten(),
                            os.environ.get("NUMBA_CPU_NAME", ""),
                            os.environ.get("NUMBA_CPU_FEATURES", ""),
                            os.environ.get("NUMBA_OPT", ""))).encode())
    return digest.hexdigest()[:16]


def active() -> Any:
    """The compiled kernels, to run now (None: the NumPy path). In a thread that has not yet used
    the thread count `set_threads` chose, applies it first: numba keeps that count per calling
    thread, so a server's worker threads (or the batcher's leaders) would otherwise run the
    kernels on every core whatever `num_threads` said. Applying it starts numba's threads, which
    is why loading does not call this: a process may still fork safely after `minfer.load`."""
    k = compiled()
    if k is not None and _kernel_threads and getattr(_applied, "threads", None) != _kernel_threads:
        k.set_threads(_kernel_threads)
        _applied.threads = _kernel_threads
    return k


def _check_threading_layer() -> None:
    """NUMBA_THREADING_LAYER names a layer this machine can load, or a one-line ConfigError
    (numba itself says so only at the first parallel call, in a multi-line ValueError). Only
    imports the layers' modules: starting threads here would make a later fork unsafe."""
    import numba
    asked = str(numba.config.THREADING_LAYER).lower()
    choices = _LAYER_CHOICES.get(asked)
    if choices is None:
        raise ConfigError(f"NUMBA_THREADING_LAYER={asked!r}: expected one of "
                          f"{', '.join(_LAYER_CHOICES)}")
    for layer in choices:
        try:
            importlib.import_module(f"numba.np.ufunc.{_LAYER_MODULES[layer]}")
            return
        except (ImportError, OSError):
            continue
    hint = " (pip install tbb)" if "tbb" in choices else ""
    raise ConfigError(f"NUMBA_THREADING_LAYER={asked!r}: no threading layer it allows "
                      f"({', '.join(choices)}) can be loaded on this machine{hint}; unset it to "
                      "let numba choose")


_kernel_threads = 0                 # numba threads set_threads chose (0: numba's default)
_applied = threading.local()        # .threads: the count this thread last gave numba


def _in_forked_child() -> None:
    """After fork, in the child: GNU OpenMP cannot run in a process forked from one whose OpenMP
    threads had started (numba terminates the child at its first parallel call), so such a child
    computes on the NumPy path (the same results, slower; use the spawn start method for the
    kernels' speed). Thread pools did not survive the fork: they are made again when needed."""
    global _after_fork, _pool
    _pool = None
    _applied.__dict__.clear()
    if _compiled is not None:
        import numba
        try:
            started = numba.threading_layer() == "omp"
        except ValueError:   # no parallel layer started in the parent: the kernels are safe
            started = False
        _after_fork = _after_fork or started


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_forked_child)


def set_threads(n: int | None) -> int:
    """Threads for the CPU work (None: the cores this process may use). Returns the count.

    With the compiled kernels active there is one set of threads at a time: numba's for the
    kernels, and for the large products (BLAS) this module's pool, which splits each product
    into one part per thread and runs the parts with BLAS set to one thread (process-wide,
    through threadpoolctl). Two pools spinning on the same cores cost far more than they
    gave: OpenBLAS's threads spin ~0.1 s after every call, and with the kernels between its
    calls (Transformer-XL's scoring: head logits by BLAS, tail clusters by the kernels) a
    scoring pass ran up to twice as long (benchmarks/README.md, "Measurements behind constants
    in the code"). In the NumPy mode BLAS keeps its own threads (`n` of them
    when given)."""
    global _threads
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError(f"num_threads must be a positive integer, got {n!r}")
    threads = (usable or 1) if n is None else n
    k = compiled()
    if k is not None:
        global _kernel_threads
        _kernel_threads = min(threads, k.max_threads())
        _applied.__dict__.clear()   # every thread applies it at its next kernel call
        _set_blas_threads(1)
        _threads = threads
    elif n is not None:
        _set_blas_threads(n)
    return threads


def _set_blas_threads(n: int) -> None:
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:   # a core dependency; without it BLAS keeps its own setting
        return
    threadpool_limits(limits=n, user_api="blas")


# -- the pool for large products ----------------------------------------------------------------------
_threads = 1            # parts a large product is split into (set_threads)
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def parts(n: int, min_part: int = 1) -> int:
    """How many parts `split` cuts n items into: one per thread, each at least min_part."""
    if _threads <= 1 or compiled() is None:
        return 1
    return max(1, min(_threads, n // max(min_part, 1)))


def split(n: int, work: Callable[[int, int, int], None], count: int | None = None,
          blas: bool = False) -> None:
    """Run work(part, start, stop) over [0, n) cut into `count` (default `parts(n)`) contiguous
    ranges: the first in the calling thread, the others on the pool; return when all are done
    (and only then raise the first part's error). The work must release the GIL to run in
    parallel (BLAS products, NumPy ufuncs and the `nogil` kernels do). Without the compiled
    kernels (or with one thread) it is one call.

    `blas`: the work calls BLAS, so under a memory limit (`keep_blas_on_pool`) with the compiled
    kernels every part runs on the pool, none in the calling thread: OpenBLAS keeps a buffer for
    each thread that ever called it, outside any arena, for the thread's life; on the pool that
    is one per pool thread, whatever the number of request threads. Otherwise a one-part call
    stays in the calling thread (a hand-off per call, on every layer of a decoding step).
    (In the NumPy mode BLAS runs its own threads from the caller's, as before.) A pool thread's
    own call runs where it is: no part waits on the pool from inside it."""
    if compiled() is None or not _blas_on_pool:
        blas = False
    count = parts(n) if count is None else min(count, n)
    if getattr(_in_pool, "yes", False):
        bounds = [n * i // count for i in range(count + 1)] if count > 1 else [0, n]
        for i in range(len(bounds) - 1):
            work(i, bounds[i], bounds[i + 1])
        return
    if count <= 1 and not blas:
        work(0, 0, n)
        return
    count = max(count, 1)
    bounds = [n * i // count for i in range(count + 1)]
    first = 0 if blas else 1            # the parts the pool runs
    pool = _get_pool(max(count - first, _threads))
    futures = []
    try:   # (a failed submit too waits for the parts already running)
        futures.extend(pool.submit(work, i, bounds[i], bounds[i + 1]) for i in range(first, count))
        if not blas:
            work(0, bounds[0], bounds[1])
    finally:
        # every part has ended before anything is raised: a part still running could otherwise
        # write into memory that the caller hands to the next request once the error is out
        wait(futures)
    for f in futures:
        f.result()   # the first failing part's error, in part order


def on_pool(call: Callable[[], Any], xp: Any = None) -> None:
    """Run one BLAS call on the pool (see `split`'s `blas`), waiting for it; with a device array
    namespace `xp` (not NumPy) in the calling thread, as its library runs it."""
    if xp is not None and xp.__name__ != "numpy":
        call()
        return
    split(1, lambda part, a, b: call(), 1, blas=True)


_in_pool = threading.local()   # .yes in the pool's own threads
_blas_on_pool = False          # BLAS work only on the pool's threads (keep_blas_on_pool)


def keep_blas_on_pool(on: bool = True) -> None:
    """Call BLAS only from the pool's threads (the loading of a model under a memory limit
    turns it on for the process: memory outside the arena then stays bounded whatever the
    number of threads that run requests)."""
    global _blas_on_pool
    _blas_on_pool = on


def _pool_thread() -> None:
    """The pool's threads run parts of model calls, which check their outputs for NaN and
    infinity themselves (numerics.quiet): NumPy's warnings stay off there for good."""
    np.seterr(over="ignore", invalid="ignore", divide="ignore")
    _in_pool.yes = True


def _get_pool(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < workers:
            # a larger pool replaces it; the old one is not shut down (a caller that holds it
            # may still submit): its idle threads end once nothing refers to it
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="minfer",
                                       initializer=_pool_thread)
        return _pool


def max_threads() -> int:
    """The most threads the compiled kernels may run here (numba's NUMBA_NUM_THREADS; what
    per-thread scratch is sized for), or 0 where they are not selected."""
    k = compiled()
    return k.max_threads() if k is not None else 0


# The floors the int8 products' epilogue takes (`low`; float32, the compiled entries' one
# signature): the FF's ReLU, or none.
RELU_FLOOR, NO_FLOOR = np.float32(0.0), np.float32(-np.inf)


def quantised_bytes(M: int, K: int, groups: int) -> int:
    """Bytes of scratch an int8 x int8 product of M input rows of K columns quantises them into
    (`quantised_products`' layout: the int8 rows, grouped by 4 and interleaved, their int32 sums
    per group of columns, the float32 row scales, each part 64-byte aligned)."""
    return align_up(M * K, 64) + align_up(M * groups * 4, 64) + align_up(M * 4, 64)


def bfloat16_native() -> bool:
    """Whether the compiled kernels are selected here and the CPU they compile for multiplies
    bfloat16 itself (AVX512_BF16's vdpbf16ps): then compute="bfloat16" is the default for
    bfloat16 weights, faster than widening them to float32."""
    if compiled() is None:
        return False
    from . import bfloat16_tiles
    return bfloat16_tiles.ISA == "avx512bf16"


def bfloat16_instructions() -> str:
    """Which instructions compute="bfloat16" runs its products on here (`minfer info`)."""
    if compiled() is None:
        return "no compiled kernels: inputs rounded to bfloat16, products in float32 (NumPy)"
    from . import bfloat16_tiles
    return bfloat16_tiles.describe()


def int8_products() -> str:
    """Which instructions compute="int8" runs its products on here (`minfer info`)."""
    k = compiled()
    if k is None:
        return "no compiled kernels: inputs rounded to int8, products in float32 (NumPy)"
    from . import tiles
    return tiles.describe()


def warm_up() -> bool:
    """Compile (first run) or load from numba's cache every kernel now, instead of inside the
    first product. Returns whether the compiled kernels are active."""
    k = active()
    if k is None:
        return False
    k.warm_up()
    return True
