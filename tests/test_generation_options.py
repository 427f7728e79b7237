"""Generation options (generation/options.py): precedence, checks, defaults."""
import pytest

from minfer import generation as g
from minfer.errors import InputError


class FakeModel:
    def __init__(self, hf_config=None, generation_config=None):
        self.hf_config = hf_config or {}
        self.generation_config = generation_config or {}


def test_option_precedence():
    model = FakeModel({"num_beams": 2, "task_specific_params": {
        "summarization": {"prefix": "summarize: ", "num_beams": 4, "max_length": 200,
                          "min_length": 30, "no_repeat_ngram_size": 3, "length_penalty": 2.0}}},
        {"max_length": 50, "num_beams": 3})
    opts, prefix = g.resolve_options(model)
    assert (opts.num_beams, opts.max_new_tokens, prefix) == (3, 49, "")
    opts, prefix = g.resolve_options(model, task="summarization", num_beams=1)
    assert prefix == "summarize: "
    assert (opts.num_beams, opts.max_new_tokens, opts.min_new_tokens, opts.no_repeat_ngram_size,
            opts.length_penalty) == (1, 199, 29, 3, 2.0)


def test_no_silent_twenty_token_cap():
    assert g.resolve_options(FakeModel({}, {"max_length": 20}))[0].max_new_tokens == \
        g.DEFAULT_MAX_NEW_TOKENS


@pytest.mark.parametrize("bad,needle", [
    ({"temperature": 0}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"num_beams": 0}, "num_beams"), ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"num_return_sequences": 3, "num_beams": 2}, "num_return_sequences"),
    ({"min_new_tokens": 9, "max_new_tokens": 3}, "exceeds"), ({"colour": 1}, "unknown generation option"),
    ({"stop": [""]}, "stop"), ({"seed": "x"}, "seed"),
])
def test_bad_options_are_named(bad, needle):
    with pytest.raises(InputError, match=needle):
        g.resolve_options(FakeModel(), **bad)


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(InputError, match="known: summarization"):
        g.resolve_options(FakeModel({"task_specific_params": {"summarization": {}}}), task="poetry")
