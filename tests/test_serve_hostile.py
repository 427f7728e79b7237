"""`minfer serve` under hostile traffic (issue 30): capped inputs, JSON bodies only, Host
headers when bound to loopback, every answer counted once, API keys as HTTP carries them, a
taken port said before the model loads, and SIGTERM's drain. Real server processes on
127.0.0.1 (a free port), bounded loops, every process stopped by its test."""
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
pytest.importorskip("starlette")

import serve_process
from serve_process import serving

ROOT = Path(__file__).resolve().parents[1]
DATES = ROOT / "weights" / "tiny-t5-dates"
PROMPTS = [json.loads(line)["prompt"] for line in open(DATES / "heldout.jsonl")][::25]
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONGER = {"max_tokens": 12000, "ignore_eos": True}   # outlasts a grace period of seconds


@pytest.fixture(scope="module")
def server():
    """A key given with a trailing space (HTTP strips it from the header clients send), few
    inputs per request, one extra host name."""
    with serving(DATES, "--api-key", KEY + " ", "--max-inputs", "8",
                 "--allowed-host", "app.test") as s:
        yield s


def sse(lines) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in lines if line.startswith("data: ")]


def requests_total(server) -> dict[tuple[str, str], float]:
    out = {}
    for name, value in server.metrics().items():
        if name.startswith("minfer_requests_total{"):
            labels = dict(part.split("=") for part in name[len("minfer_requests_total{"):-1]
                          .split(","))
            out[labels["endpoint"].strip('"'), labels["status"].strip('"')] = value
    return out


def is_openai_error(r, status, code=None) -> bool:
    error = r.json()["error"]
    return (r.status_code == status and set(error) == {"message", "type", "param", "code"}
            and (code is None or error["code"] == code) and "\n" not in error["message"])


# -- item 13: the API key ---------------------------------------------------------------------
def test_a_key_given_with_surrounding_whitespace_is_the_key_clients_send(server):
    with server.client(headers=AUTH) as http:
        assert http.get("/v1/models").status_code == 200
        assert http.post("/v1/completions", json={"prompt": PROMPTS[0]}).status_code == 200
        assert http.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code \
            == 200   # the scheme's case does not matter in HTTP
    with server.client() as http:
        r = http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}x"})
        assert is_openai_error(r, 401, "invalid_api_key")


@pytest.mark.parametrize("key, match", [(" ", "empty"), ("a\tb", "control character"),
                                        ("k\x01", "control character")])
