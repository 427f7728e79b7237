"""The compiled CPU kernels (kernels.py, _numba_kernels.py) against plain NumPy, at the edges of
their blocking: rows that are not a multiple of the blocks, 1..17 input rows, every format."""
import numpy as np
import pytest

from minfer import kernels, ops

k = kernels.active()
pytestmark = pytest.mark.skipif(k is None, reason="numba not importable or MINFER_KERNELS=numpy")
rng = np.random.default_rng(3)


def widen_f16(bits):
    return bits.view(np.float16).astype(np.float32)


def widen_bf16(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 17])
@pytest.mark.parametrize("N,K", [(1, 1), (33, 7), (64, 64), (70, 130)])
def test_matmul_kernels_equal_the_numpy_product(M, N, K):
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    f16 = w.astype(np.float16).view(np.uint16)
    bf16 = (w.view(np.uint32) >> 16).astype(np.uint16)
    q = rng.integers(-127, 128, (N, K)).astype(np.int8)
    scale = rng.random(N).astype(np.float32)
    cases = [(k.matmul_f32, (w,), w), (k.matmul_f16, (f16,), widen_f16(f16)),
             (k.matmul_bf16, (bf16,), widen_bf16(bf16)),
             (k.matmul_i8, (q, scale), q.astype(np.float32) * scale[:, None])]
    for kernel, args, dense in cases:
        out = np.full((M, N), np.nan, np.float32)
        kernel(x, *args, out)
        np.testing.assert_allclose(out, x @ dense.T, rtol=2e-5, atol=2e-5 * np.sqrt(K))


def test_add_rms_norm_adds_then_normalises_each_row():
    x, d = rng.standard_normal((3, 2, 40)).astype(np.float32), rng.standard_normal((3, 2, 40)).astype(np.float32)
    g = rng.standard_normal(40).astype(np.float32)
    want_x = x + d
    want = g * want_x / np.sqrt((want_x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    h = np.empty_like(x)
    ops.add_rms_norm(np, x, d, g, 1e-6, h)
    np.testing.assert_allclose(x, want_x, rtol=1e-6)
    np.testing.assert_allclose(h, want, rtol=1e-5, atol=1e-6)
    ops.add_rms_norm(np, x, None, g, 1e-6, h)          # no residual: only the norm
    np.testing.assert_allclose(x, want_x, rtol=1e-6)
    np.testing.assert_allclose(h, want, rtol=1e-5, atol=1e-6)


def numpy_attention(q, k_, v, bias):
    s = q @ k_.swapaxes(-1, -2) + bias
    s = np.exp(s - s.max(-1, keepdims=True))
    return (s / s.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("B,H,S,D,bias_shape", [(1, 8, 1, 64, (1, 8, 1, 1)), (2, 4, 9, 16, (2, 1, 1, 9)),
                                                (16, 8, 40, 64, (1, 8, 1, 40))])
def test_one_query_attention_with_broadcast_bias(B, H, S, D, bias_shape):
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    cache = rng.standard_normal((2, B, H, S + 5, D)).astype(np.float32)[:, :, :, :S]  # cache views
    bias = rng.standard_normal(bias_shape).astype(np.float32)
    if bias_shape[0] == B > 1:
        bias[1] = np.finfo(np.float32).min                 # a row whose every key is masked
    ctx = np.empty((B, 1, H, D), np.float32)
    ops.attention(np, q, cache[0], cache[1], bias, None, ctx)
    want = numpy_attention(q, cache[0], cache[1], bias).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(ctx, want, rtol=1e-4, atol=1e-5)
    assert not np.isnan(ctx).any()


@pytest.mark.parametrize("name", ["relu", "gelu_new", "gelu", "silu"])
@pytest.mark.parametrize("gated", [False, True])
def test_activate_equals_the_numpy_activations(name, gated):
    F = 24
    hidden = rng.standard_normal((3, 2 * F if gated else F)).astype(np.float32) * 3
    want = ops.activation(name)(np, hidden[:, :F].copy())
    if gated:
        want *= hidden[:, F:]
    got = ops.activate(np, name, hidden.copy(), F, gated)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_top_k_equals_a_stable_descending_sort_with_ties():
    from minfer.generation.processors import top_k_indices
    a = rng.integers(0, 6, (5, 300)).astype(np.float32)     # many ties
    a[2] = -np.inf
    a[3, 7] = np.inf
    for k_ in (1, 3, 8, 300):
        np.testing.assert_array_equal(top_k_indices(a, k_),
                                      np.argsort(-a, axis=1, kind="stable")[:, :k_])


def test_log_softmax_rows_equals_numpy():
    x = (rng.standard_normal((4, 1000)) * 20).astype(np.float32)
    want = x - x.max(1, keepdims=True)
    want = want - np.log(np.exp(want).sum(1, keepdims=True))
    np.testing.assert_allclose(ops.log_softmax_(np, x.copy()), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [[2, 0, 1], [1, 1, 1], [0], [3, 2, 1, 0]])
def test_gather_rows_moves_filled_positions_of_every_layer(rows):
    cache = rng.standard_normal((3, 4, 2, 9, 5)).astype(np.float32)
    want = cache.copy()
    want[:, :len(rows), :, :6] = cache[:, rows, :, :6]
    k.gather_rows(cache, np.array(rows), 6)
    np.testing.assert_array_equal(cache, want)


def test_widening_kernels_equal_numpy():
    w = rng.standard_normal((7, 33)).astype(np.float32)
    out = np.empty_like(w)
    k.widen_f16(w.astype(np.float16).view(np.uint16), out)
    np.testing.assert_array_equal(out, w.astype(np.float16).astype(np.float32))
    bits = (w.view(np.uint32) >> 16).astype(np.uint16)
    k.widen_bf16(bits, out)
    np.testing.assert_array_equal(out, (bits.astype(np.uint32) << 16).view(np.float32))
    q = rng.integers(-127, 128, w.shape).astype(np.int8)
    k.widen_i8(q, out)
    np.testing.assert_array_equal(out, q.astype(np.float32))
