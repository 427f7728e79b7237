"""The FF's activations compiled (kernels/activations.py, issue 26): each equals its formula
evaluated in float64 (written so that it loses nothing to cancellation), gated or not, on one
thread and over the threads; the quantising variant gives exactly the bytes the int8 product's
own quantisation gives; a gated model with compute="int8" computes the same bits with it as
without it."""
from __future__ import annotations

import math

import numpy as np
import pytest
from factories import write_t5

import minfer
from minfer import kernels, ops, products
from minfer.kernels import quantised_bytes

k = kernels.compiled()
pytestmark = pytest.mark.skipif(k is None, reason="the compiled kernels are off")
rng = np.random.default_rng(26)
SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_erfc = np.vectorize(math.erfc)


def formula(name: str, x: np.ndarray) -> np.ndarray:
    """act(x) in float64, each in a form without cancellation in its negative tail."""
    with np.errstate(over="ignore", invalid="ignore"):
        if name == "relu":
            return np.where(np.isnan(x), x, np.maximum(x, 0))
        if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):   # x sigmoid(2 y)
            return x / (1 + np.exp(-2 * SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))
        if name == "gelu":                                          # x (1 + erf(x / sqrt 2)) / 2
            return 0.5 * x * _erfc(-x / math.sqrt(2))
        return x / (1 + np.exp(-x))                                 # silu, swish


def inputs(R: int, F: int, gated: bool) -> np.ndarray:
    """Rows across the activations' whole range: a sweep of -12 .. 12, tiny and huge values."""
    sweep = np.concatenate([np.linspace(-12, 12, 997), [0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3,
                                                         30, -30, 90, -90, 1e6, -1e6, 1e30]])
    x = np.resize(sweep, R * F).reshape(R, F)
    x = x * rng.uniform(0.5, 1.5, (R, 1))                   # (rows differ)
    gate = rng.standard_normal((R, F)) * 2
    return np.concatenate([x, gate], axis=1).astype(np.float32) if gated else x.astype(np.float32)


@pytest.mark.parametrize("name", sorted(k.ACTIVATION_KINDS) if k else [])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("R,F", [(3, 37), (40, 1024)])     # one thread; over the threads
def test_each_activation_equals_its_formula(name, gated, R, F):
    hidden = inputs(R, F, gated)
    before = hidden.copy()
    k.activate(hidden, F, gated, k.ACTIVATION_KINDS[name])
    x = before[:, :F].astype(np.float64)
    want = formula(name, x)
    scale = np.abs(before[:, F:].astype(np.float64)) if gated else 1.0
    if gated:
        want = want * before[:, F:]
    got = hidden[:, :F].astype(np.float64)
    # a few float32 roundings of the result, plus Abramowitz & Stegun's erf (|error| < 1.5e-7)
    bound = 2e-6 * np.abs(want) + (1e-7 * np.abs(x) + 1e-37) * scale
    bad = ~(np.abs(got - want) <= bound)
    assert not bad.any(), (x[bad][:5], got[bad][:5], want[bad][:5])
    if gated:
        np.testing.assert_array_equal(hidden[:, F:], before[:, F:])   # the gate half untouched


@pytest.mark.parametrize("name", sorted(k.ACTIVATION_KINDS) if k else [])
def test_non_finite_inputs_give_what_the_formula_gives(name):
    """+inf, -inf and NaN give what the float64 formula (and HF's float32 one) gives: inf, NaN
    (-inf * 0; ReLU: 0) and NaN."""
    x = np.array([[np.inf, -np.inf, np.nan, 1.0]], np.float32)
    hidden = x.copy()
    k.activate(hidden, 4, False, k.ACTIVATION_KINDS[name])
    want = formula(name, x.astype(np.float64))
    np.testing.assert_array_equal(hidden[0, :3], want[0, :3].astype(np.float32))


@pytest.mark.parametrize("name", ["gelu_new", "gelu", "silu", "relu"])
@pytest.mark.parametrize("R,F,groups", [(5, 192, 1), (9, 200, 1), (300, 256, 4), (7, 128, 2)])
def test_the_quantised_activation_is_the_products_own_quantisation(name, R, F, groups):
    """`activate_quantised` writes, byte for byte, what `activate` then the int8 product's
    quantisation (`quantised_products._quantise`) write: rows in 4-row groups and a tail, a
    ragged last step of columns, group sums; hidden is left as it was."""
    from minfer.kernels.quantised_products import _quantise
    hidden = (rng.standard_normal((R, 2 * F)) * 3).astype(np.float32)
    hidden[1, :F] = 0.0                                     # a zero row: scale 0
    before = hidden.copy()
    size = quantised_bytes(R, F, groups)
    fused, plain = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
    k.activate_quantised(hidden, F, True, k.ACTIVATION_KINDS[name], fused, groups)
    np.testing.assert_array_equal(hidden, before)
    k.activate(hidden, F, True, k.ACTIVATION_KINDS[name])
    _quantise(np.ascontiguousarray(hidden[:, :F]), plain, groups)
    np.testing.assert_array_equal(fused, plain)


GATED = dict(feed_forward_proj="gated-gelu", d_model=64, d_kv=16, num_heads=4, d_ff=128,
             num_layers=2, num_decoder_layers=2, tie_word_embeddings=False, vocab_size=120)


def test_a_gated_model_computes_the_same_bits_with_the_quantised_activation(tmp_path,
                                                                             monkeypatch):
    """A v1.1-shaped (gated-GELU) model with compute="int8": its encoder states and greedy ids
    are the same whether the activation quantises its rows into W_out's scratch or writes them
    as floats for W_out to quantise, and the quantised route runs in the encoder and the
    decoder's steps."""
    folder = write_t5(tmp_path / "gated", seed=3, **GATED)
    ids = rng.integers(2, 120, (3, 11))
    m = minfer.load(folder, dtype="int8", compute="int8")
    calls = []
    quantised = k.activate_quantised
    monkeypatch.setattr(k, "activate_quantised",
                        lambda *a: (calls.append(a[0].shape[0]), quantised(*a))[1])
    states = m.encode(ids)
    assert calls == [ids.size] * GATED["num_layers"]                     # the encoder's rows
    generated = m.generate(ids, max_new_tokens=6, min_new_tokens=6)
    assert calls.count(ids.shape[0]) >= 5 * GATED["num_decoder_layers"]   # its decoding steps
    monkeypatch.setattr(k, "activate_quantised", quantised)
    monkeypatch.setattr(products.PackedWeight, "norm_work", lambda self, M: None)
    plain = minfer.load(folder, dtype="int8", compute="int8")
    np.testing.assert_array_equal(states, plain.encode(ids))
    assert generated == plain.generate(ids, max_new_tokens=6, min_new_tokens=6)


def test_the_numpy_path_stays_for_arrays_the_kernels_do_not_take():
    """float16 rows (float16 compute) and strided ones go through NumPy's activations, which
    agree with the kernel."""
    F = 64
    hidden = (rng.standard_normal((4, 2 * F)) * 2).astype(np.float32)
    want = ops.activate(np, "gelu_new", hidden.copy(), F, True)
    half = ops.activate(np, "gelu_new", hidden.astype(np.float16), F, True)
    assert half.dtype == np.float16
    np.testing.assert_allclose(half, want, rtol=1e-2, atol=1e-2)
    strided = np.repeat(hidden, 2, axis=0)[::2]
    assert not strided.flags.c_contiguous
    np.testing.assert_allclose(ops.activate(np, "gelu_new", strided, F, True), want,
                               rtol=1e-5, atol=1e-6)
