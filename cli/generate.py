"""`minfer generate`: prompts from arguments, stdin or a bulk file -> streamed, batched or JSON
Lines output.

Output streams as it is decided, one prompt at a time; --no-stream and --json run the prompts in
batches (generation.text.run_iter: a window of prompts at a time, so memory stays flat however
long stdin is). Every stdin line is a prompt, a blank one too, so output line k answers input
line k (with several sequences a prompt, plain lines are labelled ROW.K). A prompt that cannot
run (a blank line; in batches, any row error) is an `error` record (--json) or an empty line;
the run carries on, and ends with one line naming the count and the first error, status 1.
Bulk mode (--input) is cli/bulk.py.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
from typing import Any, BinaryIO, Iterable, Iterator

import click

from minfer.generation.options import (DEFAULT_MAX_BATCH_SIZE, MAX_BATCH_SIZE, MAX_PENALTY,
                                       MAX_ROWS, MAX_TEMPERATURE, MIN_PENALTY)
from minfer.io.limits import MAX_LENGTH
from minfer.tokenizers import tokenizer_files

from .bulk import (MAX_LINE_BYTES, bulk_options, bulk_settings, lines, results_in_order, run_bulk,
                   utf8)
from .common import (EXIT_USAGE, command_flags, emit, fail, load_model, quiet_on_closed_pipe,
                     read_text, with_flags, with_model_options)

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def _unescape_stops(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    r"""--stop '\n' means a newline (what Transformer-XL users are told to stop at): \n, \t and \\
    are read as escapes; any other backslash is refused rather than guessed."""
    out = []
    for value in values:
        def one(m: re.Match, value: str = value) -> str:
            if m.group(1) not in _ESCAPES:
                what = (f"unknown escape '\\{m.group(1)}'" if m.group(1)
                        else "a lone backslash at the end")
                raise click.BadParameter(f"{value!r}: {what} (use \\n, \\t or \\\\)")
            return _ESCAPES[m.group(1)]
        text = re.sub(r"\\(.?)", one, value, flags=re.S)
        if not text:
            raise click.BadParameter("a stop string must not be empty")
        out.append(text)
    return tuple(out)


class Finite(click.FloatRange):
    """A float in a range that is also finite: click's FloatRange lets nan and inf through."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


# Ranges are generate()'s own (minfer.generation.options), so a value it would refuse fails
# here, before the model loads, as a usage error naming the flag.
@click.command()
@with_model_options
@click.argument("prompts", nargs=-1)
@click.option("--max-new-tokens", type=click.IntRange(1, MAX_LENGTH), default=None,
              help="New tokens at most  [default: the checkpoint's, else 256].")
@click.option("--min-new-tokens", type=click.IntRange(0, MAX_LENGTH), default=None,
              help="New tokens before eos is allowed  [default: 0].")
@click.option("--do-sample/--greedy", default=None,
              help="Sample instead of greedy search  [default: greedy unless --temperature, "
                   "--top-k or --top-p is given].")
@click.option("--temperature", type=Finite(0, MAX_TEMPERATURE), default=None,
              help="Sampling temperature; 0 means greedy search, as the server reads it  "
                   "[default: 1.0].")
@click.option("--top-k", type=click.IntRange(0, MAX_LENGTH), default=None,
              help="Sample from the k most likely tokens (0 = all)  [default: 50].")
@click.option("--top-p", type=Finite(0, 1, min_open=True), default=None,
              help="Nucleus sampling: smallest set with this much probability  [default: 1.0].")
@click.option("--repetition-penalty", type=Finite(MIN_PENALTY, MAX_PENALTY), default=None,
              help="Penalty for tokens already generated  [default: 1.0].")
@click.option("--no-repeat-ngram-size", type=click.IntRange(0, MAX_LENGTH), default=None,
              help="Never repeat an n-gram of this size  [default: 0 = off].")
@click.option("--num-beams", type=click.IntRange(1, MAX_ROWS), default=None,
              help="Beam search width  [default: 1 = greedy].")
@click.option("--length-penalty", type=Finite(), default=None,
              help="Beam score = logprob / length**penalty  [default: 1.0].")
@click.option("--num-return-sequences", type=click.IntRange(1, MAX_ROWS), default=None,
              help="Results per prompt  [default: 1]. Above 1 each plain line is labelled "
                   "ROW.K and a tab (ROW: the PROMPT argument's or stdin line's number, K: the "
                   "sequence's), and --json puts them all under \"sequences\".")
@click.option("--stop", multiple=True, callback=_unescape_stops,
              help="Stop when this text appears (repeatable); it is not printed. Backslash "
                   "escapes \\n (newline), \\t (tab) and \\\\ (backslash) are read, so --stop "
                   "'\\n' stops at the end of a line.")
