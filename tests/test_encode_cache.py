"""The encoder-output cache (minfer/encoding/cache.py): hits give the bytes the miss computed,
LRU eviction within the byte budget, counters, threads, and the paths that use it (encode,
embed, generation's encoder pass)."""
import threading

import numpy as np
import pytest

import minfer
from minfer.encoding.cache import EncodeCache, row_key
from minfer.errors import ConfigError
from minfer.models.t5 import math as t5

TEXTS = ["a cat sat on the mat", "hi", "one two three four"]


@pytest.fixture(scope="module")
def folder(text_model_folder):   # (conftest's: the session's small T5 with the tiny tokenizer)
    return text_model_folder


@pytest.fixture
def counted(monkeypatch):
    """How many encoder passes ran (t5.encode calls)."""
    calls = []
    real = t5.encode
    monkeypatch.setattr(t5, "encode", lambda *a, **k: (calls.append(a[3].shape), real(*a, **k))[1])
    return calls


def test_a_hit_returns_the_bytes_of_the_miss(folder, counted):
    model = minfer.load(folder, encode_cache="16MiB")
    plain = minfer.load(folder)
    first = model.encode(TEXTS, preset="flux", max_length=10)
    runs = len(counted)
    again = model.encode(TEXTS, preset="flux", max_length=10)
    assert len(counted) == runs                       # no encoder pass for the repeat
    assert again.tobytes() == first.tobytes()
    np.testing.assert_allclose(first, plain.encode(TEXTS, preset="flux", max_length=10),
                               rtol=0, atol=1e-5)
    stats = model.encode_cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (3, 3, 3)
    assert stats.bytes == sum(3 * (10 * 32 * 4 + 256) for _ in [0])
    # a mix: the known rows from the cache, the new one alone through the encoder
    mixed = model.encode([TEXTS[1], "brand new words"], preset="flux", max_length=10)
    assert counted[-1] == (1, 10)
    assert mixed[0].tobytes() == first[1].tobytes()
    # another mask rule is another key: chroma masks the encoder, flux does not
    model.encode(TEXTS[1], preset="chroma", max_length=10)
    assert counted[-1] == (1, 10)


