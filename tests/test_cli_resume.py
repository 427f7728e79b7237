"""--resume continues only minfer's own output, for this input: anything else is a one-line
refusal and the file is left byte for byte as it was (issue 30, item 1). And the other ways an
output path could destroy a user's file: a directory, the input itself."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from test_fuzz_inputs import run_cli

FAMILY = Path(__file__).resolve().parent.parent / "weights" / "family"
ST = FAMILY / "st_prompts"   # a sentence-transformers fixture: 8 floats a row
NOTES = "".join(f"note {i}: call the plumber about the {i}th pipe\n" for i in range(800))


def one_line_error(result, code, needle):
    status, _, err = result
    lines = err.strip().splitlines()
    assert status == code and len(lines) == 1 and lines[0].startswith("minfer: error: "), err
    assert needle in lines[0], err
    return lines[0]


def generate(folder, *args):
    return run_cli(["generate", "-m", str(folder), "--max-new-tokens", "2", *map(str, args)])


def embed(*args):
    return run_cli(["embed", "-m", str(ST), *map(str, args)])


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("a b c\nx y\nhello world\n")
    return path


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n"
                            for i, t in enumerate(["a b c", "x y", "hello world"])))
    return path


FOREIGN = {
    "notes": NOTES,
    "notes without a last newline": "my notes, one line",
    "one json-looking line cut short": '{"foo": [1, 2',
    "another tool's json lines": "".join(json.dumps({"text": f"t{i}", "label": i}) + "\n"
                                         for i in range(3)),
    "blank lines": "\n\n",
    "a json array": "[1, 2, 3]\n",
}


@pytest.mark.parametrize("name", FOREIGN)
def test_generate_resume_refuses_a_file_it_did_not_write(text_model_folder, tmp_path, prompts, name):
    out = tmp_path / "notes.txt"
    out.write_text(FOREIGN[name])
    before = out.read_bytes()
    line = one_line_error(generate(text_model_folder, "-i", prompts, "-o", out, "--resume"), 1,
                          f"--resume: {out} line 1 ")
    assert "resume only this command's output" in line or "not a record minfer writes" in line
    assert out.read_bytes() == before


@pytest.mark.parametrize("name", FOREIGN)
def test_embed_resume_refuses_a_json_lines_file_it_did_not_write(tmp_path, prompts, name):
    out = tmp_path / "notes.jsonl"
    out.write_text(FOREIGN[name])
    before = out.read_bytes()
    one_line_error(embed("-i", prompts, "-o", out, "--resume"), 1, f"--resume: {out} line 1 ")
    assert out.read_bytes() == before


def test_records_of_the_other_command_or_another_input_are_refused(text_model_folder, tmp_path,
                                                                   prompts, rows):
    made = tmp_path / "made.jsonl"
    assert generate(text_model_folder, "-i", rows, "-o", made)[0] == 0
    theirs = made.read_bytes()
    # generate's records are not embed's, and embed's are not generate's
    one_line_error(embed("-i", rows, "-o", made, "--resume"), 1, "not a record minfer writes")
    assert made.read_bytes() == theirs
    embedded = tmp_path / "embedded.jsonl"
    assert embed("-i", rows, "-o", embedded)[0] == 0
    ours = embedded.read_bytes()
    one_line_error(generate(text_model_folder, "-i", rows, "-o", embedded, "--resume"), 1,
                   "not a record minfer writes")
    assert embedded.read_bytes() == ours
    # generate's own records, for other rows (their ids differ from this input's)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"id": 10 + i, "text": "q"}) + "\n" for i in range(3)))
    one_line_error(generate(text_model_folder, "-i", other, "-o", made, "--resume"), 1,
                   f"line 1 does not answer {other} line 1 (the fields it copies differ")
    assert made.read_bytes() == theirs
    # a record with a field no input row had
    extra = json.loads(theirs.splitlines()[0])
    extra["mine"] = 1
    forged = tmp_path / "forged.jsonl"
    forged.write_text(json.dumps(extra) + "\n")
    one_line_error(generate(text_model_folder, "-i", rows, "-o", forged, "--resume"), 1,
                   "line 1 does not answer")


def test_resume_keeps_its_own_records_and_rewrites_only_one_cut_short(text_model_folder, tmp_path,
                                                                     rows):
    full = tmp_path / "full.jsonl"
    assert generate(text_model_folder, "-i", rows, "-o", full)[0] == 0
    lines = full.read_bytes().splitlines(keepends=True)
    for cut in (1, 9, len(lines[1]) - 1):   # inside the copied id, the text, before the newline
        part = tmp_path / f"part{cut}.jsonl"
        part.write_bytes(lines[0] + lines[1][:cut])
        status, _, err = generate(text_model_folder, "-i", rows, "-o", part, "--resume")
        assert status == 0 and "after the 1 already in" in err and "incomplete record" in err, err
        assert part.read_bytes() == full.read_bytes()
    # a last line that does not start as that row's record would is not ours to cut
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_bytes(lines[0] + b'{"id": 7, "te')
    one_line_error(generate(text_model_folder, "-i", rows, "-o", wrong, "--resume"), 1,
                   "line 2 is not a record minfer writes")
    assert wrong.read_bytes() == lines[0] + b'{"id": 7, "te'


@pytest.mark.parametrize("command", ["generate", "embed jsonl", "embed npy"])
def test_a_missing_or_empty_output_is_a_fresh_start(text_model_folder, tmp_path, prompts, command):
    suffix = ".npy" if command.endswith("npy") else ".jsonl"
    for name, content in (("missing", None), ("empty", b"")):
        out = tmp_path / (name + suffix)
        if content is not None:
            out.write_bytes(content)
        status, _, err = (generate(text_model_folder, "-i", prompts, "-o", out, "--resume")
                          if command == "generate" else embed("-i", prompts, "-o", out, "--resume"))
        assert status == 0 and err.startswith("minfer: 3 rows -> "), err
        if suffix == ".npy":
            assert np.load(out).shape == (3, 8)
        else:
            assert len(out.read_text().splitlines()) == 3


def test_embed_resume_refuses_an_npy_it_did_not_write(tmp_path, prompts):
    saved = tmp_path / "saved.npy"
    np.save(saved, np.ones((2, 8), np.float32))      # the right shape, numpy's own header
    text = tmp_path / "text.npy"
    text.write_text(NOTES)
    short = tmp_path / "short.npy"
    short.write_bytes(b"\x93NUMPY\x01\x00v\x00{'descr': '<f8'")
    for path in (saved, text, short):
        before = path.read_bytes()
        one_line_error(embed("-i", prompts, "-o", path, "--resume"), 1,
                       "not a (rows, 8) float32 file written by minfer embed")
        assert path.read_bytes() == before
    # its own, cut inside the first rows' header write: nothing kept, nothing refused
    full = tmp_path / "full.npy"
    assert embed("-i", prompts, "-o", full)[0] == 0
    cut = tmp_path / "cut.npy"
    cut.write_bytes(full.read_bytes()[:40].replace(b"(3, 8)", b"(0, 8)"))
    status, _, err = embed("-i", prompts, "-o", cut, "--resume")
    assert status == 0, err
    assert np.array_equal(np.load(cut), np.load(full))


def test_output_onto_a_directory_or_the_input_is_a_usage_error(text_model_folder, tmp_path, prompts):
    before = prompts.read_bytes()
    for command in (["generate", "-m", str(text_model_folder)], ["embed", "-m", str(ST)]):
        one_line_error(run_cli([*command, "-i", str(prompts), "-o", str(tmp_path)]), 2,
                       f"--output {tmp_path}: is a directory")
        # stdin redirected from the file the output names: writing it would empty the input
        with open(prompts, "rb") as stdin:
            proc = subprocess.run([sys.executable, "-m", "minfer", *command, "-i", "-", "-o",
                                   str(prompts)], stdin=stdin, capture_output=True, text=True,
                                  env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=120)
        assert proc.returncode == 2 and "is the input file" in proc.stderr, proc.stderr
        assert prompts.read_bytes() == before


@pytest.mark.parametrize("command", ["generate", "embed"])
def test_resume_keeps_its_own_records_longer_than_the_input_line_limit(text_model_folder, tmp_path,
                                                                      command):
    # a row near the input limit, copied into its record beside the result, makes a record over
    # the limit: --resume read it as cut short and refused the file
    from minfer_cli.bulk import MAX_LINE_BYTES
    source = tmp_path / "in.jsonl"
    big = json.dumps({"pad": "p" * (MAX_LINE_BYTES - 40), "text": "a b c"})
    source.write_text(big + "\n" + json.dumps({"text": "x y"}) + "\n"
                      + json.dumps({"text": "hello world"}) + "\n")
    assert len(big) < MAX_LINE_BYTES

    def run(out):
        return (generate(text_model_folder, "-i", source, "-o", out, "--resume")
                if command == "generate" else embed("-i", source, "-o", out, "--resume"))
    full = tmp_path / "full.jsonl"
    assert run(full)[0] == 0
    lines = full.read_bytes().splitlines(keepends=True)
    assert len(lines) == 3 and len(lines[0]) > MAX_LINE_BYTES + 1
    for kept in (lines[0], lines[0] + lines[1][:7]):   # complete, then one cut short after it
        part = tmp_path / "part.jsonl"
        part.write_bytes(kept)
        status, _, err = run(part)
        assert status == 0 and "after the 1 already in" in err, err
        assert part.read_bytes() == full.read_bytes()


def test_resume_refuses_a_line_longer_than_any_record_it_writes_unread(tmp_path, prompts,
                                                                      monkeypatch):
    import minfer_cli.bulk
    monkeypatch.setattr(minfer_cli.bulk, "RESULT_BYTES", 500)
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"embedding": [' + b"1.0, " * 400 + b"1.0]}\nmore\n")
    bound = len(json.dumps({"text": "a b c"}))   # what the record copies: line 1's text
    line = one_line_error(embed("-i", prompts, "-o", out, "--resume"), 1,
                          f"--resume: {out} line 1 is longer than the {500 + bound} bytes this "
                          "command "
                          f"writes for {prompts} line 1")
    assert "resume only its own output" in line


@pytest.mark.parametrize("last_newline", [True, False])
def test_resume_counts_the_lines_of_an_output_longer_than_its_input(tmp_path, prompts, last_newline):
    full = tmp_path / "full.jsonl"
    assert embed("-i", prompts, "-o", full)[0] == 0
    lines = full.read_bytes().splitlines(keepends=True)
    longer = tmp_path / "longer.jsonl"
    extra = b"".join(lines[:2])
    longer.write_bytes(b"".join(lines) + (extra if last_newline else extra.rstrip(b"\n")))
    before = longer.read_bytes()
    one_line_error(embed("-i", prompts, "-o", longer, "--resume"), 1,
                   f"--resume: {longer} holds 5 lines but {prompts} has only 3:")
    assert longer.read_bytes() == before


# -- another input's output: every record names the prompt it answers, and a .npy's rows the
#    hashes of their texts (x.npy.inputs), so --resume checks them (issue 30, hostile pass)
@pytest.fixture
def others(tmp_path):
    """Other prompts than `prompts`', one line more."""
    path = tmp_path / "in3.txt"
    path.write_text("q r\ns t\nu v\nw z\n")
    return path


