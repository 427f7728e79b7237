"""The encoder's attention in float32 on the compiled kernels (kernels/pass_attention_float.py,
what compute="float32" runs on the CPU, issue 26): against attention in float64 at the edges
of its blocks, panels and tiles; NaN, infinities and masked rows; the array path
computing the same function; the models' passes through it (its scratch and thread counts: in
test_rounded_attention beside the bfloat16 kernel's)."""
from __future__ import annotations

import numpy as np
import pytest
from test_rounded_attention import MASKED, case, unrounded
from test_rounded_attention import run as run_kernel
from test_shipped_models import T5_DIR

import minfer
from minfer import kernels, ops

k = kernels.active()
needs_kernels = pytest.mark.skipif(k is None, reason="numba not importable or MINFER_KERNELS=numpy")
# float32 sums over D (scores) and S (values), an exponential within float32's rounding: within
# 1e-5 of the largest output against float64 (2.3e-6 the most seen over these cases, at D =
# 130, where the scores' own rounding is largest); a key left out or a bias misplaced moves
# outputs by 1e-2 and more
TOLERANCE = 1e-5


def run(qkv, table, key_mask, fill=0xFF):
    return run_kernel(qkv, table, key_mask, fill=fill, kind="float32")


@needs_kernels
@pytest.mark.parametrize("B,H,T,D", [(2, 3, 5, 8), (1, 2, 67, 64), (2, 4, 130, 64), (1, 1, 33, 80),
                                     (3, 2, 64, 16), (1, 2, 1, 64), (1, 2, 200, 130), (2, 3, 7, 33),
                                     (1, 1, 17, 1), (2, 2, 129, 4)])
def test_the_kernel_is_float_attention(B, H, T, D):
    # T across query blocks (64), key panels (64), tiles (4 rows) and vectors (16); D odd, below
    # a vector, across the value panels (64)
    qkv, table, key_mask = case(B, H, T, D)
    want = unrounded(qkv, table, key_mask)
    got = run(qkv, table, key_mask)
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()


@needs_kernels
def test_a_bias_row_shared_by_every_head_and_a_wholly_masked_batch_row():
    qkv, table, key_mask = case(2, 3, 20, 16, shared=True)
    key_mask[1] = MASKED                               # every key masked: uniform weights
    got = run(qkv, table, key_mask)
    want = unrounded(qkv, table, np.where(key_mask[:, None, :] == MASKED, -1e30, 0.0)[:, 0])
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()
    np.testing.assert_allclose(got[1], qkv[1, :, 2].mean(axis=0, dtype=np.float64)[None]
                               .repeat(20, 0), rtol=1e-5, atol=1e-6)


@needs_kernels
def test_nan_and_infinite_inputs_give_nan_rows_as_numpy():
    qkv, table, key_mask = case(1, 2, 9, 8)
    qkv[0, 3, 0, 0, 2] = np.nan                        # a query: its row of head 0
    qkv[0, 5, 0, 1, 1] = np.inf                        # a query of head 1: +inf scores
    got = run(qkv, table, key_mask, fill=0)
    assert np.isnan(got[0, 3, 0]).all() and np.isnan(got[0, 5, 1]).all()
    others = np.ones((9, 2), bool)
    others[3, 0] = others[5, 1] = False
    assert np.isfinite(got[0][others]).all()


@needs_kernels
def test_the_array_path_computes_the_same_function(monkeypatch):
    """ops.float_distance_attention with the kernels and without them (distance_attention's
    rounds of BLAS products), each in the scratch `distance_scratch` sizes with the kernels:
    the array path fits its rounds to it."""
    B, H, T, D = 2, 3, 40, 64
    qkv, table, key_mask = case(B, H, T, D)
    bias = ops.DistanceBias(table, key_mask)
    stats = tuple(np.empty((B, H, T, 1), np.float32) for _ in range(2))
    outs = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(ops, "compiled", lambda xp, x: None)
        scores = np.full(ops.distance_scratch(B, H, T, D, 4, "float32"), np.nan, np.float32)
        ctx = np.full((B, T, H, D), np.nan, np.float32)
        ops.float_distance_attention(np, qkv, bias, scores, ctx, stats)
        outs.append(ctx)
    want = unrounded(qkv, table, key_mask)
    for out in outs:
        assert np.abs(out - want).max() <= TOLERANCE * np.abs(want).max()


@needs_kernels
def test_the_float32_encoder_takes_the_kernel_and_equals_the_array_path(monkeypatch):
    """A float32 model's encoder runs its self-attention on the kernel, every layer; its states
    equal those of the array path (MINFER_KERNELS=numpy's) to float32's rounding."""
    calls = []
    real = k.attend_f32
    monkeypatch.setattr(k, "attend_f32",
                        lambda *a, **kw: (calls.append(a[0].shape), real(*a, **kw))[1])
    m = minfer.load(T5_DIR)
    texts = ["translate: 3 May 1999", "hello there, a longer input than the other one"]
    fast = m.encode(texts)
    assert len(calls) == m.config.num_layers
    monkeypatch.setattr(kernels, "_mode", "numpy")
    slow = minfer.load(T5_DIR).encode(texts)
    assert np.abs(fast - slow).max() <= 1e-5 * np.abs(slow).max()
