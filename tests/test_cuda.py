"""The CUDA backend: half-precision model code (checked on NumPy everywhere) and real-GPU
comparisons with the NumPy backend that run only where CuPy finds a device."""
import json
from pathlib import Path

import numpy as np
import pytest
from factories import write_t5  # noqa: E402

import minfer
from minfer.arena import Arena
from minfer.backend import Backend
from minfer.devices import cuda_available
from minfer.io.checkpoint import Checkpoint
from minfer.models.t5 import T5Model
from minfer.models.t5 import math as t5_math

DEC = [[0, 3, 4, 9], [0, 5, 6, 7]]
IDS = [[5, 6, 7, 8, 1], [9, 10, 1]]


ROOT = Path(__file__).resolve().parents[1]


DATES = ROOT / "weights" / "tiny-t5-dates"


gpu = pytest.mark.skipif(not cuda_available(), reason="no CUDA device found by CuPy")


def half_model(folder):
    """The T5 model code over NumPy with float16 weights and activations: the GPU's default
    precision, minus the GPU."""
    be = Backend(xp=np, device="cpu", arena=Arena("64MiB", np), dtype=np.dtype(np.float16))
    return T5Model.load(Checkpoint(folder), be, tokenizer=minfer.load(folder).tokenizer)


@pytest.mark.skipif(not DATES.is_dir(), reason="shipped tiny-t5-dates missing")
def test_half_precision_model_code_keeps_greedy_outputs_and_close_logits():
    rows = [json.loads(line) for line in (DATES / "heldout.jsonl").read_text().splitlines()][::40]
    prompts = [r["prompt"] for r in rows]
    full, half = minfer.load(DATES), half_model(DATES)
    assert half.generate(prompts) == [r["target"] for r in rows] == full.generate(prompts)
    ids = full.batch([full.tokenizer.encode(p) for p in prompts])[0]
    dec = [[0] + full.tokenizer.encode(r["target"])[:-1] for r in rows]
    dec = full.batch(dec)[0]
    lf, lh = full.forward(ids, dec), half.forward(ids, dec)
    assert lh.dtype == np.float32  # returned to the host as float32
    assert np.abs(lh - lf).max() / np.abs(lf).max() < 2e-2


def test_half_precision_guard_clamps_only_once_an_inf_appears():
    # transformers' T5: clamp to +-(max - 1000) when the float16 stream holds an inf, else to
    # +-max (finite values untouched); decided on the device, no host sync
    lim = np.empty(2, np.float16)
    finite = np.array([[1.0, 65000.0, -65504.0]], np.float16)
    t5_math.clamp_if_inf(np, finite, lim)
    np.testing.assert_array_equal(finite, np.array([[1.0, 65000.0, -65504.0]], np.float16))
    with np.errstate(over="ignore"):
        x = np.array([[1.0, 65000.0, -np.inf]], np.float32).astype(np.float16)
    t5_math.clamp_if_inf(np, x, lim)
    bound = np.float16(t5_math.FP16_CLAMP)
    assert np.isfinite(x).all() and x[0, 1] == bound and x[0, 2] == -bound and x[0, 0] == 1


def test_half_precision_norm_does_not_overflow():
    from minfer import ops
    x = np.full((1, 64), 300.0, np.float16)  # sum of squares 5.76e6 > float16 max
    out = ops.rms_normalize(np, x, 1e-6, out=np.empty_like(x))
    np.testing.assert_allclose(out.astype(np.float32), 1.0, rtol=1e-3)


def test_half_precision_norm_keeps_the_input_dtype():
    # A float32 result would make the next product widen its float16 weight matrix (on CUDA, a
    # whole-head copy the workspace plan never counted).
    from minfer import ops
    x = np.random.default_rng(1).standard_normal((2, 3, 16)).astype(np.float16)
    got = ops.rms_normalize(np, x, 1e-6)
    assert got.dtype == np.float16
    xf = x.astype(np.float32)
    want = xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-3, atol=2e-3)
    assert ops.rms_norm(np, x, np.ones(16, np.float16), 1e-6).dtype == np.float16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_t5(tmp_path_factory.mktemp("gpu") / "m", seed=4, d_model=64, d_kv=16, num_heads=4,
                    d_ff=256, num_layers=3, num_decoder_layers=3, vocab_size=200)


@gpu
def test_cuda_float32_matches_numpy(folder):
    cpu, dev = minfer.load(folder), minfer.load(folder, device="cuda", dtype="float32")
    want, got = cpu.forward(IDS, DEC), dev.forward(IDS, DEC)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    assert dev.generate(IDS, max_new_tokens=8) == cpu.generate(IDS, max_new_tokens=8)


@gpu
def test_cuda_float16_is_close_to_numpy(folder):
    # (int8 against NumPy's int8 below: its quantisation error alone is ~6% on this model)
    want = minfer.load(folder).forward(IDS, DEC)
    got = minfer.load(folder, device="cuda", dtype="float16").forward(IDS, DEC)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2


