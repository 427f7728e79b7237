"""The compiled CPU kernels (minfer/kernels/) against plain NumPy, at the edges of
their blocking: rows that are not a multiple of the blocks, 1..17 input rows, every format."""
import json
import os
import time

import numba
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
@pytest.mark.parametrize("N,K", [(1, 1), (33, 7), (64, 64), (70, 130), (70, 1100)])
def test_matmul_kernels_equal_the_numpy_product(M, N, K):
    # (K = 1100: from 4 input rows on (float32 weights; 8 for the others) they are more bytes
    # than the stream keeps in L1, so the 4 x 4 tiles take them, float32 rows as stored)
    fp = k.float_products
    assert 4 * 1100 * 4 > fp.STREAM_MAX_INPUT_BYTES >= 3 * 1100 * 4
    assert 8 * 1100 * 4 > fp.STREAM_MAX_WIDENED_INPUT_BYTES >= 5 * 1100 * 4
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
        # float32 sums in another order than float64's: within 1e-5 of the sum of the products'
        # magnitudes (one product of K left out would be ~1/K of it)
        want = x.astype(np.float64) @ dense.astype(np.float64).T
        bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(dense).astype(np.float64).T) + 1e-6
        assert np.all(np.abs(out - want) <= bound), kernel


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
    full = rng.standard_normal((2, B, H, S + 5, D)).astype(np.float32)   # caches of 5 more
    cache = full[:, :, :, :S]                                             # the filled part
    bias = rng.standard_normal(bias_shape).astype(np.float32)
    if bias_shape[0] == B > 1:
        bias[1] = np.finfo(np.float32).min                 # a row whose every key is masked
    want = numpy_attention(q, cache[0], cache[1], bias).transpose(0, 2, 1, 3)
    for k, v, keys in ((cache[0], cache[1], None), (full[0], full[1], S)):   # a view / a length
        ctx = np.empty((B, 1, H, D), np.float32)
        ops.attention(np, q, k, v, bias, None, ctx, keys=keys)
        np.testing.assert_allclose(ctx, want, rtol=1e-4, atol=1e-5)
        assert not np.isnan(ctx).any()


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("T", [1, 2])
def test_attention_rows_read_the_key_value_rows_kv_rows_names(compiled, T, monkeypatch):
    """kv_rows: row b of q attends over row kv_rows[b] of k and v (a decoding state's beams
    read their input's one copy of the cross K/V), in the compiled step kernels (one query
    position) and the array path (any number; CUDA, MINFER_KERNELS=numpy): as attention over
    k and v expanded to a row each, with each row's own mask."""
    B, H, S, D = 5, 3, 7, 16
    kv_rows = np.array([0, 0, 0, 1, 1])                    # two inputs: three beams, two beams
    q = rng.standard_normal((B, H, T, D)).astype(np.float32)
    kk, v = (rng.standard_normal((2, H, S, D)).astype(np.float32) for _ in range(2))
    bias = np.zeros((B, 1, 1, S), np.float32)
    bias[3:, :, :, 5:] = np.finfo(np.float32).min          # the second input is shorter
    if not compiled:
        monkeypatch.setattr(ops, "compiled", lambda xp, x: None)
    elif T > 1:
        pytest.skip("the compiled kernels take one query position")
    want = numpy_attention(q, kk[kv_rows], v[kv_rows], bias).transpose(0, 2, 1, 3)
    got = np.full((B, T, H, D), np.nan, np.float32)
    ops.attention(np, q, kk, v, bias, np.empty((B, H, T, S), np.float32), got, kv_rows=kv_rows)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


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


@pytest.mark.parametrize("rows", [[2, 0, 1], [1, 1, 1], [0], [3, 2, 1, 0], [0, 1, 3, 3], [0, 0, 2, 1], [0, 1]])
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


@pytest.fixture
def three_threads():
    """The pool cut into 3 parts (the machine may have fewer cores: the parts still run)."""
    before = kernels.set_threads(None)
    kernels.set_threads(3)
    yield
    kernels.set_threads(before)


