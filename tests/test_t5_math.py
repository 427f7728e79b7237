"""T5's math (models/t5/math.py): position buckets, the causal table, one block for every pass."""
import numpy as np
import pytest
from factories import BASE, write_t5

import minfer
from minfer.models.t5 import math as t5
from minfer.models.t5.config import T5Config


@pytest.mark.parametrize("rel,bucket", [(0, 0), (-1, 1), (-8, 8), (-16, 10), (-32, 12), (-64, 14),
                                        (-128, 15), (-1000, 15), (1, 17), (8, 24), (16, 26),
                                        (32, 28), (64, 30), (128, 31), (5000, 31)])
def test_encoder_buckets(rel, bucket):
    assert t5.relative_bucket(np.array([rel]), True, 32, 128)[0] == bucket


@pytest.mark.parametrize("rel,bucket", [(-15, 15), (-16, 16), (-32, 21), (-64, 26), (-128, 31),
                                        (-4000, 31), (0, 0), (1, 0), (300, 0)])
def test_decoder_buckets(rel, bucket):
    assert t5.relative_bucket(np.array([rel]), False, 32, 128)[0] == bucket


def test_buckets_are_monotone_in_distance_and_in_range():
    rel = np.arange(-300, 301)
    for bidirectional in (True, False):
        for nb, md in ((32, 128), (8, 12), (16, 9)):
            b = t5.relative_bucket(rel, bidirectional, nb, md)
            assert b.min() >= 0 and b.max() < nb
            neg = b[rel <= 0][::-1]  # distance 0, 1, 2, ... to the past
            assert (np.diff(neg) >= 0).all()


def position_bias(cfg, rel_bias, q_len, k_len, bidirectional):
    """The reference: (H, T, S) bias of every (query, key) pair, rel_bias[bucket(key - query)]."""
    rel = np.arange(k_len)[None, :] - np.arange(q_len)[:, None]
    buckets = t5.relative_bucket(rel, bidirectional, cfg.num_buckets, cfg.max_distance)
    return rel_bias[buckets].transpose(2, 0, 1)


def test_causal_table_by_distance_gives_each_step_its_row():
    cfg = T5Config.from_hf(BASE)
    rng = np.random.default_rng(0)
    rel_bias = rng.standard_normal((cfg.num_buckets, cfg.num_heads)).astype(np.float32)
    max_len = 40
    table = t5.causal_bias_by_distance(cfg, rel_bias, max_len)
    full = position_bias(cfg, rel_bias, max_len, max_len, bidirectional=False)  # (H, T, T)
    for t in (0, 1, 7, 39):
        np.testing.assert_array_equal(table[:, max_len - 1 - t:], full[:, t, :t + 1])


class _HostBackend:
    def upload(self, dst, host):
        dst[...] = host


def test_position_bias_is_filled_into_its_buffer_a_head_at_a_time():
    """The (H, T, S) bias goes into the arena buffer without a host copy of its size, nor a (T,
    S) bucket matrix: what NumPy allocates is a row per head (T + S - 1 values) and the rows'
    buckets, plus one head (T, S) at a time when a mask is added (a 16-head, 256 x 256 fill
    allocated the whole 4 MiB (T, S, H) gather first, then a 512 KiB int64 bucket matrix and
    its 2 MiB of temporaries). Against the (T, S) definition, T = S and not."""
    import tracemalloc
    cfg = T5Config.from_hf({**BASE, "num_heads": 16})
    rng = np.random.default_rng(0)
    rel_bias = rng.standard_normal((cfg.num_buckets, 16)).astype(np.float32)
    for T, S in ((256, 256), (100, 300), (300, 7)):
        causal = np.triu(np.full((T, S), float(np.finfo(np.float16).min) * 2, np.float32), 1)
        for bidirectional, extra, dtype in ((True, None, np.float32), (False, causal, np.float16)):
            out = np.empty((16, T, S), dtype)
            tracemalloc.start()
            t5.fill_position_bias(_HostBackend(), out, cfg, rel_bias, bidirectional, extra)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            rows = (T + S - 1) * (16 * 4 + 12 * 8)   # the heads' rows + the buckets' int64 work
            assert peak < rows + (0 if extra is None else T * S * 4) + 4096, (T, S, peak)
            want = position_bias(cfg, rel_bias, T, S, bidirectional)
            if extra is not None:   # + the causal mask, clipped into float16's range
                info = np.finfo(np.float16)
                want = np.clip(want + extra, info.min, info.max)
            np.testing.assert_array_equal(out, want.astype(dtype))


@pytest.mark.parametrize("overrides", [{}, {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False},
                                       {"feed_forward_proj": "gated-silu"},
                                       {"num_layers": 3, "num_decoder_layers": 1, "d_kv": 5}])
def test_incremental_steps_equal_the_full_forward(tmp_path, overrides):
    model = minfer.load(write_t5(tmp_path / "m", seed=1, **overrides))
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 64, (2, 11))
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    dec = rng.integers(2, 64, (2, 20))
    dec[:, 0] = 0
    full = model.forward(ids, dec, mask)  # (B, T, V)
    with model.start_decoding(ids, mask, max_len=20) as state:
        for t in range(20):
            step = np.array(state.step(dec[:, t]))
            np.testing.assert_allclose(step, full[:, t], rtol=1e-5, atol=1e-5 * np.abs(full).max())


def test_the_encoder_pass_holds_no_bias_matrix():
    # the position bias is an (H, 2T - 1) table by distance (ops.distance_attention); only the
    # scores scratch is (B, H, T, T)-sized, where the array ops run the attention (two rounds of
    # heads: CUDA, or the CPU without the kernels); the CPU's kernels hold blocks of scores
    from minfer import kernels
    from minfer.models.t5.buffers import EncoderScratch
    cfg = T5Config.from_hf({**BASE, "num_heads": 5})
    B, T = 3, 64
    for on_host in (True, False, None):              # (None: a plan, for either)
        specs = EncoderScratch.specs(cfg, B, T, np.float32, "float32", on_host)
        big = {name for name, (shape, _) in specs.items() if np.prod(shape) >= B * 5 * T * T}
        assert big == (set() if on_host and kernels.max_threads() else {"scores"})
    assert specs["distance"][0] == (5, 2 * T - 1) and specs["mask"][0] == (B, T)