@gpu
def test_cuda_streaming_under_a_limit_equals_the_resident_run(folder):
    resident = minfer.load(folder, device="cuda", dtype="float32")
    limited = minfer.load(folder, device="cuda", dtype="float32", memory_limit=1_000_000,
                          workspace=300_000)
    assert limited.weight_plan.streamed
    np.testing.assert_array_equal(limited.forward(IDS, DEC), resident.forward(IDS, DEC))
    arena = limited.backend.arena
    before = arena.used
    limited.generate(IDS, max_new_tokens=8)
    assert arena.used == before  # CuPy's temporaries went to the arena and came back
    assert arena.stats().peak <= 1_000_000


XL_CASE = ROOT / "weights" / "transfo_xl" / "adaptive_div4"


@gpu
@pytest.mark.skipif(not XL_CASE.is_dir(), reason="XL fixture missing")
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("float16", 0.1)])
def test_cuda_transformer_xl_matches_numpy(dtype, tol):
    cpu, dev = minfer.load(XL_CASE), minfer.load(XL_CASE, device="cuda", dtype=dtype)
    ids = np.arange(3, 27).reshape(2, 12) % cpu.config.vocab_size
    mem_a, mem_b = cpu.new_memory(2), dev.new_memory(2)
    for seg in (ids[:, :6], ids[:, 6:]):
        want, mem_a = cpu.forward(seg, mem_a)
        got, mem_b = dev.forward(seg, mem_b)
        assert np.abs(got - want).max() < tol
    np.testing.assert_allclose(mem_b.to_host(), mem_a.to_host(), atol=tol)
    prompt = ids[:1, :5].tolist()
    if dtype == "float32":
        assert dev.generate(prompt, max_new_tokens=6, num_beams=3) == \
            cpu.generate(prompt, max_new_tokens=6, num_beams=3)
    text = list(ids[0])
    assert abs(dev.score(text)["log_likelihood"] - cpu.score(text)["log_likelihood"]) < 50 * tol


@gpu
def test_cuda_int8_matches_numpy_int8(folder):
    want = minfer.load(folder, dtype="int8").forward(IDS, DEC)
    got = minfer.load(folder, device="cuda", dtype="int8").forward(IDS, DEC)
    assert np.isfinite(got).all() and np.abs(got - want).max() / np.abs(want).max() < 1e-2


T5_BASE = dict(vocab_size=32128, d_model=768, d_kv=64, num_heads=12, d_ff=3072, num_layers=12,
               num_decoder_layers=12)


@gpu
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_cuda_t5_base_sized_under_a_limit_equals_the_unlimited_run(tmp_path_factory, dtype):
    # a t5-base-shaped random model (0.9 GB in float32 on disk, written once per session)
    folder = tmp_path_factory.getbasetemp() / "t5-base-shaped"
    if not (folder / "model.safetensors").is_file():
        write_t5(folder, seed=1, **T5_BASE)
    full = minfer.load(folder, device="cuda", dtype=dtype)
    ids = [[5 + i for i in range(40)], [9, 10, 11, 1]]
    want = full.generate(ids, max_new_tokens=16, num_beams=2)
    weights = full.weight_plan.fixed + sum(full.weight_plan.unit_bytes.values())
    del full
    limit = weights // 3 + (96 << 20)
    limited = minfer.load(folder, device="cuda", dtype=dtype, memory_limit=limit,
                          workspace="96MiB")
    assert limited.weight_plan.streamed
    assert limited.generate(ids, max_new_tokens=16, num_beams=2) == want
    arena = limited.backend.arena
    assert arena.stats().peak <= limit and arena.pool_peak <= arena.capacity


@gpu
def test_cuda_encode_hands_torch_a_tensor_on_the_models_device(folder):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from minfer.integrations.diffusers import pipeline_inputs
    cpu, dev = minfer.load(folder), minfer.load(folder, device="cuda:0", dtype="float32")
    states = dev.encode(IDS, return_tensors="pt")
    assert states.device == torch.device("cuda", 0) and states.dtype == torch.float32
    want = cpu.encode(IDS)
    assert np.abs(states.cpu().numpy() - want).max() / np.abs(want).max() < 1e-4
    kept = states.clone()
    dev.encode([[7, 8, 9, 10, 11, 1]], return_tensors="pt")   # the arena reused: ours unchanged
    assert torch.equal(states, kept)
    raw = dev.encode(IDS, return_tensors="cupy")
    assert torch.equal(torch.from_dlpack(raw), states)
    kwargs = pipeline_inputs(dev, IDS, "chroma", max_sequence_length=8, dtype=torch.float16)
    assert {t.device for t in kwargs.values()} == {torch.device("cuda", 0)}
