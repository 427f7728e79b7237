"""POST /v1/encode's continuous batching on a real `minfer serve` process (127.0.0.1, a free
port): requests that arrive while the model is busy share encoder passes (fewer passes than
requests in /metrics) and answer the very bytes each gets alone, for the flux, sd3 and wan
presets and no preset; a client that leaves while its request waits costs the others nothing."""
import time

import httpx
import pytest
from factories import in_threads
from serve_process import serving

LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)   # > 128 tokens
# two requests of each rule (no preset: rows padded to the request's longest, LONG in both)
BODIES = [{"input": ["a cat sat on the mat", "hi there"], "preset": "flux"},
          {"input": "one two three four", "preset": "flux"},
          {"input": ["sun", "moon and stars"], "preset": "sd3"},
          {"input": "rain", "preset": "sd3"},
          {"input": "  a   dog &amp; a cat ", "preset": "wan"},
          {"input": ["x", "y z"], "preset": "wan", "dtype": "bfloat16"},
          {"input": [LONG, "a short one"]},
          {"input": [LONG, "another short one", "z"], "dtype": "float16"}]
# a request that keeps the model busy for a while (64 rows of 512 tokens, one pass of its own:
# ~0.3 s on 2 Zen 4 cores); the tests queue BLOCKERS of them, so that what is sent after them
# waits well past a client's 0.3 s timeout however fast the pass gets
BLOCKER = {"input": [f"blocker {i}" for i in range(64)], "preset": "flux"}
BLOCKERS = 6


@pytest.fixture(scope="module")
def server(text_model_folder):
    with serving(text_model_folder) as s:
        yield s


def post(server, body, timeout=120):
    with httpx.Client(base_url=server.url, timeout=timeout) as http:
        return http.post("/v1/encode", json={"encoding_format": "base64", **body})


def busy(server, since):
    """Once the blocker's pass has begun: a request runs and no pass has ended since."""
    deadline = time.monotonic() + 60
    while True:
        m = server.metrics()
        if m["minfer_requests_running"] >= 1:
            return m["minfer_encode_passes_total"] == since
        assert time.monotonic() < deadline, "the blocker never ran"
        time.sleep(0.01)


def test_concurrent_requests_share_passes_and_answer_their_own_bytes(server):
    before = server.settle()
    blocker, blocking = in_threads([lambda: post(server, BLOCKER)] * BLOCKERS)
    assert busy(server, before["minfer_encode_passes_total"]), "the blocker ended too soon"
    out, threads = in_threads([lambda b=b: post(server, b) for b in BODIES])
    for t in blocking + threads:
        t.join(180)
    after = server.settle()
    assert all(b.status_code == 200 for b in blocker)
    for got in out:
        assert not isinstance(got, Exception) and got.status_code == 200, got
    passes = after["minfer_encode_passes_total"] - before["minfer_encode_passes_total"]
    served = (after["minfer_encode_pass_requests_total"]
              - before["minfer_encode_pass_requests_total"])
    assert served == len(BODIES) + BLOCKERS
    assert passes < served   # requests that waited behind the blocker shared passes
    # one at a time: the very same answer bytes
    for body, got in zip(BODIES, out):
        alone = post(server, body)
        assert alone.status_code == 200 and alone.content == got.content, body


def test_a_client_that_leaves_while_waiting_costs_the_others_nothing(server):
    before = server.settle()
    blocker, blocking = in_threads([lambda: post(server, BLOCKER)] * BLOCKERS)
    assert busy(server, before["minfer_encode_passes_total"]), "the blocker ended too soon"
    # the first gives up after 0.3 s, its rows still waiting behind the blockers
    out, threads = in_threads([lambda: post(server, BODIES[0], timeout=0.3),
                                 lambda: post(server, BODIES[1]),
                                 lambda: post(server, BODIES[2])])
    for t in blocking + threads:
        t.join(180)
    after = server.settle()
    assert isinstance(out[0], httpx.TimeoutException)
    gone = 'minfer_requests_total{endpoint="encode",status="499"}'
    assert after.get(gone, 0) == before.get(gone, 0) + 1
    for body, got in zip(BODIES[1:3], out[1:]):
        assert got.status_code == 200 and got.content == post(server, body).content
    assert post(server, BODIES[0]).status_code == 200   # and the server goes on
