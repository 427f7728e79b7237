"""The CPU kernels: hand-written loops compiled with numba (LLVM), for what NumPy does slowly.

Decoding multiplies one row per sequence by every weight matrix: a product that only streams the
weights from memory. BLAS reaches 50-60% of the memory bandwidth on such products and has no
float16, bfloat16 or int8 product at all; these kernels read each weight row once, in its stored
format, widen it in registers (float16 through the F16C conversion, bfloat16 by a shift, int8 by
a convert) and take the dot products with every input row while the weight row is in L1. Blocks
of output rows are spread over the threads (`prange`). Products of more rows (the encoder, a
prompt) stay with BLAS: see `params/formats.py` for the dispatch.

Fused step functions cut the rest of a decoding step: one call per sublayer instead of a dozen
small NumPy calls (attention of one query position over a KV cache with its bias and softmax;
a residual add with the RMS norm that follows it).

Everything here is optional: `MINFER_KERNELS=numpy` (or numba not importable) selects the pure
NumPy path, which computes the same functions; the parity tests run both ways. Compiled code is
cached on disk (numba's `cache=True`), so only the first run of an installation compiles.

Threads: numba's threading layer must be a fast one ("omp": GNU OpenMP, or "tbb"); its
"workqueue" fallback spins slowly. `set_threads(n)` sets how many threads the kernels use.
"""

from __future__ import annotations

import os
from typing import Any


from .errors import ConfigError

MODES = ("numba", "numpy")
BLOCK_ROWS = 32  # output rows per task: enough work per task, and both threads stay busy


def _mode_from_env() -> str:
    mode = os.environ.get("MINFER_KERNELS", "numba").strip().lower() or "numba"
    if mode not in MODES:
        raise ConfigError(f"MINFER_KERNELS={mode!r}: expected one of {', '.join(MODES)}")
    return mode


_mode = _mode_from_env()
_compiled: Any = None   # the module of compiled kernels, once built


def set_mode(mode: str) -> None:
    """'numba' (compiled kernels on the CPU) or 'numpy' (plain NumPy/BLAS everywhere)."""
    global _mode
    if mode not in MODES:
        raise ConfigError(f"kernels {mode!r}: expected one of {', '.join(MODES)}")
    _mode = mode


def mode() -> str:
    return _mode


def active() -> Any:
    """The compiled kernels when they are selected and numba can be imported, else None."""
    global _compiled
    if _mode != "numba":
        return None
    if _compiled is None:
        try:
            from . import _numba_kernels
        except ImportError:   # numba missing: the NumPy path, which computes the same things
            return None
        _compiled = _numba_kernels
    return _compiled


def set_threads(n: int | None) -> int:
    """Threads for the compiled kernels and, when `n` is given, for BLAS too (None: the cores
    this process may use, BLAS left as it is). Returns the kernels' thread count.

    numba keeps the setting per calling thread; BLAS's is process-wide (through threadpoolctl,
    which finds whichever BLAS NumPy was built with)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError(f"num_threads must be a positive integer, got {n!r}")
    threads = usable if n is None else n
    k = active()
    if k is not None:
        k.set_threads(min(threads, k.max_threads()))
    if n is not None:
        from threadpoolctl import threadpool_limits
        threadpool_limits(limits=n, user_api="blas")
    return threads


def warm_up() -> bool:
    """Compile (first run) or load from numba's cache every kernel now, instead of inside the
    first product. Returns whether the compiled kernels are active."""
    k = active()
    if k is None:
        return False
    k.warm_up()
    return True


_blas_shutdown: Any = False   # OpenBLAS's thread shutdown, once looked up (None: not available)


def quiet_blas() -> None:
    """Stop OpenBLAS's worker threads after a phase of large products (an encoder pass, a
    prompt), before the compiled kernels take over: after each call OpenBLAS's threads spin for
    ~0.1 s (its THREAD_TIMEOUT), and spinning next to the kernels' threads on the same cores cost
    12-28% of decoding speed. They restart by themselves at the next BLAS call (~0.1 ms). Other
    BLAS libraries are left alone."""
    global _blas_shutdown
    if _blas_shutdown is False:
        _blas_shutdown = None
        try:
            from threadpoolctl import ThreadpoolController
            for lib in ThreadpoolController().select(internal_api="openblas").lib_controllers:
                _blas_shutdown = getattr(lib.dynlib, "blas_thread_shutdown_", None)
                break
        except Exception:  # no threadpoolctl or an unusual build: nothing to quiet
            _blas_shutdown = None
    if _blas_shutdown is not None and active() is not None:
        _blas_shutdown()
