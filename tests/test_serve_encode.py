"""POST /v1/encode on a real `minfer serve` process (127.0.0.1, a free port): states equal to
model.encode with the preset, base64 in each dtype, the cache hit seen in /metrics, the API key,
one-line JSON errors."""
import base64

import numpy as np
import pytest
from serve_process import serving

import minfer

KEY = "test-key-1234"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["a cat sat on the mat", "hi there", "one two three four"]


@pytest.fixture(scope="module")
def folder(text_model_folder):   # (conftest's: the session's small T5 with the tiny tokenizer)
    return text_model_folder


@pytest.fixture(scope="module")
def model(folder):
    return minfer.load(folder)


@pytest.fixture(scope="module")
def server(folder):
    with serving(folder, "--encode-cache", "64MiB", "--api-key", KEY) as s:
        with s.client() as http:   # the served name is --model's
            named = http.post("/v1/encode", json={"model": str(folder), "input": "x"},
                              headers=AUTH)
            assert named.status_code == 200, named.text
        yield s


def post(server, body, headers=AUTH):
    with server.client() as http:
        return http.post("/v1/encode", json=body, headers=headers)


def bf16_round(x):
    """float32 -> bfloat16's value, to nearest even (an independent bit computation)."""
    out = []
    for v in np.asarray(x, np.float32).ravel():
        b = int(np.float32(v).view(np.uint32))
        lower, upper = b & 0xFFFF, b >> 16
        if lower > 0x8000 or (lower == 0x8000 and upper & 1):
            upper += 1
        out.append(np.uint32(upper << 16).view(np.float32))
    return np.array(out, np.float32).reshape(np.shape(x))


def test_states_masks_and_usage_equal_model_encode(server, model):
    got = post(server, {"input": PROMPTS, "preset": "chroma", "max_length": 12})
    assert got.status_code == 200, got.text
    body = got.json()
    states, mask = model.encode(PROMPTS, preset="chroma", max_length=12, return_mask=True)
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
    for d, s, k in zip(body["data"], states, mask):
        assert d["object"] == "encoding" and d["shape"] == [12, 32] and d["dtype"] == "float32"
        np.testing.assert_allclose(np.array(d["states"], np.float32), s, rtol=0, atol=1e-5)
        assert d["attention_mask"] == k.tolist()
    tokens = sum(min(len(model.tokenizer.encode(p)), 12) for p in PROMPTS)   # cut at 12
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # no preset: each input's own tokens, a string input alone
    one = post(server, {"input": PROMPTS[2]}).json()["data"][0]
    n = len(model.tokenizer.encode(PROMPTS[2]))
    assert one["shape"] == [n, 32] and one["attention_mask"] == [1] * n
    np.testing.assert_allclose(np.array(one["states"]), model.encode(PROMPTS[2])[0], atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_base64_in_each_dtype(server, model, dtype):
    got = post(server, {"input": PROMPTS[:1], "preset": "flux", "max_length": 8, "dtype": dtype,
                        "encoding_format": "base64"}).json()["data"][0]
    want = model.encode(PROMPTS[:1], preset="flux", max_length=8)[0]
    raw = base64.b64decode(got["states"])
    if dtype == "float32":
        values = np.frombuffer(raw, "<f4")
        expect = want
    elif dtype == "float16":
        values = np.frombuffer(raw, "<f2").astype(np.float32)
        expect = want.astype(np.float16).astype(np.float32)
    else:
        values = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        expect = bf16_round(want)
    assert got["dtype"] == dtype and len(raw) == want.size * (4 if dtype == "float32" else 2)
    np.testing.assert_allclose(values.reshape(8, 32), expect, rtol=0,
                               atol=1e-5 if dtype == "float32" else 0.02)
    if dtype != "float32":   # the rounding itself: within one unit of the last place
        assert np.abs(values.reshape(8, 32) - expect).max() <= np.abs(expect).max() * 2 ** -7


def test_a_repeated_long_prompt_is_a_cache_hit(server, model):
    long_prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 80)
    body = {"input": long_prompt, "preset": "flux", "encoding_format": "base64"}
    first = post(server, body)
    before = server.metrics()
    second = post(server, body)
    after = server.metrics()
    assert first.status_code == second.status_code == 200
    assert second.content == first.content   # the whole answer, byte for byte
    assert second.json()["data"][0]["shape"] == [512, 32]
    raw = base64.b64decode(second.json()["data"][0]["states"])
    assert raw == model.encode(long_prompt, preset="flux")[0].astype("<f4").tobytes()
    assert after["minfer_encode_cache_hits_total"] == before["minfer_encode_cache_hits_total"] + 1
    assert after["minfer_encode_cache_misses_total"] == before["minfer_encode_cache_misses_total"]
    assert after["minfer_encode_cache_bytes"] >= 512 * 32 * 4
    assert after['minfer_requests_total{endpoint="encode",status="200"}'] >= 2


