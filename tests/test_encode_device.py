"""encode()'s states kept on a CUDA model's device (return_tensors "cupy" / "pt"): through the
strict CuPy stand-in (tests/strict_cupy.py), which counts the bytes copied each way, so "no host
copy of the states" and "a cache hit uploads once" are measured, not assumed; the states are
compared with the CPU model's. The real-GPU versions are in tests/test_cuda.py."""
import sys
import types

import numpy as np
import pytest

import minfer
from minfer.errors import InputError

TEXTS = ["a cat sat on the mat", "hi", "one two three four"]


@pytest.fixture(scope="module")
def folder(text_model_folder):   # (conftest's: the session's small T5 with the tiny tokenizer)
    return text_model_folder


@pytest.fixture(scope="module")
def cpu(folder):
    return minfer.load(folder)


def counted(cuda, work):
    """work() -> (its result, bytes device -> host, bytes host -> device)."""
    cuda.STATE.to_host = cuda.STATE.to_device = 0
    out = work()
    return out, cuda.STATE.to_host, cuda.STATE.to_device


def in_arena(model, array) -> bool:
    return np.shares_memory(array._a, model.backend.arena._raw._a)


def test_cupy_states_stay_on_the_device_in_memory_the_caller_owns(strict_cuda, folder, cpu):
    m = minfer.load(folder, device="cuda", dtype="float32")
    arena = m.backend.arena
    base, pooled = arena.used, strict_cuda.STATE.pools[0].used
    states, to_host, _ = counted(strict_cuda, lambda: m.encode(TEXTS, return_tensors="cupy"))
    assert isinstance(states, strict_cuda.ndarray) and states.dtype == np.float32
    # the one read back is the finiteness check's float32 sum: never the states themselves
    assert to_host == 4 and states.nbytes > 1000
    assert not in_arena(m, states) and arena.used == base
    assert strict_cuda.STATE.pools[0].used - pooled >= states.nbytes   # CuPy's own pool
    want = cpu.encode(TEXTS)
    kept = states.get()
    np.testing.assert_allclose(kept, want, rtol=0, atol=1e-5 * np.abs(want).max())
    m.encode(["other words entirely", "and more"], return_tensors="cupy")   # the arena reused
    np.testing.assert_array_equal(states.get(), kept)                     # ours unchanged


def test_float16_models_hand_over_float32_states(strict_cuda, folder, cpu):
    m = minfer.load(folder, device="cuda", dtype="float16")
    states, to_host, _ = counted(strict_cuda, lambda: m.encode(TEXTS, return_tensors="cupy"))
    want = cpu.encode(TEXTS)
    assert states.dtype == np.float32 and to_host == 4
    np.testing.assert_array_equal(states.get(), m.encode(TEXTS))   # the host path's values
    assert np.abs(states.get() - want).max() < 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("preset", ["wan", "chroma", "flux"])
def test_presets_and_masks_on_the_device_equal_the_host_path(strict_cuda, folder, preset):
    m = minfer.load(folder, device="cuda", dtype="float32")
    (states, mask), to_host, _ = counted(strict_cuda, lambda: m.encode(
        TEXTS, preset=preset, max_length=12, return_mask=True, return_tensors="cupy"))
    want_states, want_mask = m.encode(TEXTS, preset=preset, max_length=12, return_mask=True)
    assert isinstance(mask, strict_cuda.ndarray) and to_host == 4
    np.testing.assert_array_equal(states.get(), want_states)     # wan: the zeroed tail too
    np.testing.assert_array_equal(mask.get(), want_mask)
    if preset == "wan":
        assert (want_states[want_mask == 0] == 0).all() and (want_mask == 0).any()


def test_a_cache_hit_uploads_the_states_once(strict_cuda, folder):
    m = minfer.load(folder, device="cuda", dtype="float32", encode_cache="16MiB")
    miss = m.encode(TEXTS, return_tensors="cupy").get()
    hits = m.encode_cache.stats().hits
    states, to_host, to_device = counted(strict_cuda, lambda: m.encode(TEXTS, return_tensors="cupy"))
    assert m.encode_cache.stats().hits == hits + len(TEXTS)
    assert to_host == 0 and to_device == states.nbytes         # no pass: one upload, nothing back
    assert not in_arena(m, states)
    np.testing.assert_array_equal(states.get(), miss)            # a hit: the miss's bytes


def test_pt_hands_the_device_array_to_dlpack(strict_cuda, folder, monkeypatch):
    # no CUDA torch here: a stand-in torch records what from_dlpack was given
    handed = []
    fake = types.ModuleType("torch")
    fake.from_dlpack = lambda x: handed.append(x) or ("tensor", x)
    monkeypatch.setitem(sys.modules, "torch", fake)
    m = minfer.load(folder, device="cuda", dtype="float32")
    (states, mask), to_host, _ = counted(strict_cuda, lambda: m.encode(
        TEXTS, preset="ltx", max_length=12, return_mask=True, return_tensors="pt"))
    assert [type(x) for x in handed] == [strict_cuda.ndarray] * 2 and to_host == 4
    assert states == ("tensor", handed[0]) and mask == ("tensor", handed[1])
    np.testing.assert_array_equal(handed[0].get(), m.encode(TEXTS, preset="ltx", max_length=12))


def test_return_tensors_errors_are_one_line(cpu):
    with pytest.raises(InputError, match="'cupy' needs a model on a CUDA device"):
        cpu.encode(TEXTS, return_tensors="cupy")
    with pytest.raises(InputError, match="is not 'np', 'pt' or 'cupy'") as e:
        cpu.encode(TEXTS, return_tensors="tf")
    assert "\n" not in str(e.value)


def test_a_cpu_pass_writes_the_states_into_the_callers_array_not_the_arena(folder, cpu):
    # on the CPU the result is host memory already: the arena holds the pass's scratch only,
    # never a (B, T, C) copy of the states (8 MiB of a 512-token T5-XXL pass under a limit)
    from minfer.arena import bytes_needed
    from minfer.models.t5.buffers import encoder_scratch
    cfg, arena = cpu.config, cpu.backend.arena
    ids = np.arange(2, 26).reshape(3, 8)
    B, T = ids.shape
    arena.reset_peak()
    base = arena.used
    states = cpu.encode(ids, np.ones_like(ids))
    scratch = encoder_scratch(cfg).nbytes(cfg, B, T, np.float32)
    output = bytes_needed({"out": ((B, T, cfg.d_model), np.float32)})
    assert arena.stats().peak - base <= scratch           # the planned scratch, and no output
    assert cpu.plan(B, T)["encoder_scratch"] == scratch + output   # (the plan still counts it)
    assert states.shape == (B, T, cfg.d_model) and np.isfinite(states).all()


def test_a_second_devices_padding_is_zeroed_on_that_device(strict_cuda, folder):
    # Wan's zeroed tail ran on the thread's current device (0), not the model's
    m = minfer.load(folder, device="cuda:1", dtype="float32")
    states, mask = m.encode(["a cat sat on the mat", "hi"], preset="wan", max_length=12,
                            return_mask=True, return_tensors="cupy")
    with m.backend.on_device():
        host, kept = states.get(), mask.get()
    assert (host[kept == 0] == 0).all() and (host[kept == 1] != 0).any()
