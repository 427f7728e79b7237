"""One output line (or --json object) per input line in every output mode of generate and embed:
blank lines are rows, several sequences are labelled or grouped, --json names the batch's time
for what it is (issue 30, item 16)."""
import json

import numpy as np
import pytest

from test_fuzz_inputs import run_cli
from test_cli_resume import ST

LINES = ["a b c", "", "x y", "   ", "hello world"]
STDIN = ("\n".join(LINES) + "\n").encode()


@pytest.mark.parametrize("mode", [[], ["--no-stream"]])
def test_plain_output_keeps_a_line_for_each_blank_stdin_line(text_model_folder, text_model, mode):
    code, out, err = run_cli(["generate", "-m", str(text_model_folder), "--max-new-tokens", "4",
                              *mode], stdin=STDIN)
    assert code == 1 and err.strip() == ("minfer: error: 2 of 5 prompts failed (first: stdin: "
                                         "line 2: empty prompt (nothing but whitespace))"), err
    want = [text_model.generate(p, max_new_tokens=4) if p.strip() else "" for p in LINES]
    assert out.split("\n")[:-1] == want


def test_json_has_one_object_per_stdin_line_and_names_the_batch_time(text_model_folder):
    code, out, err = run_cli(["generate", "-m", str(text_model_folder), "--max-new-tokens", "4",
                              "--json"], stdin=STDIN)
    assert code == 1, err
    got = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in got] == LINES
    assert [("error" in r) for r in got] == [not p.strip() for p in LINES]
    assert "line 4: empty prompt" in got[3]["error"]
    done = [r for r in got if "error" not in r]
    # the prompts of one batch share its time: the field says so, and no per-prompt rate
    # divides a prompt's tokens by a whole batch's seconds
    assert all("seconds" not in r and "tokens_per_second" not in r for r in done)
    assert len({r["batch_seconds"] for r in done}) == 1
    code, out, _ = run_cli(["generate", "-m", str(text_model_folder), "--max-new-tokens", "4",
                            "--json", "--batch-size", "1", "a b c", "x y"])
    assert code == 0 and all(json.loads(line)["batch_seconds"] > 0 for line in out.splitlines())


def test_several_sequences_are_labelled_in_plain_output_and_grouped_in_json(text_model_folder,
                                                                            text_model):
    args = ["generate", "-m", str(text_model_folder), "--max-new-tokens", "4", "--num-beams", "3",
            "--num-return-sequences", "2"]
    want = [text_model.generate(p, max_new_tokens=4, num_beams=3, num_return_sequences=2)
            for p in ("a b c", "x y")]
    code, out, err = run_cli([*args, "a b c", "x y"])
    assert code == 0, err
    assert out.split("\n")[:-1] == [f"{i}.{k}\t{want[i - 1][k - 1]}" for i in (1, 2) for k in (1, 2)]
    code, out, err = run_cli([*args, "--no-stream"], stdin=b"a b c\n\nx y\n")
    assert code == 1 and "1 of 3 prompts failed" in err
    assert out.split("\n")[:-1] == ["1.1\t" + want[0][0], "1.2\t" + want[0][1], "2.1\t", "2.2\t",
                                    "3.1\t" + want[1][0], "3.2\t" + want[1][1]]
    code, out, err = run_cli([*args, "--json", "a b c", "x y"])
    assert code == 0, err
    got = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in got] == ["a b c", "x y"]
    assert [[s["text"] for s in r["sequences"]] for r in got] == want
    assert all(r["text"] == r["sequences"][0]["text"] for r in got)


def test_embed_keeps_a_record_for_each_blank_stdin_line():
    import minfer
    model = minfer.load(ST)
    lines = ["A quick fox.", "", "Hello world", "  "]
    code, out, err = run_cli(["embed", "-m", str(ST)], stdin=("\n".join(lines) + "\n").encode())
    got = [json.loads(line) for line in out.splitlines()]
    assert [r["text"] for r in got] == lines
    for text, record in zip(lines, got):
        try:   # whatever the library answers for that text alone: its vector, or its error
            want = model.embed([text])[0]
        except minfer.InputError:
            assert code == 1 and record["embedding"] is None and record["error"]
        else:
            assert np.abs(np.array(record["embedding"]) - want).max() < 1e-5
    code, out, err = run_cli(["embed", "-m", str(ST)], stdin=b"")
    assert code == 2 and "no text: stdin was empty" in err