@click.option("--seed", type=click.IntRange(0, 2**64 - 1), default=None,
              help="Random seed for sampling, 0 to 2**64-1  [default: random].")
@click.option("--task", default=None,
              help="Apply the checkpoint's task settings and prefix, e.g. translation_en_to_de.")
@click.option("--no-stream", is_flag=True, help="Print each result whole when it is done.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per prompt, in input order: text, token ids, finish reason, "
                   "token counts, and batch_seconds: the wall time of the batch it ran in, "
                   "shared by the prompts batched with it (--batch-size 1 times each alone).")
@click.option("--batch-size", "max_batch_size", type=click.IntRange(1, MAX_BATCH_SIZE), default=None,
              help="Prompts per batch at most (--no-stream, --json, --input); fewer when the "
                   f"workspace cannot hold that many  [default: {DEFAULT_MAX_BATCH_SIZE}].")
@click.option("--max-input-tokens", type=click.IntRange(1, MAX_LENGTH), default=None,
              help="Prompt tokens at most: a longer prompt fails as a row (or is cut, with "
                   "--truncate)  [default: no limit but the workspace].")
@click.option("--truncate", is_flag=True,
              help="Cut prompts longer than --max-input-tokens instead of failing them.")
@bulk_options("prompt", "where the JSON Lines go ('-' for stdout)")
@quiet_on_closed_pipe
def generate(load, prompts, max_new_tokens,
             min_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty,
             no_repeat_ngram_size, num_beams, length_penalty, num_return_sequences, stop, seed,
             task, no_stream, as_json, max_batch_size, max_input_tokens, truncate, input_path,
             output_path, input_format, input_field, resume) -> None:
    """Generate text for each PROMPT (or each line of stdin when no PROMPT is given; a blank
    line is a prompt too, which fails as a row, so output line k answers input line k).

    Output streams as it is decided, one prompt at a time; --no-stream and --json run the
    prompts in batches (grouped by length, printed in input order). Bulk mode (--input PATH
    [--output PATH]) reads and writes as it goes, in constant memory however long the input: one
    JSON object per input line with text, finish_reason, prompt_tokens and new_tokens, or an
    `error` for a row that could not run (the run carries on, and exits 1 at the end)."""
    bulk = bulk_settings(prompts, input_path, output_path, input_format, input_field, resume,
                          truncate, max_input_tokens)
    stream = (bulk is None and not no_stream and not as_json
              and (num_return_sequences or 1) == 1)
    rows = None   # batched output: (prompt, its name, the prompt as --json shows it), read as needed
    from_stdin = bulk is None and not prompts
    if from_stdin:
        if sys.stdin is None or sys.stdin.isatty():
            fail("no prompt: give PROMPT arguments or pipe lines on stdin", EXIT_USAGE)
        stdin = getattr(sys.stdin, "buffer", sys.stdin)
        if stream:   # streamed output reads all of stdin first: a bad byte fails before any output
            text = read_text(stdin, "stdin")
            prompts = tuple(text.split("\n")[:-1] if text.endswith("\n") else text.split("\n"))
            empty = not text
        else:        # batched output reads as it goes (a bad line is a row error)
            rows = _peeked(_stdin_prompts(stdin))
            empty = rows is None
        if empty:
            fail("no prompt: stdin was empty", EXIT_USAGE)
    for i, prompt in enumerate(prompts, 1):
        # an argument that is not UTF-8 arrives with its bad bytes as lone surrogates
        # (surrogateescape): name it as bytes, which is what the user typed
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            fail(f"PROMPT {i}: not valid UTF-8 at character {e.start} "
                  f"({prompt[e.start].encode('utf-8', 'surrogateescape')!r})", EXIT_USAGE)
    if temperature == 0:   # greedy, as the server reads temperature 0 (sampling flags aside)
        if do_sample:
            fail("--temperature 0 means greedy search; it cannot go with --do-sample", EXIT_USAGE)
        do_sample, temperature = False, None
    if do_sample is None and any(v is not None for v in (temperature, top_k, top_p)):
        do_sample = True
    options = dict(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                   do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                   repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                   num_beams=num_beams, length_penalty=length_penalty,
                   num_return_sequences=num_return_sequences, stop=list(stop) or None, seed=seed,
                   max_batch_size=max_batch_size, max_input_tokens=max_input_tokens,
                   truncation=True if truncate else None)
    m = load_model(load)
    m.check_can_generate()   # an encoder-only model: one line, before any prompt is read
    _check_options(m, task, options)
    if m.tokenizer is None:
        fail(f"{m.folder} has no tokenizer ({tokenizer_files(m)}): text prompts need one")
    if bulk is not None:
        run_bulk(m, bulk, task, options)
        return
    if stream:
        _run_streamed(m, prompts, from_stdin, task, options)
        return
    if rows is None:
        rows = ((p, f"PROMPT {i}", p, i) for i, p in enumerate(prompts, 1))
    _run_batched(m, rows, as_json, task, options)


