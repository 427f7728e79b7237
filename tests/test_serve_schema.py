"""The server's pieces that need no HTTP: the OpenAI fields mapped onto generate's options
(schema.py), the chat rule (chat.py), the limits (limits.py), admission (workers.py) and the
jobs' refusals (jobs.py). The server itself is tested over HTTP in test_serve.py."""
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("starlette")

import minfer
from minfer.serve import jobs, schema
from minfer.serve.chat import chat_prompt
from minfer.serve.errors import APIError, from_exception
from minfer.serve.limits import LONGEST_DEFAULT, Limits, longest_prompt
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
    ({"logprobs": 2}, "logprobs", "not supported"),
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
    for body, match in (({"input": ""}, "empty"), ({"input": [[1, 2]]}, "token ids"),
                        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
                        ({}, "required")):
        with pytest.raises(APIError, match=match):
            schema.embedding_request(body)


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
    with pytest.raises(minfer.InputError, match="no encoder") as e:
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
