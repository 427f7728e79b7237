"""Shared math (ops.py): norms, softmax, activations, products, row gathers."""
import math

import numpy as np
import pytest

from minfer import ops
from minfer.errors import ConfigError
from minfer.io.formats import FORMATS
from minfer.products import PackedWeight, wrap

rng = np.random.default_rng(0)


def rand(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def test_rms_norm_is_t5s_layer_norm():
    x, w = rand(2, 3, 8), rand(8)
    want = w * x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(ops.rms_norm(np, x.copy(), w, 1e-6), want, rtol=1e-5)
    out = np.empty_like(x)
    assert ops.rms_normalize(np, x, 1e-6, out=out) is out  # writes into the caller's buffer
    np.testing.assert_allclose(out * w, want, rtol=1e-5)


def test_layer_norm_uses_the_biased_variance():
    x, w, b = rand(4, 6), rand(6), rand(6)
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5) * w + b
    np.testing.assert_allclose(ops.layer_norm(np, x, w, b, 1e-5), want, rtol=1e-5, atol=1e-6)


def test_softmax_in_place_and_fully_masked_rows_are_uniform():
    x = rand(3, 5, scale=10)
    x[1] = np.finfo(np.float32).min                      # a row that masks every key
    want = np.exp(x - x.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    got = ops.softmax_(np, x)
    assert got is x and not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got[1], np.full(5, 0.2), rtol=1e-6)


def test_log_softmax_matches_the_log_of_softmax():
    x = rand(4, 9, scale=5)
    want = np.log(ops.softmax_(np, x.copy()))
    np.testing.assert_allclose(ops.log_softmax_(np, x), want, rtol=1e-5, atol=1e-6)


def test_half_norm_and_softmax_compute_in_float32():
    x = np.full((1, 64), 300.0, np.float16)   # its sum of squares (5.8e6) overflows float16
    y = ops.rms_normalize(np, x, 1e-6)
    assert y.dtype == np.float16 and np.allclose(y, 1.0, atol=1e-3)
    z = rand(2, 50, scale=4)
    got = ops.softmax_(np, z.astype(np.float16))
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, ops.softmax_(np, z.copy()), atol=1e-3)


@pytest.mark.parametrize("name,reference", [
    ("relu", lambda x: np.maximum(x, 0)),
    ("gelu_new", lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))),
    ("gelu", lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))),
    ("silu", lambda x: x / (1 + np.exp(-x))),
])
def test_activations_match_their_formulas(name, reference):
    x = np.linspace(-6, 6, 101).astype(np.float32)
    got = ops.activation(name)(np, x.copy())
    np.testing.assert_allclose(got, reference(x.astype(np.float64)), rtol=1e-5, atol=2e-7)


def test_unknown_activation_is_named():
    with pytest.raises(ConfigError, match="activation 'mish'.*supported: gelu"):
        ops.activation("mish")


@pytest.mark.parametrize("name", ["a" * 5000, ["relu"], {"relu": 1}, None])
def test_an_unknown_activation_of_any_size_or_type_is_one_short_line(name):
    # a 5,000-character name gave a 5,107-character message; a list raised TypeError (unhashable)
    with pytest.raises(ConfigError) as e:
        ops.activation(name)
    msg = str(e.value)
    assert msg.startswith("activation ") and "supported: gelu" in msg and len(msg) < 200


def test_linear_is_one_product_over_all_leading_axes():
    x, w = rand(3, 4, 8), rand(5, 8)                       # w: (out, in)
    want = np.einsum("btc,oc->bto", x, w)
    np.testing.assert_allclose(ops.linear(np, x, w), want, rtol=1e-5, atol=1e-6)
    out = np.empty((3, 4, 10), np.float32)[..., :5]       # a strided destination
    ops.linear(np, x, w, out=out)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_linear_and_embed_take_packed_weights():
    x, w = rand(2, 20, 16), rand(40, 16)
    arrays = FORMATS["int8"].encode("w", w)
    packed = wrap(FORMATS["int8"], "w", arrays, np.float32, np.empty(16 * 7, np.float32), None)
    assert isinstance(packed, PackedWeight)   # its 40 rows are widened 7 at a time
    stored = arrays["w"] * arrays["w_scale"][:, None]
    np.testing.assert_allclose(ops.linear(np, x, packed), x @ stored.T, rtol=1e-5, atol=1e-5)
    ids = np.array([[3, 39, 0]])
    out = np.empty((1, 3, 16), np.float32)
    np.testing.assert_allclose(ops.embed(np, packed, ids, out), stored[ids], rtol=1e-6)
    np.testing.assert_array_equal(ops.embed(np, w, ids, np.empty_like(out)), w[ids])
