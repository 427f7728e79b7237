"""Log-probabilities on /v1/completions and /v1/chat/completions (issue 29): OpenAI's shapes,
read by the official client; the values model.generate(logprobs=k) gives (tests/
test_generation_logprobs.py checks those against forward's logits). A real server process on
127.0.0.1 (a free port), stopped by the module."""
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

import minfer
from serve_process import serving

DATES = Path(__file__).resolve().parents[1] / "weights" / "tiny-t5-dates"
PROMPT = "date: 4th of July 1976"


@pytest.fixture(scope="module")
def server():
    with serving(DATES) as s:
        yield s


@pytest.fixture(scope="module")
def want():
    return minfer.load(DATES).generate([PROMPT], logprobs=2, return_details=True)[0][0]


def test_completion_logprobs_are_openais_shape_and_the_models_values(server, want):
    got = server.openai("x").completions.create(model=str(DATES), prompt=PROMPT, logprobs=2)
    lp = got.choices[0].logprobs
    assert got.choices[0].text == want.text == "".join(lp.tokens)
    assert np.allclose(lp.token_logprobs, want.token_logprobs, atol=1e-6)
    assert len(lp.top_logprobs) == len(lp.tokens) == want.new_tokens
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert np.allclose([max(t.values()) for t in lp.top_logprobs], lp.token_logprobs, atol=1e-6)


def test_chat_logprobs_are_a_content_list(server, want):
    got = server.openai("x").chat.completions.create(
        model=str(DATES), messages=[{"role": "user", "content": PROMPT}], logprobs=True,
        top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert "".join(c.token for c in content) == got.choices[0].message.content
    assert np.allclose([c.logprob for c in content], want.token_logprobs, atol=1e-6)
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    plain = server.openai("x").chat.completions.create(
        model=str(DATES), messages=[{"role": "user", "content": PROMPT}])
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
])
def test_bad_logprob_fields_are_400s_naming_them(server, path, body, param):
    with server.client() as http:
        r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def test_streamed_completion_logprobs_join_to_the_whole_answer(server, want):
    """Each chunk carries the tokens decided since the last one; together they are the
    non-streamed answer's tokens, values and offsets."""
    chunks = list(server.openai("x").completions.create(model=str(DATES), prompt=PROMPT,
                                                         logprobs=2, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    tokens = [t for p in parts for t in p.tokens]
    values = [v for p in parts for v in p.token_logprobs]
    assert "".join(tokens) == "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert np.allclose(values, want.token_logprobs, atol=1e-6) and len(values) == want.new_tokens
    assert [o for p in parts for o in p.text_offset] == \
        [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    assert all(len(top) == 2 for p in parts for top in p.top_logprobs)


def test_streamed_chat_logprobs_and_a_stream_without_them(server):
    messages = [{"role": "user", "content": PROMPT}]
    chunks = list(server.openai("x").chat.completions.create(
        model=str(DATES), messages=messages, logprobs=True, top_logprobs=1, stream=True,
        n=2, temperature=3.0, seed=7))
    model = minfer.load(DATES)
    for index in (0, 1):   # sequence j of a seeded request draws from seed + j
        sampled = model.generate([PROMPT], do_sample=True, temperature=3.0, seed=7 + index,
                                 logprobs=1, return_details=True)[0][0]
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        content = [e for c in mine if c.logprobs for e in c.logprobs.content]
        assert np.allclose([e.logprob for e in content], sampled.token_logprobs, atol=1e-6)
        assert "".join(e.token for e in content) == "".join(c.delta.content or "" for c in mine)
    plain = list(server.openai("x").chat.completions.create(model=str(DATES), messages=messages,
                                                            stream=True))
    assert all(c.choices[0].logprobs is None for c in plain if c.choices)
