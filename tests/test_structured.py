"""Structured output (issue 29): response_format's grammar masks the tokens it forbids, so every
answer parses and validates, whatever the model; choices are one of the choices. Random T5
models (tests/factories.py) with the shipped tiny tokenizer (its 600 pieces include "{" and
"}") and, where ../shared/t5-tokenizer is present, T5's real 32k vocabulary (which has none)."""
import json
import shutil
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("llguidance")

import minfer
from minfer.errors import InputError
from minfer.generation import structured
from factories import write_t5

ROOT = Path(__file__).resolve().parents[1]
TINY_TOKENIZER = ROOT / "weights" / "tokenizers" / "tiny-t5"
T5_TOKENIZER = ROOT.parent / "shared" / "t5-tokenizer"
if not T5_TOKENIZER.is_dir():
    T5_TOKENIZER = Path("/work/shared/t5-tokenizer")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 5},
                                   "zip": {"type": "integer", "minimum": 1000, "maximum": 9999}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "colour", "address"],
    "additionalProperties": False,
}


def as_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def violations(value, schema, where="$"):
    """What in `value` the (subset of) JSON schema forbids: an independent check of the answers."""
    out = []
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: {value!r} not in enum")
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            return out + [f"{where}: not an object"]
        props = schema.get("properties", {})
        out += [f"{where}: {k} missing" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            out += [f"{where}: {k} not allowed" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                out += violations(v, props[k], f"{where}.{k}")
    elif kind == "string":
        if not isinstance(value, str):
            return out + [f"{where}: not a string"]
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30):
            out.append(f"{where}: length {len(value)}")
    elif kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return out + [f"{where}: not an integer"]
        if not schema.get("minimum", -1e300) <= value <= schema.get("maximum", 1e300):
            out.append(f"{where}: {value} out of bounds")
    elif kind == "array":
        if not isinstance(value, list):
            return out + [f"{where}: not an array"]
        if len(value) > schema.get("maxItems", 1 << 30):
            out.append(f"{where}: {len(value)} items")
        for i, v in enumerate(value):
            out += violations(v, schema["items"], f"{where}[{i}]")
    return out


def test_the_validator_rejects_what_it_should():   # (so that its silence below means something)
    good = {"name": "ab", "age": 3, "colour": "red", "address": {"city": "x", "zip": 1234}}
    assert violations(good, PERSON) == []
    for bad in ({**good, "age": 121}, {**good, "colour": "pink"}, {**good, "extra": 1},
                {**good, "name": ""}, {**good, "address": {"city": "x"}}, {**good, "age": "3"}):
        assert violations(bad, PERSON)


def random_model(folder, tokenizer, vocab_size, seed=0):
    write_t5(folder, seed=seed, vocab_size=vocab_size, d_model=32, num_heads=2, d_kv=16, d_ff=64)
    for f in tokenizer.iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    return minfer.load(str(folder))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return random_model(tmp_path_factory.mktemp("rand-t5"), TINY_TOKENIZER, 600)


def test_200_sampled_answers_of_a_random_model_parse_and_validate(model):
    rows = model.generate(["a person", "another one"], response_format=as_format(PERSON),
                          do_sample=True, seed=7, num_return_sequences=100, max_new_tokens=200,
                          return_details=True)
    answers = [r for row in rows for r in row]
    assert len(answers) == 200
    assert {r.finish_reason for r in answers} == {"eos"}       # each ended by the grammar
    for r in answers:
        value = json.loads(r.text)
        assert violations(value, PERSON) == [], r.text
    # a random model: the answers differ (the mask shapes them, it does not decide them)
    assert len({r.text for r in answers}) > 150


def test_greedy_beams_and_streams_validate(model):
    fmt = as_format(PERSON)
    greedy = model.generate("x", response_format=fmt, max_new_tokens=200)
    assert violations(json.loads(greedy), PERSON) == []
    beams = model.generate("x", response_format=fmt, max_new_tokens=200, num_beams=3,
                           num_return_sequences=3)
    assert len(beams) == 3 and all(violations(json.loads(b), PERSON) == [] for b in beams)
    sampled_beams = model.generate("y", response_format=fmt, max_new_tokens=200, num_beams=2,
                                   do_sample=True, seed=1)
    assert violations(json.loads(sampled_beams), PERSON) == []
    streamed = "".join(model.generate("x", response_format=fmt, max_new_tokens=200, stream=True))
    assert streamed == greedy          # the same masked decoding, piece by piece


def test_the_mask_changes_only_what_the_grammar_forbids(model):
    # a choice of every one-token answer the greedy model would give: the grammar then forbids
    # nothing the model wanted, and the answer is the unconstrained one
    free = model.generate("z", max_new_tokens=1)
    if free:
        assert model.generate("z", max_new_tokens=5, response_format={
            "type": "choice", "choice": [free, free + "x"]}) in (free, free + "x")


def test_concurrent_requests_each_keep_their_own_grammar(model):
    formats = [as_format(PERSON), {"type": "choice", "choice": ["yes", "no"]},
               {"type": "json_object"}, None]
    results = [None] * 8

    def run(i):
        [r] = model.generate(f"p{i}", response_format=formats[i % 4], do_sample=True,
                             seed=i, max_new_tokens=200, return_details=True)
        results[i] = r.text if r.finish_reason == "eos" or i % 4 == 3 else "cut: " + r.text
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, text in enumerate(results):
        assert text is not None and not text.startswith("cut: "), text
        if i % 4 == 0:
            assert violations(json.loads(text), PERSON) == []
        elif i % 4 == 1:
            assert text in ("yes", "no")
        elif i % 4 == 2:
            assert isinstance(json.loads(text), dict)


def test_choices_and_json_object(model):
    choices = ["positive", "negative", "n/a", 'say "hi"']
    out = model.generate(["a", "b", "c"], response_format={"type": "choice", "choice": choices},
                         do_sample=True, seed=3, num_return_sequences=20, max_new_tokens=30)
    assert all(text in choices for row in out for text in row)
    assert len({text for row in out for text in row}) > 1
    objects = model.generate(["q"], response_format={"type": "json_object"}, do_sample=True,
                             seed=4, num_return_sequences=20, max_new_tokens=200,
                             return_details=True)[0]
    for r in objects:
        if r.finish_reason == "eos":
            assert isinstance(json.loads(r.text), dict)
    assert sum(r.finish_reason == "eos" for r in objects) >= 15


def test_near_the_length_limit_values_are_closed(model):
    # an unbounded string: a random model rarely writes '"' by itself; the last steps before
    # max_new_tokens steer to closers, so the answer ends by the grammar within the limit
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"],
              "additionalProperties": False}
    rows = model.generate(["w"], response_format=as_format(schema), do_sample=True, seed=5,
                          num_return_sequences=20, max_new_tokens=40, return_details=True)[0]
    assert {r.finish_reason for r in rows} == {"eos"}
    assert all(violations(json.loads(r.text), schema) == [] for r in rows)


