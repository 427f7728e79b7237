"""Structured output through the server (issue 29): response_format on /v1/completions and
/v1/chat/completions, vLLM's choice fields, streamed and not, read by the official `openai`
client; bad formats are one-line 400s. A real server process on 127.0.0.1 (a free port) serving
the shipped tiny T5 (its tokenizer writes "{" and "}"), stopped by the module."""
import json
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("llguidance")

from serve_process import serving
from test_structured import PERSON, as_format, violations

DATES = Path(__file__).resolve().parents[1] / "weights" / "tiny-t5-dates"
MESSAGES = [{"role": "user", "content": "date: 4th of July 1976"}]


@pytest.fixture(scope="module")
def server():
    with serving(DATES) as s:
        yield s


def test_chat_json_schema_streamed_and_not(server):
    client = server.openai("x")
    got = client.chat.completions.create(model=str(DATES), messages=MESSAGES, max_tokens=200,
                                         response_format=as_format(PERSON), temperature=0.8,
                                         seed=1)
    assert got.choices[0].finish_reason == "stop"
    assert violations(json.loads(got.choices[0].message.content), PERSON) == []
    pieces = client.chat.completions.create(model=str(DATES), messages=MESSAGES, max_tokens=200,
                                            response_format=as_format(PERSON), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert violations(json.loads(text), PERSON) == []


def test_completions_json_object_and_choices(server):
    client = server.openai("x")
    got = client.completions.create(model=str(DATES), prompt="date: 1 May 2000", max_tokens=200,
                                    n=4, temperature=1.0, seed=2,
                                    extra_body={"response_format": {"type": "json_object"}})
    for c in got.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
    labels = ["past", "future", "unknown"]
    for extra in ({"guided_choice": labels}, {"structured_outputs": {"choice": labels}},
                  {"response_format": {"type": "choice", "choice": labels}}):
        got = client.completions.create(model=str(DATES), prompt="date: 1 May 2000",
                                        max_tokens=20, n=5, temperature=1.0, seed=3,
                                        extra_body=extra)
        assert all(c.text in labels for c in got.choices)
    chat = client.chat.completions.create(model=str(DATES), messages=MESSAGES, max_tokens=20,
                                          extra_body={"guided_choice": labels})
    assert chat.choices[0].message.content in labels


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"$ref": "#/missing"}}}}, "response_format"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"guided_choice": ["a"], "response_format": {"type": "json_object"}},
     "guided_choice"),
])
def test_bad_formats_are_one_line_400s(server, path, extra, param):
    body = ({"messages": MESSAGES} if "chat" in path else {"prompt": "x"}) | extra
    with server.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "\n" not in error["message"]
