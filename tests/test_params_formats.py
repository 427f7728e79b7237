"""Weight formats of the linear slots (io/formats.py, products.py): storage, encoding, products, lookups."""
import numpy as np
import pytest

from minfer import kernels
from minfer.errors import ConfigError
from minfer.io.formats import (FORMATS, INT4_GROUP, SCALE_SUFFIX, apply_scale, int4_group,
                               quantise_int4, quantise_int8, to_bfloat16_bits)
from minfer.products import KERNEL_MAX_ROWS, ROUNDINGS, PackedWeight, wrap

rng = np.random.default_rng(1)


def test_int8_quantisation_is_per_output_channel_and_within_half_a_step():
    w = rng.standard_normal((10, 64)).astype(np.float32) * np.arange(1, 11, dtype=np.float32)[:, None]
    w[3] = 0  # a dead channel must not divide by zero
    q, scale = quantise_int8(w)
    assert q.dtype == np.int8 and scale.shape == (10,)
    assert np.abs(q).max() == 127
    out = FORMATS["int8"].decode(q, scale, w.shape)
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


# each format with the compute modes that multiply it
COMPUTES = {"int8": ("float32", "int8"), "int4": ("float32", "int8"),
            "bfloat16": ("float32", "bfloat16")}
# (the fp8 formats hold only a file's codes, never encoded from floats: tests/test_fp8_storage.py
# multiplies them against float64)
CASES = [(name, K, compute) for name in FORMATS if not FORMATS[name].from_file for K in (48, 128)
         for compute in COMPUTES.get(name, ("float32",))]


@pytest.mark.parametrize("name,K,compute", CASES)
@pytest.mark.parametrize("mode", ["numpy", "numba"])
def test_every_format_multiplies_and_looks_up_what_it_stores(name, K, compute, mode, monkeypatch):
    """Small products (kernels when on), large ones (BLAS over widened row blocks) and row
    lookups all compute with the stored values, in both kernel modes; with compute="int8" the
    products take each input row rounded to int8 steps (integer kernels, or the same rounding
    before a float product)."""
    monkeypatch.setattr(kernels, "_mode", mode)
    fmt = FORMATS[name]
    w = rng.standard_normal((70, K)).astype(np.float32)       # 70 rows: not a multiple of blocks
    arrays = fmt.encode("w", w)
    assert set(arrays) == set(fmt.array_names("w")) == set(fmt.stored("w", w.shape))
    for key, (shape, dtype) in fmt.stored("w", w.shape).items():
        assert arrays[key].shape == shape and arrays[key].dtype == dtype
    scratch = np.empty(K * 9, np.float32)                     # 9 rows a block: several blocks
    packed = wrap(fmt, "w", arrays, np.float32, scratch, kernels.active(),
                      compute=compute)
    stored = np.empty_like(w)                                 # what the format really holds
    if isinstance(packed, PackedWeight):
        assert packed.shape == w.shape
        packed.widen(packed.bits, stored)
        if packed.scale is not None:
            apply_scale(stored, packed.scale)
    else:
        stored[...] = packed
    assert np.abs(stored - w).max() <= {"float32": 0, "float16": 2e-3, "bfloat16": 2e-2,
                                        "int8": 2e-2, "int4": 0.25, "int8g32": 2e-2,
                                        "int8g16": 2e-2, "int4g32": 0.07,
                                        "int4g16": 0.07}[name] * np.abs(w).max()
    for M in (1, 3, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 40):
        x = rng.standard_normal((M, K)).astype(np.float32)
        out = np.empty((M, 70), np.float32)
        if isinstance(packed, PackedWeight):
            packed.matmul(np, x, out)
        else:
            np.matmul(x, packed.T, out=out)
        inputs = ROUNDINGS[compute](np, x) if compute in ROUNDINGS else x
        np.testing.assert_allclose(out, inputs @ stored.T, rtol=1e-4, atol=1e-4)
    ids = np.array([0, 69, 5, 5])
    rows = np.empty((4, K), np.float32)
    if isinstance(packed, PackedWeight):
        packed.rows(np, ids, rows)
    else:
        rows[...] = packed[ids]
    np.testing.assert_allclose(rows, stored[ids], rtol=1e-6)


def test_int4_quantisation_keeps_each_groups_largest_value_and_rounds_the_rest():
    w = rng.standard_normal((6, 256)).astype(np.float32)
    w[2, 64:128] = 0                                          # a dead group must not divide by 0
    q, scale = quantise_int4(w)
    assert q.shape == (6, 128) and q.dtype == np.uint8 and scale.shape == (6, 256 // INT4_GROUP)
    back = FORMATS["int4"].decode(q, scale, w.shape)
    step = np.repeat(np.abs(scale), INT4_GROUP, axis=1)
    largest = np.abs(w).reshape(6, -1, INT4_GROUP).max(-1)
    err = np.abs(back - w)
    # half a step, but a value opposite in sign to the group's largest and beyond 7.5 steps
    # clips to 7 (the range is -8..7): up to a step
    assert np.all(err <= step + 1e-6) and np.mean(err <= step / 2 + 1e-6) > 0.99
    assert np.allclose(np.abs(back).reshape(6, -1, INT4_GROUP).max(-1), largest)  # kept exactly
    np.testing.assert_array_equal(back[2, 64:128], 0)
    assert int4_group(256) == INT4_GROUP and int4_group(192) == 64 and int4_group(40) == 40
    with pytest.raises(ConfigError, match="even number of input channels"):
        FORMATS["int4"].stored("w", (4, 7))


def test_int8_files_and_layers_share_one_scale_suffix():
    assert FORMATS["int8"].array_names("x.weight") == ("x.weight", "x.weight" + SCALE_SUFFIX)
    assert SCALE_SUFFIX == "_scale"