@pytest.mark.parametrize("fmt,words", [
    ({"type": "xml"}, "type must be"),
    ("json", "must be an object"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": 3}}, "json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}, "not a usable schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nope"}}}, "not a usable schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5,
                                                        "maximum": 1}}}, "Unsatisfiable"),
    ({"type": "choice", "choice": []}, "non-empty list"),
    ({"type": "choice", "choice": ["a", 3]}, "non-empty list"),
])
def test_bad_formats_are_one_line_errors_naming_the_field(model, fmt, words):
    with pytest.raises(InputError) as e:
        model.generate("x", response_format=fmt)
    assert "response_format" in str(e.value) and words in str(e.value)
    assert "\n" not in str(e.value)


def test_text_is_no_format(model):
    assert model.generate("x", response_format={"type": "text"}, max_new_tokens=5) == \
        model.generate("x", max_new_tokens=5)


def test_without_llguidance_a_format_is_a_clear_error(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)     # import llguidance now fails
    monkeypatch.setattr(structured, "_grammars", type(structured._grammars)())
    with pytest.raises(InputError, match=r"minfer\[structured\]"):
        model.generate("x", response_format={"type": "json_object"})


@pytest.mark.skipif(not T5_TOKENIZER.is_dir(), reason="../shared/t5-tokenizer is absent")
def test_t5_vocabulary_refuses_objects_and_writes_choices_and_arrays(tmp_path):
    t5 = random_model(tmp_path / "t5", T5_TOKENIZER, 32128)
    for fmt in ({"type": "json_object"}, as_format(PERSON)):
        with pytest.raises(InputError, match=r"needs '\{', which this model's vocabulary cannot"):
            t5.generate("x", response_format=fmt)
    labels = ["positive", "negative", "neutral"]
    out = t5.generate(["a", "b"], response_format={"type": "choice", "choice": labels},
                      do_sample=True, seed=0, num_return_sequences=10, max_new_tokens=10)
    assert all(text in labels for row in out for text in row)
    digits = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
              "maxItems": 3}
    rows = t5.generate(["c"], response_format=as_format(digits), do_sample=True, seed=1,
                       num_return_sequences=10, max_new_tokens=40, return_details=True)[0]
    assert {r.finish_reason for r in rows} == {"eos"}
    assert all(violations(json.loads(r.text), digits) == [] for r in rows)
    with pytest.raises(InputError, match="choice 'a{b' cannot be written"):
        t5.generate("x", response_format={"type": "choice", "choice": ["a{b"]})