def test_a_key_no_client_can_send_is_refused_at_start_in_one_line(key, match):
    proc = subprocess.run([sys.executable, "-m", "minfer", "serve", "-m", str(ROOT / "no-model"),
                           "--port", "0", "--api-key", key], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items()
                                            if k != "MINFER_API_KEY"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "--api-key" in lines[0] and match in lines[0]


# -- item 16: the port before the model --------------------------------------------------------
def test_a_taken_port_is_said_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "minfer", "serve", "-m",
                               str(ROOT / "no-model"), "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "cannot listen on" in lines[0] and str(port) in lines[0]   # not "no-model ..."


def test_a_bad_allowed_host_is_refused_at_start():
    proc = subprocess.run([sys.executable, "-m", "minfer", "serve", "-m", str(ROOT / "no-model"),
                           "--port", "0", "--allowed-host", "http://app.test/"],
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "--allowed-host" in lines[0], proc.stderr


# -- item 10: JSON bodies only, Host headers ---------------------------------------------------
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/embeddings"])
def test_a_body_not_sent_as_json_is_415(server, path, content_type):
    """What a web page may POST to a local server without a CORS preflight is refused."""
    body = json.dumps({"prompt": "x", "input": "x",
                       "messages": [{"role": "user", "content": "x"}]})
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    with server.client() as http:
        r = http.post(path, content=body, headers=headers)
        assert is_openai_error(r, 415, "unsupported_media_type")
        assert "application/json" in r.json()["error"]["message"]
        r = http.post(path, content=body,
                      headers={**AUTH, "Content-Type": "Application/JSON; charset=utf-8"})
        assert r.status_code == 200


@pytest.mark.parametrize("host, ok", [("127.0.0.1", True), ("localhost:9", True),
                                      ("127.0.0.2:80", True), ("[::1]:8000", True),
                                      ("APP.test:443", True), ("evil.test", False),
                                      ("evil.test:8000", False), ("localhost.evil.test", False),
                                      ("192.168.1.1", False)])
@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models"])
def test_bound_to_loopback_only_loopback_and_allowed_hosts_are_answered(server, path, host, ok):
    """DNS rebinding: a page at evil.test re-pointed at 127.0.0.1 still sends Host: evil.test."""
    with server.client(headers=AUTH) as http:
        r = http.get(path, headers={"Host": host})
        if ok:
            assert r.status_code == 200
        else:
            assert is_openai_error(r, 421, "host_not_allowed") and "--allowed-host" in r.text


# -- item 9: inputs per request ----------------------------------------------------------------
def test_inputs_prompts_and_sequences_beyond_the_cap_are_400s(server):
    with server.client(headers=AUTH) as http:
        for path, body, param in (
                ("/v1/embeddings", {"input": ["a"] * 9}, "input"),
                ("/v1/completions", {"prompt": ["a"] * 9}, "prompt"),
                ("/v1/completions", {"prompt": ["a"] * 3, "n": 3, "temperature": 1}, "n"),
                ("/v1/completions", {"prompt": ["a"] * 3, "n": 3, "temperature": 1,
                                     "stream": True}, "n"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                          "n": 9, "temperature": 1}, "n")):
            r = http.post(path, json=body)
            assert is_openai_error(r, 400) and r.json()["error"]["param"] == param, r.text
            assert "--max-inputs" in r.json()["error"]["message"]
        r = http.post("/v1/embeddings", json={"input": ["a"] * 8})
        assert r.status_code == 200 and len(r.json()["data"]) == 8
        r = http.post("/v1/completions", json={"prompt": ["a"] * 2, "n": 4, "temperature": 1,
                                               "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_a_checkpoints_default_beams_count_against_the_cap(beam_model_folder):
    """Its generation_config.json decodes with 4 beams: 3 prompts are 12 rows, not 3."""
    with serving(beam_model_folder, "--max-inputs", "8") as server, server.client() as http:
        for stream in (False, True):
            r = http.post("/v1/completions", json={"prompt": ["a"] * 3, "stream": stream})
            assert is_openai_error(r, 400) and r.json()["error"]["param"] == "num_beams"
            assert "num_beams 4 x 3 prompts = 12" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": ["a"] * 2, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_the_default_cap_refuses_100000_inputs_at_once():
    """0.5 MB of body once made a 259 MB answer and 1 GB more resident memory."""
    with serving(DATES) as server, server.client() as http:
        t0 = time.monotonic()
        r = http.post("/v1/embeddings", json={"input": ["a"] * 100000})
        assert is_openai_error(r, 400) and "limit of 2048" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 10 and len(r.content) < 1000
        assert http.post("/v1/embeddings", json={"input": ["a"] * 2048}).status_code == 200


# -- item 16: an empty text is a text ----------------------------------------------------------
def test_an_empty_string_is_embedded_as_model_embed_does(server, offline):
    with server.client(headers=AUTH) as http:
        r = http.post("/v1/embeddings", json={"input": "", "encoding_format": "float"})
        assert r.status_code == 200
        assert np.array_equal(np.array(r.json()["data"][0]["embedding"], np.float32),
                              offline.embed([""])[0])
        r = http.post("/v1/embeddings", json={"input": ["a b", ""], "encoding_format": "float"})
        assert r.status_code == 200
        assert np.array_equal(np.array([d["embedding"] for d in r.json()["data"]], np.float32),
                              offline.embed(["a b", ""]))
        r = http.post("/v1/embeddings", json={"input": []})
        assert is_openai_error(r, 400) and r.json()["error"]["param"] == "input"


# -- item 12: metrics --------------------------------------------------------------------------
def test_every_answered_request_is_counted_once(server):
    cases = [  # (method, path, headers, body, endpoint, status)
        ("POST", "/v1/completions", {}, {"prompt": "x"}, "completions", 401),
        ("GET", "/v1/nothing", AUTH, None, "other", 404),
        ("GET", "/v1/completions", AUTH, None, "completions", 405),
        ("DELETE", "/v1/models", AUTH, None, "models", 405),
        ("POST", "/v1/embeddings", {**AUTH, "Content-Type": "text/plain"}, "{}", "embeddings",
         415),
        ("GET", "/v1/models", {**AUTH, "Host": "evil.test"}, None, "models", 421),
        ("POST", "/v1/completions", AUTH, {"prompt": "x", "n": "two"}, "completions", 400),
        ("POST", "/v1/chat/completions", AUTH,
         {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 3},
         "chat/completions", 200),
        ("GET", "/v1/models", AUTH, None, "models", 200),
        ("GET", "/health", {}, None, "health", 200),
    ]
    with server.client() as http:
        for method, path, headers, body, endpoint, status in cases:
            before = requests_total(server)
            content = body if isinstance(body, str) or body is None else json.dumps(body)
            r = http.request(method, path, headers={"Content-Type": "application/json",
                                                    **headers}, content=content)
            assert r.status_code == status, (path, r.text)
            after = requests_total(server)
            grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k)}
            grew.pop(("metrics", "200"), None)   # the scrape just before counts itself
            assert grew == {(endpoint, str(status)): 1}, (method, path, grew)


def test_streamed_prompt_tokens_are_counted_as_the_usage_reports_them(server):
    server.settle()
    before = server.metrics()
    with server.client(headers=AUTH) as http:
        r = http.post("/v1/completions", json={
            "prompt": PROMPTS[:2], "n": 3, "temperature": 1.0, "seed": 3, "max_tokens": 5,
            "stream": True, "stream_options": {"include_usage": True}})
        events = sse(r.iter_lines())
    usage = events[-2]["usage"]
    after = server.settle()
    assert after["minfer_prompt_tokens_total"] - before["minfer_prompt_tokens_total"] \
        == usage["prompt_tokens"]
    assert after["minfer_generated_tokens_total"] - before["minfer_generated_tokens_total"] \
        == usage["completion_tokens"]


# -- item 11: SIGTERM's drain ------------------------------------------------------------------
def test_sigterm_answers_queued_requests_503_lets_running_ones_finish_and_cuts_the_rest(offline):
    """Three requests run (a short stream, a long stream, a long plain request), two wait for a
    worker. On SIGTERM the two waiting get OpenAI's 503 "shutting down" at once; the short
    stream finishes whole; at the end of the grace period the long plain request gets a 503 and
    the long stream a last error event; the log has one line for each, and no traceback."""
    grace = 4
    server = serve_process.Server(DATES, "--max-running", "3", "--max-waiting", "4",
                                  "--grace-period", str(grace), "--max-tokens", "30000")
    try:
        results, done = {}, {}

        def send(name, body):
            try:
                with server.client() as http, http.stream("POST", "/v1/completions",
                                                          json=body) as r:
                    results[name] = (r.status_code, r.headers.get("content-type", ""),
                                     list(r.iter_lines()))
            except httpx.HTTPError as e:
                results[name] = e
            done[name] = time.monotonic()

        def start(name, body):
            thread = threading.Thread(target=send, args=(name, body))
            thread.start()
            return thread

        def accepted(n):
            deadline = time.monotonic() + 30
            while True:
                m = server.metrics()
                if m["minfer_requests_running"] + m["minfer_requests_waiting"] >= n:
                    return
                assert time.monotonic() < deadline, m
                time.sleep(0.02)
        threads = [start("short", {"prompt": PROMPTS[3], "stream": True, "max_tokens": 150,
                                   "ignore_eos": True,
                                   "stream_options": {"include_usage": True}}),
                   start("long stream", {"prompt": PROMPTS[:16], "stream": True, **LONGER}),
                   start("long plain", {"prompt": PROMPTS[:8], **LONGER})]
        accepted(3)   # the three hold the three workers
        threads += [start("queued plain", {"prompt": PROMPTS[0]}),
                    start("queued stream", {"prompt": PROMPTS[1], "stream": True})]
        accepted(5)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(grace + 20) == 0
        took = time.monotonic() - t0
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        for name in ("queued plain", "queued stream"):   # at once, OpenAI's error
            status, kind, lines = results[name]
            error = json.loads("".join(lines))["error"]
            assert (status, kind, error["code"]) == (503, "application/json", "shutting_down")
            assert done[name] - t0 < grace - 1
        status, _, lines = results["long plain"]
        assert status == 503 and done["long plain"] - t0 >= grace - 0.5
        assert json.loads("".join(lines))["error"]["type"] == "service_unavailable"
        events = sse(results["short"][2])                 # in flight: finished whole
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 150
        assert "".join(e["choices"][0]["text"] for e in events[:-2]) == offline.generate(
            PROMPTS[3], max_new_tokens=150, min_new_tokens=150)
        cut = sse(results["long stream"][2])              # cut with a last error event
        assert results["long stream"][0] == 200 and cut[-1]["error"]["code"] == "shutting_down"
        assert grace - 0.5 < took < grace + 15
        log = server.output()
        assert "Traceback" not in log and "CancelledError" not in log, log
        lines = [line for line in log.splitlines() if "shutting down" in line]
        assert len(lines) == 5, log
        assert sorted(line.split(": ")[-1] for line in lines) == \
            ["200, while shutting down"] + ["503, while shutting down"] * 4
    finally:
        server.stop(signal.SIGKILL)