@pytest.mark.parametrize("fmt", ["base64", "float"])
def test_answers_from_the_cache_and_fresh_ones_mix_byte_for_byte(server, model, fmt):
    """A request of a cached input and a new one: the cached one's answer is its own alone
    request's, the new one's is computed; asked again, all from the cache, the same bytes."""
    known, new = f"a known prompt in {fmt}", f"a new prompt in {fmt}"
    body = {"preset": "sd3", "max_length": 16, "dtype": "bfloat16", "encoding_format": fmt}
    alone = post(server, {**body, "input": known})
    before = server.metrics()
    mixed = post(server, {**body, "input": [known, new]})
    middle = server.metrics()
    again = post(server, {**body, "input": [known, new]})
    after = server.metrics()
    assert alone.status_code == mixed.status_code == again.status_code == 200
    assert again.content == mixed.content
    hits, misses = "minfer_encode_cache_hits_total", "minfer_encode_cache_misses_total"
    assert middle[hits] - before[hits] == 1 and middle[misses] - before[misses] == 1
    assert after[hits] - middle[hits] == 2 and after[misses] == middle[misses]
    got = mixed.json()
    assert [d["index"] for d in got["data"]] == [0, 1]
    assert {**got["data"][0], "index": 0} == alone.json()["data"][0]
    assert {**got["data"][1], "index": 0} == post(server, {**body, "input": new}).json()["data"][0]
    tokens = sum(min(len(model.tokenizer.encode(t)), 16) for t in (known, new))
    assert got["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_errors_are_one_line_json(server):
    for body, param in (({"input": "x", "preset": "dalle"}, "preset"),
                        ({"input": "x", "dtype": "int8"}, "dtype"),
                        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
                        ({"input": "x", "max_length": 0}, "max_length"),
                        ({"preset": "flux"}, "input")):
        got = post(server, body)
        assert got.status_code == 400, got.text
        err = got.json()["error"]
        assert err["param"] == param and "\n" not in err["message"]
    too_long = post(server, {"input": "x", "max_length": 10 ** 6})
    assert too_long.status_code == 400 and "max_length" in too_long.json()["error"]["message"]
    assert post(server, {"input": "x"}, headers={}).status_code == 401


def test_float16_states_beyond_its_range_are_a_400_naming_dtype(model, monkeypatch):
    """States past 65504 would go out as infinities (base64) or fail the JSON (floats)."""
    import json

    from minfer.serve.encode import encode_request, run
    from minfer.serve.encode_passes import EncodePasses
    from minfer.serve.errors import from_exception
    from minfer.serve.jobs import Job
    from minfer.serve.schema import field_of
    real = model.encode
    monkeypatch.setattr(model, "encode", lambda *a, **k: (lambda s, m: (s * 1e6, m))(*real(*a, **k)))
    passes = EncodePasses(model)
    for dtype in ("float32", "bfloat16"):
        body, _ = run(Job(model), encode_request({"input": PROMPTS[:1], "dtype": dtype}, 8), 64,
                      passes, "m")
        assert np.abs(np.array(json.loads(body)["data"][0]["states"])).max() > 65504
    with pytest.raises(minfer.InputError) as e:
        run(Job(model), encode_request({"input": PROMPTS[:1], "dtype": "float16"}, 8), 64,
            passes, "m")
    error = from_exception(e.value, field_of(str(e.value), "input"))   # as the route maps it
    assert error.status == 400 and error.param == "dtype" and "65504" in error.message
