"""The int8 x int8 products' blocking (issue 26): quantised input rows in groups of 4 interleaved
64 columns at a time (`quantised_products._place`), a first pass of 1 x C tiles streaming the
weights, 4 x 4 tiles after it, K tails as masked steps. Edges: M, N and K off every multiple
(tiles of 4, blocks of 32-128 weight rows, steps of 64 columns), non-finite and zero rows in every
part of the layout, the fallback build agreeing exactly with the best one; from PANEL_MIN_ROWS
input rows the panels (weights repacked per call, input columns broadcast)."""

from __future__ import annotations

import numpy as np
import pytest

from minfer import kernels

numba = pytest.importorskip("numba")
k = kernels.compiled()
pytestmark = pytest.mark.skipif(k is None, reason="the compiled kernels are off")
rng = np.random.default_rng(26)


def quantised(x):
    from minfer.products import quantise_rows
    return quantise_rows(np, x)


def run(kernel, x, q, scale):
    M, K = x.shape
    groups = 1 if scale.ndim == 1 else scale.shape[1]
    out = np.full((M, q.shape[0]), np.nan, np.float32)
    kernel(x, q, scale, out, np.empty(kernels.quantised_bytes(M, K, groups), np.uint8))
    return out


def extremes(M: int, N: int, K: int):
    """Integer inputs (M, K) whose rows' maximum is 127 (they quantise to themselves, scale 1),
    one row of -127s, int8 weights (N, K) with a row of -128s and one of 127s, and their exact
    products (below 2^24: exact in float32)."""
    x = rng.integers(-127, 128, (M, K)).astype(np.float32)
    x[:, 0] = 127
    x[1, 1:] = -127
    q = rng.integers(-128, 128, (N, K)).astype(np.int8)
    q[2] = -128
    q[3] = 127
    return x, q, x.astype(np.int64) @ q.T.astype(np.int64)


@pytest.mark.parametrize("M,K", [(1, 64), (2, 100), (3, 40), (4, 64), (5, 129), (7, 63),
                                 (8, 768), (9, 200), (13, 127), (64, 190), (66, 1)])
