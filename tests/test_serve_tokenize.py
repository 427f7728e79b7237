"""POST /tokenize and /detokenize (issue 29, vLLM's shapes): the ids a completion's prompt
becomes, chat messages by the chat rule, the round trip, the API key, errors naming the field,
metrics. A real server process on 127.0.0.1 (a free port), stopped by the module."""
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

import minfer
from minfer.serve.chat import chat_prompt
from serve_process import serving

DATES = Path(__file__).resolve().parents[1] / "weights" / "tiny-t5-dates"
KEY = "tok-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    with serving(DATES, "--api-key", KEY, "--max-input-tokens", "48") as s:
        yield s


@pytest.fixture(scope="module")
def model():
    return minfer.load(DATES)


def test_tokenize_gives_the_ids_a_completion_prompt_becomes(server, model):
    prompt = "date: 4th of July 1976"
    with server.client(headers=AUTH) as http:
        got = http.post("/tokenize", json={"model": str(DATES), "prompt": prompt}).json()
        done = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}).json()
    assert got["tokens"] == model.tokenizer.encode(prompt) and got["tokens"][-1] == 1   # </s>
    assert got["count"] == len(got["tokens"]) == done["usage"]["prompt_tokens"]
    assert got["max_model_len"] == 48
    with server.client(headers=AUTH) as http:
        bare = http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()
    assert bare["tokens"] == got["tokens"][:-1]


def test_messages_are_one_prompt_by_the_chat_rule(server, model):
    messages = [{"role": "system", "content": "date:"}, {"role": "user", "content": "1 May 2001"}]
    with server.client(headers=AUTH) as http:
        got = http.post("/tokenize", json={"messages": messages}).json()
    assert got["tokens"] == model.tokenizer.encode(chat_prompt(messages))


def test_detokenize_skips_special_tokens_so_a_round_trip_gives_the_text(server):
    prompt = "date: 12 March 1999"
    with server.client(headers=AUTH) as http:
        ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
        back = http.post("/detokenize", json={"tokens": ids}).json()
    assert back == {"prompt": prompt}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "messages"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, 600]}, "tokens"),      # the vocabulary has 600 ids
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_bad_bodies_are_400s_naming_the_field(server, path, body, param):
    with server.client(headers=AUTH) as http:
        r = http.post(path, json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and "\n" not in error["message"]


def test_the_key_guards_them_and_metrics_count_them(server):
    before = server.settle().get('minfer_requests_total{endpoint="tokenize",status="200"}', 0)
    with server.client() as http:
        for path in ("/tokenize", "/detokenize"):
            r = http.post(path, json={"prompt": "x", "tokens": [1]})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert http.post("/tokenize", json={"prompt": "x"}, headers=AUTH).status_code == 200
        assert http.get("/health").status_code == 200
    after = server.settle()
    assert after['minfer_requests_total{endpoint="tokenize",status="200"}'] == before + 1
    assert after['minfer_requests_total{endpoint="detokenize",status="401"}'] >= 1
