"""Transformer-XL's math (models/transfo_xl/math.py): rel_shift, masks, the relative-key tables."""
import numpy as np
import pytest

from minfer.models.transfo_xl import math as xl
from minfer.models.transfo_xl.config import XLConfig


@pytest.mark.parametrize("T,M", [(1, 0), (4, 0), (4, 3), (5, 9), (7, 2)])
def test_rel_shift_equals_the_naive_loop(T, M):
    K = M + T
    x = np.random.default_rng(T * 10 + M).standard_normal((2, 3, T, K)).astype(np.float32)
    got = xl.rel_shift(np, x)
    for i in range(T):
        for j in range(K):
            if j <= i + M:  # every key the query may see
                assert got[..., i, j].tolist() == x[..., i, j + T - 1 - i].tolist()


def test_attention_mask_same_length():
    cfg = XLConfig.from_hf({"model_type": "transfo-xl", "vocab_size": 10, "cutoffs": [],
                               "div_val": 1, "d_model": 4, "n_head": 1, "d_head": 4,
                               "d_inner": 4, "n_layer": 1, "mem_len": 3, "same_length": True})
    m = xl.attention_mask(cfg, qlen=3, mlen=3)  # (3, 6)
    # query i sits at key position 3+i; with same_length every query sees the same number
    # (mem_len) of keys ending at itself: i+1 .. i+3
    assert m.tolist() == [[True, False, False, False, True, True],
                          [True, True, False, False, False, True],
                          [True, True, True, False, False, False]]
    plain = xl.attention_mask(cfg.__class__(**{**cfg.__dict__, "same_length": False}), 3, 3)
    assert not plain[:, :4].any() and plain[0, 4:].all()
