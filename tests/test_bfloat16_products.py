"""The bfloat16 x bfloat16 products (minfer/kernels/bfloat16_products.py, compute="bfloat16")
against NumPy: activations rounded to bfloat16 (to nearest, ties to even), both operands
widened, the product taken in float64. The kernels accumulate in float32, so the tolerance is
the float32 summation's bound for their order of additions, far below what a wrong rounding of
the activations (or a lost column) moves a sum by. Both builds are checked: vdpbf16ps (where the
CPU has AVX512_BF16) and the widening fallback."""
import numpy as np
import pytest

from minfer import kernels

pytestmark = pytest.mark.skipif(kernels.active() is None,
                                reason="numba not importable or MINFER_KERNELS=numpy")
if kernels.active() is not None:
    from minfer.kernels import bfloat16_products as bp
    from minfer.kernels import bfloat16_tiles
    BUILDS = {"best": bp.bmatmul_bf16, "fallback": bp.bmatmul_bf16_fallback}
else:
    BUILDS = {}
rng = np.random.default_rng(26)
U = 2.0 ** -24                          # float32's unit roundoff


def to_bf16(x):
    """float32 -> bfloat16 bits, to nearest with ties to even; NaN -> 0x7FC0 (torch's)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def widen(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def reference(x, w):
    """bf16(x) @ widen(w).T in float64, and the bound on |error| of a float32 sum of its terms in
    the kernels' order (each lane adds K / 16 products in turn, then a 16-lane fold and K / KC
    partial sums): (K / 16 + 16 + K / KC) x u x sum |products|."""
    a, b = widen(to_bf16(x)).astype(np.float64), widen(w).astype(np.float64)
    K = x.shape[1]
    with np.errstate(invalid="ignore", over="ignore"):
        bound = (K / 16 + 16 + K / bp.KC) * U * (np.abs(a) @ np.abs(b).T)
        return a @ b.T, bound


def run(kernel, x, w, out=None, work=None):
    M, K = x.shape
    out = np.full((M, w.shape[0]), np.nan, np.float32) if out is None else out
    work = np.empty(bp.bmatmul_work_bytes(M, K), np.uint8) if work is None else work
    kernel(x, w, out, work)
    return out


def random_weights(N, K):
    return to_bf16(rng.standard_normal((N, K)).astype(np.float32))


@pytest.mark.parametrize("build", ["best", "fallback"])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 8, 17, 70, 256, 263])
@pytest.mark.parametrize("N,K", [(1, 1), (33, 7), (5, 32), (37, 33), (64, 64), (70, 130),
                                 (9, 2100), (130, 768)])
def test_products_equal_the_rounded_float64_product(build, M, N, K):
    """Every edge of the blocking: M and N not multiples of the 4 x 4 tiles (and M < 4: the
    first pass's 1 x M tiles), K not a multiple of the 32-column steps (the masked tail), K
    past one KC pass (partial sums added into out), N past one block of weight rows; from 256
    rows the panels: N not a multiple of 16 or of a 64-row panel, an odd K (half a pair)."""
    x = rng.standard_normal((M, K)).astype(np.float32) * np.float32(3.0)
    w = random_weights(N, K)
    want, bound = reference(x, w)
    got = run(BUILDS[build], x, w)
    assert np.all(np.abs(got - want) <= bound + 1e-30), np.abs(got - want).max()


@pytest.mark.parametrize("M,N,K", [(1, 8, 40), (6, 5, 100), (33, 70, 2100)])
def test_the_builds_agree_exactly_where_every_sum_is_exact(M, N, K):
    """Small integers: every partial sum is exact in float32, so the two builds (and NumPy)
    give the same bits whatever the order of the additions."""
    x = rng.integers(-8, 9, (M, K)).astype(np.float32)
    w = to_bf16(rng.integers(-8, 9, (N, K)).astype(np.float32))
    want = x.astype(np.float64) @ widen(w).astype(np.float64).T
    for kernel in BUILDS.values():
        np.testing.assert_array_equal(run(kernel, x, w), want.astype(np.float32))


def test_the_builds_agree_on_a_large_product():
    x = rng.standard_normal((70, 768)).astype(np.float32)
    w = random_weights(200, 768)
    best, fallback = run(bp.bmatmul_bf16, x, w), run(bp.bmatmul_bf16_fallback, x, w)
    _, bound = reference(x, w)
    assert np.all(np.abs(best - fallback) <= 2 * bound)


# bits of float32 activations -> the bfloat16 bits round to nearest, ties to even, gives them
TIES = {
    0x3F808000: 0x3F80,   # 1 + 2^-8 exactly halfway, kept bit even: down
    0x3F818000: 0x3F82,   # halfway, kept bit odd: up to even
    0x3F808001: 0x3F81,   # just above halfway: up
    0x3F807FFF: 0x3F80,   # just below: down
    0xBF818000: 0xBF82,   # negative, halfway, odd: away from zero (to even)
    0xBF808000: 0xBF80,   # negative, halfway, even: towards zero
    0x3F7FFFFF: 0x3F80,   # the carry reaches the exponent: the next binade
    0x7F7FFFFF: 0x7F80,   # past the largest bfloat16: inf (as torch)
    0x7F800000: 0x7F80,   # inf stays inf
    0xFF800000: 0xFF80,
    0x7F800001: 0x7FC0,   # a NaN whose payload would carry into inf: a quiet NaN
    0xFFC00000: 0x7FC0,
    0x00008000: 0x0000,   # denormals round as any other value (halfway, even: down)
    0x00018000: 0x0002,
    0x80000000: 0x8000,   # -0 keeps its sign
}


def test_rounding_is_to_nearest_with_ties_to_even():
    """The kernels' rounding pass itself, read back from the scratch (its interleaved layout:
    row m's 32-column step s at [m // 4, (s * 4 + m % 4) * 32:])."""
    src = np.array(list(TIES), np.uint32).view(np.float32)
    x = np.tile(src, (6, 3)).astype(np.float32)               # 6 rows: two groups of rows
    x[5] = x[5, ::-1]
    M, K = x.shape
    work = np.zeros(bp.bmatmul_work_bytes(M, K) + 1, np.uint8)[1:]     # unaligned on purpose
    xb = bp._carve(work, M, K)
    bp._round_rows(x, xb)
    Kp = (K + 31) // 32 * 32
    for m in range(M):
        steps = xb[m // 4].reshape(Kp // 32, 4, 32)[:, m % 4].reshape(-1)
        np.testing.assert_array_equal(steps[:K], to_bf16(x[m]))
        assert (steps[K:] == 0).all()                          # the padding
    np.testing.assert_array_equal(to_bf16(src), np.array(list(TIES.values()), np.uint16))


@pytest.mark.parametrize("build", ["best", "fallback"])
def test_products_multiply_the_rounded_activations(build):
    """Through a whole product: a weight row with one 1.0 picks one rounded activation (normal
    values rounding to finite ones only: vdpbf16ps treats denormal inputs as zero, and an inf
    times the zeros would be NaN)."""
    normal = {b: r for b, r in TIES.items()
              if 0x00800000 <= b & 0x7FFFFFFF < 0x7F800000 and r & 0x7FFF < 0x7F80}
    x = np.array(list(normal), np.uint32).view(np.float32)[None, :].copy()
    K = x.shape[1]
    w = np.zeros((K, K), np.uint16)
    w[np.arange(K), np.arange(K)] = 0x3F80                     # bfloat16 1.0
    got = run(BUILDS[build], x, w)
    np.testing.assert_array_equal(got[0], widen(np.array(list(normal.values()), np.uint16)))


@pytest.mark.parametrize("build", ["best", "fallback"])
@pytest.mark.parametrize("M", [6, 258])                        # the tiles, the panels
def test_nan_and_inf_propagate(build, M):
    K = 70                                                    # the bad values in the tail too
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[1, 3], x[2, 65], x[3, 10], x[3, 11] = np.nan, np.inf, np.inf, -np.inf
    w = random_weights(5, K)
    w[4, 40] = 0x7FC0                                          # a NaN weight
    w[2, :] = 0                                                # inf x 0 = NaN
    w[:, 11] = w[:, 10]                                        # inf a - inf a = NaN
    want, _ = reference(x, w)
    got = run(BUILDS[build], x, w)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    assert np.isnan(got[1]).all() and np.isnan(got[:, 4]).all() and np.isnan(got[3]).all()
    assert np.isinf(got[2, [0, 1, 3]]).all() and np.isnan(got[2, 2])
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", ["best", "fallback"])
@pytest.mark.parametrize("M", [5, 261])                        # the tiles, the panels
def test_strided_views_write_only_their_own_part(build, M):
    """x any layout (rounded into the scratch), out a column range of a larger array (rows
    strided, as a split product passes): nothing outside it is written."""
    big_x = rng.standard_normal((2 * M - 1, 300)).astype(np.float32)
    x = big_x[::2, 5:205]                                      # (M, 200), strided both ways
    w = random_weights(11, 200)
    big_out = np.full((M, 40), -7.0, np.float32)
    run(BUILDS[build], x, w, out=big_out[:, 13:24])
    want, bound = reference(np.ascontiguousarray(x), w)
    assert np.all(np.abs(big_out[:, 13:24] - want) <= bound)
    assert (big_out[:, :13] == -7).all() and (big_out[:, 24:] == -7).all()


@pytest.mark.parametrize("build", ["best", "fallback"])
def test_empty_inner_dimension_gives_zeros(build):
    for M in (3, 256):
        got = run(BUILDS[build], np.zeros((M, 0), np.float32), np.zeros((5, 0), np.uint16))
        np.testing.assert_array_equal(got, 0)


def test_mismatched_arguments_are_refused():
    x, w = np.ones((2, 8), np.float32), np.zeros((3, 8), np.uint16)
    work = np.empty(bp.bmatmul_work_bytes(2, 8), np.uint8)
    with pytest.raises(ValueError, match="shapes"):
        bp.bmatmul_bf16(x, np.zeros((3, 9), np.uint16), np.empty((2, 3), np.float32), work)
    with pytest.raises(ValueError, match="shapes"):
        bp.bmatmul_bf16(x, w, np.empty((2, 4), np.float32), work)
    with pytest.raises(ValueError, match="work"):
        bp.bmatmul_bf16(x, w, np.empty((2, 3), np.float32), work[:-1])
    with pytest.raises(ValueError, match="contiguous"):
        bp.bmatmul_bf16(x, np.zeros((3, 16), np.uint16)[:, ::2], np.empty((2, 3), np.float32), work)


def test_work_bytes_cover_groups_of_four_padded_rows():
    assert bp.bmatmul_work_bytes(1, 1) == 4 * 32 * 2 + 64
    assert bp.bmatmul_work_bytes(5, 33) == 8 * 64 * 2 + 64
    assert bp.bmatmul_work_bytes(2048, 768) == 2048 * 768 * 2 + 64


def test_the_build_follows_the_cpus_features():
    """vdpbf16ps only where the CPU numba compiles for has AVX512_BF16 (LLVM aborts the process
    when asked for an instruction the target lacks); the fallback needs nothing."""
    assert bfloat16_tiles.runnable({"avx512f", "avx512bw", "avx512bf16"}) == ["avx512bf16", "widen"]
    assert bfloat16_tiles.runnable({"avx512f", "avx512bw", "avx2", "fma"}) == ["widen"]
    assert bfloat16_tiles.ISA == bfloat16_tiles.runnable(bfloat16_tiles._FEATURES)[0]
    assert bfloat16_tiles.FALLBACK == "widen"
