"""The text layer (generation/text.py): prompts in, text out, streaming, stop strings."""
import numpy as np
import pytest

from minfer import generation as g
from minfer.errors import InputError


def test_stop_matcher_holds_back_partial_matches():
    m = g.StopMatcher(["END", "\n\n"])
    pieces = [m.feed(p) for p in ["Hello E", "N", "ough. Then EN", "D more"]]
    assert pieces == [("Hello ", False), ("", False), ("ENough. Then ", False), ("", True)]
    m = g.StopMatcher(["xyz"])
    assert m.feed("abc") == ("abc", False) and m.feed("xy") == ("", False) and m.flush() == "xy"


def test_text_in_text_out_shapes(text_model):
    one = text_model.generate("date: March 5, 2021", max_new_tokens=6)
    assert isinstance(one, str)
    many = text_model.generate(["a b c", "date: 1999"], max_new_tokens=6)
    assert isinstance(many, list) and len(many) == 2 and all(isinstance(t, str) for t in many)
    assert many[0] == text_model.generate("a b c", max_new_tokens=6)  # batching changes nothing
    multi = text_model.generate("a b c", max_new_tokens=5, num_beams=3, num_return_sequences=2)
    assert isinstance(multi, list) and len(multi) == 2
    ids = text_model.generate([[5, 6, 7, 1]], max_new_tokens=4)
    assert ids[0][0] == 0 and 1 < len(ids[0]) <= 5


def test_details_report_ids_and_reasons(text_model):
    [[r]] = text_model.generate(["a b c"], max_new_tokens=5, return_details=True)
    assert r.token_ids[0] == 0 and r.new_tokens == len(r.token_ids) - 1 <= 5
    assert r.finish_reason in ("eos", "length") and r.prompt_tokens > 0
    assert r.text == text_model.tokenizer.decode(r.token_ids)


def test_a_prompt_over_max_input_tokens_is_told_in_pythons_words(text_model):
    with pytest.raises(InputError, match=r"more than max_input_tokens 3 \(truncation=True cuts it\)$"):
        text_model.generate("a b c d e f g", max_input_tokens=3)
    [r] = text_model.generate("a b c d e f g", max_input_tokens=3, return_details=True)
    assert r.error.endswith("(truncation=True cuts it)") and "--truncate" not in r.error


def test_details_follow_the_shape_of_the_input(text_model):
    """A string in gives that prompt's list of Results (one per returned sequence), as a string
    in gives a string without details; a list gives one such list per prompt."""
    one = text_model.generate("a b c", max_new_tokens=5, return_details=True)
    assert isinstance(one, list) and len(one) == 1 and isinstance(one[0], g.Result)
    assert one[0].text == text_model.generate("a b c", max_new_tokens=5)
    two = text_model.generate("a b c", max_new_tokens=5, num_beams=3, num_return_sequences=2,
                              return_details=True)
    assert [type(r) for r in two] == [g.Result, g.Result]
    assert [r.text for r in two] == text_model.generate("a b c", max_new_tokens=5, num_beams=3,
                                                        num_return_sequences=2)
    listed = text_model.generate(["a b c", "date: 1999"], max_new_tokens=5, return_details=True)
    assert [len(row) for row in listed] == [1, 1] and listed[0][0].text == one[0].text
    ids = text_model.generate([[5, 6, 7, 1]], max_new_tokens=4, return_details=True)
    assert len(ids) == 1 and isinstance(ids[0][0], g.Result)
    array = text_model.generate(np.array("a b c"), max_new_tokens=5, return_details=True)
    assert [r.text for r in array] == [one[0].text]      # a 0-d string array is one prompt


@pytest.mark.parametrize("options", [{}, {"do_sample": True, "seed": 3, "top_k": 20},
                                     {"stop": ["e"]}, {"num_beams": 3}])
def test_stream_pieces_join_to_the_whole_text(text_model, options):
    prompt = "translate: the house is wonderful"
    whole = text_model.generate(prompt, max_new_tokens=24, **options)
    pieces = list(text_model.generate(prompt, max_new_tokens=24, stream=True, **options))
    assert "".join(pieces) == whole
    if "num_beams" not in options:
        assert all(isinstance(p, str) and p for p in pieces)


def test_stream_of_token_ids_yields_ids(text_model):
    ids = list(text_model.generate([9, 10, 11, 1], stream=True, max_new_tokens=7))
    assert all(isinstance(i, int) for i in ids)
    assert [0] + ids == text_model.generate([[9, 10, 11, 1]], max_new_tokens=7)[0]


def test_closing_a_stream_early_releases_the_arena(text_model):
    arena = text_model.backend.arena
    before = arena.used
    it = text_model.generate("a b c d", stream=True, max_new_tokens=50, min_new_tokens=50)
    next(it)
    assert arena.used > before
    it.close()
    assert arena.used == before


