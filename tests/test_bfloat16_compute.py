"""`compute="bfloat16"` (issue 26) through the whole model: agreement with float32 on the shipped
trained models' held-out prompts, encoder states on the parity fixtures, the NumPy path computing
the same function, the rounding itself, when it is the default, its errors, no host temporaries,
the CLI."""
from __future__ import annotations

import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from conftest import T5_CASES, T5_FIXTURES, load_reference, rel_err
from factories import IDS
from test_shipped_models import T5_DIR, XL_DIR, predictions, read_jsonl

import minfer
from minfer import kernels
from minfer.io.formats import FORMATS
from minfer.products import PackedWeight, round_to_bfloat16, wrap

rng = np.random.default_rng(26)


def test_t5_heldout_prompts_agree_with_float32():
    prompts = [r["prompt"] for r in read_jsonl(T5_DIR / "heldout.jsonl")]
    want = minfer.load(T5_DIR).generate(prompts)
    m = minfer.load(T5_DIR, dtype="bfloat16", compute="bfloat16")
    assert (m.backend.weight_format, m.backend.compute) == ("bfloat16", "bfloat16")
    got = m.generate(prompts)
    assert len(prompts) == 800 and np.mean([g == w for g, w in zip(got, want)]) >= 0.99


def test_xl_heldout_rows_agree_with_float32():
    float32 = minfer.load(XL_DIR)
    rows = read_jsonl(XL_DIR / "heldout.jsonl")
    for r in rows:
        r["ids"] = float32.tokenizer.encode(r["text"], add_eos=False)
    m = minfer.load(XL_DIR, dtype="bfloat16", compute="bfloat16")
    got, want = predictions(m, rows), predictions(float32, rows)
    assert len(rows) == 500 and np.mean([g == w for g, w in zip(got, want)]) >= 0.97


def test_trained_t5_encoder_states_stay_within_1e_2_of_float32():
    """The issue's bound, relative to the largest state, against float32 compute on the same
    bfloat16 weights (the weights' own rounding is dtype="bfloat16"'s, not the compute mode's)."""
    prompts = [r["prompt"] for r in read_jsonl(T5_DIR / "heldout.jsonl")][:64]
    want = minfer.load(T5_DIR, dtype="bfloat16", compute="float32").encode(prompts)
    got = minfer.load(T5_DIR, dtype="bfloat16", compute="bfloat16").encode(prompts)
    assert 0 < rel_err(got, want) < 1e-2


# The parity fixtures are random T5s of 24-32 channels, the worst case for any rounding (their
# bfloat16 weights alone move the states by 3-4%): rounding the products' inputs moves the
# encoder states by 0.7-3.0% of the largest and the logits by 1.4-7.8% (measured against
# float32 compute on the same weights, kernels and NumPy alike). What must hold: it stays at
# that level and nothing blows up.
@pytest.mark.parametrize("case", T5_CASES)
def test_parity_fixture_states_stay_near_float32_compute(case):
    ref = load_reference(case)
    ids, mask, dec = ref["input_ids"], ref["attention_mask"], ref["decoder_input_ids"]
    float32 = minfer.load(T5_FIXTURES / case, dtype="bfloat16", compute="float32")
    both = minfer.load(T5_FIXTURES / case, dtype="bfloat16", compute="bfloat16")
    assert 0 < rel_err(both.encode(ids, attention_mask=mask),
                       float32.encode(ids, attention_mask=mask)) < 5e-2
    logits = both.forward(ids, dec, mask)
    assert np.isfinite(logits).all() and rel_err(logits, float32.forward(ids, dec, mask)) < 0.12


def test_the_numpy_path_computes_what_the_kernels_do(monkeypatch):
    """Kernels off: the same rounding, the product in float32 (bfloat16 pairs multiply exactly
    in float32; only the order of the sums differs: test_products_round_their_inputs checks
    each product). Rounding is a step function, so float32-level differences upstream (the
    kernels' RMS norm) move a few inputs by one bfloat16 step: the states of the two paths
    differ by 8e-4 of the largest (measured), a seventh of what the mode itself moves them."""
    ids = [[5 + (i * 7 + j) % 90 for j in range(40 + 9 * i)] for i in range(3)]
    fast = minfer.load(T5_DIR, dtype="bfloat16", compute="bfloat16")
    assert kernels.active() is not None
    want = fast.encode(ids)
    monkeypatch.setattr(kernels, "_mode", "numpy")
    slow = minfer.load(T5_DIR, dtype="bfloat16", compute="bfloat16")
    assert all(not isinstance(p, PackedWeight) or p.rounded_kernel is None
               for p in slow.params["encoder"][0].params.values())
    assert rel_err(slow.encode(ids), want) < 2e-3


def test_rounding_is_to_nearest_even_and_keeps_nan_and_inf():
    one = np.float32(1.0)
    step = np.float32(2.0 ** -7)                  # bfloat16's spacing just above 1
    x = np.array([[one + step / 2,                # a tie, 1 is even: down
                   one + step * 1.5,              # a tie, 1 + 2 steps is even: up
                   one + step / 2 + np.float32(2.0 ** -20),   # above the tie: up
                   -(one + step / 2), np.inf, -np.inf, np.nan,
                   np.float32(3.4e38)]], np.float32)          # past bfloat16's largest: inf
    got = round_to_bfloat16(np, x)[0]
    assert list(got[:4]) == [one, one + 2 * step, one + step, -one]
    assert got[4] == np.inf and got[5] == -np.inf and np.isnan(got[6]) and got[7] == np.inf
    wide = rng.standard_normal((4, 1000)).astype(np.float32)
    back = round_to_bfloat16(np, wide)
    assert (back.view(np.uint32) & 0xFFFF == 0).all()
    assert (np.abs(back - wide) <= np.abs(wide) * 2.0 ** -8).all()


