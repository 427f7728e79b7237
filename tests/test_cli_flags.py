"""A bad flag value is a usage error (status 2) naming the flag, never the Python option behind it,
for every flag that takes a value; --temperature 0 is greedy search, as the server reads it
(issue 30, item 16)."""
import re

import pytest

from test_cli_resume import ST
from test_fuzz_inputs import run_cli

# (arguments, the flag the one-line error must name); values generate() itself refuses, values
# that only fail together, and values a model or a device cannot take
GENERATE = [
    (["--batch-size", "100000"], "--batch-size"),
    (["--batch-size", "0"], "--batch-size"),
    (["--max-new-tokens", str(2**40)], "--max-new-tokens"),
    (["--min-new-tokens", str(2**40)], "--min-new-tokens"),
    (["--min-new-tokens", "9", "--max-new-tokens", "3"], "--min-new-tokens"),
    (["--top-k", str(2**40)], "--top-k"),
    (["--top-p", "nan"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "1e9"], "--temperature"),
    (["--temperature", "1e-50"], "--temperature"),
    (["--temperature", "0", "--do-sample"], "--temperature"),
    (["--temperature", "0.0001", "--num-beams", "2", "--do-sample"], "--temperature"),
    (["--repetition-penalty", "inf"], "--repetition-penalty"),
    (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--no-repeat-ngram-size", str(2**40)], "--no-repeat-ngram-size"),
    (["--num-beams", "100000"], "--num-beams"),
    (["--length-penalty", "nan"], "--length-penalty"),
    (["--length-penalty", "50", "--num-beams", "2", "--max-new-tokens", "100"],
     "--length-penalty"),
    (["--num-return-sequences", "100000"], "--num-return-sequences"),
    (["--num-return-sequences", "3", "--num-beams", "2"], "--num-return-sequences"),
    (["--max-input-tokens", str(2**40)], "--max-input-tokens"),
    (["--seed", "-1"], "--seed"),
    (["--task", "poetry"], "--task"),
    (["--stop", "\\q"], "--stop"),
    (["--device", "tpu"], "--device"),
    (["--dtype", "int3"], "--dtype"),
    (["--compute", "int2"], "--compute"),
    (["--compute", "int8", "--dtype", "float32"], "--compute"),
    (["--workspace", "lots"], "--workspace"),
    (["--workspace", "-5"], "--workspace"),
    (["--memory-limit", "lots"], "--memory-limit"),
    (["--memory-limit", "0"], "--memory-limit"),
    (["--memory-limit", "1MiB", "--workspace", "2MiB"], "--workspace"),
    (["--threads", "0"], "--threads"),
    (["--subfolder", "../x"], "--subfolder"),
    (["--parts", "head"], "--parts"),
]
PYTHON_NAMES = re.compile(r"\b(max_batch_size|max_new_tokens|min_new_tokens|top_k|top_p|"
                          r"repetition_penalty|no_repeat_ngram_size|num_beams|length_penalty|"
                          r"num_return_sequences|max_input_tokens|memory_limit|num_threads|"
                          r"do_sample|prompt_name)\b")


def assert_usage_error(result, flag):
    code, out, err = result
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, (code, err)
    assert lines[0].startswith("minfer: error: ") and flag in lines[0], err
    # a name outside a formula is the flag's, not the Python option's
    assert not PYTHON_NAMES.search(re.sub(r"\([^)]*\*[^)]*\)|\S*\*\*\S*", "", lines[0])), err


@pytest.mark.parametrize("args,flag", GENERATE, ids=[" ".join(a) for a, _ in GENERATE])
def test_a_bad_generate_flag_is_a_usage_error_naming_it(text_model_folder, args, flag):
    assert_usage_error(run_cli(["generate", "-m", str(text_model_folder), "a b", *args]), flag)


@pytest.mark.parametrize("args,flag", [
    (["--prompt-name", "nope"], "--prompt-name"),
    (["--batch-size", "0"], "--batch-size"),
    (["--dtype", "int3"], "--dtype"),
    (["--workspace", "lots"], "--workspace"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_a_bad_embed_flag_is_a_usage_error_naming_it(args, flag):
    assert_usage_error(run_cli(["embed", "-m", str(ST), "a b", *args]), flag)


@pytest.mark.parametrize("command", [["info"], ["score", "-"]])
def test_other_commands_name_their_flags(text_model_folder, command):
    for args, flag in (["--memory-limit", "lots"], "--memory-limit"), (["--device", "tpu"], "--device"):
        assert_usage_error(run_cli([command[0], "-m", str(text_model_folder), *command[1:], *args],
                                   stdin=b"x\n"), flag)


def test_temperature_zero_is_greedy_search_as_on_the_server(text_model_folder, text_model):
    greedy = text_model.generate("a b c", max_new_tokens=6)
    for extra in ([], ["--top-k", "5", "--seed", "3"], ["--greedy"]):
        code, out, err = run_cli(["generate", "-m", str(text_model_folder), "a b c",
                                  "--max-new-tokens", "6", "--temperature", "0", *extra])
        assert code == 0 and out == greedy + "\n", err
