"""`minfer serve` as clients see it: real server processes on 127.0.0.1 (a free port), spoken to
over HTTP by the official `openai` client and by httpx. Every loop is bounded in count and time,
and every process is stopped by the test that started it."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

import minfer
from serve_process import Server, serving
from minfer import embedding

ROOT = Path(__file__).resolve().parents[1]
DATES = ROOT / "weights" / "tiny-t5-dates"
EMBEDDER = ROOT / "weights" / "family" / "st_sentence_t5"
PROMPTS = [json.loads(line)["prompt"] for line in open(DATES / "heldout.jsonl")][::25]   # 32
KEY = "test-key-1234"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}   # for bodies sent as raw bytes
LONG = {"max_tokens": 2048, "ignore_eos": True}   # seconds of decoding on the tiny model
# what must outlast a deadline or a grace period: 2048 tokens take under a second on a quiet
# machine (servers started with --max-tokens 30000)
LONGER = {"max_tokens": 12000, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    """The main server: an API key, a small body limit and prompt limit."""
    with serving(DATES, "--api-key", KEY, "--max-body-size", "64KiB",
                 "--max-input-tokens", "100", "--served-model-name", "dates") as s:
        yield s


def sse(lines) -> list:
    """The JSON objects of a server-sent-event stream, and "[DONE]" if it came."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# -- answers ------------------------------------------------------------------------------------------
def test_completions_equal_offline_generate(server, offline):
    client = server.openai(KEY)
    got = client.completions.create(model="dates", prompt=PROMPTS[:8], max_tokens=30)
    want = offline.generate(PROMPTS[:8], return_details=True, max_new_tokens=30)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == \
        [row[0].text for row in want]
    assert {c.finish_reason for c in got.choices} == {"stop"}          # eos
    assert got.usage.prompt_tokens == sum(row[0].prompt_tokens for row in want)
    assert got.usage.completion_tokens == sum(row[0].new_tokens for row in want)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    cut = client.completions.create(model="dates", prompt=PROMPTS[0], max_tokens=3)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    stop = client.completions.create(model="dates", prompt="date: 4th of July 1976", stop=["-07"])
    assert (stop.choices[0].text, stop.choices[0].finish_reason) == ("1976", "stop")


