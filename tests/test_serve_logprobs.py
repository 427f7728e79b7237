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
    ("/v1/completions", {"prompt": "x", "logprobs": 1, "stream": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
])
def test_bad_logprob_fields_are_400s_naming_them(server, path, body, param):
    with server.client() as http:
        r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