@pytest.mark.parametrize("command", ["generate", "embed"])
def test_resume_refuses_the_output_of_another_text_input(text_model_folder, tmp_path, prompts,
                                                         others, command):
    run = ((lambda *a: generate(text_model_folder, *a)) if command == "generate" else embed)
    key = "prompt" if command == "generate" else "text"
    out = tmp_path / "out.jsonl"
    assert run("-i", prompts, "-o", out)[0] == 0
    assert [json.loads(line)[key] for line in out.read_text().splitlines()] == \
        prompts.read_text().splitlines()
    before = out.read_bytes()
    one_line_error(run("-i", others, "-o", out, "--resume"), 1,
                   f"--resume: {out} line 1 does not answer {others} line 1 (its {key!r} is "
                   "not that line's)")
    assert out.read_bytes() == before
    # the same first line, another second one: refused at the line that differs
    second = tmp_path / "second.txt"
    second.write_text("a b c\nsomething else\nhello world\nmore\n")
    one_line_error(run("-i", second, "-o", out, "--resume"), 1, "line 2 does not answer")
    assert out.read_bytes() == before
    # JSON Lines input whose other fields match (the same ids) but whose prompts do not
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "text": t}) + "\n"
                            for i, t in enumerate(["a b c", "x y", "hello world"])))
    made = tmp_path / "made.jsonl"
    assert run("-i", rows, "-o", made)[0] == 0
    swapped = tmp_path / "swapped.jsonl"
    swapped.write_text("".join(json.dumps({"id": i, "text": t}) + "\n"
                               for i, t in enumerate(["x y", "a b c", "hello world", "z"])))
    kept = made.read_bytes()
    one_line_error(run("-i", swapped, "-o", made, "--resume"), 1,
                   f"line 1 does not answer {swapped} line 1 (its {key!r} is not that line's)")
    assert made.read_bytes() == kept
    # this input's own output, with one more line to do: continued
    longer = tmp_path / "longer.txt"
    longer.write_text(prompts.read_text() + "more words\n")
    status, _, err = run("-i", longer, "-o", out, "--resume")
    assert status == 0 and "1 rows after the 3 already in" in err, err
    assert out.read_bytes().startswith(before) and len(out.read_text().splitlines()) == 4


