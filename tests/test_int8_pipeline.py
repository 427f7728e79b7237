"""compute="int8" as one pipeline (issue 26): the RMS norm in front of an int8 x int8 product
quantises its rows straight into that product's scratch (`add_rms_norm_quantised`, no float copy
of rows that only feed the product), and the FF's ReLU runs in the products' epilogue (`low`).
Both must compute exactly what the separate passes compute: the same bits, kernel by kernel and
through a whole model, with the fallback build too."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from test_shipped_models import T5_DIR

import minfer
from minfer import kernels, products
from minfer.io.formats import FORMATS, quantise_int4, quantise_int8

k = kernels.compiled()
pytestmark = pytest.mark.skipif(k is None, reason="the compiled kernels are off")
rng = np.random.default_rng(2026)


def weights(kind: str, N: int, K: int):
    """(kernel, fallback, stored weights, their scale or params, sums per input row)."""
    from minfer.kernels import quantised_products as qp
    w = rng.standard_normal((N, K)).astype(np.float32)
    if kind == "int8":
        return (qp.qmatmul_i8, qp.qmatmul_i8_fallback, *quantise_int8(w), 1)
    if kind == "int4":
        q, s = quantise_int4(w)
        return (qp.qmatmul_i4, qp.qmatmul_i4_fallback, q, s, s.shape[1])
    stored = FORMATS[kind].encode("w", w)
    return (qp.qmatmul_i8g, qp.qmatmul_i8g_fallback, stored["w"], stored["w_scale"], None)


def scratch(kind: str, M: int, K: int) -> np.ndarray:
    from minfer.kernels.quantised_products import grouped_work_bytes
    if kind.startswith("int8g"):
        return np.empty(grouped_work_bytes(M, K, K // int(kind[5:])), np.uint8)
    groups = 1 if kind == "int8" else K // 64
    return np.empty(kernels.quantised_bytes(M, K, groups), np.uint8)


@pytest.mark.parametrize("kind", ["int8", "int4", "int8g32", "int8g16"])
@pytest.mark.parametrize("M", [1, 6, 17, 257])        # the small-M tiles; 257: the panels
def test_the_epilogue_floor_is_a_relu_after_the_product(kind, M):
    K, N = 256, 83                                     # a partial panel (83 = 64 + 16 + 3)
    best, fallback, q, scale, _ = weights(kind, N, K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[M // 2, 3] = np.nan                              # a NaN row stays NaN (not floored to 0)
    for kernel in (best, fallback):
        plain = np.full((M, N), -5.0, np.float32)
        kernel(x, q, scale, plain, scratch(kind, M, K))
        floored = np.full((M, N), -5.0, np.float32)
        kernel(x, q, scale, floored, scratch(kind, M, K), 0.0)
        assert np.isnan(plain[M // 2]).all() and (M == 1 or (plain < 0).any())
        np.testing.assert_array_equal(floored, np.maximum(plain, 0))


def norm_then_product(kernel, x, delta, weight, q, scale, work, fused):
    """The residual add + RMS norm, then the product: as two passes (a float norm the product
    quantises) or fused (the norm's rows quantised into the product's scratch)."""
    M, K = x.shape
    out = np.full((M, q.shape[0]), np.nan, np.float32)
    h = np.full((M, K), np.nan, np.float32)
    eps = 1e-6
    if fused:
        groups = 1 if scale.ndim == 1 else scale.shape[1]
        k.add_rms_norm_quantised(x, delta, weight, eps, work, groups)
        kernel(h, q, scale, out, work, ready=True)     # (h only gives the shape: NaN here)
    else:
        k.add_rms_norm(x, delta, weight, eps, h)
        kernel(h, q, scale, out, work)
    return out


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("M,K", [(1, 64), (5, 200), (64, 768), (257, 256), (300, 192)])
@pytest.mark.parametrize("add", [True, False])
def test_norm_quantised_rows_equal_the_norm_then_the_product(kind, M, K, add):
    if kind == "int4" and K % 64:
        K += 64 - K % 64                               # (int4 takes whole 64-column blocks)
    best, fallback, q, scale, _ = weights(kind, 37, K)
    x = (rng.standard_normal((M, K)) * 3).astype(np.float32)
    delta = rng.standard_normal((M, K)).astype(np.float32) if add else np.empty((0, K), np.float32)
    if M > 2:
        x[1] = 0                                       # a zero row (with delta: not zero)
        x[2, 7] = np.inf                               # a row that becomes NaN
    weight = rng.random(K).astype(np.float32) + 0.5
    for kernel in (best, fallback):
        xa, xb = x.copy(), x.copy()
        want = norm_then_product(kernel, xa, delta, weight, q, scale, scratch(kind, M, K), False)
        got = norm_then_product(kernel, xb, delta, weight, q, scale, scratch(kind, M, K), True)
        np.testing.assert_array_equal(xb, xa)          # the residual stream, updated alike
        np.testing.assert_array_equal(got, want)
        if M > 2:
            assert np.isnan(got[2]).all() and np.isfinite(np.delete(got, 2, axis=0)).all()


def peak_bytes(call) -> int:
    call()                                             # (compiled and warm first)
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_fused_norm_allocates_no_host_memory():
    """The fused norm writes only into the product's scratch; the product then allocates what
    it allocates anyway (each parallel task's repacked panel of weights, K x 64 bytes)."""
    M, K = 512, 768
    best, _, q, scale, _ = weights("int8", 64, K)
    x, delta = rng.standard_normal((2, M, K)).astype(np.float32)
    weight, work = np.ones(K, np.float32), scratch("int8", M, K)
    out, h = np.empty((M, 64), np.float32), np.empty((M, K), np.float32)
    assert peak_bytes(lambda: k.add_rms_norm_quantised(x, delta, weight, 1e-6, work, 1)) < 16 << 10
    ready = peak_bytes(lambda: best(h, q, scale, out, work, 0.0, True))
    assert ready <= peak_bytes(lambda: best(h, q, scale, out, work)) < 128 << 10, ready


def slots(tree):
    """Every PackedWeight in a model's params (dicts and lists of them)."""
    if isinstance(tree, products.PackedWeight):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from slots(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from slots(v)


def unfused(model, monkeypatch):
    """The model's int8 products without the pipeline: every norm writes float rows, the ReLU
    runs after the product."""
    from minfer import ops
    monkeypatch.setattr(products.PackedWeight, "norm_work", lambda self, M: None)
    linear = ops.linear

    def product_then_relu(xp, x, w, out=None, relu=False):
        out = linear(xp, x, w, out)
        return np.maximum(out, 0, out=out) if relu else out
    monkeypatch.setattr(ops, "linear", product_then_relu)
    assert any(w.floors for w in slots(model.params))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_whole_model_computes_the_same_bits_fused(dtype, monkeypatch):
    """The trained T5 (a gated-GELU FF) with compute="int8": encoder states of a padded batch
    and the generated answers, fused (norms and the activation into the scratch of the product
    they feed) and not, are identical; the fused norm runs for the encoder's and the decoder's
    norms."""
    from test_shipped_models import read_jsonl
    prompts = [r["prompt"] for r in read_jsonl(T5_DIR / "heldout.jsonl")][:23]   # (odd rows)
    m = minfer.load(T5_DIR, dtype=dtype, compute="int8")
    calls = []
    quantise = k.add_rms_norm_quantised
    monkeypatch.setattr(k, "add_rms_norm_quantised",
                        lambda *a: (calls.append(a[0].shape), quantise(*a))[1])
    states, answers = m.encode(prompts), m.generate(prompts)
    assert len(calls) >= 4 * m.config.num_layers     # encoder: 2 a layer; decoder: 3 a layer
    monkeypatch.setattr(k, "add_rms_norm_quantised", quantise)
    plain = minfer.load(T5_DIR, dtype=dtype, compute="int8")
    unfused(plain, monkeypatch)
    np.testing.assert_array_equal(states, plain.encode(prompts))
    assert answers == plain.generate(prompts)


def test_a_short_scratch_keeps_the_float_norm():
    """norm_work says yes only when the product's scratch holds all the rows quantised (else
    the product quantises its rows in parts, from a float norm)."""
    q, scale = quantise_int8(rng.standard_normal((32, 256)).astype(np.float32))
    small = np.empty(kernels.quantised_bytes(8, 256, 1) // 4, np.float32)
    w = products.wrap(FORMATS["int8"], "w", {"w": q, "w_scale": scale}, np.float32, small,
                      k, compute="int8")
    assert w.ready_rows and w.floors
    assert w.norm_work(8) is not None and w.norm_work(64) is None
    float32 = products.wrap(FORMATS["int8"], "w", {"w": q, "w_scale": scale}, np.float32, small,
                            k)
    assert float32.norm_work(8) is None              # float32 compute: nothing to quantise


@pytest.mark.parametrize("fmt,compute", [("float32", "float32"), ("int8", "float32"),
                                         ("bfloat16", "bfloat16"), ("int8", "int8")])
@pytest.mark.parametrize("M", [3, 300])              # the small-M kernels; BLAS parts or panels
def test_relu_with_the_product_is_relu_after_it_on_every_path(fmt, compute, M):
    """`matmul(relu=True)` floors the outputs where the product runs: in the int8 epilogue, in
    each thread's part of the output columns after BLAS, or after a small product."""
    f = FORMATS[fmt]
    stored = f.encode("w", rng.standard_normal((150, 128)).astype(np.float32))
    work = np.empty(1 << 21, np.float32)
    w = products.wrap(f, "w", stored, np.float32, work, k, compute=compute)
    assert isinstance(w, products.PackedWeight)
    x = rng.standard_normal((M, 128)).astype(np.float32)
    plain, floored = (np.full((M, 150), np.nan, np.float32) for _ in range(2))
    w.matmul(np, x, plain)
    w.matmul(np, x, floored, relu=True)
    assert (plain < 0).any()
    np.testing.assert_array_equal(floored, np.maximum(plain, 0))
