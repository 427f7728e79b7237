"""The server's pieces that need no HTTP: the OpenAI fields mapped onto generate's options
(schema.py), the chat rule (chat.py), the limits (limits.py), admission (workers.py) and the
jobs' refusals (jobs.py). The server itself is tested over HTTP in test_serve.py."""
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("starlette")

import minfer
from minfer.serve import jobs, schema
from minfer.serve.chat import chat_prompt
from minfer.serve.errors import APIError, from_exception
from minfer.serve.limits import LONGEST_DEFAULT, Limits, clean_api_key, longest_prompt
from minfer.serve.workers import Workers

ROOT = Path(__file__).resolve().parents[1]
DATES = ROOT / "weights" / "tiny-t5-dates"


@pytest.fixture(scope="module")
def model():
    return minfer.load(DATES)


def options(body, max_tokens=2048, max_input=512):
    return schema.completion_request({"prompt": "x", **body}, max_tokens, max_input).options


# -- fields -> options ----------------------------------------------------------------------------
@pytest.mark.parametrize("body, want", [
    ({}, dict(do_sample=None, temperature=None, max_new_tokens=None)),     # the checkpoint's own
    ({"temperature": 0}, dict(do_sample=False, temperature=None)),         # greedy
    ({"temperature": 0.7}, dict(do_sample=True, temperature=0.7)),
    ({"top_p": 0.9}, dict(do_sample=True, top_p=0.9)),                     # alone: sampling
    ({"temperature": 0, "top_p": 0.9}, dict(do_sample=False)),             # 0 wins
    ({"top_k": -1}, dict(do_sample=True, top_k=0)),                        # vLLM's "no cut"
    ({"max_tokens": 7, "min_tokens": 2}, dict(max_new_tokens=7, min_new_tokens=2)),
    ({"n": 3}, dict(num_return_sequences=3, num_beams=None)),
    ({"use_beam_search": True, "best_of": 4, "n": 2}, dict(num_beams=4, num_return_sequences=2)),
    ({"num_beams": 3}, dict(num_beams=3)),
    ({"stop": "\n"}, dict(stop=["\n"])),
    ({"truncate_prompt_tokens": 9}, dict(max_input_tokens=9, truncation=True)),
    ({"seed": 5, "repetition_penalty": 1.2}, dict(seed=5, repetition_penalty=1.2)),
])
def test_openai_fields_map_onto_generate_options(body, want):
    got = options(body)
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize("body, param, match", [
    ({"temperature": "hot"}, "temperature", "must be a finite number"),
    ({"temperature": -1}, "temperature", "at least 0"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"max_tokens": 5000}, "max_tokens", "over this server's limit of 2048"),
    ({"max_tokens": 2.5}, "max_tokens", "an integer"),
    ({"max_tokens": True}, "max_tokens", "an integer"),
    ({"n": 0}, "n", "at least 1"),
    ({"stream": "yes"}, "stream", "true or false"),
    ({"stop": [1]}, "stop", "string or a non-empty list"),
    ({"use_beam_search": True}, "best_of", "greater than 1"),
    ({"best_of": 3}, "best_of", "needs use_beam_search"),
    ({"logprobs": 21}, "logprobs", "at most 20"),
    ({"echo": True}, "echo", "not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"truncate_prompt_tokens": 600}, "truncate_prompt_tokens", "limit of 512"),
    ({"stream_options": {"include_usage": "y"}}, "stream_options", "true or false"),
    ({"stop": [str(i) for i in range(17)]}, "stop", "more than 16"),
    ({"prompt": [1, 2, 3]}, "prompt", "token ids are not supported"),
    ({"prompt": []}, "prompt", "non-empty list"),
    ({"prompt": None}, "prompt", "required"),
])
def test_bad_fields_are_400s_naming_the_field(body, param, match):
    with pytest.raises(APIError, match=match) as e:
        options(body)
    assert (e.value.status, e.value.param) == (400, param)


def test_harmless_values_of_unsupported_fields_pass():
    options({"logprobs": None, "echo": False, "presence_penalty": 0, "logit_bias": {},
             "user": "someone", "an_unknown_field": [1, 2]})


def test_settle_applies_the_checkpoints_defaults_under_the_servers_cap(model):
    req = schema.settle(model, schema.completion_request({"prompt": "x"}, 2048, 512), 2048)
    assert req.options["max_new_tokens"] == 24          # tiny-t5-dates' generation_config.json
    req = schema.settle(model, schema.completion_request({"prompt": "x"}, 10, 512), 10)
    assert req.options["max_new_tokens"] == 10          # capped by --max-tokens
    req = schema.settle(model, schema.completion_request(
        {"prompt": "x", "ignore_eos": True, "max_tokens": 30}, 2048, 512), 2048)
    assert req.options["min_new_tokens"] == req.options["max_new_tokens"] == 30   # no early eos


