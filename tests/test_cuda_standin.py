"""The CUDA path (minfer/cuda.py and the model code over its namespace) on every CPU run, through
the strict CuPy stand-in of tests/strict_cupy.py (see its docstring for what it refuses and
counts). Each test here failed on the code before issue 20's fixes (bb6bba4)."""
import threading
from pathlib import Path

import numpy as np
import pytest
from factories import DEC, IDS, SHAPE, write_t5

import minfer
from minfer.arena import SCOPE_TEMPORARIES, align_up
from minfer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def rel(got, want):
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def run_counted(cuda, model, work):
    """work() on a loaded stand-in model: (its result, host syncs, allocations that bypassed the
    arena, arena peak above what was in use before)."""
    arena = model.backend.arena
    arena.reset_peak()
    base = arena.used
    cuda.STATE.syncs, cuda.STATE.outside, cuda.STATE.counting_outside = 0, 0, True
    out = work()
    cuda.STATE.counting_outside = False
    assert arena.used == base                      # every scope gave its memory back
    return out, cuda.STATE.syncs, cuda.STATE.outside, align_up(arena.stats().peak) - align_up(base)


# =====================================================================================================
# T5
# =====================================================================================================
def test_t5_float32_matches_the_cpu_with_one_sync_per_result(strict_cuda, folder, reference):
    want, ids = reference
    m = minfer.load(folder, device="cuda", dtype="float32")
    got, syncs, outside, peak = run_counted(strict_cuda, m, lambda: m.forward(IDS, DEC))
    assert rel(got, want) < 1e-5 and syncs == 1 and outside == 0
    plan = m.plan(batch=2, input_len=5)
    assert peak <= SCOPE_TEMPORARIES + plan["encoder_scratch"] + 4 * plan["decode_state"]
    ids_got, syncs, outside, peak = run_counted(
        strict_cuda, m, lambda: m.generate(IDS, max_new_tokens=12, min_new_tokens=12))
    assert ids_got == ids and outside == 0
    assert peak <= m.plan(batch=2, input_len=5, max_new_tokens=12)["peak"]
    assert syncs == 12              # one per step: its logits


def test_t5_steps_sync_once_and_allocate_nothing(strict_cuda, folder):
    m = minfer.load(folder, device="cuda", dtype="float16")
    ids, mask = m.batch(IDS)
    with m.start_decoding(ids, mask, max_len=6, repeat=2) as state:
        arena = m.backend.arena
        used = arena.used
        strict_cuda.STATE.syncs = 0
        strict_cuda.STATE.counting_outside = True
        tokens = np.zeros(4, np.int64)
        for t in range(4):
            logits = state.step(tokens)
            assert logits.dtype == np.float32 and np.isfinite(logits).all()
            tokens = logits.argmax(-1)
        state.reorder([3, 0, 0])                       # beams follow their parents
        state.step(tokens[[3, 0, 0]])
        assert strict_cuda.STATE.syncs == 5 and strict_cuda.STATE.outside == 0
        assert arena.used == used
    assert arena.pool_peak <= SCOPE_TEMPORARIES


def test_t5_float16_follows_transformers_and_stays_close_to_float32(strict_cuda, folder,
                                                                   reference):
    # float16 like transformers 4.57: wo in float32 (its _keep_in_fp32_modules), the stream
    # float32 from the first FF on. Tolerance: 1e-2 of the largest logit.
    want, ids = reference
    m = minfer.load(folder, device="cuda", dtype="float16")
    blk = next(iter(m.params["encoder"]))
    assert blk["w_out"].dtype == np.float32 and blk["w_in"].dtype == np.float16
    got, syncs, outside, _ = run_counted(strict_cuda, m, lambda: m.forward(IDS, DEC))
    assert rel(got, want) < 1e-2 and syncs == 1 and outside == 0
    assert m.generate(IDS, max_new_tokens=12, min_new_tokens=12) == ids
    cpu = minfer.load(folder)
    assert m.generate(IDS, max_new_tokens=6, num_beams=3) == cpu.generate(IDS, max_new_tokens=6,
                                                                           num_beams=3)