def test_every_row_is_placed_once(M, K):
    """_place puts the M x K quantised bytes in M * K distinct places (the buffer
    kernels.quantised_bytes sizes), each row's steps and tail where its group's tiles read."""
    from minfer.kernels.quantised_products import STEP, _place
    place = _place.py_func
    seen = np.zeros(M * K, np.int64)
    main = K // STEP * STEP
    for m in range(M):
        base, _, ss, tb, _ = place(M, K, m)
        for s in range(K // STEP):
            seen[base + s * ss:base + s * ss + STEP] += 1
        seen[tb:tb + K - main] += 1
    assert (seen == 1).all()
    for m in range(0, M // 4 * 4, 4):               # a 4-row tile's rows: base + c * rs, tb + c * ts
        base, rs, ss, tb, ts = place(M, K, m)
        for c in range(1, 4):
            assert place(M, K, m + c)[0] == base + c * rs and place(M, K, m + c)[3] == tb + c * ts


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 11, 21])
@pytest.mark.parametrize("N,K", [(1, 64), (6, 65), (37, 127), (130, 40), (263, 192), (67, 320)])
def test_int8_products_equal_the_rounded_float_product_and_the_fallback_exactly(M, N, K):
    from minfer.io.formats import quantise_int8
    x = rng.standard_normal((M, K)).astype(np.float32) * rng.random((M, 1)).astype(np.float32)
    q, scale = quantise_int8(rng.standard_normal((N, K)).astype(np.float32))
    want = quantised(x) @ (q.astype(np.float32) * scale[:, None]).T
    best = run(k.qmatmul_i8, x, q, scale)
    np.testing.assert_allclose(best, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(run(k.qmatmul_i8_fallback, x, q, scale), best)


@pytest.mark.parametrize("M", [1, 3, 4, 6, 9, 17, 257])      # 257: the panels
@pytest.mark.parametrize("N,K", [(5, 64), (131, 128), (70, 384), (260, 256)])
def test_int4_products_equal_the_float_product_and_the_fallback_exactly(M, N, K):
    from minfer.io.formats import FORMATS, quantise_int4
    x = rng.standard_normal((M, K)).astype(np.float32)
    q, scale = quantise_int4(rng.standard_normal((N, K)).astype(np.float32))
    want = quantised(x) @ FORMATS["int4"].decode(q, scale, (N, K)).T
    best = run(k.qmatmul_i4, x, q, scale)
    np.testing.assert_allclose(best, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(run(k.qmatmul_i4_fallback, x, q, scale), best)


@pytest.mark.parametrize("K", [64, 100, 191, 256])
def test_int8_sums_are_exact_at_the_extremes(K):
    """Integer inputs whose row maximum is 127 quantise to themselves (scale 1): the products
    are the exact integer sums, -128 weights and -127 inputs included, K tails too."""
    x, q, exact = extremes(10, 9, K)
    for kernel in (k.qmatmul_i8, k.qmatmul_i8_fallback):
        np.testing.assert_array_equal(run(kernel, x, q, np.ones(9, np.float32)), exact)


@pytest.mark.parametrize("M", [3, 6, 9])
def test_non_finite_and_zero_rows_in_every_part_of_the_layout(M):
    """Rows 0-3 (the streaming pass, a group), 4-7 (a 4 x 4 group) and past the last group (plain
    rows): inf / NaN rows give NaN outputs, zero rows zeros, the other rows their products."""
    from minfer.io.formats import quantise_int4, quantise_int8
    K, N = 192, 70
    x = rng.standard_normal((M, K)).astype(np.float32)
    bad = {0: np.inf, M - 1: np.nan, **({4: -np.inf} if M > 5 else {})}
    zero = {1} | ({M - 2} - set(bad))
    for m, v in bad.items():
        x[m, 5] = v
    for m in zero:
        x[m] = 0.0
    w = rng.standard_normal((N, K)).astype(np.float32)
    clean = np.where(np.isfinite(x), x, 0).astype(np.float32)
    for kernel, (q, s) in ((k.qmatmul_i8, quantise_int8(w)), (k.qmatmul_i4, quantise_int4(w)),
                           (k.qmatmul_i8_fallback, quantise_int8(w))):
        out = run(kernel, x, q, s)
        good = run(kernel, clean, q, s)
        for m in range(M):
            if m in bad:
                assert np.isnan(out[m]).all()
            elif m in zero:
                assert (out[m] == 0).all()
            else:
                np.testing.assert_array_equal(out[m], good[m])


def test_the_thread_count_does_not_change_the_products():
    """Blocks of weight rows are sized by the thread count (`_block_rows`); each output is one
    tile's whole sum whichever block holds it."""
    from minfer.io.formats import quantise_int8
    x = rng.standard_normal((13, 200)).astype(np.float32)
    q, s = quantise_int8(rng.standard_normal((300, 200)).astype(np.float32))
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = run(k.qmatmul_i8, x, q, s)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = run(k.qmatmul_i8, x, q, s)
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(one, two)


@pytest.mark.parametrize("M", [256, 259])
@pytest.mark.parametrize("N,K", [(1, 64), (17, 128), (65, 192), (130, 64), (64, 200)])
def test_panel_products_equal_the_rounded_float_product_and_the_fallback_exactly(M, N, K):
    """From PANEL_MIN_ROWS input rows the int8 products take the panels (K % 64 == 0; K = 200
    keeps the tiles): partial panels (N % 64, N % 16), the last M % 4 rows one at a time."""
    from minfer.io.formats import quantise_int8
    from minfer.kernels.quantised_products import PANEL_MIN_ROWS
    assert M >= PANEL_MIN_ROWS
    x = rng.standard_normal((M, K)).astype(np.float32) * rng.random((M, 1)).astype(np.float32)
    x[3, 1] = np.nan
    x[M - 1] = 0.0
    q, scale = quantise_int8(rng.standard_normal((N, K)).astype(np.float32))
    want = quantised(x) @ (q.astype(np.float32) * scale[:, None]).T
    best = run(k.qmatmul_i8, x, q, scale)
    finite = np.isfinite(want)
    np.testing.assert_allclose(best[finite], want[finite], rtol=1e-5,
                               atol=1e-5 * np.abs(want[finite]).max())
    assert np.isnan(best[3]).all() and (best[M - 1] == 0).all()
    np.testing.assert_array_equal(run(k.qmatmul_i8_fallback, x, q, scale), best)


def test_panel_sums_are_exact_at_the_extremes():
    N = 70
    x, q, exact = extremes(258, N, 256)
    for kernel in (k.qmatmul_i8, k.qmatmul_i8_fallback):
        np.testing.assert_array_equal(run(kernel, x, q, np.ones(N, np.float32)), exact)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512bw", "avxvnni", "avx512vnni"])
def test_group_and_panel_tiles_are_exact_on_every_instruction_set(isa):
    """Every build of the new tiles (the kernels build only the CPU's best and its fallback)
    gives the exact integer sums: the group tile with a K tail, the panel tile with a partial
    panel (rows past `valid` not written)."""
    from numba import njit
    from minfer.kernels import quantised_products as qp
    from minfer.kernels import tiles
    if isa not in tiles.runnable(tiles._FEATURES):
        pytest.skip(f"{isa} is not available on this CPU")
    group, panel = tiles.make_group_tile({True: isa, False: isa}), tiles.make_panel_tile(
        {True: isa, False: isa})
    I8 = tiles.INT8
    off = tiles.offset(isa)
    M, N, K = 5, 40, 192 + 7
    Kp = 192                                     # the panel tile: whole steps only

    @njit
    def run_group(w, s, xq, sums, sx, out):
        base, rs, ss, tb, ts = qp._place(M, K, 0)
        group(I8, 4, 4, True, w, s, 0, xq, base, rs, ss, tb, ts, sums, 0, K // 64, K % 64, 0,
              sx, out, off)
        base, rs, ss, tb, ts = qp._place(M, K, 4)
        group(I8, 1, 1, True, w, s, 4, xq, base, rs, ss, tb, ts, sums, 4, K // 64, K % 64, 0,
              sx, out, off)

    @njit
    def run_panel(words, xq, sums, sx, s, out):
        base, rs, ss, _, _ = qp._place(M, Kp, 0)
        panel(3, 4, True, words, xq, base, rs, ss, Kp // 64, sums, 0, sx, s, 0, N, out, off,
              qp.NO_FLOOR)
        base, rs, ss, _, _ = qp._place(M, Kp, 4)
        panel(3, 1, True, words, xq, base, rs, ss, Kp // 64, sums, 4, sx, s, 0, N, out, off,
              qp.NO_FLOOR)

    w = rng.integers(-128, 128, (N, K)).astype(np.int8)
    w[1] = -128
    x = rng.integers(-127, 128, (M, K)).astype(np.int8)
    x[0] = -127
    ones_w, ones_x = np.ones(N, np.float32), np.ones(M, np.float32)

    def layout(x, K):
        xq = np.empty(M * K, np.int8)
        for m in range(M):
            base, _, ss, tb, _ = qp._place.py_func(M, K, m)
            for s in range(K // 64):
                xq[base + s * ss:base + s * ss + 64] = x[m, s * 64:s * 64 + 64]
            xq[tb:tb + K % 64] = x[m, K // 64 * 64:]
        return xq, x.astype(np.int32).sum(1, keepdims=True).astype(np.int32)

    xq, sums = layout(x, K)
    out = np.full((M, N), np.nan, np.float32)
    run_group(w, ones_w, xq, sums, ones_x, out)
    exact = x.astype(np.int64) @ w.T.astype(np.int64)
    np.testing.assert_array_equal(out[:4, :4], exact[:4, :4])
    np.testing.assert_array_equal(out[4, 4], exact[4, 4])

    xs, wp = x[:, :Kp].copy(), w[:, :Kp]
    xq, sums = layout(xs, Kp)
    width = 48                                   # 3 vectors of 16 weight rows, N = 40 of them
    words = np.zeros((Kp // 4, width), np.uint32)
    words[:, :N] = (wp.view(np.uint32) ^ np.uint32(0x80808080 if off else 0)).T
    out = np.full((M, N + 3), np.nan, np.float32)
    run_panel(words.reshape(-1).view(np.int8), xq, sums, ones_x, np.ones(N + 3, np.float32), out)
    np.testing.assert_array_equal(out[:, :N], xs.astype(np.int64) @ wp.T.astype(np.int64))
    assert np.isnan(out[:, N:]).all()


def test_int4_panels_of_non_finite_and_zero_rows():
    from minfer.io.formats import quantise_int4
    M, N, K = 258, 70, 256
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[2, 9], x[257, 0] = np.inf, np.nan
    x[5] = 0.0
    q, s = quantise_int4(rng.standard_normal((N, K)).astype(np.float32))
    for kernel in (k.qmatmul_i4, k.qmatmul_i4_fallback):
        out = run(kernel, x, q, s)
        assert np.isnan(out[2]).all() and np.isnan(out[257]).all() and (out[5] == 0).all()
        assert np.isfinite(np.delete(out, [2, 5, 257], axis=0)).all()
