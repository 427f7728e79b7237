"""The encoder's attention with int8 products (compute="int8", issue 26): the compiled kernel
(kernels/pass_attention_int8.py) against the same quantisation in float64, at the edges of its
blocks, panels and padding, with both tile builds; NaN, infinities, padding and fully masked
rows; thread counts; the NumPy path computing the same function; a trained model's states.
(Its scratch, host allocations and errors: test_rounded_attention's kernel tests.)"""
from __future__ import annotations

import numba
import numpy as np
import pytest
from conftest import compiled_then_array_path
from test_shipped_models import T5_DIR

import minfer
from minfer import kernels, ops
from minfer.kernels.attention_layout import AttentionShape

k = kernels.active()
needs_kernels = pytest.mark.skipif(k is None, reason="numba not importable or MINFER_KERNELS=numpy")
MASKED = np.finfo(np.float32).min
LEVELS = 127          # a softmax weight's largest code
# Codes this close to a rounding boundary may round either way: the kernel's scores (float32,
# up to ~100 here) differ from float64's by ~1e-5, its exponential by a few ulps: 127 e by ~2e-3.
BOUNDARY = 5e-3


def quantised(a, axis):
    """a (float32) quantised along `axis` as the kernel does: codes rint(a * (127 / absmax)) in
    float32, scale absmax / 127; returned as float64 (codes, scale)."""
    top = np.abs(a).max(axis=axis, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(top > 0, np.float32(127.0) / top, np.float32(0.0)).astype(np.float32)
    return np.rint(a * inv).astype(np.float64), (top / np.float32(127.0)).astype(np.float64)


def reference(qkv, table, key_mask):
    """(ctx (B, T, H, D), the bound of each output's rounding flips) in float64: q and k
    quantised per row, v per column, the weights as codes round(127 e) over their sum. Where
    127 e lies within BOUNDARY of a rounding boundary float32's may round the other way: each
    such code moves an output by at most (|v| + |output|) / (the row's code sum - such codes)."""
    T = qkv.shape[1]
    parts = [qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3)]           # (B, H, T, D)
    (cq, sq), (ck, sk), (cv, sv) = (quantised(parts[0], -1), quantised(parts[1], -1),
                                    quantised(parts[2], -2))
    idx = np.arange(T)[None, :] - np.arange(T)[:, None] + T - 1
    s = (cq @ ck.swapaxes(-1, -2)) * sq * sk.swapaxes(-1, -2)
    s += table[:, idx].astype(np.float64)[None] + key_mask[:, None, None, :]
    x = LEVELS * np.exp(s - s.max(-1, keepdims=True))
    w = np.rint(x)
    v = cv * sv
    total = w.sum(-1, keepdims=True)
    ctx = w @ v / total
    near = (np.abs(x - np.floor(x) - 0.5) < BOUNDARY).astype(np.float64)
    flips = near.sum(-1, keepdims=True)
    bound = (near @ np.abs(v) + flips * np.abs(ctx)) / np.maximum(total - flips, 1)
    return ctx.transpose(0, 2, 1, 3), bound.transpose(0, 2, 1, 3)


