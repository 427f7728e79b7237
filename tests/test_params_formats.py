"""Weight formats of the linear slots (params/formats.py): storage, encoding, products, lookups."""
import numpy as np
import pytest

from minfer import kernels
from minfer.params.formats import (FORMATS, SCALE_SUFFIX, KERNEL_MAX_ROWS, PackedWeight,
                                   dequantize_int8, quantize_int8, to_bfloat16_bits)

rng = np.random.default_rng(1)


def test_int8_quantisation_is_per_output_channel_and_within_half_a_step():
    w = rng.standard_normal((10, 64)).astype(np.float32) * np.arange(1, 11, dtype=np.float32)[:, None]
    w[3] = 0  # a dead channel must not divide by zero
    q, scale = quantize_int8(w)
    assert q.dtype == np.int8 and scale.shape == (10,)
    assert np.abs(q).max() == 127
    out = dequantize_int8(np, q, scale, np.empty_like(w))
    assert np.all(np.abs(out - w) <= scale[:, None] / 2 + 1e-7)
    np.testing.assert_array_equal(out[3], 0)


def test_bfloat16_bits_round_to_nearest_even():
    w = np.array([1.0, 1.00390625, 1.01171875, -3.5, np.inf, np.nan, 1e-40], np.float32)
    back = (to_bfloat16_bits(w).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(back[:5], [1.0, 1.0, 1.015625, -3.5, np.inf])  # ties to even
    assert np.isnan(back[5])
    wide = rng.standard_normal(1000).astype(np.float32)
    err = np.abs((to_bfloat16_bits(wide).astype(np.uint32) << 16).view(np.float32) - wide)
    assert (err <= np.abs(wide) * 2.0 ** -8).all()                   # half a bfloat16 step


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("mode", ["numpy", "numba"])
def test_every_format_multiplies_and_looks_up_what_it_stores(name, mode, monkeypatch):
    """Small products (kernels when on), large ones (BLAS over widened row blocks) and row
    lookups all compute with the stored values, in both kernel modes."""
    monkeypatch.setattr(kernels, "_mode", mode)
    fmt = FORMATS[name]
    w = rng.standard_normal((70, 48)).astype(np.float32)      # 70 rows: not a multiple of blocks
    arrays = fmt.encode("w", w)
    assert set(arrays) == set(fmt.array_names("w")) == set(fmt.stored("w", w.shape))
    for key, (shape, dtype) in fmt.stored("w", w.shape).items():
        assert arrays[key].shape == shape and arrays[key].dtype == dtype
    scratch = np.empty(48 * 9, np.float32)                   # 9 rows a block: several blocks
    packed = fmt.wrap("w", arrays, np.float32, scratch, kernels.active())
    stored = np.empty_like(w)                                # what the format really holds
    if isinstance(packed, PackedWeight):
        packed.widen(packed.bits, stored)
        if packed.scale is not None:
            stored *= packed.scale[:, None]
    else:
        stored[...] = packed
    assert np.abs(stored - w).max() <= {"float32": 0, "float16": 2e-3, "bfloat16": 2e-2,
                                        "int8": 2e-2}[name] * np.abs(w).max()
    for M in (1, 3, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 40):
        x = rng.standard_normal((M, 48)).astype(np.float32)
        out = np.empty((M, 70), np.float32)
        if isinstance(packed, PackedWeight):
            packed.matmul(np, x, out)
        else:
            np.matmul(x, packed.T, out=out)
        np.testing.assert_allclose(out, x @ stored.T, rtol=1e-4, atol=1e-4)
    ids = np.array([0, 69, 5, 5])
    rows = np.empty((4, 48), np.float32)
    if isinstance(packed, PackedWeight):
        packed.rows(np, ids, rows)
    else:
        rows[...] = packed[ids]
    np.testing.assert_allclose(rows, stored[ids], rtol=1e-6)


def test_int8_files_and_layers_share_one_scale_suffix():
    assert FORMATS["int8"].array_names("x.weight") == ("x.weight", "x.weight" + SCALE_SUFFIX)
    assert SCALE_SUFFIX == "_scale"
