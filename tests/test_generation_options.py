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
    ({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
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


# -- strict types: generated per kind of option -------------------------------------------------
import math  # noqa: E402

import numpy as np  # noqa: E402

from minfer.errors import ConfigError  # noqa: E402
from minfer.generation import options as o  # noqa: E402

INTS = {"max_new_tokens": (1, o.MAX_LENGTH), "min_new_tokens": (0, o.MAX_LENGTH),
        "top_k": (0, o.MAX_LENGTH), "no_repeat_ngram_size": (0, o.MAX_LENGTH),
        "num_beams": (1, o.MAX_ROWS), "num_return_sequences": (1, o.MAX_ROWS),
        "seed": (0, o.MAX_SEED)}
NUMBERS = {"temperature": (0.0, o.MAX_TEMPERATURE), "top_p": (0.0, 1.0),
           "repetition_penalty": (o.MIN_PENALTY, o.MAX_PENALTY), "length_penalty": (-math.inf, math.inf)}


def bad_option_values():
    """(option, value) pairs that must be refused, generated from each option's kind and bounds."""
    wrong_type = ["3", b"3", [3], {"v": 3}, True, np.bool_(True), 3 + 0j]
    for name, (low, high) in INTS.items():
        for v in wrong_type + [3.0, np.float64(3), low - 1, high + 1, 10**400, -(10**400)]:
            yield name, v
    for name, (low, high) in NUMBERS.items():
        for v in wrong_type + [math.nan, math.inf, -math.inf, np.float32("nan"), 10**400]:
            yield name, v
        if low > -math.inf:
            yield name, low - (low or 1) * 1e-3 if low else -1e-3    # just below the range
            yield name, high * 1.001 if high else 1e-3                # just above it
    yield "temperature", 1e-46                                          # float32 rounds it to 0
    yield "top_p", 0
    for v in ["no", "false", "True", 0, 1, 1.0, np.int64(1), [True]]:
        yield "do_sample", v
    for v in ["yes", "Never", "true", 1, 0, 1.0, ["never"]]:
        yield "early_stopping", v
    for v in [b"x", [b"x"], [1], [""], "", 5, [None], ("a", 2), {"a"}, [["a"]]]:
        yield "stop", v


def test_temperature_zero_is_greedy_decoding_wherever_it_comes_from():
    """OpenAI's API, the server and the CLI read temperature 0 as greedy; the library did not
    (a call's 0 was refused, and so was a checkpoint whose generation_config.json says 0)."""
    for model, call in ((FakeModel(), {"temperature": 0}),
                        (FakeModel({}, {"temperature": 0.0}), {}),
                        (FakeModel({}, {"temperature": 0, "do_sample": True}), {}),
                        (FakeModel({}, {"do_sample": True}), {"temperature": 0})):
        opts, _ = g.resolve_options(model, **call)
        assert opts.do_sample is False and opts.temperature == 1.0, (model, call)
    with pytest.raises(InputError, match="temperature 0 is greedy decoding: it does not combine "
                                         "with do_sample=True"):
        g.resolve_options(FakeModel(), temperature=0, do_sample=True)


@pytest.mark.parametrize("name,value", [pytest.param(n, v, id=f"{n}={v!r:.25}")
                                        for n, v in bad_option_values()])
def test_bad_option_types_and_ranges_are_named(name, value):
    with pytest.raises(InputError) as e:
        g.resolve_options(FakeModel(), **{name: value})
    msg = str(e.value)
    assert msg.startswith(name) and "\n" not in msg and len(msg) < 300


def json_values(pairs):
    """The pairs a JSON file can hold (stop and seed are never read from files)."""
    return [pytest.param(n, v, id=f"{n}={v!r:.25}") for n, v in pairs if n not in ("stop", "seed")
            and not isinstance(v, (np.generic, bytes, complex, set))]


@pytest.mark.parametrize("name,value", json_values(bad_option_values()))
@pytest.mark.parametrize("where", ["config.json", "generation_config.json", "task"])
def test_bad_values_from_the_checkpoint_name_the_file_and_key(name, value, where):
    if where == "task":
        model = FakeModel({"task_specific_params": {"t": {name: value}}})
    elif where == "config.json":
        model = FakeModel({name: value})
    else:
        model = FakeModel({}, {name: value})
    model.folder = "/ckpt"
    with pytest.raises(ConfigError) as e:
        g.resolve_options(model, task="t" if where == "task" else None)
    msg = str(e.value)
    assert msg.startswith(f"/ckpt/{'config.json' if where == 'task' else where}")
    assert f"'{name}'" in msg and "\n" not in msg


@pytest.mark.parametrize("params,needle", [
    ({"max_length": "20"}, "'max_length'"), ({"min_length": 2.5}, "'min_length'"),
    ({"max_length": 10**400}, "'max_length'"), ({"max_length": True}, "'max_length'"),
    ({"max_length": 20.0}, "'max_length'"), ({"max_length": -1}, "'max_length'"),
])
def test_hf_lengths_in_files_are_typed(params, needle):
    with pytest.raises(ConfigError, match=needle):
        g.resolve_options(FakeModel({}, params))


@pytest.mark.parametrize("tsp,needle", [("x", "task_specific_params"), ({"t": 5}, r"\['t'\]"),
                                        ({"t": {"prefix": 3}}, "'prefix'")])
def test_malformed_task_params_name_the_key(tsp, needle):
    with pytest.raises(ConfigError, match=needle):
        g.resolve_options(FakeModel({"task_specific_params": tsp}), task="t")


def test_numpy_scalars_are_accepted_and_normalised():
    opts, _ = g.resolve_options(FakeModel(), max_new_tokens=np.int32(7), temperature=np.float32(0.5),
                                do_sample=np.bool_(True), top_p=np.float64(0.9), seed=np.uint64(2**64 - 1),
                                num_beams=np.int64(1), length_penalty=np.int8(2), stop="x",
                                early_stopping=np.bool_(False))
    assert (opts.max_new_tokens, opts.temperature, opts.do_sample, opts.top_p, opts.seed,
            opts.length_penalty, opts.stop, opts.early_stopping) == (7, 0.5, True, 0.9, 2**64 - 1,
                                                                     2.0, ("x",), False)
    assert all(type(getattr(opts, n)) in (int, float, bool, tuple) for n in o._CHECKS
               if n not in ("seed", "logprobs", "response_format"))   # (None unless given)
    assert type(opts.early_stopping) is bool and type(opts.seed) is int


@pytest.mark.parametrize("name", ["max_length", "min_length"])
def test_hf_length_names_point_to_the_new_token_counts(name):
    with pytest.raises(InputError, match=f"'{name}' is not supported: use {name[:3]}_new_tokens"):
        g.resolve_options(FakeModel(), **{name: 5})


@pytest.mark.parametrize("name", ["colour", "maxnewtokens", "top-k", "temprature", "beams", "Seed"])
def test_unknown_options_name_themselves(name):
    with pytest.raises(InputError, match=f"unknown generation option '{name}'"):
        g.resolve_options(FakeModel(), **{name: 1})


@pytest.mark.parametrize("seed", [0, 1, 2**32, 2**64 - 1])
def test_seeds_are_non_negative_integers(seed):
    assert g.resolve_options(FakeModel(), seed=seed)[0].seed == seed


# -- degenerate values that would reach NaN / inf scores ------------------------------------------
@pytest.mark.parametrize("nrs,beams", [(3, 2), (5, 4), (2, 1)])
@pytest.mark.parametrize("sample", [True, False])
def test_beams_return_at_most_num_beams(nrs, beams, sample):
    if beams == 1 and sample:   # plain sampling draws any number
        assert g.resolve_options(FakeModel(), num_return_sequences=nrs, num_beams=beams,
                                 do_sample=True)[0].num_return_sequences == nrs
        return
    with pytest.raises(InputError, match="num_return_sequences"):
        g.resolve_options(FakeModel(), num_return_sequences=nrs, num_beams=beams, do_sample=sample)


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 1e-4, 9.99e-4])
def test_sampled_beams_need_a_temperature_of_at_least_1e_3(temperature):
    assert g.resolve_options(FakeModel(), do_sample=True, temperature=temperature)[0]
    with pytest.raises(InputError, match="too low for sampled beam search"):
        g.resolve_options(FakeModel(), do_sample=True, num_beams=2, temperature=temperature)
    g.resolve_options(FakeModel(), do_sample=True, num_beams=2, temperature=1e-3)