@pytest.mark.parametrize("body, param", [
    ({"n": 2}, "n"),                                    # greedy cannot give 2 sequences
    ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"n": 2, "use_beam_search": True, "best_of": 2, "stream": True}, "n"),
])
def test_settle_refuses_what_the_library_refuses_naming_the_field(model, body, param):
    with pytest.raises(APIError) as e:
        schema.settle(model, schema.completion_request({"prompt": "x", **body}, 2048, 512), 2048)
    assert (e.value.status, e.value.param) == (400, param)


def test_the_request_body_must_be_a_json_object():
    assert schema.parse_body(b'{"a": 1}') == {"a": 1}
    for raw, match in ((b"{", "not valid JSON"), (b"[1]", "must be a JSON object"),
                       (b'{"a": NaN}', "not valid JSON"), (b"\xff", "not UTF-8"),
                       (b"[" * 100000, "not valid JSON")):
        with pytest.raises(APIError, match=match):
            schema.parse_body(raw)


def test_the_model_field_must_name_the_served_model():
    schema.check_model({}, "m")
    schema.check_model({"model": "m"}, "m")
    with pytest.raises(APIError) as e:
        schema.check_model({"model": "other"}, "m")
    assert (e.value.status, e.value.code) == (404, "model_not_found")


def test_embedding_requests():
    req = schema.embedding_request({"input": "a", "encoding_format": "base64"})
    assert (req.texts, req.base64, req.dimensions) == (["a"], True, None)
    # an empty text is a text (model.embed and `minfer embed` embed it); an empty list is not
    assert schema.embedding_request({"input": ""}).texts == [""]
    assert schema.embedding_request({"input": ["a", ""]}).texts == ["a", ""]
    for body, match in (({"input": []}, "non-empty list"), ({"input": [[1, 2]]}, "token ids"),
                        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
                        ({}, "required")):
        with pytest.raises(APIError, match=match):
            schema.embedding_request(body)


def _embedding(body):
    return schema.embedding_request(body, 4)


def _completion(body):
    return schema.completion_request(body, 2048, 512, 4)


def _chat(body):
    return schema.chat_request({"messages": [{"role": "user", "content": "a"}], **body},
                               2048, 512, 4)


@pytest.mark.parametrize("make, over, at_limit, param", [
    (_embedding, {"input": ["a"] * 5}, {"input": ["a"] * 4}, "input"),
    (_completion, {"prompt": ["a"] * 5}, {"prompt": ["a"] * 4}, "prompt"),
    (_completion, {"prompt": "a", "n": 5}, {"prompt": "a", "n": 4}, "n"),
    (_completion, {"prompt": ["a"] * 2, "n": 3}, {"prompt": ["a"] * 2, "n": 2}, "n"),
    (_completion, {"prompt": ["a"] * 2, "use_beam_search": True, "best_of": 3},
     {"prompt": ["a"] * 2, "use_beam_search": True, "best_of": 2}, "best_of"),
    (_completion, {"prompt": ["a"] * 3, "num_beams": 2}, {"prompt": ["a"] * 2, "num_beams": 2},
     "num_beams"),
    (_chat, {"n": 5}, {"n": 4}, "n"),
])
def test_inputs_prompts_and_sequences_are_capped_per_request(make, over, at_limit, param):
    with pytest.raises(APIError, match=r"limit of 4 per request \(serve --max-inputs\)") as e:
        make(over)
    assert (e.value.status, e.value.param) == (400, param)
    make(at_limit)   # the limit itself is allowed


