"""Weight formats of the linear slots (params/formats.py): int8 quantisation and its product."""
import numpy as np

from minfer.params.formats import dequantize_int8, quantize_int8


def test_int8_quantisation_is_per_column_and_within_half_a_step():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 10)).astype(np.float32) * np.arange(1, 11, dtype=np.float32)
    w[:, 3] = 0  # a dead column must not divide by zero
    q, scale = quantize_int8(w)
    assert q.dtype == np.int8 and scale.shape == (10,)
    assert np.abs(q).max() == 127
    out = dequantize_int8(np, q, scale, np.empty_like(w))
    assert np.all(np.abs(out - w) <= scale / 2 + 1e-7)
    np.testing.assert_array_equal(out[:, 3], 0)