@pytest.mark.parametrize("lp", [-200.0, -15.0, 15.0, 200.0, 1e300])
@pytest.mark.parametrize("n", [1, 255, 10**6])
def test_length_penalty_must_keep_length_powers_inside_float32(lp, n):
    ok = abs(lp) * math.log(n + 1) <= o.MAX_LOG_LENGTH_PENALTY
    if ok:
        g.resolve_options(FakeModel(), num_beams=2, length_penalty=lp, max_new_tokens=n)
        np.float32(float(n) ** abs(lp))   # no overflow warning is raised as an error below
    else:
        with pytest.raises(InputError, match="length_penalty"):
            g.resolve_options(FakeModel(), num_beams=2, length_penalty=lp, max_new_tokens=n)
    g.resolve_options(FakeModel(), num_beams=1, length_penalty=lp, max_new_tokens=n)  # unused


# -- batching options: not generation settings, never read from the checkpoint ---------------------
def test_batch_options_are_split_off_and_checked_strictly():
    import re
    from minfer.generation.options import DEFAULT_MAX_BATCH_SIZE, split_batch_options
    batching, rest = split_batch_options({"max_batch_size": 4, "max_new_tokens": 3,
                                          "max_input_tokens": None, "truncation": None})
    assert (batching.max_batch_size, batching.max_input_tokens, batching.truncation) == (4, None, False)
    assert rest == {"max_new_tokens": 3}
    assert split_batch_options({})[0].max_batch_size == DEFAULT_MAX_BATCH_SIZE
    for bad, needle in [({"max_batch_size": True}, "max_batch_size must be an integer"),
                        ({"max_batch_size": 2.0}, "max_batch_size must be an integer"),
                        ({"max_input_tokens": 0}, "max_input_tokens must be an integer in 1.."),
                        ({"truncation": "yes"}, "truncation must be true or false"),
                        ({"truncation": True}, "truncation=True needs max_input_tokens")]:
        with pytest.raises(InputError, match=re.escape(needle)):
            split_batch_options(bad)


def test_a_checkpoint_cannot_set_the_batch_size():
    model = FakeModel({"max_batch_size": 1}, {"max_batch_size": 1})
    opts, _ = g.resolve_options(model)
    assert not hasattr(opts, "max_batch_size")   # unknown keys of config files are ignored
    with pytest.raises(InputError, match="known: .*max_batch_size"):
        g.resolve_options(model, max_batch=2)
