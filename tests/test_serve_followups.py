"""`minfer serve` after a hostile test pass (issue 30's follow-ups): clients that leave during
the upload, flag errors in the command line's words, error messages and params in the
request's words, the warm-up, and what /metrics counts. Real server processes on 127.0.0.1 (a
free port), bounded loops, every process stopped by its test."""
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

from serve_process import serving

ROOT = Path(__file__).resolve().parents[1]
DATES = ROOT / "weights" / "tiny-t5-dates"
RECALL = ROOT / "weights" / "tiny-xl-recall"
GENERATION = ("/v1/completions", "/v1/chat/completions")
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat/completions",
             "/v1/embeddings": "embeddings"}


@pytest.fixture(scope="module")
def server():
    with serving(DATES, "--max-input-tokens", "40") as s:
        yield s


def counted(server, endpoint: str, status: int) -> float:
    return server.metrics().get(
        f'minfer_requests_total{{endpoint="{endpoint}",status="{status}"}}', 0.0)


def wait_until(condition, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.05)


# -- a client that leaves during the upload ----------------------------------------------------
@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_a_client_leaving_during_the_upload_is_499_without_a_traceback(server, path):
    endpoint = ENDPOINTS[path]
    before = {status: counted(server, endpoint, status) for status in (499, 500)}
    host, port = server.url.rsplit("/", 1)[1].split(":")
    for _ in range(20):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                         "application/json\r\nContent-Length: 100\r\n\r\n{\"x\":".encode())
    wait_until(lambda: counted(server, endpoint, 499) - before[499] == 20)
    assert counted(server, endpoint, 500) == before[500]
    log = server.output()
    assert "Traceback" not in log and "ClientDisconnect" not in log and "request failed" \
        not in log, log


# -- flag errors: exit 2, naming the flag --------------------------------------------------------
@pytest.mark.parametrize("args, flag", [
    (["--max-body-size", "0"], "--max-body-size"), (["--max-body-size", "0.1"], "--max-body-size"),
    (["--max-body-size", "1ZiB"], "--max-body-size"), (["--max-body-size", "-5"], "--max-body-size"),
    (["--request-timeout", "nan"], "--request-timeout"),
    (["--request-timeout", "inf"], "--request-timeout"),
    (["--grace-period", "nan"], "--grace-period"), (["--grace-period", "inf"], "--grace-period")])
def test_a_bad_serving_flag_is_a_usage_error_naming_it_before_the_model_loads(args, flag):
    proc = subprocess.run([sys.executable, "-m", "minfer", "serve", "-m", str(ROOT / "no-model"),
                           "--port", "0", *args], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert flag in lines[0] and "_" not in lines[0].split(", got")[0], lines[0]
    assert "no-model" not in lines[0]   # said before the model is looked for


# -- errors in the request's words -------------------------------------------------------------
@pytest.mark.parametrize("part, said", [({"type": "text"}, "text is missing"),
                                        ({"type": "text", "text": 5}, "text must be a string"),
                                        ({"type": "text", "text": None}, "text is missing")])
def test_a_text_part_without_its_text_says_so(part, said):
    from minfer.serve.chat import chat_prompt
    from minfer.serve.errors import APIError
    with pytest.raises(APIError) as e:
        chat_prompt([{"role": "user", "content": [{"type": "text", "text": "a"}, part]}])
    assert e.value.param == "messages[0].content[1].text"
    assert e.value.message.startswith(f"messages[0].content[1].{said}"), e.value.message
    assert "only text parts" not in e.value.message


@pytest.fixture(scope="module")
def dates_model():
    import minfer
    return minfer.load(DATES)


@pytest.mark.parametrize("body, said", [
    ({"n": 2}, "n 2 (more than one sequence per prompt) needs sampling (temperature above 0)"),
    ({"n": 2, "temperature": 0}, "needs sampling (temperature above 0) or beam search"),
    ({"n": 3, "num_beams": 2, "temperature": 1}, "n 3 is more than the beam width 2")])
def test_more_sequences_than_beams_is_said_in_the_requests_words(dates_model, body, said):
    from minfer.serve import schema
    from minfer.serve.errors import APIError
    with pytest.raises(APIError) as e:
        schema.settle(dates_model, schema.completion_request({"prompt": "a", **body}, 64, 64),
                      64)
    assert e.value.param == "n" and said in e.value.message, e.value.message
    assert "num_return_sequences" not in e.value.message and "do_sample" not in e.value.message


def test_library_option_names_become_request_fields():
    from minfer.serve.errors import in_request_words
    said = in_request_words("temperature 0.0001 is too low for sampled beam search (>= 0.001: "
                            "beam scores scale as 1/temperature); for the best beams use "
                            "do_sample=False")
    assert said.endswith("for the best beams use temperature 0"), said


@pytest.mark.parametrize("body, said", [
    ('{"input": ["a b", "\\ud800"]}', "input[1]: character 0 ('\\ud800') is a lone surrogate"),
    (json.dumps({"input": ["a b", "a " * 200]}), "input[1]: 201 tokens, more than this "
                                                 "server's limit of 40")])
def test_an_embedding_input_the_server_refuses_is_named_as_the_request_sent_it(server, body,
                                                                               said):
    with server.client() as http:
        r = http.post("/v1/embeddings", content=body,
                      headers={"Content-Type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "input", error
    assert error["message"].startswith(said) and "encode()" not in error["message"], error


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "zzqx", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["zzqx"], "max_tokens": 2, "stream": True}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "zzqx"}],
                              "max_tokens": 2}, "messages")])
def test_a_word_a_word_level_vocabulary_lacks_is_the_prompts_fault(xl_server, path, body, param):
    with xl_server.client() as http:
        r = http.post(path, json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, error
    assert "'zzqx' is not in the vocabulary" in error["message"]


@pytest.fixture(scope="module")
def xl_server():
    with serving(RECALL) as s:
        yield s


@pytest.mark.parametrize("method, path", [("POST", "/v1/completions/"), ("POST", "/v1/embeddings/"),
                                          ("GET", "/health/"), ("GET", "/v1/models/")])
def test_a_path_with_a_trailing_slash_is_a_json_404(server, method, path):
    with server.client() as http:
        r = http.request(method, path, json={"prompt": "a", "input": "a"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    assert path in r.json()["error"]["message"]


def test_the_warm_up_runs_a_prompt_the_models_vocabulary_has(xl_server, server):
    """tiny-xl-recall's word-level vocabulary has no <unk> (nor "warm" or "up")."""
    for s in (xl_server, server):
        assert "warm-up failed" not in s.output(), s.output()
    from minfer.serve.routes import warm_up_text
    from minfer.tokenizers import load_tokenizer
    for folder in (RECALL, DATES):
        tokenizer = load_tokenizer(folder)
        text = warm_up_text(tokenizer)
        assert any(c.isalnum() for c in text) and tokenizer.encode(text)


# -- /metrics ---------------------------------------------------------------------------------
def test_embeddings_prompt_tokens_are_counted_as_their_usage_reports_them(server):
    before = server.settle()
    with server.client() as http:
        r = http.post("/v1/embeddings", json={"input": ["a b c", "d"]})
    assert r.status_code == 200
    usage = r.json()["usage"]
    after = server.settle()
    assert usage["prompt_tokens"] > 0
    assert after["minfer_prompt_tokens_total"] - before["minfer_prompt_tokens_total"] \
        == usage["prompt_tokens"]
    assert after["minfer_generated_tokens_total"] == before["minfer_generated_tokens_total"]