def test_stop_strings_cut_and_stop(text_model):
    full = text_model.generate("a b c", max_new_tokens=30, min_new_tokens=30)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip()
    [[r]] = text_model.generate(["a b c"], max_new_tokens=30, min_new_tokens=30, stop=[stop],
                                return_details=True)
    assert r.finish_reason == "stop" and r.text == full[:full.find(stop)]
    assert r.new_tokens < 30  # decoding stopped, not just the text


def test_sampling_is_reproducible_and_varies_with_the_seed(text_model):
    a = text_model.generate("a b c", do_sample=True, seed=7, max_new_tokens=12, temperature=1.5)
    b = text_model.generate("a b c", do_sample=True, seed=7, max_new_tokens=12, temperature=1.5)
    others = {text_model.generate("a b c", do_sample=True, seed=s, max_new_tokens=12,
                                  temperature=1.5) for s in range(8, 14)}
    assert a == b and len(others | {a}) > 1


def test_task_applies_prefix_and_settings(text_model):
    with_task = text_model.generate("The house", task="translation_en_to_de", return_details=True)
    manual = text_model.generate("translate English to German: The house", num_beams=2,
                                 max_new_tokens=8, early_stopping=True, return_details=True)
    assert with_task[0].token_ids == manual[0].token_ids
    assert with_task[0].new_tokens <= 8


def test_text_input_needs_a_tokenizer(tmp_path):
    from factories import write_t5

    import minfer
    model = minfer.load(write_t5(tmp_path / "m"))
    with pytest.raises(InputError, match="text input requires a tokenizer"):
        model.generate("hello")
    with pytest.raises(InputError, match="stop strings requires a tokenizer"):
        model.generate([[1]], stop=["x"])


@pytest.mark.parametrize("prompt", ["", "   ", [""]])
def test_empty_prompts_are_refused(text_model, prompt):
    with pytest.raises(InputError, match="empty prompt"):
        text_model.generate(prompt)


# -- prompts: generated bad prompts at generated places, through generate() and stream=True ---------
BLANKS = ["", " ", "\n", "\t \n", "\u3000", "\u2003\u2003"]
SURROGATE_PROMPTS = [("\ud800", 0), ("a b \udfff c", 4), ("date: 1999\udc80", 10)]


def prompt_lists(bad):
    """The bad prompt alone, first, and last in a list: (inputs, its index or None)."""
    return [(bad, None), ([bad, "a b c"], 0), (["a b c", "x y", bad], 2)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("inputs,at", [c for b in BLANKS for c in prompt_lists(b)])
def test_blank_prompts_are_named(text_model, inputs, at, stream):
    if stream and isinstance(inputs, list):
        inputs = inputs[at:at + 1]
        at = 0
    with pytest.raises(InputError, match="empty prompt") as e:
        text_model.generate(inputs, max_new_tokens=2, stream=stream)
    assert (at is None or f"prompt {at}" in str(e.value)) and "\n" not in str(e.value)


@pytest.mark.parametrize("inputs,at,char", [(i, a, c) for bad, c in SURROGATE_PROMPTS
                                             for i, a in prompt_lists(bad)])
def test_lone_surrogates_in_prompts_are_named(text_model, inputs, at, char):
    with pytest.raises(InputError, match=f"character {char} .* lone surrogate") as e:
        text_model.generate(inputs, max_new_tokens=2)
    assert at is None or f"prompt {at}" in str(e.value)


@pytest.mark.parametrize("other", [5, 5.0, None, b"bytes", ["a"], ("a",), np.int64(3), {"a": 1}],
                         ids=repr)
@pytest.mark.parametrize("at", [1, 2])
def test_prompt_lists_with_a_non_string_name_the_item(text_model, other, at):
    inputs = ["a b c", "x y"]
    inputs.insert(at, other)
    with pytest.raises(InputError, match=f"prompt {at} is {type(other).__name__}"):
        text_model.generate(inputs, max_new_tokens=2)


def test_missing_vocabulary_names_the_files_the_family_reads(tmp_path):
    from conftest import XL_FIXTURES
    from factories import write_t5

    import minfer
    t5 = minfer.load(write_t5(tmp_path / "m"))
    with pytest.raises(InputError, match=r"has none \(tokenizer.json, spiece.model, vocab.json \+ "
                                         r"merges.txt or tokenizer_class ByT5Tokenizer\)"):
        t5.generate("hello")
    folder = XL_FIXTURES / "adaptive_div4"
    if not (folder / "config.json").is_file():
        pytest.skip("no XL fixture")
    xl = minfer.load(folder)
    with pytest.raises(InputError, match=r"has none \(vocab.txt, vocab.pkl, vocab.bin or vocab.json\)"):
        xl.generate("hello")
    with pytest.raises(InputError, match="stop strings requires a tokenizer"):
        xl.generate([[3, 4]], stop=["\n"])


@pytest.mark.parametrize("name", ["stream", "return_details"])
@pytest.mark.parametrize("value", ["no", "false", 0, 1, None, [True]], ids=repr)
def test_generate_switches_are_bools(text_model, name, value):
    with pytest.raises(InputError, match=f"{name} must be true or false"):
        text_model.generate("a b c", max_new_tokens=2, **{name: value})
