"""OpenAI's Batch API on `minfer serve --batch-dir` (serve/batches.py, batch_runner.py,
batch_store.py), as clients see it: real server processes on 127.0.0.1 (a free port), driven by
the official `openai` client (files.create / retrieve / content, batches.create / retrieve /
cancel / list) and httpx; every answer compared with the direct request the line names, sent to
the same server. Every wait is bounded and every process stopped by its test.

The stop-and-restart test (SIGKILL, and SIGTERM) runs BATCH_LINES lines (1,000 by default: ~10 s on a loaded 2-core
machine); MINFER_BATCH_LINES=10000 runs the issue's 10,000-line target (~1.5 min there).
"""
import base64
import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("python_multipart")

from serve_process import Server, serving
from minfer.io.lines import complete_lines

ROOT = Path(__file__).resolve().parents[1]
DATES = ROOT / "weights" / "tiny-t5-dates"
PROMPTS = [json.loads(line)["prompt"] for line in open(DATES / "heldout.jsonl")]
KEY = "batch-key-1234"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENDED = ("completed", "failed", "cancelled")
BATCH_LINES = int(os.environ.get("MINFER_BATCH_LINES", "1000"))
MAX_BODY = 16 << 10


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A batch server: an API key, small body and file limits, a prompt limit."""
    with serving(DATES, "--batch-dir", str(tmp_path_factory.mktemp("batches")),
                 "--api-key", KEY, "--max-body-size", f"{MAX_BODY}B",
                 "--max-batch-file-size", "256KiB", "--max-input-tokens", "100",
                 "--served-model-name", "dates") as s:
        yield s


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def requests_for(url: str, bodies: list[dict]) -> list[dict]:
    return [{"custom_id": f"line-{i}", "method": "POST", "url": url, "body": body}
            for i, body in enumerate(bodies)]


def run_batch(client, lines: list[dict], endpoint: str, seconds: float = 120):
    """Upload the lines, run them as a batch, and return the ended batch."""
    file = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    assert (file.purpose, file.bytes, file.object) == ("batch", len(jsonl(lines)), "file")
    batch = client.batches.create(input_file_id=file.id, endpoint=endpoint,
                                  completion_window="24h", metadata={"test": "yes"})
    assert batch.status == "validating" and batch.request_counts.total == len(lines)
    return wait(client, batch.id, seconds)


def wait(client, batch_id: str, seconds: float, until=ENDED):
    deadline = time.monotonic() + seconds
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.05)


def records(client, file_id: str | None) -> dict[str, dict]:
    """A result file's records by custom_id (each custom_id once)."""
    if file_id is None:
        return {}
    lines = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    assert len({r["custom_id"] for r in lines}) == len(lines)
    return {r["custom_id"]: r for r in lines}


def direct(server, url: str, body: dict) -> tuple[int, dict]:
    return direct_all(server, url, [body])[0]


