"""`minfer generate`: prompts from arguments, stdin or a bulk file -> streamed, batched or JSON
Lines output.

Output streams as it is decided, one prompt at a time; --no-stream and --json run the prompts in
batches (generation.text.run_iter: a window of prompts at a time, so memory stays flat however
long stdin is). There a prompt that cannot run is a row error: an `error` record (--json) or an
empty line (--no-stream); the run carries on, and ends with one line naming the count and the
first error, status 1. Bulk mode (--input) is cli/bulk.py.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from typing import Any, BinaryIO, Iterable, Iterator

import click

from minfer.generation.options import DEFAULT_MAX_BATCH_SIZE

from .bulk import (MAX_LINE_BYTES, bulk_options, bulk_settings, lines, results_in_order, run_bulk,
                   utf8)
from .common import EXIT_USAGE, emit, fail, load_model, quiet_on_closed_pipe, read_text, with_model_options

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


@click.command()
@with_model_options
@click.argument("prompts", nargs=-1)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="New tokens at most  [default: the checkpoint's, else 256].")
@click.option("--min-new-tokens", type=click.IntRange(min=0), default=None,
              help="New tokens before eos is allowed  [default: 0].")
@click.option("--do-sample/--greedy", default=None,
              help="Sample instead of greedy search  [default: greedy unless --temperature, "
                   "--top-k or --top-p is given].")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Sampling temperature  [default: 1.0].")
@click.option("--top-k", type=click.IntRange(min=0), default=None,
              help="Sample from the k most likely tokens (0 = all)  [default: 50].")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None,
              help="Nucleus sampling: smallest set with this much probability  [default: 1.0].")
@click.option("--repetition-penalty", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Penalty for tokens already generated  [default: 1.0].")
@click.option("--no-repeat-ngram-size", type=click.IntRange(min=0), default=None,
              help="Never repeat an n-gram of this size  [default: 0 = off].")
@click.option("--num-beams", type=click.IntRange(min=1), default=None,
              help="Beam search width  [default: 1 = greedy].")
@click.option("--length-penalty", type=float, default=None,
              help="Beam score = logprob / length**penalty  [default: 1.0].")
@click.option("--num-return-sequences", type=click.IntRange(min=1), default=None,
              help="Results per prompt  [default: 1].")
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
              help="One JSON object per result: text, token ids, finish reason, timing.")
@click.option("--batch-size", "max_batch_size", type=click.IntRange(min=1), default=None,
              help="Prompts per batch at most (--no-stream, --json, --input); fewer when the "
                   f"workspace cannot hold that many  [default: {DEFAULT_MAX_BATCH_SIZE}].")
@click.option("--max-input-tokens", type=click.IntRange(min=1), default=None,
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
    """Generate text for each PROMPT (or each line of stdin when no PROMPT is given).

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
    if bulk is None and not prompts:
        if sys.stdin is None or sys.stdin.isatty():
            fail("no prompt: give PROMPT arguments or pipe lines on stdin", EXIT_USAGE)
        stdin = getattr(sys.stdin, "buffer", sys.stdin)
        if stream:   # streamed output reads all of stdin first: a bad byte fails before any output
            prompts = tuple(line for line in read_text(stdin, "stdin").split("\n") if line.strip())
            empty = not prompts
        else:        # batched output reads as it goes (a bad line is a row error)
            rows = _peeked(_stdin_prompts(stdin))
            empty = rows is None
        if empty:
            fail("no prompt: stdin held no non-empty line", EXIT_USAGE)
    for i, prompt in enumerate(prompts, 1):
        # an argument that is not UTF-8 arrives with its bad bytes as lone surrogates
        # (surrogateescape): name it as bytes, which is what the user typed
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            fail(f"PROMPT {i}: not valid UTF-8 at character {e.start} "
                  f"({prompt[e.start].encode('utf-8', 'surrogateescape')!r})", EXIT_USAGE)
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
    if m.tokenizer is None:
        from minfer.generation.text import tokenizer_files  # the files this family would read
        fail(f"{m.folder} has no tokenizer ({tokenizer_files(m)}): text prompts need one")
    if bulk is not None:
        run_bulk(m, bulk, task, options)
        return
    if stream:
        for prompt in prompts:
            for piece in m.generate(prompt, stream=True, task=task, **options):
                emit(piece, nl=False)
            emit()
        return
    if rows is None:
        rows = ((p, f"PROMPT {i}", p) for i, p in enumerate(prompts, 1))
    _run_batched(m, rows, as_json, task, options)


def _stdin_prompts(stream: BinaryIO) -> Iterator[tuple[Any, str, str | None]]:
    """(prompt or BadRow, its name, the prompt as --json shows it) per non-blank stdin line."""
    for number, offset, raw in lines(stream):
        where = f"stdin: line {number}"
        if raw is None:
            from minfer.generation.text import BadRow
            yield BadRow(f"{where}: longer than {MAX_LINE_BYTES} bytes"), where, None
            continue
        text = utf8(raw, where, offset)
        if isinstance(text, str) and not text.strip():
            continue   # blank lines separate prompts, as when stdin is read whole
        yield text, where, text if isinstance(text, str) else None


def _peeked(rows: Iterator) -> Iterator | None:
    """The same rows, or None when there are none (checked before the model loads)."""
    first = next(rows, None)
    return None if first is None else itertools.chain([first], rows)


def _run_batched(m: Any, rows: Iterable[tuple], as_json: bool, task: str | None, options: dict) -> None:
    """--no-stream / --json: results printed in input order as each window of prompts is done.
    A row that cannot run prints an empty line (--json: its `error`); the run goes on and exits
    1 at the end, naming the first."""
    failed, first, total = 0, None, 0
    for (_, _, prompt), results, _ in results_in_order(m, rows, task, options):
        total += 1
        if results[0].error is not None:
            failed += 1
            first = first or results[0].error
            emit(json.dumps({"prompt": prompt, "error": results[0].error}, ensure_ascii=False)
                 if as_json else "")
            continue
        for r in results:
            if as_json:
                emit(json.dumps({
                    "prompt": prompt, "text": r.text, "token_ids": r.token_ids,
                    "finish_reason": r.finish_reason, "prompt_tokens": r.prompt_tokens,
                    "new_tokens": r.new_tokens, "seconds": round(r.seconds, 6),
                    "tokens_per_second": round(r.new_tokens / r.seconds, 3) if r.seconds else None,
                    **({"score": r.score} if r.score is not None else {}),
                }, ensure_ascii=False))
            else:
                emit(r.text)
    if failed:
        fail(f"{failed} of {total} prompts failed (first: {first})")