def test_the_checkpoints_own_beams_count_against_the_sequence_cap(beam_model_folder):
    """prompts x beams is capped also when the beam width is the checkpoint's default (its
    generation_config.json), which the request's own check cannot see."""
    model = minfer.load(beam_model_folder)
    assert schema.settle(model, _completion({"prompt": ["a"] * 1}), 2048, 4) \
        .options.get("num_beams") is None                     # 1 prompt x 4 beams: at the limit
    with pytest.raises(APIError, match=r"num_beams 4 x 2 prompts = 8 sequences \(this model's "
                       r"default num_beams.*limit of 4 per request") as e:
        schema.settle(model, _completion({"prompt": ["a"] * 2}), 2048, 4)
    assert (e.value.status, e.value.param) == (400, "num_beams")
    with pytest.raises(APIError, match="num_beams 4 x 2 prompts") as e:   # n below the beams
        schema.settle(model, _completion({"prompt": ["a"] * 2, "n": 2}), 2048, 4)
    with pytest.raises(APIError, match="num_beams 4 x 2 prompts"):        # streamed too
        schema.settle(model, _completion({"prompt": ["a"] * 2, "stream": True}), 2048, 4)
    schema.settle(model, _completion({"prompt": ["a"] * 4, "num_beams": 1}), 2048, 4)
    schema.settle(model, _completion({"prompt": ["a"] * 2}), 2048, 8)
    with pytest.raises(APIError, match="num_beams 4 x 600 prompts"):   # the default cap
        schema.settle(model, schema.completion_request({"prompt": ["a"] * 600}, 2048, 512),
                      2048)


def test_the_default_cap_is_openais_2048_inputs():
    assert Limits().max_inputs == 2048
    schema.embedding_request({"input": ["a"] * 2048})
    with pytest.raises(APIError, match="100000 inputs"):   # 0.5 MB of body, no longer 259 MB out
        schema.embedding_request({"input": ["a"] * 100000})


# -- the chat rule ----------------------------------------------------------------------------------
def test_one_user_message_is_the_prompt_as_is():
    assert chat_prompt([{"role": "user", "content": "Translate to German: Hello"}]) == \
        "Translate to German: Hello"


def test_system_messages_come_first_and_conversations_are_transcripts():
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"},
                                             {"type": "text", "text": "Say it in words."}]}]
    assert chat_prompt(messages) == ("Answer briefly.\n\nUser: Hi\nAssistant: Hello.\n"
                                     "User: What is 2+2?\nSay it in words.\nAssistant:")
    assert chat_prompt(messages[:2]) == "Answer briefly.\n\nHi"


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ("hello", "messages"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content[0]"),
    ([{"role": "system", "content": "x"}], "messages"),      # nobody asked anything
])
def test_chat_messages_that_make_no_prompt_are_refused(messages, param):
    with pytest.raises(APIError) as e:
        chat_prompt(messages)
    assert (e.value.status, e.value.param) == (400, param)


# -- limits, admission, jobs ------------------------------------------------------------------------
def test_the_default_prompt_limit_is_what_the_arena_holds_alone(model):
    n = longest_prompt(model, 2048)
    assert 1 <= n < LONGEST_DEFAULT
    assert model.plan(1, n, 24)["peak"] <= model.free_when_idle < model.plan(1, n + 1, 24)["peak"]
    assert Limits().checked(model).max_input_tokens == n
    assert Limits(max_input_tokens=50).checked(model).max_input_tokens == 50
    for bad in (dict(max_running=0), dict(max_tokens=1.5), dict(request_timeout=float("nan")),
                dict(max_waiting=-1)):
        with pytest.raises(minfer.InputError, match=next(iter(bad))):
            Limits(**bad).checked(model)


def test_a_request_beyond_running_and_waiting_is_refused_at_once(model):
    workers = Workers(model, max_running=1, max_waiting=1)
    release = threading.Event()
    try:
        first = workers.submit(release.wait, 30)
        second = workers.submit(lambda: "ran")
        with pytest.raises(APIError) as e:
            workers.submit(lambda: "never")
        assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
        assert (workers.running(), workers.waiting()) == (1, 1)
        release.set()
        assert first.result(30) is True and second.result(30) == "ran"
        assert workers.submit(lambda: "again").result(30) == "again"   # room again
    finally:
        release.set()
        workers.shutdown()


def test_embedding_needs_an_encoder_and_texts_within_the_limit(model):
    xl = minfer.load(ROOT / "weights" / "tiny-xl-recall")
    request = schema.embedding_request({"input": ["a b"]})
    with pytest.raises(minfer.InputError, match="cannot embed") as e:
        jobs.embed(jobs.Job(xl), request, 100)
    assert from_exception(e.value).status == 400
    with pytest.raises(minfer.InputError, match="limit of 2"):
        jobs.embed(jobs.Job(model), request, 2)
    vectors, tokens = jobs.embed(jobs.Job(model), request, 100)
    assert (vectors == model.embed(["a b"])).all() and tokens == len(model.tokenizer.encode("a b"))