def test_t5_float16_keeps_activations_beyond_float16_finite(strict_cuda, tmp_path):
    # a FF whose output outgrows float16 (|y| ~ 1e5): transformers computes wo in float32 and
    # keeps a float32 stream; a float16 wo gives inf, then NaN
    big = 3e5   # |y| ~ 0.7 big: typical FF outputs of 2e5, beyond float16
    folder = write_t5(tmp_path / "m", seed=7, **SHAPE)
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(folder / "model.safetensors"))
    for name in tensors:
        if name.endswith("DenseReluDense.wo.weight"):
            tensors[name] = tensors[name] * big
    save_file(tensors, str(folder / "model.safetensors"))
    want = minfer.load(folder).forward(IDS, DEC)
    got = minfer.load(folder, device="cuda", dtype="float16").forward(IDS, DEC)
    assert np.isfinite(got).all() and rel(got, want) < 2e-2


def realistic_int8_folder(tmp_path):
    """A T5 whose FF has real checkpoints' magnitudes: wide (d_ff 1024), large hidden
    activations (~100s) and small output weights, so that an int8 product accumulated before its
    scale (up to 127 x |w|max per term) passes float16's 65504 long before the output does."""
    folder = write_t5(tmp_path / "m", seed=11, d_model=64, d_kv=16, num_heads=4, d_ff=1024,
                      num_layers=2, num_decoder_layers=2, vocab_size=200)
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(folder / "model.safetensors"))
    for name in tensors:
        if name.endswith("DenseReluDense.wi.weight"):
            tensors[name] = tensors[name] * 300.0
        if name.endswith("DenseReluDense.wo.weight"):
            tensors[name] = tensors[name] * 0.003
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_t5_int8_products_do_not_overflow_float16(strict_cuda, tmp_path):
    folder = realistic_int8_folder(tmp_path)
    want = minfer.load(folder, dtype="int8").forward(IDS, DEC)       # the same int8, on the CPU
    m = minfer.load(folder, device="cuda", dtype="int8")
    got, syncs, outside, _ = run_counted(strict_cuda, m, lambda: m.forward(IDS, DEC))
    assert np.isfinite(got).all() and rel(got, want) < 1e-2
    assert syncs == 1 and outside == 0


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_t5_compute_float32_widens_the_stored_weights_on_the_device(strict_cuda, folder, dtype):
    # compute="float32" with half or int8 weights: the CPU's computation (weights widened to
    # float32, float32 activations), on the device
    want = minfer.load(folder, dtype=dtype).forward(IDS, DEC)
    m = minfer.load(folder, device="cuda", dtype=dtype, compute="float32")
    assert (m.backend.dtype, m.backend.compute, m.backend.weight_format) == (np.float32, "float32",
                                                                            dtype)
    got, syncs, outside, _ = run_counted(strict_cuda, m, lambda: m.forward(IDS, DEC))
    assert rel(got, want) < 1e-5 and syncs == 1 and outside == 0
    assert minfer.load(folder, device="cuda", dtype=dtype).backend.compute == "float16"
    assert minfer.load(folder, device="cuda", dtype="float32").backend.compute == "float32"
    with pytest.raises(ConfigError, match="compute 'int8' is not supported on device 'cuda'"):
        minfer.load(folder, device="cuda", dtype="int8", compute="int8")


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_t5_under_a_memory_limit_streams_with_the_unlimited_ids(strict_cuda, folder, dtype):
    full = minfer.load(folder, device="cuda", dtype=dtype)
    want = full.generate(IDS, max_new_tokens=8, num_beams=2)
    weights = full.weight_plan.fixed + sum(full.weight_plan.unit_bytes.values())
    limit, workspace = {"float32": (1_100_000, 300_000), "float16": (700_000, 300_000),
                        "int8": (428_000, 160_000)}[dtype]
    m = minfer.load(folder, device="cuda", dtype=dtype, memory_limit=limit, workspace=workspace)
    assert m.weight_plan.streamed and limit < weights
    got, _, outside, _ = run_counted(
        strict_cuda, m, lambda: m.generate(IDS, max_new_tokens=8, num_beams=2))
    assert got == want and outside == 0
    assert m.backend.arena.stats().peak <= limit


