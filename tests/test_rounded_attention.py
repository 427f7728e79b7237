"""The encoder's attention with bfloat16 products (compute="bfloat16", issue 26): the compiled
kernel (kernels/pass_attention.py) against attention of the rounded inputs in float64, at the
edges of its blocks and panels; NaN, infinities and masked rows; thread counts; the NumPy path
computing the same function; the compiled attentions' scratch (sized for short inputs too,
nothing allocated on the host: the int8 and float32 kernels' too); which compute modes take
which attention (compute="int8"'s: test_int8_attention)."""
from __future__ import annotations

import tracemalloc

import numba
import numpy as np
import pytest
from conftest import compiled_then_array_path
from test_shipped_models import T5_DIR

import minfer
from minfer import kernels, ops
from minfer.kernels.attention_layout import AttentionShape
from minfer.models.t5.buffers import EncoderScratch
from minfer.products import round_to_bfloat16

k = kernels.active()
needs_kernels = pytest.mark.skipif(k is None, reason="numba not importable or MINFER_KERNELS=numpy")
rng = np.random.default_rng(2611)
MASKED = np.finfo(np.float32).min
# Against the float64 reference of the rounded inputs the kernel is within 1e-7 of the largest
# output, except where float32's sums, exponential or division move a weight across a bfloat16
# rounding boundary: one step, 2^-8 of that weight (1.7e-3 of the largest output seen over 20
# random cases). Typical outputs are far closer: `closer_to_rounded` checks that it is the
# rounded function, not float32 attention, that they follow.
TOLERANCE = 2.0 ** -8


def bf16(x):
    flat = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
    return round_to_bfloat16(np, flat).reshape(x.shape)


def reference(qkv, table, key_mask):
    """What the kernel computes, in float64: q, k, v rounded to bfloat16, softmax of the scores
    plus bias, the weights rounded to bfloat16, their product with v. ctx (B, T, H, D)."""
    B, T, _, H, D = qkv.shape
    r = bf16(qkv).astype(np.float64)
    q, kk, v = (r[:, :, j].transpose(0, 2, 1, 3) for j in range(3))
    idx = np.arange(T)[None, :] - np.arange(T)[:, None] + T - 1
    bias = table[:, idx].astype(np.float64)[None] + key_mask[:, None, None, :]
    s = q @ kk.swapaxes(-1, -2) + bias
    e = np.exp(s - s.max(-1, keepdims=True))
    w = bf16((e / e.sum(-1, keepdims=True)).astype(np.float32)).astype(np.float64)
    return (w @ v).transpose(0, 2, 1, 3)