def test_split_covers_the_range_once_in_contiguous_parts(three_threads):
    import threading
    seen, callers = [], set()

    def work(part, a, b):
        seen.append((part, a, b))
        callers.add(threading.get_ident())

    kernels.split(10, work)
    assert sorted(seen) == [(0, 0, 3), (1, 3, 6), (2, 6, 10)]
    assert threading.get_ident() in callers and len(callers) >= 2   # the caller takes a part
    seen.clear()
    kernels.split(2, work)                  # never more parts than items
    assert sorted(seen) == [(0, 0, 1), (1, 1, 2)]
    assert kernels.parts(1000, 400) == 2 and kernels.parts(10, 400) == 1


def test_split_raises_a_failing_part_after_all_parts_ran(three_threads):
    """A part that fails early must not let split return while a slower part still runs (it
    could write into memory already handed to the next request): part 2 is made the slowest."""
    done = []

    def work(part, a, b):
        if part == 1:
            raise ValueError("part 1 failed")
        if part == 2:
            time.sleep(0.3)
        done.append(part)

    with pytest.raises(ValueError, match="part 1 failed"):
        kernels.split(9, work)
    assert sorted(done) == [0, 2]


@pytest.mark.parametrize("threads", [1, 3])
def test_blas_work_runs_only_on_the_pools_threads(threads):
    """Work that calls BLAS never runs in the calling thread (OpenBLAS keeps a buffer for every
    thread that ever called it, outside the arena): with one thread too, and a BLAS call made
    from inside a part runs where it is (no part waits on the pool from inside it)."""
    import threading
    before = kernels.set_threads(None)
    kernels.set_threads(threads)
    kernels.keep_blas_on_pool(True)   # (what loading under a memory limit turns on)
    try:
        callers, inner = [], []

        def work(part, a, b):
            callers.append(threading.current_thread())
            kernels.on_pool(lambda: inner.append(threading.current_thread()))

        for n in (1, 9):
            callers.clear(), inner.clear()
            kernels.split(n, work, blas=True)
            assert callers and threading.current_thread() not in callers
            assert all(t.name.startswith("minfer") for t in callers) and inner == callers
        x = rng.standard_normal((3, 8)).astype(np.float32)
        w = rng.standard_normal((5, 8)).astype(np.float32)
        np.testing.assert_allclose(ops.linear(np, x, w), x @ w.T, rtol=1e-6)  # a plain weight
    finally:
        kernels.keep_blas_on_pool(False)
        kernels.set_threads(before)