def test_streamed_pieces_join_to_the_whole_text(server, offline):
    client = server.openai(KEY)
    prompt = "spell: 98765"
    want = offline.generate(prompt, return_details=True)[0]
    chunks = list(client.completions.create(model="dates", prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len(pieces) > 3 and "".join(pieces) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == want.new_tokens
    assert chunks[-1].usage.prompt_tokens == want.prompt_tokens
    chat = list(client.chat.completions.create(
        model="dates", messages=[{"role": "user", "content": prompt}], stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat) == want.text
    assert chat[-1].choices[0].finish_reason == "stop"
    # a prompt list streams each choice by its index
    with server.client(headers=AUTH) as http:
        r = http.post("/v1/completions", json={"prompt": PROMPTS[:3], "stream": True})
        events = sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    texts = ["", "", ""]
    for e in events[:-1]:
        texts[e["choices"][0]["index"]] += e["choices"][0]["text"]
    assert texts == offline.generate(PROMPTS[:3])


def test_chat_completions_follow_the_chat_rule(server, offline):
    client = server.openai(KEY)
    one = client.chat.completions.create(model="dates",
                                         messages=[{"role": "user", "content": PROMPTS[4]}])
    assert one.choices[0].message.content == offline.generate(PROMPTS[4])
    assert one.choices[0].message.role == "assistant" and one.object == "chat.completion"
    messages = [{"role": "system", "content": "date:"}, {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    many = client.chat.completions.create(model="dates", messages=messages, max_tokens=12)
    assert many.choices[0].message.content == offline.generate(
        "date:\n\nUser: a\nAssistant: b\nUser: c\nAssistant:", max_new_tokens=12)
    sampled = client.chat.completions.create(
        model="dates", messages=[{"role": "user", "content": PROMPTS[5]}], n=3,
        temperature=0.9, seed=7)
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    again = client.chat.completions.create(
        model="dates", messages=[{"role": "user", "content": PROMPTS[5]}], n=3,
        temperature=0.9, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in sampled.choices]


def test_concurrent_clients_get_the_offline_answers_and_leave_nothing_behind(server, offline):
    want = offline.generate(PROMPTS)
    got = [None] * len(PROMPTS)
    errors = []

    def client(k):
        try:
            with server.client(headers=AUTH) as http:
                for i in range(k, len(PROMPTS), 16):
                    body = {"prompt": PROMPTS[i], "stream": i % 2 == 0}
                    r = http.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    if body["stream"]:
                        got[i] = "".join(e["choices"][0]["text"] for e in sse(r.iter_lines())
                                         if e != "[DONE]")
                    else:
                        got[i] = r.json()["choices"][0]["text"]
        except Exception as e:  # surfaced below
            errors.append(e)
    threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and not errors, errors[:2]
    assert got == want
    m = server.settle()
    assert m["minfer_arena_used_bytes"] == 0


def test_concurrent_requests_are_decoded_together(server):
    """The continuous batcher takes the steps of requests in flight together: 8 clients sent at
    once need far fewer decode steps than 8 x 150 tokens (the metrics count steps and the
    requests each stepped)."""
    before = server.settle()
    barrier = threading.Barrier(8)
    statuses = []

    def client(k):
        with server.client(headers=AUTH) as http:
            barrier.wait(30)
            r = http.post("/v1/completions", json={"prompt": PROMPTS[k], "max_tokens": 150,
                                                   "ignore_eos": True, "stream": k % 2 == 1})
            statuses.append((r.status_code, len(r.content)))
    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and [s for s, _ in statuses] == [200] * 8
    after = server.settle()
    steps = after["minfer_decode_steps_total"] - before["minfer_decode_steps_total"]
    stepped = (after["minfer_decode_step_requests_total"]
               - before["minfer_decode_step_requests_total"])
    assert stepped == 8 * 150 and steps < 8 * 150 / 2   # a mean batch above 2 (ideally 8)
    assert after["minfer_generated_tokens_total"] - before["minfer_generated_tokens_total"] \
        == 8 * 150


# -- bad requests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b'["a list"]', 400, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -2}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "   "}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/embeddings", {"input": 5}, 400, "input"),
])
def test_bad_requests_are_openai_errors(server, path, body, status, param):
    with server.client(headers=AUTH) as http:
        r = http.post(path, content=body if isinstance(body, bytes) else json.dumps(body),
                      headers=JSON)
        assert r.status_code == status
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
        assert "\n" not in error["message"] and "Traceback" not in error["message"]


def test_limits_and_unknown_paths_are_openai_errors_and_the_server_stays_up(server, offline):
    with server.client(headers=AUTH) as http:
        long = " ".join(["word"] * 300)
        r = http.post("/v1/completions", json={"prompt": long})
        message = r.json()["error"]["message"]   # in the request's words, not the CLI's or Python's
        assert r.status_code == 400 and "the server's limit of 100 prompt tokens" in message
        assert "truncate_prompt_tokens cuts it" in message
        assert "--truncate" not in message and "truncation=True" not in message
        r = http.post("/v1/completions", json={"prompt": long, "truncate_prompt_tokens": 50,
                                               "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 50
        r = http.post("/v1/completions", content=b'{"prompt": "' + b"a" * 70000 + b'"}',
                      headers=JSON)
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
        chunked = iter([b'{"prompt": "', b"a" * 40000, b"a" * 40000, b'"}'])   # no length
        r = http.post("/v1/completions", content=chunked, headers=JSON)
        assert r.status_code == 413
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5000})
        assert r.status_code == 400 and "limit of 2048" in r.json()["error"]["message"]
        for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                     ("DELETE", "/v1/models", 405)):
            r = http.request(method, path)
            assert r.status_code == status and "error" in r.json()
        r = http.post("/v1/completions", json={"prompt": PROMPTS[0]})
        assert r.json()["choices"][0]["text"] == offline.generate(PROMPTS[0])


def test_models_health_and_metrics(server):
    models = server.openai(KEY).models.list()
    assert [m.id for m in models.data] == ["dates"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    done = server.openai(KEY).completions.create(model="dates", prompt=PROMPTS[0], stream=True)
    assert "".join(c.choices[0].text for c in done)   # (a completion's own metrics, streamed)
    m = server.metrics()
    for name in ("minfer_requests_running", "minfer_requests_waiting",
                 "minfer_generated_tokens_total", "minfer_prompt_tokens_total",
                 "minfer_arena_used_bytes", "minfer_arena_capacity_bytes",
                 "minfer_request_duration_seconds_count{endpoint=\"completions\"}",
                 "minfer_time_to_first_token_seconds_count"):
        assert name in m, name
    assert m["minfer_arena_capacity_bytes"] > 0


def test_the_api_key_guards_v1_only_and_cors_is_off(server):
    with pytest.raises(openai.AuthenticationError):
        server.openai(key="wrong").models.list()
    with server.client() as http:
        r = http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = http.post("/v1/completions", json={"prompt": "x"},
                      headers={"Authorization": f"Bearer {KEY}x"})
        assert r.status_code == 401
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        r = http.get("/v1/models", headers={**AUTH, "Origin": "https://elsewhere.test"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


# -- disconnects ------------------------------------------------------------------------------------
def test_a_client_that_leaves_a_stream_stops_its_decoding(server, offline):
    before = server.settle()
    with server.client(headers=AUTH) as http:
        with http.stream("POST", "/v1/completions",
                         json={"prompt": PROMPTS[1], "stream": True, **LONG}) as r:
            lines = r.iter_lines()
            seen = 0
            while seen < 3:
                seen += next(lines).startswith("data: ")
    # (leaving the block closed the connection) decoding stops within a step: far from the 2048
    # tokens it would have made, and its memory is back
    after = server.settle()
    generated = after["minfer_generated_tokens_total"] - before["minfer_generated_tokens_total"]
    assert 3 <= generated < 1000
    assert after["minfer_arena_used_bytes"] == 0
    r = server.openai(KEY).completions.create(model="dates", prompt=PROMPTS[2])
    assert r.choices[0].text == offline.generate(PROMPTS[2])


def test_a_client_that_leaves_a_plain_request_stops_its_decoding(server):
    body = json.dumps({"prompt": PROMPTS, **LONG}).encode()   # 32 x 2048 tokens: ~10 s or more
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json"
                     b"\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while server.metrics()["minfer_requests_running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    left = time.monotonic()
    m = server.settle(seconds=5)   # stopped within steps, not after its 2048
    assert time.monotonic() - left < 5 and m["minfer_arena_used_bytes"] == 0
    assert m['minfer_requests_total{endpoint="completions",status="499"}'] >= 1


# -- backpressure, timeouts ---------------------------------------------------------------------------
def test_beyond_the_queue_a_request_gets_429_at_once_and_a_slow_one_504():
    with serving(DATES, "--max-running", "1", "--max-waiting", "0", "--max-tokens", "30000",
                 "--request-timeout", "2") as server, server.client() as http:
        with http.stream("POST", "/v1/completions",
                         json={"prompt": PROMPTS[0], "stream": True, **LONGER}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")   # it runs: the only slot is taken
            t0 = time.monotonic()
            busy = http.post("/v1/completions", json={"prompt": PROMPTS[1]})
            assert busy.status_code == 429 and time.monotonic() - t0 < 5
            assert busy.headers["Retry-After"] == "1"
            assert busy.json()["error"]["type"] == "rate_limit_error"
            events = sse(lines)     # the deadline cuts the stream with an error event
            assert events[-1]["error"]["type"] == "timeout_error"
        server.settle()
        t0 = time.monotonic()
        slow = http.post("/v1/completions", json={"prompt": PROMPTS[:8], **LONGER})
        assert slow.status_code == 504 and 1.5 < time.monotonic() - t0 < 10
        assert "--request-timeout" in slow.json()["error"]["message"]
        m = server.settle()
        assert m["minfer_arena_used_bytes"] == 0
        assert http.post("/v1/completions", json={"prompt": PROMPTS[1]}).status_code == 200


# -- SIGTERM ----------------------------------------------------------------------------------------
def test_sigterm_lets_streams_in_flight_finish_within_the_grace_period(offline):
    server = Server(DATES, "--grace-period", "4", "--max-tokens", "30000")
    try:
        results = {}

        def read(name, body):
            try:
                with server.client() as http, http.stream("POST", "/v1/completions",
                                                          json=body) as r:
                    lines = r.iter_lines()
                    results[name] = [next(lines)]
                    results[name].extend(lines)
                    results[name + " done"] = time.monotonic()
            except httpx.HTTPError as e:   # the long one is cut when the grace period ends
                results[name + " error"] = e
        # measured alone on 2 cores: the short one ~1 s beside the long, the long one ~12 s
        short = {"prompt": PROMPTS[3], "stream": True, "max_tokens": 150, "ignore_eos": True,
                 "stream_options": {"include_usage": True}}
        threads = [threading.Thread(target=read, args=("short", short)),
                   threading.Thread(target=read, args=("long", {"prompt": PROMPTS[:16],
                                                                "stream": True, **LONGER}))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while not ("short" in results and "long" in results):   # both have started
            assert time.monotonic() < deadline
            time.sleep(0.02)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):   # no longer accepting
            httpx.get(server.url + "/health", timeout=5)
        assert server.proc.wait(30) == 0
        took = time.monotonic() - t0
        for t in threads:
            t.join(30)
        assert results["short done"] > t0        # it was in flight when SIGTERM came
        events = sse(results["short"])
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 150
        assert "".join(e["choices"][0]["text"] for e in events[:-2]) == offline.generate(
            PROMPTS[3], max_new_tokens=150, min_new_tokens=150)
        cut = sse(results.get("long", []))                         # cut after the grace period
        assert "[DONE]" not in cut and cut[-1]["error"]["type"] == "service_unavailable"
        assert "shutting down" in cut[-1]["error"]["message"]
        assert 3.5 < took < 20
    finally:
        server.stop(signal.SIGKILL)


# -- embeddings, an encoder-only model, CORS --------------------------------------------------------
def test_embeddings_equal_model_embed_and_the_encoder_cannot_complete():
    model = minfer.load(EMBEDDER)
    texts = ["a first sentence", "and a second, longer one than the first"]
    want = model.embed(texts)
    with serving(EMBEDDER, "--cors-origin", "https://app.test") as server:
        got = server.openai(key="unused").embeddings.create(model=str(EMBEDDER), input=texts)
        assert np.array_equal(np.array([d.embedding for d in got.data], np.float32), want)
        assert got.usage.prompt_tokens == sum(embedding.token_counts(model, texts))   # (cut at 12)
        with server.client() as http:
            plain = http.post("/v1/embeddings", json={"input": texts[0],
                                                      "encoding_format": "float"}).json()
            assert np.array_equal(np.array(plain["data"][0]["embedding"], np.float32),
                                  model.embed(texts[:1])[0])   # alone: no padding
            r = http.post("/v1/completions", json={"prompt": "hello"})
            assert r.status_code == 400 and "encoder only" in r.json()["error"]["message"]
            short = http.post("/v1/embeddings", json={"input": texts[0], "dimensions": 3}).json()
            assert np.allclose(short["data"][0]["embedding"],
                               model.embed(texts[:1], dimensions=3)[0], atol=1e-6)
            width = model.embed(texts[:1]).shape[1]
            r = http.post("/v1/embeddings", json={"input": "x", "dimensions": width + 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
            assert f"this model's embeddings have {width}" in r.json()["error"]["message"]
            r = http.options("/v1/embeddings", headers={
                "Origin": "https://app.test", "Access-Control-Request-Method": "POST"})
            assert r.headers["access-control-allow-origin"] == "https://app.test"
            r = http.get("/v1/models", headers={"Origin": "https://other.test"})
            assert "access-control-allow-origin" not in r.headers


def test_a_transformer_xl_server_completes_but_refuses_embeddings_in_one_line():
    """Transformer-XL has no encoder: /v1/embeddings is the client's 400 saying so in one
    line (model.embed's own check), and the server goes on serving completions."""
    xl = ROOT / "weights" / "tiny-xl-recall"
    with serving(xl) as server, server.client() as http:
        r = http.post("/v1/embeddings", json={"input": ["a b", "c"]})
        error = r.json()["error"]
        assert r.status_code == 400 and error["type"] == "invalid_request_error"
        assert "cannot embed" in error["message"] and "\n" not in error["message"]
        assert "encoder" in error["message"] and "transfo" in error["message"].lower()
        r = http.post("/v1/completions", json={"prompt": "f8 KEY k7 f13 ASK", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_serve_fails_in_one_line_when_the_port_is_taken():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "minfer", "serve", "-m", str(DATES),
                               "--port", str(port)], capture_output=True, text=True, timeout=120,
                              env={k: v for k, v in os.environ.items() if k != "MINFER_API_KEY"})
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minfer: error:"), proc.stderr