def test_device_token_ids_are_an_input_error(strict_cuda, folder):
    from minfer.errors import InputError
    m = minfer.load(folder, device="cuda", dtype="float32")
    ids = strict_cuda.asarray(np.array(IDS[:1]))
    with pytest.raises(InputError, match="device .CuPy. array"):
        m.generate(ids, max_new_tokens=2)
    with pytest.raises(InputError, match="attention_mask: a device"):
        m.batch(np.array(IDS[:1]), strict_cuda.asarray(np.ones((1, 5), np.int64)))


def test_a_missing_wait_on_a_copy_is_a_read_of_unfinished_data(strict_cuda, folder,
                                                               monkeypatch):
    # the stand-in's copies on the transfer stream land only once an event after them is waited
    # on: without CudaTransfers.wait the compute stream reads a slot still being filled
    from minfer import cuda
    m = minfer.load(folder, device="cuda", dtype="float32", memory_limit=1_100_000,
                    workspace=300_000)
    m.forward(IDS, DEC)
    monkeypatch.setattr(cuda.CudaTransfers, "wait", lambda self, ticket: None)
    with pytest.raises(strict_cuda.StrictError, match="has not finished"):
        m.forward(IDS, DEC)


# =====================================================================================================
# Plans: what a run allocates on the device is what its plan counts
# =====================================================================================================
class ZeroCheckpoint:
    """A checkpoint of a given config whose tensors are all zeros, read without a file (a
    t5-large-sized one would be 3 GB): enough for the loader to place shape-only weights."""

    def __init__(self, config, table):
        import pathlib
        from minfer.io.tensors import TensorInfo  # noqa: F401  (the real class's fields)
        self.config, self.folder = config, pathlib.Path("/nonexistent/t5-large-shaped")
        self.shapes = table.tensors

    def names(self):
        return list(self.shapes)

    def info(self, name):
        class Info:
            shape, dtype, file = self.shapes[name], "F32", self.folder / "model.safetensors"
        return Info

    def quantised_names(self):
        return []

    def read_stored(self, name, rows=None):
        return self.read(name, np.float32, rows), None

    def read(self, name, dtype=np.float32, rows=None):
        shape = self.shapes[name]
        if rows is not None:
            shape = (rows[1] - rows[0], *shape[1:])
        return np.zeros(shape, dtype)


T5_LARGE = dict(model_type="t5", vocab_size=32128, d_model=1024, d_kv=64, num_heads=16,
                d_ff=4096, num_layers=24, num_decoder_layers=1, feed_forward_proj="relu",
                relative_attention_num_buckets=32, relative_attention_max_distance=128)


def test_t5_large_batch8_512_encode_uses_exactly_its_plan(strict_cuda):
    # issue 20's case: t5-large, batch 8 x 512 tokens, float16. Shape-only arrays (dry): every
    # allocation, view and product shape is real, no arithmetic runs. Before: ~12 GB of CuPy
    # temporaries per encode against ~0.25 GB planned.
    strict_cuda.reset(dry=True, memory=8 << 30)
    from minfer.devices import make_backend
    from minfer.models.t5 import T5Config, T5Model
    from minfer.models.t5.weights import weight_table
    cfg = T5Config.from_hf(T5_LARGE)
    be = make_backend("cuda", "float16")
    model = T5Model.load(ZeroCheckpoint(T5_LARGE, weight_table(cfg)), be)
    ids = np.full((8, 512), 5, np.int64)
    plan = model.plan(batch=8, input_len=512)["encoder_scratch"]
    _, syncs, outside, peak = run_counted(strict_cuda, model, lambda: model.encode(ids))
    assert peak == plan and syncs == 1 and outside == 0
    assert be.arena.pool_peak <= SCOPE_TEMPORARIES
    assert plan < 400 << 20