def test_embeddings_run_a_window_at_a_time_and_stop_between_windows(model, monkeypatch):
    monkeypatch.setattr(jobs, "EMBED_WINDOW", 2)
    texts = ["one", "two two", "three", "four four four", "five"]
    request = schema.embedding_request({"input": texts})
    vectors, _ = jobs.embed(jobs.Job(model), request, 100)
    assert (vectors == np.concatenate([model.embed(texts[i:i + 2]) for i in (0, 2, 4)])).all()
    job, calls = jobs.Job(model), []
    real = type(model).embed

    def embed(self, window, **kwargs):
        calls.append(window)
        job.cancel()                    # the client leaves while the first window runs
        return real(self, window, **kwargs)
    monkeypatch.setattr(type(model), "embed", embed)
    with pytest.raises(minfer.Cancelled):
        jobs.embed(job, request, 100)
    assert calls == [texts[:2]]


def _stream_request(model, prompts, n, **body):
    request = schema.completion_request({"prompt": prompts, "n": n, "stream": True,
                                         "temperature": 1.0, "seed": 1, **body}, 2048, 512)
    return schema.settle(model, request, 2048)


def _made_streams(model, monkeypatch, after=None):
    """Count the streams model.generate makes; `after(k)` runs once the k-th is made."""
    made = []
    real = type(model).generate

    def generate(self, *args, **kwargs):
        made.append(real(self, *args, **kwargs))
        if after is not None:
            after(len(made))
        return made[-1]
    monkeypatch.setattr(type(model), "generate", generate)
    return made


def test_stream_setup_stops_at_once_when_the_request_is_cancelled(model, monkeypatch):
    """A streamed request of many prompts x n is set up one stream at a time (~1 ms each): a
    client that leaves (or SIGTERM's end of the grace period) stops it there, instead of the
    worker making every stream first (seconds of work after the client is gone)."""
    job = jobs.Job(model)
    made = _made_streams(model, monkeypatch, after=lambda k: k == 3 and job.cancel())
    emitted, counted = [], []
    jobs.stream(job, _stream_request(model, ["a b", "c d"] * 8, 16), emitted.append,
                lambda *c: counted.append(c))
    assert len(made) == 3                                   # of 256: none made after the cancel
    assert [type(e) for e in emitted] == [jobs.Failed]
    assert isinstance(emitted[0].error, minfer.Cancelled)
    assert all(s.finish_reason is not None for s in made)   # each given back
    assert len(counted) == 1


def test_stream_setup_stops_at_its_deadline(model, monkeypatch):
    late = APIError(504, "the request ran longer than 1 s")
    job = jobs.Job(model, deadline=time.monotonic() + 0.3, late=late)
    made = _made_streams(model, monkeypatch, after=lambda k: time.sleep(0.05))
    emitted = []
    t0 = time.monotonic()
    jobs.stream(job, _stream_request(model, ["a b"] * 64, 32), emitted.append, lambda *c: None)
    assert time.monotonic() - t0 < 2 and 3 <= len(made) < 64 * 32
    assert [type(e) for e in emitted] == [jobs.Failed] and emitted[0].error is late
    assert job.cancelled.is_set()


def test_streamed_prompt_tokens_are_counted_once_per_prompt_as_usage_reports_them(model):
    prompts = ["spell: 12", "date: 4th of July 1976"]
    counted, emitted = [], []
    jobs.stream(jobs.Job(model), _stream_request(model, prompts, 3, max_tokens=4),
                emitted.append, lambda *c: counted.append(c))
    ended = [e for e in emitted if isinstance(e, jobs.Ended)]
    assert len(ended) == 6
    usage = sum(e.prompt_tokens for e in ended if e.index % 3 == 0)   # what _events reports
    assert usage == sum(len(model.tokenizer.encode(p)) for p in prompts)
    assert counted == [(usage, sum(e.new_tokens for e in ended))]


def test_non_finite_outputs_are_a_500_with_their_own_code():
    e = from_exception(minfer.errors.NonFiniteError("m: layer 3's outputs hold NaN"))
    assert (e.status, e.code, e.type) == (500, "non_finite_output", "internal_server_error")
    assert e.message == "m: layer 3's outputs hold NaN"
    assert from_exception(RuntimeError("x")).code == "internal_error"


def test_after_shutdown_a_request_gets_503_not_a_500(model):
    workers = Workers(model, max_running=1, max_waiting=1)
    workers.shutdown()
    with pytest.raises(APIError) as e:
        workers.submit(lambda: "never")
    assert (e.value.status, e.value.code) == (503, "shutting_down")


@pytest.mark.parametrize("error", [RuntimeError("can't start new thread"),
                                   MemoryError("no room for a thread stack"),
                                   ValueError("a bug in the pool")])