@pytest.mark.parametrize("M", [1, 5, 70, 300])
def test_products_round_their_inputs_and_allocate_no_temporaries(M):
    """Every row count (the kernels' tiles, or rows in parts when the scratch holds fewer) gives
    the product of the rounded inputs with the stored weights; a warm product allocates no host
    buffer (the rounded inputs go into the runtime's scratch)."""
    N, K = 96, 512
    fmt = FORMATS["bfloat16"]
    w = rng.standard_normal((N, K)).astype(np.float32)
    arrays = fmt.encode("w", w)
    scratch = np.empty(K * 40, np.float32)       # holds 80 rounded rows: 300 go in parts
    packed = wrap(fmt, "w", arrays, np.float32, scratch, kernels.compiled(), compute="bfloat16")
    assert isinstance(packed, PackedWeight) and packed.rounded_kernel is not None
    stored = np.empty_like(w)
    packed.widen(packed.bits, stored)
    x = rng.standard_normal((M, K)).astype(np.float32)
    want = round_to_bfloat16(np, x).astype(np.float64) @ stored.T.astype(np.float64)
    out = np.full((M, N), np.nan, np.float32)
    packed.matmul(np, x, out)
    assert np.abs(out - want).max() < 1e-4 * np.abs(want).max()
    tracemalloc.start()
    try:
        packed.matmul(np, x, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 10, peak                 # x alone is M * 2 KiB


def test_which_compute_a_load_gets():
    native = kernels.bfloat16_native()
    assert native == ("avx512_bf16" in open("/proc/cpuinfo").read() and kernels.active() is not None)
    m = minfer.load(T5_DIR, dtype="bfloat16")    # the default for bfloat16 weights
    assert m.backend.compute == ("bfloat16" if native else "float32")
    m = minfer.load(T5_DIR, compute="bfloat16")  # dtype unset: stores bfloat16
    assert (m.backend.weight_format, m.backend.compute) == ("bfloat16", "bfloat16")
    m = minfer.load(T5_DIR, dtype="bfloat16", compute="float32")
    assert m.backend.compute == "float32"
    assert minfer.load(T5_DIR).backend.compute == "float32"
    with pytest.raises(minfer.ConfigError, match=r"compute='bfloat16' multiplies bfloat16 "
                                                 r"or fp8 weights, not dtype 'int8'"):
        minfer.load(T5_DIR, dtype="int8", compute="bfloat16")


def test_cli_compute_bfloat16_and_info_line():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "minfer", *args], capture_output=True,
                              text=True, timeout=300)
    proc = run("generate", "--model", str(T5_DIR), "--compute", "bfloat16", "date: 4th of July 1976")
    assert proc.returncode == 0 and proc.stdout.strip() == "1976-07-04", proc.stderr
    proc = run("info", "--model", str(T5_DIR), "--compute", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("compute"))
    assert line.split(None, 1)[1].strip() == f"bfloat16 x bfloat16 products: {kernels.bfloat16_instructions()}"
    proc = run("info", "--model", str(T5_DIR), "--dtype", "float32", "--compute", "bfloat16")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "compute='bfloat16' multiplies bfloat16 or fp8 weights" in proc.stderr


def test_under_a_memory_limit_streamed_layers_give_the_unlimited_ids(folder):
    full = minfer.load(folder, dtype="bfloat16", compute="bfloat16")
    want = full.generate(IDS, max_new_tokens=8, min_new_tokens=8)
    weights = full.weight_plan.fixed + sum(full.weight_plan.unit_bytes.values())
    m = minfer.load(folder, dtype="bfloat16", compute="bfloat16", memory_limit=weights + 200_000,
                    workspace=300_000)
    assert m.weight_plan.streamed and m.backend.compute == "bfloat16"
    assert m.generate(IDS, max_new_tokens=8, min_new_tokens=8) == want
    assert m.backend.arena.stats().peak <= m.backend.memory_limit


def test_a_default_bfloat16_compute_travels_with_the_model():
    """Chosen by this CPU's features, it is recorded: a pickled copy on a CPU without
    AVX512_BF16 computes the same function instead of falling back to float32."""
    import pickle
    m = minfer.load(T5_DIR, dtype="bfloat16")
    assert m.load_recipe["compute"] == ("bfloat16" if kernels.bfloat16_native() else None)
    back = pickle.loads(pickle.dumps(m))
    assert back.backend.compute == m.backend.compute


def test_a_quantised_checkpoint_is_not_rounded_again_to_bfloat16(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "minfer", "convert", "--model", str(T5_DIR),
                           "--output", str(tmp_path / "q8"), "--dtype", "int8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for dtype in (None, "auto"):
        with pytest.raises(minfer.ConfigError, match="stores int8: use compute='int8'"):
            minfer.load(tmp_path / "q8", dtype=dtype, compute="bfloat16")
    m = minfer.load(tmp_path / "q8", dtype="bfloat16", compute="bfloat16")   # asked: widened
    assert (m.backend.weight_format, m.backend.compute) == ("bfloat16", "bfloat16")