# =====================================================================================================
# Loading: devices, memory, libraries
# =====================================================================================================
def test_a_second_load_gets_the_memory_a_freed_model_gave_back(strict_cuda, folder):
    import gc
    first = minfer.load(folder, device="cuda")
    capacity = first.backend.arena.capacity
    del first
    gc.collect()
    second = minfer.load(folder, device="cuda")
    assert second.backend.arena.capacity >= 0.99 * capacity


def test_a_model_on_cuda_1_runs_from_any_thread(strict_cuda, folder, reference):
    want, ids = reference
    m = minfer.load(folder, device="cuda:1", dtype="float32")
    got = {}

    def work():   # a thread whose current device is 0, as the batcher's or a Ray actor's
        got["ids"] = m.generate(IDS, max_new_tokens=12, min_new_tokens=12)
        got["logits"] = m.forward(IDS, DEC)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert got["ids"] == ids and rel(got["logits"], want) < 1e-5
    assert strict_cuda.STATE.device == 0           # the caller's device is left as it was


def test_missing_cuda_libraries_fail_at_load_saying_what_to_install(strict_cuda, folder):
    strict_cuda.reset(missing_libraries=True)
    with pytest.raises(ConfigError, match=r"cannot load the CUDA libraries .*\[ctk\]") as e:
        minfer.load(folder, device="cuda")
    assert "\n" not in str(e.value)


def test_an_old_driver_is_not_reported_as_no_device(strict_cuda, folder):
    strict_cuda.reset(driver_error="cudaErrorInsufficientDriver: CUDA driver version is "
                                   "insufficient for CUDA runtime version")
    with pytest.raises(ConfigError, match="driver is older") as e:
        minfer.load(folder, device="cuda")
    assert "no CUDA device" not in str(e.value)
    from minfer.devices import make_backend
    assert make_backend("auto").device == "cpu"     # 'auto' falls back, with a warning


# =====================================================================================================
# The namespace's products
# =====================================================================================================
@pytest.mark.parametrize("dtype,out_dtype", [("float16", "float16"), ("float16", "float32"),
                                             ("float32", "float32")])
def test_strided_products_allocate_nothing_and_match_numpy(strict_cuda, dtype, out_dtype):
    from minfer import cuda
    cp = strict_cuda
    rng = np.random.default_rng(0)
    B, T, H, D, S = 3, 5, 4, 8, 6
    qkv_h = rng.standard_normal((B, T, 3, H, D)).astype(dtype)
    qkv = cp.asarray(qkv_h)
    q, k = qkv[:, :, 0].transpose(0, 2, 1, 3), qkv[:, :, 1].transpose(0, 2, 1, 3)
    r_h = rng.standard_normal((S, H * D)).astype(dtype)
    r = cp.asarray(r_h).reshape(S, H, D).transpose(1, 2, 0)        # (H, D, S): column-major
    w_h = rng.standard_normal((7, H * D)).astype(dtype)
    w = cp.asarray(w_h)
    cases = [(q, k.swapaxes(-1, -2), (B, H, T, T)),                 # strided batch, T operand
             (q, r, (B, H, T, S)),                                  # broadcast over B
             (cp.asarray(qkv_h.reshape(B * T, -1))[:, :H * D], w.T, (B * T, 7))]  # 2-D, strided
    for a, b, shape in cases:
        out = cp.empty(shape, out_dtype)
        out_cols = cp.empty((shape[0], 2 * shape[-1]), out_dtype)[:, shape[-1]:] \
            if len(shape) == 2 else None
        cp.STATE.counting_outside, cp.STATE.outside = True, 0
        cuda.strided_matmul(a, b, out)
        assert cp.STATE.outside == 0                # no temporary of any size
        cp.STATE.counting_outside = False
        want = np.matmul(a.get().astype(np.float32), b.get().astype(np.float32))
        tol = 2e-3 if out_dtype == "float16" else 1e-5
        np.testing.assert_allclose(out.get().astype(np.float32), want, rtol=tol, atol=tol * 10)
        if out_cols is not None:    # a non-contiguous output: cuBLAS's ldc, no copy
            cuda.strided_matmul(a, b, out_cols)
            np.testing.assert_allclose(out_cols.get().astype(np.float32), want, rtol=tol,
                                       atol=tol * 10)