def _check_options(m: Any, task: str | None, options: dict) -> None:
    """The options as generate() will settle them against this model (its config, its
    generation_config.json, the task's settings): a call's value it refuses (a pair that does
    not go together, a task the checkpoint lacks) is a usage error naming the flags."""
    from minfer.errors import InputError
    from minfer.generation.options import resolve_options, split_batch_options
    try:
        _, rest = split_batch_options(options)
        resolve_options(m, task, **rest)
    except InputError as e:
        fail(with_flags(str(e), command_flags(truncation="truncate")), EXIT_USAGE)


def _run_streamed(m: Any, prompts: tuple[str, ...], from_stdin: bool, task: str | None,
                  options: dict) -> None:
    """Each prompt's text as it is decided, a line each. A blank stdin line is a row of its own
    (an empty line, counted as failed), so output line k still answers input line k."""
    failed, first = 0, None
    for number, prompt in enumerate(prompts, 1):
        if from_stdin and not prompt.strip():
            failed += 1
            first = first or f"stdin: line {number}: empty prompt (nothing but whitespace)"
        else:
            for piece in m.generate(prompt, stream=True, task=task, **options):
                emit(piece, nl=False)
        emit()
    if failed:
        fail(f"{failed} of {len(prompts)} prompts failed (first: {first})")


def _stdin_prompts(stream: BinaryIO) -> Iterator[tuple[Any, str, str | None, int]]:
    """(prompt or BadRow, its name, the prompt as --json shows it, its line number) per stdin
    line: a blank one too (it fails as a row), so output line k answers input line k."""
    for number, offset, raw in lines(stream):
        where = f"stdin: line {number}"
        if raw is None:
            from minfer.generation.planning import BadRow
            yield BadRow(f"{where}: longer than {MAX_LINE_BYTES} bytes"), where, None, number
            continue
        text = utf8(raw, where, offset)
        yield text, where, text if isinstance(text, str) else None, number


def _peeked(rows: Iterator) -> Iterator | None:
    """The same rows, or None when there are none (checked before the model loads)."""
    first = next(rows, None)
    return None if first is None else itertools.chain([first], rows)


def _run_batched(m: Any, rows: Iterable[tuple], as_json: bool, task: str | None, options: dict) -> None:
    """--no-stream / --json: results printed in input order as each window of prompts is done,
    one line per prompt (--json) or per sequence. A row that cannot run prints an empty line
    per sequence (--json: its `error`); the run goes on and exits 1 at the end, naming the
    first. With several sequences a prompt, each plain line is labelled ROW.K and a tab."""
    failed, first, total = 0, None, 0
    several = (options.get("num_return_sequences") or 1) > 1
    for (_, _, prompt, number), results, _ in results_in_order(m, rows, task, options):
        total += 1
        error = results[0].error
        if error is not None:
            failed += 1
            first = first or error
        if as_json:
            emit(json.dumps(_json_record(prompt, results), ensure_ascii=False))
        elif several:
            count = options["num_return_sequences"]
            texts = [""] * count if error is not None else [r.text for r in results]
            for k, text in enumerate(texts, 1):
                emit(f"{number}.{k}\t{text}")
        else:
            emit("" if error is not None else results[0].text)
    if failed:
        fail(f"{failed} of {total} prompts failed (first: {first})")


def _sequence(r: Any) -> dict:
    """One sequence's fields in --json: its text, token ids, finish reason, token counts and
    score (when it has one)."""
    return {"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
            "prompt_tokens": r.prompt_tokens, "new_tokens": r.new_tokens,
            **({"score": r.score} if r.score is not None else {})}


def _json_record(prompt: str | None, results: list) -> dict:
    """A prompt's --json object: its first sequence, all of them under "sequences" when there
    are several, and batch_seconds, the wall time of the batch the prompt ran in (shared by
    every prompt batched with it; --batch-size 1 times each alone); or its error."""
    if results[0].error is not None:
        return {"prompt": prompt, "error": results[0].error}
    record = {"prompt": prompt, **_sequence(results[0]),
              "batch_seconds": round(results[0].seconds, 6)}
    if len(results) > 1:
        record["sequences"] = [_sequence(r) for r in results]
    return record