@pytest.mark.parametrize("command", ["generate", "embed"])
def test_resume_refuses_records_that_do_not_name_their_input(text_model_folder, tmp_path, prompts,
                                                             command):
    # an earlier minfer's records (no prompt in them): which input they answer cannot be checked
    run = ((lambda *a: generate(text_model_folder, *a)) if command == "generate" else embed)
    key = "prompt" if command == "generate" else "text"
    out = tmp_path / "out.jsonl"
    assert run("-i", prompts, "-o", out)[0] == 0
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != key})
                           + "\n" for line in out.read_text().splitlines()[:2]))
    before = old.read_bytes()
    one_line_error(run("-i", prompts, "-o", old, "--resume"), 1,
                   f"line 1 does not answer {prompts} line 1 (it has no {key!r} field, so which "
                   "input it answers cannot be checked")
    assert old.read_bytes() == before


def test_embed_npy_resume_checks_the_texts_of_its_rows(tmp_path, prompts, others):
    out = tmp_path / "x.npy"
    inputs = tmp_path / "x.npy.inputs"
    assert embed("-i", prompts, "-o", out)[0] == 0
    assert len(inputs.read_bytes().splitlines()) == 1 + 3
    before = out.read_bytes(), inputs.read_bytes()
    one_line_error(embed("-i", others, "-o", out, "--resume"), 1,
                   f"--resume: {out} row 1 does not embed {others} line 1")
    assert (out.read_bytes(), inputs.read_bytes()) == before
    # this input and one line more: continued, as a fresh run of it writes
    longer = tmp_path / "longer.txt"
    longer.write_text(prompts.read_text() + "more words\n")
    status, _, err = embed("-i", longer, "-o", out, "--resume")
    assert status == 0 and "1 rows after the 3 already in" in err, err
    fresh = tmp_path / "fresh.npy"
    assert embed("-i", longer, "-o", fresh)[0] == 0
    assert np.allclose(np.load(out), np.load(fresh), atol=1e-6)
    assert inputs.read_bytes() == (tmp_path / "fresh.npy.inputs").read_bytes()
    # rows whose hashes were not all written (interrupted between the two): those rows redone
    part = tmp_path / "part.npy"
    part.write_bytes(fresh.read_bytes())
    (tmp_path / "part.npy.inputs").write_bytes(inputs.read_bytes()[:-40])
    status, _, err = embed("-i", longer, "-o", part, "--resume")
    assert status == 0 and "2 rows after the 2 already in" in err, err
    assert np.allclose(np.load(part), np.load(fresh), atol=1e-6)
    assert (tmp_path / "part.npy.inputs").read_bytes() == inputs.read_bytes()


def test_embed_npy_resume_refuses_rows_whose_texts_it_cannot_check(tmp_path, prompts):
    out = tmp_path / "x.npy"
    assert embed("-i", prompts, "-o", out)[0] == 0
    inputs = tmp_path / "x.npy.inputs"
    for content, why in ((None, "missing"), (b"my notes\n" * 4, "not a file minfer embed writes")):
        if content is None:
            inputs.unlink()
        else:
            inputs.write_bytes(content)
        before = out.read_bytes()
        one_line_error(embed("-i", prompts, "-o", out, "--resume"), 1,
                       f"--resume: {out} holds 3 rows but {inputs}, which names the texts they "
                       f"embed, is {why}")
        assert out.read_bytes() == before and (content is None) != inputs.exists()


def test_embed_refuses_an_input_that_is_the_npy_outputs_inputs_file(tmp_path, prompts):
    source = tmp_path / "x.npy.inputs"
    source.write_bytes(prompts.read_bytes())
    one_line_error(embed("-i", source, "-o", tmp_path / "x.npy"), 2,
                   f"--input {source} is {tmp_path / 'x.npy'}'s inputs file")
    assert source.read_bytes() == prompts.read_bytes()