def test_cupys_own_half_matmul_allocates_float32_copies(strict_cuda):
    # what the stand-in reproduces (CuPy's matmul for > 2-D float16): the reason for cuda.py's
    cp = strict_cuda                # products
    a = cp.zeros((2, 3, 4, 5), np.float16)
    b = cp.zeros((2, 3, 5, 6), np.float16)
    out = cp.empty((2, 3, 4, 6), np.float16)
    cp.STATE.counting_outside, cp.STATE.outside = True, 0
    cp.matmul(a, b, out=out)
    assert cp.STATE.outside == 3                    # a and b as float32, the float32 product


# =====================================================================================================
# Transformer-XL
# =====================================================================================================
XL_CASE = ROOT / "weights" / "transfo_xl" / "adaptive_div4"
needs_xl = pytest.mark.skipif(not XL_CASE.is_dir(), reason="XL fixture missing")


def xl_segments(model):
    ids = np.arange(3, 27).reshape(2, 12) % model.config.vocab_size
    return ids[:, :6], ids[:, 6:]


@needs_xl
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("float16", 0.1)])
def test_xl_matches_the_cpu_with_memory_and_one_sync_per_call(strict_cuda, dtype, tol):
    # tol: absolute, on log-probabilities (float16 weights and activations)
    cpu = minfer.load(XL_CASE)
    m = minfer.load(XL_CASE, device="cuda", dtype=dtype)
    first, second = xl_segments(cpu)
    want_mem = cpu.new_memory(2)
    for seg in (first, second):
        want, want_mem = cpu.forward(seg, want_mem)
    mem = m.new_memory(2)

    def run():
        nonlocal mem
        out = [m.forward(seg, mem)[0] for seg in (first, second)]
        return out[-1]
    got, syncs, outside, peak = run_counted(strict_cuda, m, run)
    assert np.abs(got - want).max() < tol and syncs == 2 and outside == 0
    assert peak <= m.plan(batch=2, input_len=6)["peak"] - m.plan(batch=2, input_len=6)["memory"]
    np.testing.assert_allclose(mem.to_host(), want_mem.to_host(), atol=tol)   # on the host
    assert m.backend.arena.pool_peak <= SCOPE_TEMPORARIES + m.plan(batch=2, input_len=6)[
        "head_temporaries"]


@needs_xl
def test_xl_generation_and_scoring_match_the_cpu(strict_cuda):
    cpu = minfer.load(XL_CASE)
    m = minfer.load(XL_CASE, device="cuda", dtype="float32")
    prompt = xl_segments(cpu)[0][:1].tolist()
    want = cpu.generate(prompt, max_new_tokens=6, num_beams=3)
    got, _, outside, peak = run_counted(
        strict_cuda, m, lambda: m.generate(prompt, max_new_tokens=6, num_beams=3))
    assert got == want and outside == 0               # beams reorder the memory on the device
    assert peak <= m.plan(batch=3, input_len=5, max_new_tokens=6)["peak"]
    ids = list(np.arange(3, 60) % cpu.config.vocab_size)
    got, _, outside, peak = run_counted(strict_cuda, m, lambda: m.score(ids, segment_len=16))
    assert abs(got["log_likelihood"] - cpu.score(ids, segment_len=16)["log_likelihood"]) < 1e-3
    assert outside == 0 and peak <= m.plan(batch=1, input_len=16)["peak"]