def unrounded(qkv, table, key_mask):
    B, T, _, H, D = qkv.shape
    q, kk, v = (qkv.astype(np.float64)[:, :, j].transpose(0, 2, 1, 3) for j in range(3))
    idx = np.arange(T)[None, :] - np.arange(T)[:, None] + T - 1
    s = q @ kk.swapaxes(-1, -2)
    s += table[:, idx].astype(np.float64)[None] + key_mask[:, None, None, :]
    e = np.exp(s - s.max(-1, keepdims=True))
    return ((e / e.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3)


def closer_to_rounded(got, qkv, table, key_mask, want):
    """The median output's distance to the rounded reference is a tenth of its distance to
    float attention of the unrounded inputs or less."""
    far = np.median(np.abs(got - unrounded(qkv, table, key_mask)))
    return np.median(np.abs(got - want)) <= 0.1 * far


def case(B, H, T, D, shared=False):
    qkv = (rng.standard_normal((B, T, 3, H, D)) * 0.7).astype(np.float32)
    table = rng.standard_normal((1 if shared else H, 2 * T - 1)).astype(np.float32)
    key_mask = np.zeros((B, T), np.float32)
    key_mask[0, T // 2 + 1:] = MASKED                  # batch row 0 padded past its middle
    return qkv, table, key_mask


def run(qkv, table, key_mask, best=True, fill=0xFF, kind="bfloat16"):
    """The bfloat16 kernel (`best` False: the tiles of a CPU without AVX512_BF16) or, with
    `kind` "float32", the float32 one (test_float_attention)."""
    B, T, _, H, D = qkv.shape
    # the scratch full of garbage (0xFF: NaN as float32): every padding element the tiles read
    # must be written
    work = np.full(AttentionShape(B, H, T, T, D, numba.get_num_threads(), kind).nbytes(), fill,
                   np.uint8)
    ctx = np.full((B, T, H, D), np.nan, np.float32)
    if kind == "bfloat16":
        k.attend_bf16(qkv, table, key_mask, ctx, work, best)
    else:
        k.attend_f32(qkv, table, key_mask, ctx, work)
    return ctx


@needs_kernels
@pytest.mark.parametrize("B,H,T,D", [(2, 3, 5, 8), (1, 2, 67, 64), (2, 4, 130, 64), (1, 1, 33, 80),
                                     (3, 2, 64, 16), (1, 2, 1, 64), (1, 2, 200, 130), (2, 3, 7, 33),
                                     (1, 1, 17, 1)])
@pytest.mark.parametrize("best", [True, False])
def test_the_kernel_is_attention_of_the_rounded_inputs(B, H, T, D, best):
    # T across query blocks (64), key panels (64), tiles (4 rows) and steps (32); D odd, below a
    # step, across the value panels (64); the tiles the CPU has and the fallback's (AVX-512 F)
    qkv, table, key_mask = case(B, H, T, D)
    want = reference(qkv, table, key_mask)
    got = run(qkv, table, key_mask, best)
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()
    assert closer_to_rounded(got, qkv, table, key_mask, want)


@needs_kernels
def test_a_bias_row_shared_by_every_head_and_a_wholly_masked_batch_row():
    qkv, table, key_mask = case(2, 3, 20, 16, shared=True)
    key_mask[1] = MASKED                               # every key masked: uniform weights
    got = run(qkv, table, key_mask)
    want = reference(qkv, table, key_mask)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()


@needs_kernels
def test_nan_and_infinite_inputs_give_nan_rows_as_numpy():
    qkv, table, key_mask = case(1, 2, 9, 8)
    qkv[0, 3, 0, 0, 2] = np.nan                        # a query: its row of head 0
    qkv[0, 5, 0, 1, 1] = np.inf                        # a query of head 1: +inf scores
    got = run(qkv, table, key_mask)
    assert np.isnan(got[0, 3, 0]).all() and np.isnan(got[0, 5, 1]).all()
    others = np.ones((9, 2), bool)
    others[3, 0] = others[5, 1] = False
    assert np.isfinite(got[0][others]).all()


@needs_kernels
@pytest.mark.parametrize("kind", ["bfloat16", "float32"])
def test_every_thread_count_gives_the_same_bits(kind):
    qkv, table, key_mask = case(3, 5, 70, 24)
    before = numba.get_num_threads()
    try:
        outs = []
        most = numba.config.NUMBA_NUM_THREADS
        for n in sorted({1, min(2, most), most}):
            numba.set_num_threads(n)
            outs.append(run(qkv, table, key_mask, kind=kind))
    finally:
        numba.set_num_threads(before)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


KERNELS = {"bfloat16": "attend_bf16", "int8": "attend_i8",   # (the others' other tests:
           "float32": "attend_f32"}                          # test_int8_attention, test_float_attention)


@needs_kernels
@pytest.mark.parametrize("kind", KERNELS)
def test_a_warm_call_allocates_nothing_on_the_host(kind):
    qkv, table, key_mask = case(2, 4, 96, 64)
    B, T, _, H, D = qkv.shape
    attend = getattr(k, KERNELS[kind])
    work = np.empty(AttentionShape(B, H, T, T, D, numba.get_num_threads(), kind).nbytes(), np.uint8)
    ctx = np.empty((B, T, H, D), np.float32)
    attend(qkv, table, key_mask, ctx, work)
    tracemalloc.start()
    try:
        attend(qkv, table, key_mask, ctx, work)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 10, peak                       # the scores alone would be 288 KiB


@needs_kernels
@pytest.mark.parametrize("kind", KERNELS)
def test_a_short_scratch_is_a_clear_error(kind):
    qkv, table, key_mask = case(1, 2, 9, 8)
    attend = getattr(k, KERNELS[kind])
    shape = AttentionShape(1, 2, 9, 9, 8, numba.get_num_threads(), kind)
    with pytest.raises(ValueError, match=f"{kind} attention: the scratch holds"):
        attend(qkv, table, key_mask, np.empty((1, 9, 2, 8), np.float32),
               np.empty(shape.nbytes() - 64, np.uint8))
    with pytest.raises(ValueError, match=f"{KERNELS[kind]}: table"):
        attend(qkv, table[:, 1:], key_mask, np.empty((1, 9, 2, 8), np.float32),
               np.empty(shape.nbytes(), np.uint8))


@pytest.mark.parametrize("T", [1, 3, 40, 130])
def test_the_numpy_path_computes_what_the_kernel_does(T, monkeypatch):
    """ops.rounded_distance_attention without the kernels: q|k|v rounded in place, the weights
    rounded after the softmax, float32 products of the rounded values (each pair's product
    exact): the kernel's function up to the order of the sums. Each path in the scratch
    `distance_scratch` sizes for it, a 1-token input's too."""
    B, H, D = 2, 3, 64
    qkv, table, key_mask = case(B, H, T, D)
    want = reference(qkv, table, key_mask)
    bias = ops.DistanceBias(table, key_mask)
    stats = tuple(np.empty((B, H, T, 1), np.float32) for _ in range(2))
    results = []
    for _ in compiled_then_array_path(monkeypatch):
        scores = np.full(ops.distance_scratch(B, H, T, D, 4, "bfloat16"), np.nan, np.float32)
        ctx = np.full((B, T, H, D), np.nan, np.float32)
        ops.rounded_distance_attention(np, qkv.copy(), bias, scores, ctx, stats)
        assert np.abs(ctx - want).max() <= TOLERANCE * np.abs(want).max()
        assert closer_to_rounded(ctx, qkv, table, key_mask, want)
        results.append(ctx)
    if len(results) == 2:
        assert np.abs(results[0] - results[1]).max() <= TOLERANCE * np.abs(want).max()


def test_the_encoder_scratch_is_sized_for_the_attention_its_compute_mode_runs():
    """With the kernels: a rounding mode, the packed q|k|v of pass_attention; float32, the
    per-thread blocks of pass_attention_float; both linear in T (T5-XXL's 64 heads over 512
    tokens: a fifth of the scores in bfloat16), short inputs (packing more than scoring)
    included, and room for one (batch row, head) of distance_attention's scores and bias (the
    path where the kernels do not run after all). Without the kernels, and on CUDA, the scores
    of `distance_attention`; a plan (where the pass runs unknown) the larger of the two."""
    cfg = minfer.load(T5_DIR).config
    H, D = cfg.num_heads, cfg.d_kv
    threads = kernels.max_threads()
    for T in (1, 2, 7, 64, 300):
        scores = ops.distance_scores(3, H, T, T)
        assert EncoderScratch.specs(cfg, 3, T, np.float32, "float32", False)["scores"][0][0] == scores
        host = EncoderScratch.specs(cfg, 3, T, np.float32, "float32", True)["scores"][0][0]
        plan = EncoderScratch.specs(cfg, 3, T, np.float32, "float32")["scores"][0][0]
        assert plan == max(host, scores)
        for compute, kind in (("float32", "float32"), ("bfloat16", "bfloat16"), ("int8", "int8")):
            elements = EncoderScratch.specs(cfg, 3, T, np.float32, compute, True)["scores"][0][0]
            if threads:
                assert elements * 4 >= AttentionShape(3, H, T, T, D, threads, kind).nbytes()
                assert elements >= 2 * T * T
            else:
                assert elements == scores
    # T5-XXL's encoder (64 heads of 64) over 512 tokens, 2 threads: 0.75 MiB in either kind
    # against 64 MiB, whatever the batch
    for kind in KERNELS:
        one = AttentionShape(1, 64, 512, 512, 64, 2, kind).nbytes()
        assert one * 64 < ops.distance_scores(1, 64, 512, 512) * 4
        assert AttentionShape(8, 64, 512, 512, 64, 2, kind).nbytes() == one


ATTENTIONS = ("rounded_distance_attention", "quantised_distance_attention",
              "float_distance_attention", "distance_attention")


@pytest.mark.parametrize("dtype,compute,attention", [
    (None, None, "float_distance_attention"), ("bfloat16", "bfloat16", "rounded_distance_attention"),
    ("int8", "int8", "quantised_distance_attention"), ("bfloat16", "float32", "float_distance_attention")])
def test_which_attention_each_compute_mode_takes(dtype, compute, attention, monkeypatch):
    calls = {name: 0 for name in ATTENTIONS}
    for name in ATTENTIONS:
        def counted(*a, real=getattr(ops, name), name=name, **kw):
            calls[name] += 1
            return real(*a, **kw)
        monkeypatch.setattr(ops, name, counted)
    m = minfer.load(T5_DIR, dtype=dtype, compute=compute)
    states = m.encode(["translate: 3 May 1999", "hello"])
    assert np.isfinite(states).all()
    assert calls[attention] == m.config.num_layers
    # (distance_attention: what the others run where the kernels do not)
    assert all(calls[name] == 0 for name in ATTENTIONS[:3] if name != attention)


@needs_kernels
def test_umt5s_per_layer_bias_tables_through_the_kernel(monkeypatch):
    """UMT5 refills the distance table every layer, and a padded batch: the kernel path equals
    the NumPy path (6e-8 of the largest state measured) and stays near float32 compute of the
    same weights (1.3e-2 measured on this 16-channel random fixture)."""
    from conftest import rel_err
    from test_family_parity import FIXTURES, reference
    ref = reference("umt5_encoder")
    ids, mask = ref["input_ids"], ref["attention_mask"]
    assert not mask.all()

    def states(compute):
        m = minfer.load(FIXTURES / "umt5_encoder", dtype="bfloat16", compute=compute)
        return m.encode(ids, attention_mask=mask)
    fast, float32 = states("bfloat16"), states("float32")
    monkeypatch.setattr(kernels, "_mode", "numpy")
    slow = states("bfloat16")
    assert rel_err(fast, slow) < 1e-5
    assert 0 < rel_err(fast, float32) < 5e-2