@pytest.mark.parametrize("fmt", ["float32", "float16", "bfloat16", "int8"])
def test_large_products_split_over_threads_equal_one_product(three_threads, fmt):
    """More rows than the kernels take: each thread widens its share of the output columns into
    its own part of the scratch (here several blocks each) and multiplies with BLAS."""
    from minfer.io.formats import FORMATS
    from minfer.products import KERNEL_MAX_ROWS, wrap
    M, N, K = KERNEL_MAX_ROWS + 7, 200, 24
    x, w = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32)
    f = FORMATS[fmt]
    arrays = f.encode("w", w)
    dense = wrap(FORMATS[fmt], "w", arrays, np.float32, np.empty(N * K, np.float32), None)
    want = ops.linear(np, x, dense)                          # the NumPy path: one pass of blocks
    packed = wrap(f, "w", arrays, np.float32, np.empty(K * 10, np.float32), k)  # 3 rows a block
    got = np.full((M, N), np.nan, np.float32)
    ops.linear(np, x, packed, out=got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_attention_over_head_ranges_equals_all_heads_at_once(three_threads):
    B, H, T, S, D = 2, 5, 3, 7, 4
    q, kk, v = (rng.standard_normal((B, H, n, D)).astype(np.float32) for n in (T, S, S))
    bias = rng.standard_normal((1, H, T, S)).astype(np.float32)
    scores = np.empty((B, H, T, S), np.float32)
    got = np.empty((B, T, H, D), np.float32)
    ops.attention(np, q, kk, v, bias, scores, got)
    logits = q @ kk.swapaxes(-1, -2) + bias
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, (p @ v).transpose(0, 2, 1, 3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("env, want", [({}, "1000"), ({"GOMP_SPINCOUNT": "5"}, "5"),
                                       ({"OMP_WAIT_POLICY": "active"}, None)])
def test_openmp_spin_count_defaults_low_and_the_users_setting_wins(env, want):
    # libgomp reads it when numba first loads it: the kernels module must set it before then,
    # and only when the user chose no waiting policy of their own
    pytest.importorskip("numba")
    import os
    import subprocess
    import sys
    code = ("import os; from minfer import kernels; k = kernels.compiled(); "
            "k.set_threads(1); print(os.environ.get('GOMP_SPINCOUNT'))")
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[-1] == str(want)


def test_the_thread_count_reaches_threads_that_did_not_set_it():
    # numba keeps its thread count per calling thread: a server's worker thread (or the
    # batcher's leader) must still run the kernels on the count load(num_threads=) chose
    numba = pytest.importorskip("numba")
    import threading
    if kernels.active() is None or numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs the compiled kernels and numba with 2 or more threads")
    before = kernels.set_threads(None)
    try:
        for n in (1, 2):
            kernels.set_threads(n)
            seen = []

            def worker(seen=seen):
                kernels.active()
                seen.append(numba.get_num_threads())

            t = threading.Thread(target=worker)
            t.start()
            t.join()
            assert seen == [n]
    finally:
        kernels.set_threads(before)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("parallel", [False, True])
def test_non_finite_attention_scores_give_nan_not_an_exception(bad, parallel):
    # an overflowed query made the compiled softmax divide by zero: a raw ZeroDivisionError,
    # where NumPy gives NaN that generation turns into a one-line error
    q = np.ones((2, 2, 4), np.float32)
    q[0, 1, 0] = bad
    cache = rng.standard_normal((2, 2, 5, 4)).astype(np.float32)
    ctx = np.zeros((2, 2, 4), np.float32)
    run = k.attend_query_parallel if parallel else k.attend_query
    run(q, cache, cache, 5, np.zeros((1, 1, 5), np.float32), ctx, np.empty(0, np.int64))
    assert np.isnan(ctx[0, 1]).all()
    assert np.isfinite(ctx[1]).all() and np.isfinite(ctx[0, 0]).all()


def test_non_finite_norm_input_gives_non_finite_output_not_an_exception():
    x = np.array([[np.inf, 1.0, 2.0], [1.0, 2.0, 3.0]], np.float32)
    h = np.empty_like(x)
    k.add_rms_norm(x, np.empty((0, 3), np.float32), np.ones(3, np.float32), 0.0, h)
    assert not np.isfinite(h[0]).all() and np.isfinite(h[1]).all()


# -- the process around the kernels: environment variables, fork ---------------------------------------
def _run_python(code, env=None, timeout=120):
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout, cwd=root)


@pytest.mark.parametrize("env, needle", [
    ({"MINFER_KERNELS": "garbage"}, "MINFER_KERNELS='garbage': expected one of numba, numpy"),
    ({"NUMBA_THREADING_LAYER": "bogus"}, "NUMBA_THREADING_LAYER='bogus': expected one of"),
    ({"NUMBA_THREADING_LAYER": "safe"}, "NUMBA_THREADING_LAYER='safe': no threading layer"),
])
def test_bad_kernel_environment_is_one_line_in_the_cli_and_a_config_error_in_the_api(env, needle):
    import importlib.util
    if "safe" in env.values() and importlib.util.find_spec("tbb") is not None:
        pytest.skip("tbb is installed: the 'safe' layer loads")
    cli = _run_python("from minfer_cli.main import main; "
                      "main(['generate', '-m', 'weights/tiny-t5-dates', 'date: 4th of July 1976'])",
                      env)
    lines = cli.stderr.strip().splitlines()
    assert cli.returncode == 1 and len(lines) == 1 and needle in lines[0], cli.stderr
    api = _run_python("import minfer\n"
                      "try:\n    minfer.load('weights/tiny-t5-dates').generate('date: 1 May 2000')\n"
                      "except minfer.ConfigError as e:\n    print('ConfigError:', e)\n", env)
    assert api.returncode == 0 and needle in api.stdout, api.stdout + api.stderr


@pytest.mark.parametrize("run_first", [False, True])
def test_fork_after_load_and_after_a_run_gives_working_children(run_first):
    # GNU OpenMP cannot run in a child forked after its threads started (numba terminates the
    # child): loading starts none, and a child forked after a run computes on the NumPy path
    code = f"""
import multiprocessing as mp
import minfer
m = minfer.load('weights/tiny-t5-dates')
prompts = ['date: 4th of July 1976', 'spell: 1234', 'date: March 5, 2021']
want = [m.generate(p) for p in prompts] if {run_first} else None

def work(p):
    return m.generate(p)

with mp.get_context('fork').Pool(2) as pool:
    got = pool.map_async(work, prompts).get(timeout=60)
print(got if want is None else got == want)
"""
    out = _run_python(code, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "unsafe" not in out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last == ("True" if run_first else
                    str(['1976-07-04', 'one thousand two hundred thirty-four', '2021-03-05']))


def test_a_forked_child_streams_layers_with_its_own_prefetch_thread(tmp_path):
    # the prefetch thread of a model under a memory limit stays in the parent: the child's copies
    # waited for it forever
    code = f"""
import multiprocessing as mp, sys
sys.path.insert(0, 'tests')
import minfer
from factories import SHAPE, write_t5
from pathlib import Path
folder = write_t5(Path({str(tmp_path / "m")!r}), seed=3, **SHAPE)
want = minfer.load(folder).generate([[5, 6, 7, 8, 1]], max_new_tokens=5)
m = minfer.load(folder, memory_limit='1MiB', workspace='400KiB')
assert m.weight_plan.streamed
assert m.generate([[5, 6, 7, 8, 1]], max_new_tokens=5) == want

def work(p):
    return m.generate([p], max_new_tokens=5)

with mp.get_context('fork').Pool(2) as pool:
    print(pool.map_async(work, [[5, 6, 7, 8, 1]] * 2).get(timeout=60) == [want, want])
"""
    out = _run_python(code, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"


# -- integer products: compute="int8" and int4 weights ---------------------------------------------------
def quantised(x):
    """What the int8 kernels multiply: each row rounded to int8 steps of its own."""
    from minfer.products import quantise_rows
    return quantise_rows(np, x)


def test_quantise_rows_rounds_each_row_to_int8_steps():
    from minfer.products import quantise_rows
    x = np.array([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, np.inf, 1.0, 0.0]],
                 np.float32)
    with np.errstate(all="raise"):                   # no warnings on inf rows either
        got = quantise_rows(np, x)
    np.testing.assert_allclose(got[0], np.rint(x[0] * 127) / 127, rtol=1e-6)
    np.testing.assert_array_equal(got[1], 0)
    assert np.isnan(got[2]).all()


@pytest.mark.parametrize("M", [1, 3, 4, 5, 16, 70])
@pytest.mark.parametrize("N,K", [(37, 128), (70, 130), (9, 64), (5, 40), (64, 512)])
def test_int8_products_equal_the_rounded_float_product(M, N, K):
    from minfer.io.formats import quantise_int8
    x = rng.standard_normal((M, K)).astype(np.float32) * rng.random((M, 1)).astype(np.float32)
    q, scale = quantise_int8(rng.standard_normal((N, K)).astype(np.float32))
    want = quantised(x) @ (q.astype(np.float32) * scale[:, None]).T
    for kernel in (k.qmatmul_i8, k.qmatmul_i8_fallback):
        out = np.full((M, N), np.nan, np.float32)
        kernel(x, q, scale, out, np.empty(kernels.quantised_bytes(M, K, 1), np.uint8))
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("M", [1, 3, 4, 17, 70])
@pytest.mark.parametrize("N,K", [(37, 128), (9, 64), (70, 192), (66, 512)])
def test_int4_products_equal_the_float_product_with_the_stored_values(M, N, K):
    from minfer.io.formats import FORMATS, quantise_int4
    x = rng.standard_normal((M, K)).astype(np.float32)
    q, scale = quantise_int4(rng.standard_normal((N, K)).astype(np.float32))
    dense = FORMATS["int4"].decode(q, scale, (N, K))
    out = np.full((M, N), np.nan, np.float32)
    k.matmul_i4(x, q, scale, out)                                          # float32 compute
    np.testing.assert_allclose(out, x @ dense.T, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    want = quantised(x) @ dense.T                                          # compute="int8"
    for kernel in (k.qmatmul_i4, k.qmatmul_i4_fallback):
        out = np.full((M, N), np.nan, np.float32)
        kernel(x, q, scale, out, np.empty(kernels.quantised_bytes(M, K, scale.shape[1]), np.uint8))
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_int8_products_of_non_finite_and_zero_rows():
    from minfer.io.formats import quantise_int4, quantise_int8
    x = rng.standard_normal((4, 128)).astype(np.float32)
    x[1, 7], x[2], x[3, 0] = np.inf, 0.0, np.nan
    w = rng.standard_normal((8, 128)).astype(np.float32)
    for kernel, (q, s) in ((k.qmatmul_i8, quantise_int8(w)), (k.qmatmul_i4, quantise_int4(w))):
        out = np.full((4, 8), 7.0, np.float32)
        kernel(x, q, s, out, np.empty(kernels.quantised_bytes(4, 128, 2), np.uint8))
        assert np.isfinite(out[0]).all() and (out[2] == 0).all()
        assert np.isnan(out[1]).all() and np.isnan(out[3]).all()


@pytest.mark.parametrize("K", [64, 200, 72, 48, 2])
def test_int4_widening_kernel_equals_numpy_for_whole_and_partial_blocks(K):
    from minfer.io.formats import FORMATS, quantise_int4
    w = rng.standard_normal((5, K)).astype(np.float32)
    q, scale = quantise_int4(w)
    want, got = np.empty((5, K), np.float32), np.empty((5, K), np.float32)
    FORMATS["int4"].widen(q, want)
    k.widen_i4(q, got)
    np.testing.assert_array_equal(got, want)
    assert np.abs(want).max() <= 8 and (want == np.rint(want)).all()


def _twice_on_a_cold_cache(tmp_path, code: str) -> list:
    """`python -c code` run twice, one after the other, over a numba cache that starts empty."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), MINFER_KERNELS="numba")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           timeout=1800) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    return runs


def test_a_cold_cache_compiles_in_a_child_process_not_in_this_one(tmp_path):
    """The first run of an installation compiles the kernels in a child process that fills
    numba's cache (LLVM's compiler would otherwise add ~60 MiB to this process's peak, outside
    any arena), saying so on stderr; this process only loads them. A second run is silent.
    (Two of the warm-ups, dealt to the children as every run deals them: the mechanism is the
    same for all, and compiling all of them again, in a cache of their own, took 2.5 minutes
    of the suite on 2 cores.)"""
    code = ("import json, numba\n"
            "from minfer.kernels import environment\n"
            "environment.configure()\n"
            "from minfer.kernels import registry\n"
            "registry.WARM_UPS = tuple(w for w in registry.WARM_UPS\n"
            "                          if w[1].__name__ in ('_steps', '_widenings'))\n"
            "from minfer import kernels\n"
            "k = kernels.compiled()\n"
            "k.warm_up()\n"
            "kernels_ = [v for v in vars(k).values() if isinstance(v, numba.core.dispatcher.Dispatcher)]\n"
            "print(json.dumps([sum(len(d.stats.cache_misses) for d in kernels_),\n"
            "                  sum(len(d.stats.cache_hits) for d in kernels_)]))\n")
    runs = _twice_on_a_cold_cache(tmp_path, code)
    (misses, hits), again = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert misses == 0 and hits > 10                   # every kernel came from the cache
    assert kernels.COMPILE_NOTICE in runs[0].stderr
    assert kernels.COMPILE_NOTICE not in runs[1].stderr and again == [0, hits]


def test_a_compile_child_that_fails_is_not_tried_again(tmp_path):
    """A child that cannot compile (here: no interpreter to run it) is tried once per cache and
    stamp: later processes compile in themselves on first use, as before, without waiting for
    a child first."""
    runs = _twice_on_a_cold_cache(tmp_path, "import sys\n"
                                            "sys.executable = '/bin/false'\n"
                                            "from minfer import kernels\n"
                                            "assert kernels.compiled() is not None\n")
    assert kernels.COMPILE_NOTICE in runs[0].stderr and kernels.COMPILE_NOTICE not in runs[1].stderr
    assert list((tmp_path / "cache").rglob("minfer-kernels-*.failed"))


# -- a pass's softmax with its bias by distance (kernels/pass_softmax.py, ops.distance_attention) ----
def _softmax_distance_bias(scores, table, h0, key_mask):
    """scores (B, h, T, S) of heads h0.. -> softmax(scores + table[h0 + g, j - i + T - 1] +
    key_mask[b, j]) in place: `_softmax_row` on every row, as the attention kernels run it."""
    from minfer.kernels.pass_softmax import _softmax_row
    from minfer.kernels.vector_math import NON_FINITE_SAFE

    @numba.njit(**NON_FINITE_SAFE)
    def rows(scores, table, h0, key_mask):
        B, Hc, T, S = scores.shape
        for b in range(B):
            for g in range(Hc):
                tb = table[0 if table.shape[0] == 1 else h0 + g]
                for i in range(T):
                    _softmax_row(scores[b, g, i], tb[T - 1 - i:T - 1 - i + S], key_mask[b], S)
    rows(scores, table, h0, key_mask)


def _distance_reference(s, table, key_mask):
    """softmax(s + table[h, j - i + T - 1] + key_mask[b, j]) in float64."""
    B, H, T, S = s.shape
    idx = np.arange(S)[None, :] - np.arange(T)[:, None] + T - 1
    rows = table[:, idx] if table.shape[0] == H else np.broadcast_to(table[0][idx], (H, T, S))
    logits = s.astype(np.float64) + rows[None] + key_mask[:, None, None, :]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize("B, H, T, S", [(1, 1, 1, 1), (2, 3, 5, 7), (3, 2, 17, 33), (1, 4, 64, 64)])
def test_softmax_with_a_distance_table_equals_the_bias_matrix(B, H, T, S):
    s = (rng.standard_normal((B, H, T, S)) * 8).astype(np.float32)   # spans e^-60 .. 1
    table = rng.standard_normal((H, T + S - 1)).astype(np.float32)
    key_mask = np.zeros((B, S), np.float32)
    key_mask[0, S // 2:] = np.finfo(np.float32).min                    # row 0's second half padded
    got = s.copy()
    _softmax_distance_bias(got, table, 0, key_mask)
    want = _distance_reference(s, table, key_mask)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    assert (got[0, :, :, S // 2:] == 0).all() if S > 1 else True   # padded keys weigh nothing
    # a head range: heads h0.. of a longer table, and one row shared by every head
    wide = np.concatenate([rng.standard_normal((2, T + S - 1)).astype(np.float32), table])
    got = s.copy()
    _softmax_distance_bias(got, wide, 2, key_mask)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    got = s.copy()
    _softmax_distance_bias(got, table[:1], 0, key_mask)
    np.testing.assert_allclose(got, _distance_reference(s, table[:1], key_mask), rtol=2e-6, atol=1e-7)


def test_the_distance_softmax_exponential_is_exact_to_float32_rounding():
    # the sweep's own exp (a polynomial, so that it vectorises) over every exponent it meets:
    # rows (0, x) give (1, e^x) / (1 + e^x); below e^-87.3 (no normal float32) exactly 0
    x = -np.concatenate([np.linspace(0, 87, 100001), rng.random(1000) * 1e-6]).astype(np.float32)
    s = np.stack([np.zeros_like(x), x], axis=-1).reshape(1, 1, -1, 2)
    _softmax_distance_bias(s, np.zeros((1, s.shape[2] + 1), np.float32), 0,
                           np.zeros((1, 2), np.float32))
    np.testing.assert_allclose(s[0, 0, :, 1] / s[0, 0, :, 0], np.exp(x.astype(np.float64)),
                               rtol=1e-6)
    s = np.array([0.0, -88.0, -200.0, 0.0], np.float32).reshape(1, 1, 1, 4)
    _softmax_distance_bias(s, np.zeros((1, 4), np.float32), 0, np.zeros((1, 4), np.float32))
    np.testing.assert_array_equal(s[0, 0, 0], [0.5, 0.0, 0.0, 0.5])


def test_the_distance_softmax_keeps_nan_and_uniform_rows_as_numpy():
    s = rng.standard_normal((1, 1, 6, 4)).astype(np.float32)
    s[0, 0, 0, 2] = np.nan
    s[0, 0, 1, 1] = np.inf
    s[0, 0, 2] = np.finfo(np.float32).min              # an all-masked row: uniform, never NaN
    s[0, 0, 3, 0] = -np.float32(np.nan)                # a NaN with its sign bit set (not the max)
    s[0, 0, 4] = [-0.0, -3.0, -np.inf, -1.0]           # -inf weighs nothing; the maximum is -0
    s[0, 0, 5] = [-5.0, -7.0, -6.0, -9.0]              # all negative: the max is the least negative
    want = s.astype(np.float64)
    with np.errstate(invalid="ignore"):
        want = np.exp(want - want.max(-1, keepdims=True))
        want /= want.sum(-1, keepdims=True)
    _softmax_distance_bias(s, np.zeros((1, 9), np.float32), 0, np.zeros((1, 4), np.float32))
    assert np.isnan(s[0, 0, :2]).all() and np.isnan(s[0, 0, 3]).all()
    np.testing.assert_allclose(s[0, 0, 2], 0.25, rtol=1e-6)
    np.testing.assert_allclose(s[0, 0, 4:], want[0, 0, 4:], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("H", [1, 5, 6])
def test_distance_attention_equals_attention_with_the_bias_matrix(H, three_threads):
    # the array path in rounds of (batch row, head) pairs, each round's bias built from the
    # table in the scratch's second half: two rounds of half the heads (`distance_scores`), or
    # as many pairs as a smaller scratch holds (one; five: rounds across batch rows and heads);
    # and the compiled float32 kernel over the same q|k|v
    B, T, S, D = 3, 9, 9, 8
    q, kk, v = (rng.standard_normal((B, H, n, D)).astype(np.float32) for n in (T, S, S))
    table = rng.standard_normal((H, T + S - 1)).astype(np.float32)
    key_mask = np.zeros((B, S), np.float32)
    key_mask[1, 6:] = ops.mask_value(np.float32)
    idx = np.arange(S)[None, :] - np.arange(T)[:, None] + T - 1
    bias = np.ascontiguousarray(table[:, idx][None] + key_mask[:, None, None, :])
    want = np.empty((B, T, H, D), np.float32)
    ops.attention(np, q, kk, v, bias, np.empty((B, H, T, S), np.float32), want)
    distance = ops.DistanceBias(table, key_mask)
    np.testing.assert_array_equal(ops.toeplitz_view(np, table, T), table[:, idx])
    for size in (ops.distance_scores(B, H, T, S), 2 * T * S, 2 * T * S * 5 + 7):
        scores = np.full(size, np.nan, np.float32)
        got = np.full((B, T, H, D), np.nan, np.float32)
        stats = (np.empty((B, H, T, 1), np.float32), np.empty((B, H, T, 1), np.float32))
        ops.distance_attention(np, q, kk, v, distance, scores, got, stats)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="scratch holds"):
        ops.distance_attention(np, q, kk, v, distance, np.empty(2 * T * S - 1, np.float32), got)
    qkv = np.ascontiguousarray(np.stack([q, kk, v], axis=2).transpose(0, 3, 2, 1, 4))  # (B, T, 3, H, D)
    work = np.full(ops.distance_scratch(B, H, T, D, 4, "float32"), np.nan, np.float32)
    got = np.full((B, T, H, D), np.nan, np.float32)
    ops.float_distance_attention(np, qkv, distance, work, got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_first_runs_compile_is_dealt_to_children_once_each(monkeypatch):
    """Every warm-up goes to exactly one compiling child, whatever their number; as many
    children as processors, at most COMPILE_PARTS, fewer where free memory holds fewer."""
    from minfer.kernels import registry
    names = [call.__name__ for _, call in registry.WARM_UPS]
    assert len(set(names)) == len(names)                  # (a child is dealt names)
    for parts in range(1, 6):
        dealt = registry.shares(parts)
        assert len(dealt) == parts and sorted(sum(dealt, [])) == sorted(names)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    page = os.sysconf("SC_PAGE_SIZE")
    for free, want in ((64 << 30, kernels.COMPILE_PARTS), (2 * kernels.COMPILE_CHILD_BYTES, 2),
                       (kernels.COMPILE_CHILD_BYTES // 2, 1)):
        monkeypatch.setattr(os, "sysconf", lambda name, free=free: free // page
                            if name == "SC_AVPHYS_PAGES" else page)
        assert kernels._compile_parts() == want
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert kernels._compile_parts() == 1