@needs_xl
def test_xl_streams_under_a_memory_limit(strict_cuda):
    full = minfer.load(XL_CASE, device="cuda", dtype="float32")
    limit = 470_000                  # weights 192 KB; two slots, a 240 KB workspace, the pool
    m = minfer.load(XL_CASE, device="cuda", dtype="float32", memory_limit=limit,
                    workspace=240_000)
    assert m.weight_plan.streamed
    mem_a, mem_b = full.new_memory(2), m.new_memory(2)
    for seg in xl_segments(full):
        want, mem_a = full.forward(seg, mem_a)
        got, mem_b = m.forward(seg, mem_b)
        np.testing.assert_array_equal(got, want)
    assert m.backend.arena.stats().peak <= limit


def test_xl_float16_layer_norm_of_large_values_is_finite(strict_cuda):
    from minfer import ops
    cp = strict_cuda
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 3, 64)) * 1000).astype(np.float16)   # |x - mean| >> 256
    w, b = np.ones(64, np.float16), np.zeros(64, np.float16)
    got = ops.layer_norm(cp, cp.asarray(x), cp.asarray(w), cp.asarray(b), 1e-5).get()
    xf = x.astype(np.float64)
    want = (xf - xf.mean(-1, keepdims=True)) / np.sqrt(xf.var(-1, keepdims=True) + 1e-5)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.astype(np.float64), want, atol=5e-3)


# =====================================================================================================
# The T5 family's variants (LongT5's attention, UMT5's per-layer biases, UL2's shapes)
# =====================================================================================================
@pytest.mark.parametrize("case", ["longt5/local", "longt5/tglobal", "family/umt5_seq2seq",
                                  "family/ul2_shape"])
def test_t5_variants_on_the_device_path_match_the_cpu_within_their_plan(strict_cuda, case):
    folder = ROOT / "weights" / case
    ref = np.load(folder / "reference.npz")
    ids = ref["input_ids"]
    mask = ref["attention_mask"] if "attention_mask" in ref.files else np.ones_like(ids)
    cpu = minfer.load(folder)
    m = minfer.load(folder, device="cuda", dtype="float32")
    got, syncs, outside, peak = run_counted(strict_cuda, m, lambda: m.encode(ids, mask))
    want = cpu.encode(ids, mask)
    assert rel(got * mask[..., None], want * mask[..., None]) < 1e-5
    assert syncs == 1 and outside == 0
    assert peak <= m.plan(ids.shape[0], ids.shape[1])["encoder_scratch"]
    got, syncs, outside, peak = run_counted(
        strict_cuda, m, lambda: m.generate(ids, attention_mask=mask, max_new_tokens=4))
    assert got == cpu.generate(ids, attention_mask=mask, max_new_tokens=4) and outside == 0
    assert peak <= m.plan(ids.shape[0], ids.shape[1], 4)["peak"]


def test_steps_take_nothing_from_a_full_device_arena(strict_cuda, folder):
    # a compute scope carved its 64 KiB pool from the arena: with other requests holding all
    # but a little, a stacked step that "fitted" failed every request in it, and so did a state
    # stepped alone; the arena now holds that pool for good
    import contextlib

    from minfer.models.t5.buffers import StepScratch
    m = minfer.load(folder, device="cuda", dtype="float32")
    be = m.backend
    ids, mask = m.batch(IDS)
    with contextlib.ExitStack() as stack:
        s1 = stack.enter_context(m.start_decoding(ids, mask, 6))
        s2 = stack.enter_context(m.start_decoding(ids, mask, 6))
        keys = max(s1.buf.cross_k.shape[3], 1)
        need = StepScratch.nbytes(m.config, s1.batch + s2.batch, keys, be.dtype)
        filler = be.arena.hold({"x": ((be.arena.available - need - 1024,), np.uint8)})
        try:
            out = m.step_together([s1, s2], [s1.first_tokens, s2.first_tokens])   # stacked
            assert [o.shape for o in out] == [(2, 200), (2, 200)]
        finally:
            filler.release()
        filler = be.arena.hold({"x": ((be.arena.available - 1024,), np.uint8)})
        try:
            out = m.step_together([s1, s2], [s1.first_tokens[:2], s2.first_tokens[:2]])  # alone
            assert [o.shape for o in out] == [(2, 200), (2, 200)]
        finally:
            filler.release()
