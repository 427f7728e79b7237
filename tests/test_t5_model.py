"""T5's public class (models/t5/model.py): decode states in the arena, generation defaults."""
import json

import numpy as np
import pytest
from factories import write_t5

import minfer
from minfer.errors import InputError
from minfer.models.t5 import math as t5


def test_generation_uses_the_arena_and_gives_it_back(tmp_path, monkeypatch):
    model = minfer.load(write_t5(tmp_path / "m", seed=2), workspace="4MiB")
    arena = model.backend.arena
    calls = []
    real_cross_kv = t5.cross_kv
    monkeypatch.setattr(t5, "cross_kv", lambda *a, **k: (calls.append(1), real_cross_kv(*a, **k)))
    arena.reset_peak()
    before = arena.stats()
    out = model.generate([[3, 4, 5, 6, 1], [7, 8, 1]], max_new_tokens=30, min_new_tokens=30)
    after = arena.stats()
    assert [len(r) for r in out] == [31, 31]
    assert after.used == before.used  # everything released
    plan = model.plan(batch=2, input_len=5, max_new_tokens=30)
    assert after.peak >= plan["decode_state"]  # the KV caches and cross K/V lived in the arena
    assert after.peak <= plan["peak"]
    assert len(calls) == 1  # cross K/V computed once per encode, not per step


def test_decode_steps_do_not_grow_the_arena(tmp_path):
    model = minfer.load(write_t5(tmp_path / "m"))
    ids, mask = np.array([[3, 4, 5, 1]]), np.ones((1, 4), int)
    with model.start_decoding(ids, mask, max_len=8) as state:
        used = model.backend.arena.used
        for t in range(8):
            state.step(np.array([t + 2]))
            assert model.backend.arena.used == used


@pytest.mark.parametrize("options,needle", [({"max_new_tokens": 0}, "max_new_tokens"),
                                            ({"max_new_tokens": 2.5}, "max_new_tokens"),
                                            ({"min_new_tokens": -1}, "min_new_tokens")])
def test_bad_generation_options_are_named(tmp_path, options, needle):
    model = minfer.load(write_t5(tmp_path / "m"))
    with pytest.raises(InputError, match=needle):
        model.generate([[3, 4, 1]], **options)


def test_generation_config_sets_the_default_length(tmp_path):
    folder = write_t5(tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4}))
    model = minfer.load(folder)
    out = model.generate([[3, 4, 1]], min_new_tokens=4)
    assert len(out[0]) == 5


def test_a_reorder_in_a_full_arena_moves_the_caches_through_the_states_own_scratch(folder,
                                                                                   monkeypatch):
    # the NumPy (and device) reorder took one layer's scratch from the arena: under concurrency
    # the arena can be full by then, and the step that reordered failed another request
    from minfer import kernels
    from factories import IDS
    monkeypatch.setattr(kernels, "_mode", "numpy")
    m = minfer.load(folder)
    ids, mask = m.batch(IDS)
    results = []
    for fill in (False, True):
        with m.start_decoding(ids, mask, max_len=8, repeat=2) as state:
            tokens = np.array([3, 4, 5, 6])
            for _ in range(3):
                tokens = state.step(tokens).argmax(-1)
            hold = None
            if fill:     # every byte the arena has left goes to someone else
                room = m.backend.arena.available - m.backend.arena.alignment
                hold = m.backend.arena.hold({"x": ((room,), np.uint8)})
            state.reorder(np.array([3, 0, 0, 2]))
            if hold is not None:
                hold.release()
            results.append(state.step(tokens[[3, 0, 0, 2]]).copy())
    np.testing.assert_array_equal(results[0], results[1])


def test_encode_of_a_huge_text_cut_to_max_length_reads_only_what_it_keeps(text_model, monkeypatch):
    # encode(text, max_length, truncation) tokenized the whole text first (1.7 s for 2.3 MB)
    tok = text_model.tokenizer
    words = " ".join(["date:", "1999", "and", "more", "words", "spell:", "1234"] * 3000)
    full = tok.encode(words)
    got = text_model.encode(words, padding="max_length", max_length=24, truncation=True)
    want = text_model.encode([full[:23] + full[-1:]])
    np.testing.assert_array_equal(got, want)
    longest = []
    real = type(tok)._encode
    monkeypatch.setattr(type(tok), "_encode", lambda self, text: (longest.append(len(text)),
                                                                   real(self, text))[1])
    huge = words * 200                                   # ~7 MB
    text_model.encode(huge, max_length=24, truncation=True)
    with pytest.raises(InputError, match="more than max_length 24"):
        text_model.encode(huge, max_length=24)
    assert max(longest) < 100_000


def test_beams_share_their_inputs_cross_keys_and_values(tmp_path):
    """A decode state of B inputs x `repeat` rows holds the cross-attention K/V once per input
    (every row reads its input's, `cross_rows`, which follows the rows through reorders):
    (repeat - 1) / repeat of that memory less than a copy a row. Beam search over a batch whose
    rows finish apart (reorders that drop inputs) keeps the answers of each input alone."""
    from minfer.models.t5.buffers import DecodeBuffers
    folder = write_t5(tmp_path / "m", seed=5, num_layers=2, num_decoder_layers=2)
    m = minfer.load(folder)
    ids, mask = m.batch([[5, 6, 7, 8, 1], [9, 10, 1]])
    B, S, N, repeat = 2, ids.shape[1], 6, 3
    with m.start_decoding(ids, mask, N, repeat=repeat) as state:
        assert state.buf.cross_k.shape[1] == B and list(state.buf.cross_rows) == [0, 0, 0, 1, 1, 1]
        state.step(state.first_tokens)
        state.reorder([3, 4, 1])          # rows of the second input, then one of the first
        assert list(state.live.cross_rows) == [1, 1, 0]
    cfg, dtype = m.config, m.backend.dtype
    shared = DecodeBuffers.nbytes(cfg, B * repeat, S, N, dtype, B)
    copied = DecodeBuffers.nbytes(cfg, B * repeat, S, N, dtype)
    L, H, D = cfg.num_decoder_layers, cfg.num_heads, cfg.d_kv
    assert copied - shared >= 2 * L * (B * repeat - B) * H * S * D * np.dtype(dtype).itemsize
    beams, rows = m.plan(B * repeat, S, N, repeat=repeat), m.plan(B * repeat, S, N)
    assert beams["decode_state"] == shared and rows["decode_state"] == copied
    assert beams["peak"] < rows["peak"]           # (and the encoder runs for B prompts only)
    with pytest.raises(InputError, match="batch 5 is not a whole number of prompts of repeat 3"):
        m.plan(5, S, N, repeat=3)
    prompts = [[5, 6, 7, 8, 1], [9, 10, 1], [11, 12, 13, 1]]
    kw = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2)
    together = m.generate(prompts, **kw)
    assert together == [seq for p in prompts for seq in m.generate([p], **kw)]   # (2 a prompt)