def test_a_pool_that_refuses_work_is_a_503_and_gives_the_place_back(model, monkeypatch, error):
    """Refused by the pool while the server is up (no thread could be started): not "shutting
    down", and the request's place in the queue is given back (a leaked place per failure
    would end in every request being a 429)."""
    workers = Workers(model, max_running=1, max_waiting=0)
    try:
        def refuse(*args, **kwargs):
            raise error
        with monkeypatch.context() as patch:
            patch.setattr(workers._pool, "submit", refuse)
            for _ in range(3):   # more than the queue holds: a leak would make the 3rd a 429
                with pytest.raises(APIError) as e:
                    workers.submit(lambda: "never")
                assert (e.value.status, e.value.code) == (503, "worker_unavailable")
                assert "could not start a worker" in e.value.message
                assert e.value.headers["Retry-After"] == "1"
                assert (workers.running(), workers.waiting()) == (0, 0)
        assert workers.submit(lambda: "ran").result(30) == "ran"
    finally:
        workers.shutdown()


def test_a_pool_shut_down_while_submitting_is_a_503_shutting_down(model, monkeypatch):
    workers = Workers(model, max_running=1, max_waiting=1)
    real = workers._pool.submit

    def shut_meanwhile(*args, **kwargs):   # SIGTERM's drain between admission and the pool
        workers.shutdown()
        return real(*args, **kwargs)
    monkeypatch.setattr(workers._pool, "submit", shut_meanwhile)
    with pytest.raises(APIError) as e:
        workers.submit(lambda: "never")
    assert (e.value.status, e.value.code) == (503, "shutting_down")
    assert workers.waiting() == 0


def test_work_refused_because_no_thread_started_never_runs_later(model, monkeypatch):
    """The pool queues the work before it starts a thread for it: when the start fails, the
    next thread that frees up must not run the refused request for nobody."""
    import concurrent.futures.thread as pool_threads

    class NoThread(threading.Thread):
        def start(self):
            raise RuntimeError("can't start new thread")
    workers = Workers(model, max_running=2, max_waiting=2)
    release, ran = threading.Event(), []
    try:
        first = workers.submit(release.wait, 30)        # the pool's one thread, busy
        with monkeypatch.context() as patch:
            patch.setattr(pool_threads.threading, "Thread", NoThread)
            with pytest.raises(APIError) as e:
                workers.submit(ran.append, "refused")   # needs a second thread: none starts
        assert (e.value.status, e.value.code) == (503, "worker_unavailable")
        release.set()
        assert first.result(30) is True
        workers._pool.shutdown(wait=True)   # every queued item taken by the freed thread
        assert ran == []
    finally:
        release.set()
        workers.shutdown()


@pytest.mark.parametrize("given, want", [("k ", "k"), ("\tk-1 ", "k-1"), ("a b", "a b"),
                                         (None, None)])
def test_api_keys_are_stripped_as_http_strips_header_values(given, want):
    assert clean_api_key(given) == want


@pytest.mark.parametrize("given, match", [("", "empty"), ("  ", "only whitespace"),
                                          ("a\tb", "control character"),
                                          ("a\x00b", "control character"),
                                          ("clé", "non-ASCII")])
def test_api_keys_no_client_can_send_are_refused(given, match):
    with pytest.raises(minfer.InputError, match=match):
        clean_api_key(given)


@pytest.mark.parametrize("header, ok", [
    ("localhost", True), ("LOCALHOST:8000", True), ("localhost.", True), ("127.0.0.1", True),
    ("127.3.2.1:80", True), ("[::1]", True), ("[::1]:8000", True), (None, True),
    ("app.test", True), ("app.test:443", True),
    ("evil.test", False), ("evil.test:8000", False), ("localhost.evil.test", False),
    ("10.0.0.1", False), ("[::2]:80", False), ("", False), ("127.0.0.1.evil.test", False),
])
def test_host_headers_must_name_loopback_or_an_allowed_host(header, ok):
    middleware = pytest.importorskip("minfer.serve.middleware")
    assert middleware.host_allowed(header, middleware.host_names(["app.test"])) is ok
    assert middleware.host_allowed("anything.test", middleware.host_names(["*"]))


@pytest.mark.parametrize("name", ["", "http://a.test", "a.test:80", "a b", "a/b"])
def test_allowed_host_names_are_names(name):
    middleware = pytest.importorskip("minfer.serve.middleware")
    with pytest.raises(minfer.InputError, match="not a host name"):
        middleware.host_names([name])