def test_own_tokens_are_keyed_whatever_the_padding(folder, counted):
    """padding_states=False (embed, /v1/encode, Wan): a text beside a longer one is the key it
    is alone; its own tokens' states are the bytes first computed, the padding's zeros."""
    model = minfer.load(folder, encode_cache="16MiB")
    plain = minfer.load(folder)
    alone = model.encode([TEXTS[1]], padding_states=False)            # (1, n, C): no padding
    runs = len(counted)
    both = model.encode([TEXTS[0], TEXTS[1]], padding_states=False)  # TEXTS[0] is longer
    assert counted[-1][0] == 1 and len(counted) == runs + 1          # only TEXTS[0] ran
    n = alone.shape[1]
    assert both[1, :n].tobytes() == alone[0].tobytes() and not both[1, n:].any()
    want = plain.encode([TEXTS[0], TEXTS[1]])
    np.testing.assert_allclose(both[1, :n], want[1, :n], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(plain.encode([TEXTS[0], TEXTS[1]], padding_states=False)[1, n:], 0)
    # the default keeps the padding's states, keyed with the padding: the padded row runs again
    # (the longest, unpadded, is the same key either way)
    runs = len(counted)
    full = model.encode([TEXTS[0], TEXTS[1]])
    assert counted[runs:] == [(1, full.shape[1])] and full[1, n:].any()


def test_lru_eviction_within_the_budget():
    row = np.ones((4, 8), np.float32)                 # 128 bytes + 256 counted per entry
    cache = EncodeCache(3 * 384)
    keys = [row_key("m", np.array([i]), np.array([1])) for i in range(4)]
    for k in keys[:3]:
        cache.put(k, row * 1)
    assert cache.get(keys[0]) is not None              # 0 is now the most recent
    cache.put(keys[3], row)                            # evicts 1, the least recently used
    assert cache.get(keys[1]) is None
    assert all(cache.get(k) is not None for k in (keys[0], keys[2], keys[3]))
    s = cache.stats()
    assert (s.entries, s.evicted, s.bytes, s.stored) == (3, 1, 3 * 384, 4)
    assert s.bytes <= s.budget
    cache.put(keys[0], np.ones((100, 8), np.float32))  # bigger than the budget: not kept
    assert cache.stats().bytes <= 3 * 384
    with pytest.raises(ValueError):
        cache.get(keys[2])[0, 0] = 5                   # stored rows are read-only


def test_keys_tell_models_ids_and_masks_apart():
    ids, ones = np.array([5, 6, 1]), np.ones(3, np.int64)
    base = row_key("a", ids, ones)
    assert base == row_key("a", ids.astype(np.int32), ones)
    assert base != row_key("b", ids, ones)
    assert base != row_key("a", np.array([5, 7, 1]), ones)
    assert base != row_key("a", ids, np.array([1, 1, 0]))


def test_budget_errors_are_one_line(folder):
    with pytest.raises(ConfigError, match="encode_cache: expected a size"):
        minfer.load(folder, encode_cache="lots")
    with pytest.raises(ConfigError, match="encode_cache: the budget must be positive"):
        minfer.load(folder, encode_cache=0)


def test_generation_and_embed_skip_the_encoder_on_repeats(folder, counted):
    model = minfer.load(folder, encode_cache="16MiB")
    plain = minfer.load(folder)
    want = plain.generate(TEXTS[:2], max_new_tokens=4, num_beams=2)
    sampled = plain.generate(TEXTS[:2], max_new_tokens=4, do_sample=True, seed=3)
    runs = len(counted)
    assert model.generate(TEXTS[:2], max_new_tokens=4, num_beams=2) == want
    assert len(counted) == runs + 1
    assert model.generate(TEXTS[:2], max_new_tokens=4, num_beams=2) == want
    assert model.generate(TEXTS[:2], max_new_tokens=4, do_sample=True, seed=3) == sampled
    assert len(counted) == runs + 1                    # both repeats from the cache
    # an unpadded encode of a prompt shares generation's key: one of its rows, as stored
    ids = model.tokenizer.encode(TEXTS[1])
    got = model.encode([ids])
    assert len(counted) == runs + 1
    np.testing.assert_allclose(got, plain.encode([ids]), rtol=0, atol=1e-5)
    n = len(counted)
    e1 = model.embed(TEXTS)
    assert len(counted) == n + 1
    assert model.embed(TEXTS).tobytes() == e1.tobytes() and len(counted) == n + 1


def test_a_mask_that_is_not_right_padding_skips_generations_cache():
    """A caller's left-padded mask: the unpadded key would name other tokens (and poison the
    rows of a prompt that equals them), so such a batch runs the encoder and keeps nothing."""
    dates = "weights/tiny-t5-dates"
    plain, cached = minfer.load(dates), minfer.load(dates, encode_cache="16MiB")
    pad, a = plain.token_ids.pad, plain.tokenizer.encode("date: 4th of July 1976")
    ids, mask = np.array([[pad, pad] + a]), np.array([[0, 0] + [1] * len(a)])
    want = plain.generate(ids, attention_mask=mask, max_new_tokens=12)
    for _ in range(2):
        assert cached.generate(ids, attention_mask=mask, max_new_tokens=12) == want
    assert cached.encode_cache.stats().entries == 0
    other = [[pad, pad] + a[:-2]]
    assert cached.generate(other, max_new_tokens=12) == plain.generate(other, max_new_tokens=12)


def test_threads_share_one_cache(folder):
    model = minfer.load(folder, encode_cache="16MiB")
    want = model.encode(TEXTS, preset="flux", max_length=10)
    errors, results = [], []

    def work():
        try:
            for _ in range(5):
                results.append(model.encode(TEXTS, preset="flux", max_length=10).tobytes())
        except Exception as e:   # pragma: no cover (reported below)
            errors.append(e)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 20 and set(results) == {want.tobytes()}
    assert model.encode_cache.stats().hits >= 60


def test_a_pickled_model_brings_its_own_cache(folder):
    import pickle
    model = minfer.load(folder, encode_cache="16MiB")
    model.encode(TEXTS)
    copy = pickle.loads(pickle.dumps(model))
    assert model.load_recipe["encode_cache"] == "16MiB"
    assert copy.encode_cache is not model.encode_cache and copy.encode_cache.budget == 16 << 20
    assert copy.encode_cache.stats().entries == 0     # a new, empty cache in the new process


def test_the_cuda_path_takes_cached_states_into_the_device_arena(strict_cuda, folder):
    # the strict CuPy stand-in (tests/strict_cupy.py): the upload of cached states and the host
    # copy kept after a miss go through the backend, as on a GPU
    model = minfer.load(folder, device="cuda", dtype="float32", encode_cache="16MiB")
    want = minfer.load(folder).generate(TEXTS[:2], max_new_tokens=4)
    assert model.generate(TEXTS[:2], max_new_tokens=4) == want
    hits = model.encode_cache.stats().hits
    assert model.generate(TEXTS[:2], max_new_tokens=4) == want
    assert model.encode_cache.stats().hits == hits + 2
    np.testing.assert_allclose(model.encode(TEXTS, preset="flux", max_length=8),
                               minfer.load(folder).encode(TEXTS, preset="flux", max_length=8),
                               rtol=0, atol=1e-5)
