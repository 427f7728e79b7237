"""The compiled kernels as one namespace (what `kernels.compiled()` returns), the registry that
says which kernel runs each storage format's products, warm-up and numba's thread count.

Importing it imports numba and compiles nothing: each kernel is compiled (or loaded from numba's
disk cache) at its first call; `warm_up` makes those first calls on tiny arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numba
import numpy as np

from ..io import tensors as io_tensors
from . import (activation_formulas, activations, attention_layout, bfloat16_products,
               bfloat16_tiles, float_products, float_tiles, pass_attention, pass_attention_float,
               pass_attention_int8, pass_softmax, quantised_products, step_ops, tiles,
               vector_math, widening)
from .activations import ACTIVATION_KINDS, activate, activate_quantised
from .bfloat16_products import (bmatmul_bf16, bmatmul_e4m3, bmatmul_e5m2, bmatmul_work_bytes,
                                fp8_work_bytes)
from .float_products import (matmul_bf16, matmul_e4m3, matmul_e5m2, matmul_f16, matmul_f32,
                             matmul_i4, matmul_i4g, matmul_i8, matmul_i8g)
from .pass_attention import attend_bf16
from .pass_attention_float import attend_f32
from .pass_attention_int8 import attend_i8
from .quantised_products import (_qmatmul_i4, _qmatmul_i8, _qmatmul_i8g, add_rms_norm_quantised,
                                 grouped_work_bytes, qmatmul_i4, qmatmul_i4_fallback, qmatmul_i8,
                                 qmatmul_i8_fallback, qmatmul_i8g, qmatmul_i8g_fallback)
from .step_ops import add_rms_norm, attend_query, attend_query_parallel, gather_rows, top_k
from .widening import (widen_bf16, widen_e4m3, widen_e5m2, widen_f16, widen_i4, widen_i4g,
                       widen_i8)

# The sources whose compiled code numba caches (kernels._kernel_stamp hashes them), and the
# plain modules whose constants they compile in: io/tensors.py (the fp8 tables of the bfloat16
# products), kernels/attention_layout.py (the bfloat16 attention's layout),
# kernels/activation_formulas.py (the activations' constants).
SOURCES = tuple(Path(m.__file__) for m in (widening, float_products, quantised_products,
                                           step_ops, tiles, bfloat16_products, bfloat16_tiles,
                                           pass_softmax, pass_attention, io_tensors,
                                           attention_layout, float_tiles, pass_attention_float,
                                           vector_math, activations, activation_formulas,
                                           pass_attention_int8))


def _int8_work(M: int, K: int, groups: int) -> int:
    from . import quantised_bytes   # (the package's: tests size the kernels' scratch with it)
    return quantised_bytes(M, K, groups)


def _bfloat16_work(M: int, K: int, groups: int) -> int:
    return bmatmul_work_bytes(M, K)


def _fp8_bfloat16_work(M: int, K: int, groups: int) -> int:
    return fp8_work_bytes(M, K)


@dataclass(frozen=True)
class FormatKernels:
    """The kernels of one storage format: its float32 product (small M), the widening of its
    rows into float32 blocks (large M, then BLAS; None: already float32) and `rounded`: by
    compute mode, the product that rounds its inputs first and the scratch bytes it rounds
    M rows of K columns into (the quantised formats and GGUF's int8 blocks: compute="int8"'s
    int8 x int8 product; bfloat16 and fp8: compute="bfloat16"'s bfloat16 x bfloat16 product).
    floors: that rounded product takes a floor for its outputs (`low`: the FF's ReLU in its
    epilogue); ready_rows: it takes input rows the RMS norm already quantised (`ready`,
    `add_rms_norm_quantised`)."""
    product: Callable
    widen: Callable | None = None
    rounded: dict[str, tuple[Callable, Callable[[int, int, int], int]]] = field(default_factory=dict)
    floors: bool = False
    ready_rows: bool = False


BY_FORMAT: dict[str, FormatKernels] = {
    "float32": FormatKernels(matmul_f32),
    "float16": FormatKernels(matmul_f16, widen_f16),
    "bfloat16": FormatKernels(matmul_bf16, widen_bf16,
                              {"bfloat16": (bmatmul_bf16, _bfloat16_work)}),
    # (the compiled entries themselves, which take `low` float32 and `ready` always: a Python
    # wrapper's defaults cost a decoding step's ~70 products a few microseconds each)
    "int8": FormatKernels(matmul_i8, widen_i8, {"int8": (_qmatmul_i8, _int8_work)},
                          floors=True, ready_rows=True),
    "int4": FormatKernels(matmul_i4, widen_i4, {"int8": (_qmatmul_i4, _int8_work)},
                          floors=True, ready_rows=True),
    # GGUF's blocks: q widened as int8's, then scaled and offset (formats.apply_scale); with
    # compute="int8" the blocks' q times the quantised inputs, per group (compute="bfloat16"
    # refuses these formats: q x scale + offset is no bfloat16)
    "int8g32": FormatKernels(matmul_i8g, widen_i8, {"int8": (_qmatmul_i8g, grouped_work_bytes)},
                             floors=True),
    "int8g16": FormatKernels(matmul_i8g, widen_i8, {"int8": (_qmatmul_i8g, grouped_work_bytes)},
                             floors=True),
    # GGUF's 4-bit blocks: the unsigned codes widened, then scaled and offset as the above
    # (float32 products only)
    "int4g32": FormatKernels(matmul_i4g, widen_i4g),
    "int4g16": FormatKernels(matmul_i4g, widen_i4g),
}
# fp8 codes and their row scales: float32 products, or compute="bfloat16"'s bfloat16 x bfloat16
# (every fp8 value is a bfloat16: the file's values multiplied exactly); compute="int8" refuses
# them (backend.resolve_dtype)
BY_FORMAT.update({
    "float8_e4m3": FormatKernels(matmul_e4m3, widen_e4m3,
                                 {"bfloat16": (bmatmul_e4m3, _fp8_bfloat16_work)}),
    "float8_e5m2": FormatKernels(matmul_e5m2, widen_e5m2,
                                 {"bfloat16": (bmatmul_e5m2, _fp8_bfloat16_work)}),
})


# -- warm-up: the first calls, in parts a first run compiles side by side (kernels._compile_ahead) ----
_X, _OUT = np.zeros((1, 4), np.float32), np.zeros((1, 2), np.float32)
_X64, _OUT64 = np.zeros((1, 64), np.float32), np.zeros((1, 2), np.float32)   # (a 64-column block)
_NIBBLES, _SCALES = np.zeros((2, 32), np.uint8), np.ones((2, 1), np.float32)


def _work() -> np.ndarray:
    return np.empty(4096, np.uint8)


def _float_products() -> None:
    matmul_f32(_X, np.zeros((2, 4), np.float32), _OUT)
    matmul_f16(_X, np.zeros((2, 4), np.uint16), _OUT)
    matmul_bf16(_X, np.zeros((2, 4), np.uint16), _OUT)
    matmul_i8(_X, np.zeros((2, 4), np.int8), np.ones(2, np.float32), _OUT)
    matmul_i4(_X64, _NIBBLES, _SCALES, _OUT64)
    matmul_i8g(_X64, np.zeros((2, 64), np.int8), np.zeros((2, 2, 2), np.float32), _OUT64)
    matmul_i4g(_X64, _NIBBLES, np.zeros((2, 2, 2), np.float32), _OUT64)
    for fp8 in ("float8_e4m3", "float8_e5m2"):
        BY_FORMAT[fp8].product(_X, np.zeros((2, 4), np.uint8), np.ones(2, np.float32), _OUT)


def _widenings() -> None:
    for widen in (widen_f16, widen_bf16):
        widen(np.zeros((1, 4), np.uint16), np.empty((1, 4), np.float32))
    widen_i8(np.zeros((1, 4), np.int8), np.empty((1, 4), np.float32))
    for fp8 in ("float8_e4m3", "float8_e5m2"):
        BY_FORMAT[fp8].widen(np.zeros((1, 4), np.uint8), np.empty((1, 4), np.float32))
    widen_i4(_NIBBLES, np.empty((2, 64), np.float32))
    widen_i4g(_NIBBLES, np.empty((2, 64), np.float32))


def _int8_products() -> None:
    qmatmul_i8(_X64, np.zeros((2, 64), np.int8), np.ones(2, np.float32), _OUT64, _work())
    add_rms_norm_quantised(np.ones((1, 64), np.float32), np.ones((1, 64), np.float32),
                           np.ones(64, np.float32), 1e-6, _work(), 1)


def _activations() -> None:
    for kind in sorted(set(ACTIVATION_KINDS.values())):
        activate(np.ones((1, 4), np.float32), 2, True, kind)
    activate_quantised(np.ones((1, 128), np.float32), 64, True, ACTIVATION_KINDS["gelu_new"],
                       _work(), 1)


def _int4_products() -> None:
    qmatmul_i4(_X64, _NIBBLES, _SCALES, _OUT64, _work())


def _grouped_products() -> None:
    qmatmul_i8g(_X64, np.zeros((2, 64), np.int8), np.zeros((2, 2, 2), np.float32), _OUT64, _work())


def _bfloat16_products() -> None:
    bmatmul_bf16(_X64, np.zeros((2, 64), np.uint16), _OUT64, _work())


def _fp8_products() -> None:
    for fp8 in (bmatmul_e4m3, bmatmul_e5m2):
        fp8(_X64, np.zeros((2, 64), np.uint8), np.ones(2, np.float32), _OUT64, _work())


def _steps() -> None:
    add_rms_norm(np.ones((1, 4), np.float32), np.ones((1, 4), np.float32),
                 np.ones(4, np.float32), 1e-6, np.empty((1, 4), np.float32))
    top_k(np.zeros((1, 4), np.float32), 2, np.empty((1, 2), np.int64), np.empty((1, 2), np.float32))
    cache = np.zeros((1, 1, 2, 2, 4), np.float32)        # (L, B, H, N, D)
    q, ctx = np.zeros((1, 2, 4), np.float32), np.empty((1, 2, 4), np.float32)
    # (Bb, Hb, S) bias: contiguous, or a strided view (the window of a longer causal table)
    biases = (np.zeros((1, 2, 2), np.float32), np.zeros((1, 2, 4), np.float32)[:, :, 2:])
    for attend in (attend_query, attend_query_parallel):
        for bias in biases:
            attend(q, cache[0], cache[0], 2, bias, ctx, np.zeros(1, np.int64))
    gather_rows(cache, np.zeros(1, np.int64), 1)


def _pass_attention() -> None:
    qkv = np.zeros((1, 2, 3, 1, 4), np.float32)
    args = (qkv, np.zeros((1, 3), np.float32), np.zeros((1, 2), np.float32),
            np.empty((1, 2, 1, 4), np.float32))
    for kind, attend in (("bfloat16", attend_bf16), ("int8", attend_i8), ("float32", attend_f32)):
        shape = attention_layout.AttentionShape(1, 1, 2, 2, 4, max_threads(), kind)
        attend(*args, np.zeros(shape.nbytes(), np.uint8))


# Each warm-up with its compile seconds (one core, a cold cache, AMD EPYC Zen 4, 2026-11-28:
# benchmarks/README.md "A first run's compile, in parts"): `shares` deals them to the compiling
# children, heaviest first to the least loaded, so that each child's share takes about as long.
WARM_UPS = ((59.0, _pass_attention), (35.5, _float_products), (21.3, _int8_products),
            (18.4, _fp8_products), (11.1, _int4_products), (11.4, _grouped_products),
            (9.7, _steps), (7.4, _activations), (9.5, _bfloat16_products), (2.2, _widenings))


def shares(parts: int) -> list[list[str]]:
    """The names of WARM_UPS' calls in `parts` lists of about equal compile time."""
    loads, dealt = [0.0] * parts, [[] for _ in range(parts)]
    for seconds, call in sorted(WARM_UPS, key=lambda entry: -entry[0]):
        least = loads.index(min(loads))
        loads[least] += seconds
        dealt[least].append(call.__name__)
    return dealt


def warm_up(names: list[str] | None = None) -> None:
    """Compile (or load from the cache) the kernels for the array types the models use: all of
    them, or the warm-ups named (a share `shares` dealt: a first run compiles them side by
    side, one child a share)."""
    for _, call in WARM_UPS:
        if names is None or call.__name__ in names:
            call()


def set_threads(n: int) -> None:
    numba.set_num_threads(n)


def max_threads() -> int:
    return numba.config.NUMBA_NUM_THREADS


__all__ = ["ACTIVATION_KINDS", "BY_FORMAT", "FormatKernels", "SOURCES", "activate",
           "activate_quantised", "add_rms_norm", "add_rms_norm_quantised",
           "attend_bf16", "attend_f32", "attend_i8", "attend_query",
           "attend_query_parallel", "gather_rows", "max_threads", "qmatmul_i4_fallback",
           "qmatmul_i8_fallback", "qmatmul_i8g_fallback", "set_threads",
           "top_k", "warm_up"]