def direct_all(server, url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    """Each body's answer as a direct request (status, JSON body), one after another."""
    with server.client(headers=AUTH) as http:
        return [(r.status_code, r.json()) for r in (http.post(url, json=b) for b in bodies)]


def same_answer(got: dict, want: dict) -> bool:
    """Equal but for what differs between any two requests (the id, the creation time) and the
    rounding of floats (log-probabilities, embeddings: 1e-4), which depends on which requests
    the continuous batcher stepped together: texts, tokens and counts exactly."""
    def strip(body: dict) -> dict:
        return {k: v for k, v in body.items() if k not in ("id", "created")}
    return close(strip(got), strip(want))


def close(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        if "embedding" in a and isinstance(a["embedding"], str):   # base64 float32
            a, b = ({**x, "embedding": np.frombuffer(base64.b64decode(x["embedding"]),
                                                      "<f4").tolist()} for x in (a, b))
        if "states" in a and isinstance(a["states"], str):         # /v1/encode's base64 float32
            a, b = ({**x, "states": np.frombuffer(base64.b64decode(x["states"]),
                                                  "<f4").tolist()} for x in (a, b))
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(close, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4 * max(1.0, abs(b))
    return type(a) is type(b) and a == b


def one_line_error(body: dict) -> str:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    return error["message"]


# -- a job end to end for each endpoint kind ----------------------------------------------------
@pytest.mark.parametrize("url, bodies", [
    ("/v1/completions", [
        {"model": "dates", "prompt": PROMPTS[0], "max_tokens": 30},
        {"prompt": [PROMPTS[1], PROMPTS[2]], "max_tokens": 5},
        {"prompt": PROMPTS[3], "logprobs": 2, "max_tokens": 6},
        {"prompt": PROMPTS[4], "n": 2, "temperature": 0.8, "seed": 7, "max_tokens": 12},
        {"prompt": "date: 4th of July 1976", "stop": ["-07"]},
        *({"prompt": p, "max_tokens": 20} for p in PROMPTS[10:40])]),
    ("/v1/chat/completions", [
        {"model": "dates", "messages": [{"role": "user", "content": PROMPTS[5]}]},
        {"messages": [{"role": "user", "content": PROMPTS[6]}], "max_tokens": 4,
         "logprobs": True, "top_logprobs": 2},
        *({"messages": [{"role": "user", "content": p}]} for p in PROMPTS[40:60])]),
    ("/v1/embeddings", [
        {"model": "dates", "input": PROMPTS[7]},
        {"input": PROMPTS[8:12], "encoding_format": "float"},
        {"input": [PROMPTS[12]], "encoding_format": "base64"}]),
    ("/v1/encode", [
        {"model": "dates", "input": PROMPTS[13]},
        {"input": PROMPTS[14:16], "max_length": 24, "encoding_format": "base64"}]),
])
def test_each_line_is_answered_as_its_direct_request(server, url, bodies):
    client = server.openai(KEY)
    lines = requests_for(url, bodies)
    batch = run_batch(client, lines, url)
    assert batch.status == "completed" and batch.error_file_id is None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(lines), 0)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert batch.metadata == {"test": "yes"} and batch.model == "dates"
    output = client.files.retrieve(batch.output_file_id)
    assert output.purpose == "batch_output"
    got = records(client, batch.output_file_id)
    assert list(got) == [line["custom_id"] for line in lines]   # in input order
    for line, (status, want) in zip(lines, direct_all(server, url, bodies)):
        record = got[line["custom_id"]]
        assert record["error"] is None and record["id"].startswith("batch_req_")
        assert record["response"]["status_code"] == 200
        assert status == 200 and same_answer(record["response"]["body"], want), line


def test_a_failing_line_is_an_error_line_not_a_failed_batch(server):
    client = server.openai(KEY)
    bodies = [{"prompt": PROMPTS[0], "max_tokens": 5},
              {"prompt": 5},                                            # not a string
              {"prompt": "date: " + "1 " * 300},                        # over --max-input-tokens
              {"model": "another", "prompt": PROMPTS[1]},               # not the served model
              {"prompt": PROMPTS[2], "temperature": -1},                # out of range
              {"prompt": PROMPTS[3], "max_tokens": 5, "stream": True},  # nobody to stream to
              {"prompt": "x" * (MAX_BODY + 10)},                        # over --max-body-size
              {"prompt": PROMPTS[4], "max_tokens": 5}]
    lines = requests_for("/v1/completions", bodies)
    batch = run_batch(client, lines, "/v1/completions")
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 6)
    good, bad = records(client, batch.output_file_id), records(client, batch.error_file_id)
    assert sorted(good) == ["line-0", "line-7"]
    for i in (1, 2, 3, 4):   # exactly the direct request's status and one-line error
        response = bad[f"line-{i}"]["response"]
        assert (response["status_code"], response["body"]) == direct(
            server, "/v1/completions", bodies[i])
        one_line_error(response["body"])
    assert bad["line-5"]["response"]["status_code"] == 400
    assert bad["line-5"]["response"]["body"]["error"]["param"] == "stream"
    assert bad["line-6"]["response"]["status_code"] == 413
    assert "--max-body-size" in one_line_error(bad["line-6"]["response"]["body"])
    status, _ = direct(server, "/v1/completions", bodies[6])
    assert status == 413   # as the direct request


def test_cancel_stops_a_running_job_and_ends_a_queued_one(server):
    client = server.openai(KEY)
    long = requests_for("/v1/completions", [{"prompt": p, "max_tokens": 2048,
                                             "ignore_eos": True} for p in PROMPTS[:40]])
    files = [client.files.create(file=("long.jsonl", jsonl(long)), purpose="batch")
             for _ in range(2)]
    running, queued = (client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                             completion_window="24h") for f in files)
    wait(client, running.id, 60, until=("in_progress",))
    started = time.monotonic()   # an interactive request is not queued behind the job
    assert direct(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 5})[0] == 200
    assert time.monotonic() - started < 10
    ended = client.batches.cancel(queued.id)   # never started: cancelled at once
    assert ended.status == "cancelled" and ended.output_file_id is None
    assert ended.request_counts.completed == 0
    cancelling = client.batches.cancel(running.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait(client, running.id, 60)
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert counts.completed + counts.failed < counts.total == 40
    kept = records(client, done.output_file_id)
    assert len(kept) == counts.completed
    assert list(kept) == [f"line-{i}" for i in range(counts.completed)]   # a prefix, in order
    with pytest.raises(openai.BadRequestError, match="only a validating or in-progress"):
        client.batches.cancel(running.id)
    assert server.settle()["minfer_requests_running"] == 0   # every line's job let go


# -- bad input: one-line JSON errors ------------------------------------------------------------
def test_bad_files_are_refused_naming_the_line(server):
    client = server.openai(KEY)
    good = requests_for("/v1/completions", [{"prompt": PROMPTS[0]}])[0]
    cases = [
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'
         b'{not json\n', "line 2"),
        (jsonl([good, good]), "used twice"),
        (jsonl([{**good, "method": "GET"}]), "method"),
        (jsonl([{**good, "body": "text"}]), "body must be a JSON object"),
        (jsonl([good]) + b"\n", "line 2: empty"),
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
         b'"body": {"prompt": "a", "temperature": NaN}}', "NaN is not JSON"),
        (b"", "holds no requests"),
    ]
    for data, words in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.create(file=("bad.jsonl", data), purpose="batch")
        assert words in one_line_error(refused.value.response.json()), words
        assert refused.value.response.json()["error"]["param"] == "file"
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        client.files.create(file=("in.jsonl", jsonl([good])), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as large:
        client.files.create(file=("big.jsonl", b"x" * (300 << 10)), purpose="batch")
    assert large.value.status_code == 413
    assert "--max-batch-file-size" in one_line_error(large.value.response.json())
    with server.client(headers=AUTH) as http:   # a file is a multipart upload
        response = http.post("/v1/files", json={"purpose": "batch"})
    assert response.status_code == 415
    one_line_error(response.json())


def test_bad_batches_are_refused_naming_the_field(server):
    client = server.openai(KEY)
    file = client.files.create(file=("in.jsonl", jsonl(requests_for(
        "/v1/completions", [{"prompt": PROMPTS[0], "max_tokens": 3}]))), purpose="batch")
    mixed = client.files.create(file=("mixed.jsonl", jsonl(
        requests_for("/v1/completions", [{"prompt": "a"}])
        + [{"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
            "body": {"input": "a"}}])), purpose="batch")

    def refused(error, **fields):
        with pytest.raises(error) as caught:
            client.batches.create(**{"input_file_id": file.id, "endpoint": "/v1/completions",
                                     "completion_window": "24h", **fields})
        body = caught.value.response.json()
        one_line_error(body)
        return body["error"]
    assert refused(openai.NotFoundError, input_file_id="file-" + "0" * 32)["param"] == \
        "input_file_id"
    assert refused(openai.BadRequestError, endpoint="/v1/score")["param"] == "endpoint"
    assert refused(openai.BadRequestError, completion_window="1h")["param"] == \
        "completion_window"
    error = refused(openai.BadRequestError, input_file_id=mixed.id)
    assert "line 2" in error["message"] and "/v1/embeddings" in error["message"]
    done = run_batch(client, requests_for("/v1/completions", [{"prompt": PROMPTS[0]}]),
                     "/v1/completions")
    error = refused(openai.BadRequestError, input_file_id=done.output_file_id)
    assert "purpose 'batch_output'" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-" + "1" * 32)
    with pytest.raises(openai.NotFoundError):
        client.files.content("../../etc/passwd")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with server.client(headers=AUTH) as http:
        too_big = http.post("/v1/batches", json={"input_file_id": file.id, "endpoint":
                                                 "/v1/completions", "completion_window": "24h",
                                                 "metadata": {"x": "y" * MAX_BODY}})
        bad_limit = http.get("/v1/batches", params={"limit": 0})
        bad_after = http.get("/v1/batches", params={"after": "batch_x"})
        no_key = httpx.get(server.url + "/v1/batches", timeout=30)
    assert too_big.status_code == 413 and bad_limit.status_code == bad_after.status_code == 400
    assert bad_after.json()["error"]["param"] == "after" and no_key.status_code == 401
    for response in (too_big, bad_limit, bad_after, no_key):
        one_line_error(response.json())


def test_list_pages_newest_first(server):
    client = server.openai(KEY)
    lines = requests_for("/v1/completions", [{"prompt": PROMPTS[0], "max_tokens": 2}])
    made = [run_batch(client, lines, "/v1/completions").id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert first.has_more and len(first.data) == 2
    every = [b.id for b in client.batches.list(limit=2)]   # (iterating pages on: after=)
    assert every == sorted(every, reverse=True) and every[:3] == made[::-1]


def test_metrics_count_jobs_lines_and_requests(server):
    client = server.openai(KEY)
    before = server.metrics()
    lines = requests_for("/v1/completions", [{"prompt": PROMPTS[0], "max_tokens": 2},
                                             {"prompt": 5}])
    run_batch(client, lines, "/v1/completions")
    after = server.settle()

    def grew(name):
        return after.get(name, 0) - before.get(name, 0)
    assert grew('minfer_batches_total{status="completed"}') == 1
    assert grew('minfer_batch_lines_total{outcome="completed"}') == 1
    assert grew('minfer_batch_lines_total{outcome="failed"}') == 1
    assert grew('minfer_requests_total{endpoint="files",status="200"}') == 1
    assert grew('minfer_requests_total{endpoint="batches",status="200"}') >= 2


def test_without_a_batch_dir_the_routes_say_how_to_enable_them():
    with serving(DATES) as bare:
        with bare.client() as http:
            for response in (http.get("/v1/batches"), http.get("/v1/files/file-x"),
                             http.post("/v1/files", files={"file": ("a.jsonl", b"{}")},
                                       data={"purpose": "batch"})):
                assert response.status_code == 404
                assert "--batch-dir" in one_line_error(response.json())


def test_a_batch_dir_that_cannot_be_used_is_refused_before_the_model_loads(tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("not a folder")
    done = subprocess.run([sys.executable, "-m", "minfer", "serve", "-m", str(DATES),
                           "--port", "0", "--batch-dir", str(taken / "jobs")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--batch-dir" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_a_second_server_on_a_batch_dir_in_use_is_refused(tmp_path):
    """Two servers on one folder would resume the same jobs and both append their answers."""
    folder = tmp_path / "jobs"
    with serving(DATES, "--batch-dir", str(folder)):
        done = subprocess.run([sys.executable, "-m", "minfer", "serve", "-m", str(DATES),
                               "--port", "0", "--batch-dir", str(folder)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "in use by another server" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    with serving(DATES, "--batch-dir", str(folder)) as again:   # free once the first stops
        assert again.openai(KEY).batches.list().data == []


# -- a crash never loses or repeats an answer ---------------------------------------------------
def test_the_resume_point_is_after_the_last_complete_line(tmp_path):
    path = tmp_path / "out.jsonl"
    assert complete_lines(path) == (0, 0)   # no file yet
    path.write_bytes(b"")
    assert complete_lines(path) == (0, 0)
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c"')
    assert complete_lines(path) == (2, len(b'{"a": 1}\n{"b": 2}\n'))
    big = b"x" * (3 << 20) + b"\n"   # lines across the reader's 1 MiB pieces
    path.write_bytes(big * 2 + b"y")
    assert complete_lines(path) == (2, 2 * len(big))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_stopped_halfway_a_restarted_server_answers_every_line_once(tmp_path, sig):
    folder = tmp_path / "batches"
    unique = PROMPTS[:100]
    lines = requests_for("/v1/completions", [{"prompt": unique[i % len(unique)],
                                              "max_tokens": 4} for i in range(BATCH_LINES)])
    first = Server(DATES, "--batch-dir", str(folder))
    try:
        client = first.openai("none")
        file = client.files.create(file=("many.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 600
        while client.batches.retrieve(batch.id).request_counts.completed < BATCH_LINES // 2:
            assert time.monotonic() < deadline, "the job made no progress"
            time.sleep(0.05)
        assert first.stop(sig) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    finally:
        first.stop()
    state = json.loads((folder / "batches" / f"{batch.id}.json").read_text())
    assert state["status"] == "in_progress"
    output = folder / "files" / f"{state['_output']}.jsonl"
    written, end = complete_lines(output)
    assert BATCH_LINES // 2 <= written < BATCH_LINES
    with open(output, "ab") as f:   # as if the kill had come in the middle of a write
        f.write(b'{"id":"batch_req_cut","custom_id":"line-')
    with serving(DATES, "--batch-dir", str(folder)) as second:
        client = second.openai("none")
        resumed = client.batches.retrieve(batch.id)
        assert resumed.request_counts.completed >= written   # counted from the file
        done = wait(client, batch.id, 600)
        assert done.status == "completed" and done.error_file_id is None
        assert done.request_counts.completed == BATCH_LINES
        text = client.files.content(done.output_file_id).text
        got = [json.loads(line) for line in text.splitlines()]
        ids = collections.Counter(r["custom_id"] for r in got)
        assert len(got) == BATCH_LINES and set(ids) == {line["custom_id"] for line in lines}
        assert max(ids.values()) == 1
        answers = direct_all(second, "/v1/completions",
                             [{"prompt": prompt, "max_tokens": 4} for prompt in unique])
        assert {status for status, _ in answers} == {200}
        want = {prompt: body for prompt, (_, body) in zip(unique, answers)}
        for line, record in zip(lines, got):   # in input order, each as its direct request
            assert record["custom_id"] == line["custom_id"]
            assert same_answer(record["response"]["body"], want[line["body"]["prompt"]])
