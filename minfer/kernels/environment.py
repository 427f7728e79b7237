"""The process settings numba and its OpenMP threads take from the environment, made once, before
numba is imported (`configure`, called by `kernels.compiled`): nothing here runs at import."""

from __future__ import annotations

import os


def configure() -> None:
    """The settings below, unless the user made them; then numba, with a fast threading layer
    first: GNU OpenMP (libgomp) or TBB ("workqueue" is the slow fallback)."""
    _spin_briefly()
    _prefer_512_bit_vectors()
    import numba
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]


def _spin_briefly() -> None:
    """GNU OpenMP's idle threads spin 300,000 times before they sleep. On a machine whose cores
    other processes also use, the spinning thread takes the core the working one needs; 1,000
    spins cost nothing measurable on a quiet machine (benchmarks/README.md, "Threads on a busy machine"). Read
    once, when numba loads libgomp at the first parallel call; the user's own setting wins."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = "1000"


def _prefer_512_bit_vectors() -> None:
    """LLVM tunes Intel's AVX-512 server cores (skylake-avx512, icelake-server, sapphirerapids)
    to prefer 256-bit vectors, so the loops here would be vectorised at half the width the CPU
    has (AMD's znver4 already gets 512 bits). numba takes the target's features from
    NUMBA_CPU_FEATURES when set: the host's own plus "-prefer-256-bit" lifts the preference.
    Only when the user set neither NUMBA_CPU_NAME nor NUMBA_CPU_FEATURES, and before numba's first
    compilation in the process (numba builds its target machine once)."""
    if "NUMBA_CPU_FEATURES" in os.environ or "NUMBA_CPU_NAME" in os.environ:
        return
    import llvmlite.binding as ll
    features = ll.get_host_cpu_features()
    if features.get("avx512f"):
        os.environ["NUMBA_CPU_FEATURES"] = features.flatten() + ",-prefer-256-bit"
