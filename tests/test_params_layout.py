"""A layer's packed layout (params/layout.py)."""
import numpy as np

from minfer.io.formats import FORMATS, SCALE_SUFFIX
from minfer.products import PackedWeight, wrap
from minfer.params.layout import Layout


def test_layout_packs_aligned_round_trips_and_wraps_linear_slots():
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((3, 5)).astype(np.float32),
              "b": rng.integers(-127, 128, (2, 7)).astype(np.int8),   # (out, in)
              "b" + SCALE_SUFFIX: rng.random(2).astype(np.float32)}
    layout = Layout.of(arrays, linear={"b": FORMATS["int8"]})
    assert all(e.offset % 256 == 0 for e in layout.entries.values())
    assert layout.nbytes >= sum(a.nbytes for a in arrays.values())
    views = layout.views(layout.pack(arrays))
    for name, a in arrays.items():
        np.testing.assert_array_equal(views[name], a)
        assert views[name].dtype == a.dtype
    # what the math receives: the int8 slot and its scales become one product object
    params = layout.params(views, lambda fmt, name, arrays, dtype: wrap(
        fmt, name, arrays, np.float32, np.empty(64, np.float32), None))
    assert set(params) == {"a", "b"} and isinstance(params["b"], PackedWeight)
    x = rng.standard_normal((4, 7)).astype(np.float32)
    out = params["b"].matmul(np, x, np.empty((4, 2), np.float32))
    np.testing.assert_allclose(out, x @ (arrays["b"] * arrays["b" + SCALE_SUFFIX][:, None]).T,
                               rtol=1e-5)
    assert layout.scratch_bytes(np.float32) == 256   # min(1 MiB, 7*2*4 bytes) aligned