def case(B, H, T, D, scale=1.0, shared=False):
    rng = np.random.default_rng([B, H, T, D])
    qkv = (rng.standard_normal((B, T, 3, H, D)) * scale).astype(np.float32)
    table = rng.standard_normal((1 if shared else H, 2 * T - 1)).astype(np.float32)
    key_mask = np.zeros((B, T), np.float32)
    if B > 1:
        key_mask[1, T - T // 3:] = MASKED         # padding
    return qkv, table, key_mask


def run(qkv, table, key_mask, best=True):
    B, T, _, H, D = qkv.shape
    work = np.full(AttentionShape(B, H, T, T, D, numba.get_num_threads(), "int8").nbytes(), 0x5A,
                   np.uint8)                       # (garbage: the kernel must write what it reads)
    ctx = np.full((B, T, H, D), np.nan, np.float32)
    k.attend_i8(qkv, table, key_mask, ctx, work, best)
    return ctx


def within(ctx, want, bound):
    return bool((np.abs(ctx - want) <= bound + 1e-5 * np.abs(want).max()).all())


@needs_kernels
@pytest.mark.parametrize("best", [True, False], ids=["best", "fallback"])
@pytest.mark.parametrize("B,H,T,D,shared", [
    (1, 1, 1, 8, False), (2, 3, 5, 8, True), (2, 2, 63, 64, False), (1, 2, 64, 64, False),
    (2, 3, 65, 72, False), (3, 2, 130, 10, True), (1, 2, 67, 128, False), (2, 2, 200, 64, False)])
def test_the_kernel_is_attention_of_the_quantised_inputs(B, H, T, D, shared, best):
    qkv, table, key_mask = case(B, H, T, D, scale=2.0, shared=shared)
    want, bound = reference(qkv, table, key_mask)
    ctx = run(qkv, table, key_mask, best)
    assert within(ctx, want, bound)
    # the quantised function, not float attention (with one or two keys the values' columns are
    # their own absmax: quantised exactly)
    if T > 2:
        exact = float_attention(qkv, table, key_mask)
        assert np.abs(ctx - exact).max() > 10 * (np.abs(ctx - want).max() + 1e-7)


def float_attention(qkv, table, key_mask):
    T = qkv.shape[1]
    q, kk, v = (qkv.astype(np.float64)[:, :, j].transpose(0, 2, 1, 3) for j in range(3))
    idx = np.arange(T)[None, :] - np.arange(T)[:, None] + T - 1
    s = q @ kk.swapaxes(-1, -2) + table[:, idx].astype(np.float64)[None] + key_mask[:, None, None, :]
    e = np.exp(s - s.max(-1, keepdims=True))
    return ((e / e.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3)


@needs_kernels
def test_non_finite_values_stay_where_they_belong():
    """A NaN in one query row makes that query's outputs NaN (in its head); an inf in one value
    column makes that column NaN for every query of its head; zeros quantise to zero; a row with
    every key masked takes uniform weights; nothing else is touched."""
    B, H, T, D = 2, 2, 70, 64
    qkv, table, key_mask = case(B, H, T, D)
    qkv[0, 5, 0, 1, 3] = np.nan                    # query 5 of head 1, batch row 0
    qkv[1, 9, 2, 0, 7] = np.inf                    # value column 7 of head 0, batch row 1
    qkv[1, :, 1, 1] = 0.0                          # every key of head 1, batch row 1: zero
    ctx = run(qkv, table, key_mask)
    bad = np.zeros(ctx.shape, bool)
    bad[0, 5, 1] = True
    bad[1, :, 0, 7] = True
    assert np.isnan(ctx[bad]).all() and np.isfinite(ctx[~bad]).all()
    clean = qkv.copy()
    clean[0, 5, 0, 1, 3] = 0.0
    clean[1, 9, 2, 0, 7] = 0.0
    want, bound = reference(clean, table, key_mask)
    assert within(ctx[1, :, 1], want[1, :, 1], bound[1, :, 1])   # zero keys: scores = bias
    masked = np.full((1, T), MASKED, np.float32)
    ctx = run(qkv[:1], table, masked)
    want, bound = reference(qkv[:1], table, masked)
    assert np.isfinite(ctx[0, :, 0]).all() and within(ctx[0, :, 0], want[0, :, 0], bound[0, :, 0])


@needs_kernels
def test_every_thread_count_gives_the_same_bits():
    qkv, table, key_mask = case(3, 3, 77, 64)
    before = numba.get_num_threads()
    try:
        outs = []
        for n in sorted({1, 2, before}):
            numba.set_num_threads(n)
            outs.append(run(qkv, table, key_mask))
    finally:
        numba.set_num_threads(before)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


@pytest.mark.parametrize("T", [1, 3, 40, 130])
def test_the_numpy_path_computes_what_the_kernel_does(T, monkeypatch):
    """ops.quantised_distance_attention without the kernels: q|k|v quantised in place, the
    weights after the softmax, float32 products: the kernel's function up to float rounding,
    in the scratch `distance_scratch` sizes for either path."""
    B, H, D = 2, 3, 64
    qkv, table, key_mask = case(B, H, T, D, scale=2.0)
    want, bound = reference(qkv, table, key_mask)
    bias = ops.DistanceBias(table, key_mask)
    stats = tuple(np.empty((B, H, T, 1), np.float32) for _ in range(2))
    for _ in compiled_then_array_path(monkeypatch):
        scores = np.full(ops.distance_scratch(B, H, T, D, 4, "int8"), np.nan, np.float32)
        ctx = np.full((B, T, H, D), np.nan, np.float32)
        ops.quantised_distance_attention(np, qkv.copy(), bias, scores, ctx, stats)
        assert within(ctx, want, bound + 1e-4 * np.abs(want).max())


def test_a_trained_model_with_compute_int8_stays_near_float32():
    """The trained T5's encoder states with compute="int8" (int8 attention and products) within
    6% of float32's largest state (measured: 4.2e-2 with the kernels, 4.6e-2 with the bfloat16
    attention before; 5.3e-2 on the NumPy path, MINFER_KERNELS=numpy, whose float32 products
    flip other roundings: see test_quantised_compute)."""
    prompts = ["translate: 3 May 1999", "what day is 12/01/2020 plus three days?", "hello"]
    float32 = minfer.load(T5_DIR).encode(prompts)
    int8 = minfer.load(T5_DIR, dtype="int8", compute="int8").encode(prompts)
    scale = np.abs(float32).max()
    assert np.abs(int8 - float32).max() < 0.06 * scale
