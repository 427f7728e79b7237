"""Bulk mode (`generate --input PATH [--output PATH]`): input rows -> JSON Lines records, read and
written as it goes (a window of rows at a time), so memory stays flat however long the input; an
interrupted run continues with --resume. Also the line reader and the in-order decoding that the
batched stdin output shares.

Every input line is a row, so output line k always answers input line k: a row that cannot run
(a bad line, a blank, invalid UTF-8 or JSON, too long) is an `error` record and the run carries
on, ending with one line naming the count and the first error, status 1.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from typing import Any, BinaryIO, Callable, Iterable, Iterator

import click

from .common import EXIT_USAGE, fail, writing

# A line longer than this is a row error, read past in pieces, never held whole (json.loads of
# it would take ~10x its size).
MAX_LINE_BYTES = 16 << 20
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


def lines(stream: BinaryIO) -> Iterator[tuple[int, int, bytes | None]]:
    r"""(line number from 1, byte offset of its start, its bytes without \n or \r\n) per line of
    a byte stream, read as it goes; None for a line over MAX_LINE_BYTES."""
    number = offset = 0
    while True:
        line = stream.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if isinstance(line, str):   # a text stream without .buffer (an embedding program's)
            line = line.encode("utf-8", "surrogateescape")
        number += 1
        start, offset = offset, offset + len(line)
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while not line.endswith(b"\n"):   # read past the rest in bounded pieces
                line = stream.readline(1 << 20)
                offset += len(line)
                if not line:
                    break
            yield number, start, None
            continue
        if line.endswith(b"\n"):
            line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
        yield number, start, line


def utf8(raw: bytes, where: str, offset: int) -> Any:
    """A line as text, or a BadRow naming the invalid byte by its offset in the stream."""
    from minfer.generation.text import BadRow
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadRow(f"{where}: not valid UTF-8 at byte {offset + e.start} "
                      f"({raw[e.start:e.start + 1]!r}: {e.reason})")


def results_in_order(m: Any, rows: Iterable[tuple], task: str | None, options: dict,
             on_batch: Any = None) -> Iterator[tuple[tuple, list, bool]]:
    """(row, its Results, whether it ends a window) in input order for rows of (prompt or
    BadRow, name, *anything), decoded in batches by `run_iter` as the rows are read."""
    from minfer.generation.text import run_iter
    pending: collections.deque = collections.deque()   # rows read but not yet answered

    def prompts() -> Iterator[Any]:
        for row in rows:
            pending.append(row)
            yield row[0]

    # run_iter names row i while it holds the window that row is in, and it reads the next
    # window only after every result of the last one was taken: row i is pending[i - answered]
    answered = 0
    results = run_iter(m, prompts(), task=task, on_batch=on_batch,
                       name_row=lambda i: pending[i - answered][1], **options)
    for result in results:
        row = pending.popleft()
        answered += 1
        yield row, result, not pending   # the last row of its window: a moment to flush


class Bulk:
    """Bulk mode's settings, checked before the model loads."""

    def __init__(self, input_path: str, output_path: str, jsonl: bool, field: str, resume: bool):
        self.input_path, self.output_path = input_path, output_path
        self.jsonl, self.field, self.resume = jsonl, field, resume
        self.name = "stdin" if input_path == "-" else input_path
        self.out_name = "stdout" if output_path == "-" else output_path


def bulk_settings(prompts: tuple, input_path: str | None, output_path: str | None, fmt: str,
                   field: str | None, resume: bool, truncate: bool,
                   max_input_tokens: int | None) -> Bulk | None:
    if truncate and max_input_tokens is None:
        fail("--truncate needs --max-input-tokens (the length to cut prompts to)", EXIT_USAGE)
    if input_path is None:
        given = [o for o, v in (("--output", output_path), ("--resume", resume),
                                ("--input-field", field), ("--input-format", fmt != "auto")) if v]
        if given:
            fail(f"{given[0]} needs --input PATH (bulk mode)", EXIT_USAGE)
        return None
    if prompts:
        fail("give prompts either as PROMPT arguments or with --input, not both", EXIT_USAGE)
    output_path = output_path or "-"
    if input_path == "-" and (sys.stdin is None or sys.stdin.isatty()):
        fail("--input -: stdin is a terminal; pipe the prompts in or give a file", EXIT_USAGE)
    if resume and output_path == "-":
        fail("--resume needs --output PATH: a file to continue", EXIT_USAGE)
    if input_path != "-" and not os.path.exists(input_path):
        fail(f"--input {input_path}: no such file", EXIT_USAGE)
    if input_path != "-" and os.path.isdir(input_path):   # a pipe (<(zcat ...)) is fine
        fail(f"--input {input_path}: is a directory", EXIT_USAGE)
    if (output_path != "-" and input_path != "-" and os.path.exists(output_path)
            and os.path.samefile(input_path, output_path)):
        fail(f"--output {output_path} is the input file: writing it would destroy the input",
              EXIT_USAGE)
    jsonl = fmt == "jsonl" or (fmt == "auto" and (field is not None or (
        input_path != "-" and input_path.lower().endswith(_JSONL_SUFFIXES))))
    if field is not None and not jsonl:
        fail("--input-field applies to JSON Lines input (--input-format jsonl)", EXIT_USAGE)
    return Bulk(input_path, output_path, jsonl, field or "text", resume)


def bulk_rows(stream: BinaryIO, bulk: Bulk, skip: int) -> Iterator[tuple[Any, str, dict]]:
    """(prompt or BadRow, its name, the fields copied into its record) per input line after the
    first `skip`. Every line is a row (an empty one too: it fails as a row), so output line k
    always answers input line k and --resume can count."""
    from minfer.errors import InputError
    from minfer.generation.text import BadRow
    from minfer.io.limits import parse_json
    number = 0
    for number, offset, raw in lines(stream):
        if number <= skip:
            continue
        where = f"{bulk.name}: line {number}"
        if raw is None:
            yield BadRow(f"{where}: longer than {MAX_LINE_BYTES} bytes"), where, {}
            continue
        if not bulk.jsonl:
            yield utf8(raw, where, offset), where, {}
            continue
        if not raw.strip():
            yield BadRow(f"{where}: empty line, expected a JSON object"), where, {}
            continue
        try:   # nesting bounded before parsing; bad UTF-8 and bad JSON named
            obj = parse_json(raw, where, InputError)
        except InputError as e:
            yield BadRow(str(e)), where, {}
            continue
        if not isinstance(obj, dict):
            yield BadRow(f"{where}: expected a JSON object, got {json_type(obj)}"), where, {}
            continue
        extra = {k: v for k, v in obj.items() if k != bulk.field}
        prompt = obj.get(bulk.field)
        if bulk.field not in obj:
            prompt = BadRow(f"{where}: no {bulk.field!r} field (--input-field names the prompt's)")
        elif not isinstance(prompt, str):
            prompt = BadRow(f"{where}: field {bulk.field!r} is {json_type(prompt)}, not a string")
        yield prompt, where, extra
    if number < skip:   # more records than input lines: not this input's output
        fail(f"--resume: {bulk.out_name} holds {skip} records but {bulk.name} has only {number} "
             "lines: it is not this input's output (remove it, or drop --resume)")


def json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             type(None): "null", int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


def _bulk_record(extra: dict, results: list) -> dict:
    """One input row's output object: its copied fields, then what was generated (the first
    sequence, and all of them under "sequences" when there are several), or its error."""
    first = results[0]
    if first.error is not None:
        return {**extra, "text": None, "finish_reason": "error", "error": first.error}
    record = {**extra, **_result_fields(first)}
    if len(results) > 1:
        record["sequences"] = [_result_fields(r) for r in results]
    return record


def _result_fields(r: Any) -> dict:
    fields = {"text": r.text, "finish_reason": r.finish_reason, "prompt_tokens": r.prompt_tokens,
              "new_tokens": r.new_tokens}
    if r.score is not None:
        fields["score"] = r.score
    return fields


def bulk_options(item: str, output_help: str):
    """The bulk-mode options every command with --input shares (`item`: what a row holds,
    "prompt" or "text")."""
    options = [
        click.option("--input", "-i", "input_path", default=None, metavar="PATH",
                     help=f"Bulk mode: read {item}s from PATH ('-' for stdin), one per line, or "
                          "JSON Lines (see --input-format); write one result per input line to "
                          "--output."),
        click.option("--output", "-o", "output_path", default=None, metavar="PATH",
                     help=f"Bulk mode: {output_help}  [default: -]."),
        click.option("--input-format", type=click.Choice(["auto", "text", "jsonl"]),
                     default="auto", show_default=True,
                     help="auto: JSON Lines for *.jsonl, *.ndjson, *.json or with --input-field, "
                          f"else text (one {item} per line)."),
        click.option("--input-field", default=None, metavar="NAME",
                     help=f"JSON Lines: the field holding the {item}; the object's other fields "
                          "are copied into its output  [default: text]."),
        click.option("--resume", is_flag=True,
                     help="Bulk mode: keep the complete records already in --output, skip that "
                          "many input rows and append the rest."),
    ]

    def apply(command):
        for option in reversed(options):
            command = option(command)
        return command
    return apply


def open_to_resume(path: str) -> BinaryIO | None:
    """The output file of an earlier run, open for reading and cutting (None: there is none)."""
    try:
        return open(path, "r+b")
    except FileNotFoundError:
        return None
    except OSError as e:
        fail(f"--output {path}: cannot open: {e.strerror or e}")


def is_generate_record(obj: Any) -> bool:
    """Whether a JSON value is a record `generate --input` writes (its result fields are there)."""
    return (isinstance(obj, dict) and obj.get("finish_reason") in ("eos", "length", "stop", "error")
            and "text" in obj and (obj["finish_reason"] != "error" or "error" in obj))


def resume_point(path: str, is_record: Callable[[Any], bool]) -> tuple[int, bool]:
    """(complete records already in `path`, whether anything after them was cut off). The file
    is cut after the last complete record (`is_record` says what the command writes): a line the
    last run was writing when it stopped, or anything else (a stray line another process
    appended), ends them, and is dropped to be written again. No file: (0, False)."""
    f = open_to_resume(path)
    if f is None:
        return 0, False
    with f:
        good = end = 0
        while line := f.readline(MAX_LINE_BYTES + 1):   # our own records, one a line
            try:
                ok = line.endswith(b"\n") and is_record(json.loads(line))
            except (ValueError, RecursionError):
                ok = False
            if not ok:
                break
            good, end = good + 1, end + len(line)
        cut = f.seek(0, os.SEEK_END) > end
        if cut:   # (a character device such as /dev/null cannot be truncated, nor needs it)
            f.truncate(end)
    return good, cut


def count_lines(path: str) -> int:
    """Lines of a file (a last one without a newline counts), read in bounded chunks."""
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n")


class Progress:
    """Rows and new tokens done; a tqdm bar on stderr when it is a terminal (prompts/s,
    tokens/s, ETA when the number of rows is known)."""

    def __init__(self, total: int | None, unit: str = "prompt", tokens: bool = True):
        self.rows = self.tokens = 0
        self.start = time.perf_counter()
        self.bar, self.show_tokens = None, tokens
        if sys.stderr is not None and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit=unit, file=sys.stderr, leave=False,
                            dynamic_ncols=True)

    def __call__(self, rows: int, tokens: int = 0) -> None:
        self.rows += rows
        self.tokens += tokens
        if self.bar is not None and self.show_tokens:
            self.bar.set_postfix_str(f"{self.tokens / self.elapsed():.0f} tokens/s", refresh=False)
        if self.bar is not None:
            self.bar.update(rows)

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.start, 1e-9)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class NamedOutput:
    """The bulk output (a file, or stdout's bytes): a write, flush or close that fails (a full
    disk) is one line naming it (common.writing). Closing stdout only flushes it."""

    def __init__(self, f: BinaryIO, name: str, owned: bool):
        self._f, self.name, self._owned = f, name, owned

    def write(self, data: bytes) -> int:
        with writing(self.name):
            return self._f.write(data)

    def flush(self) -> None:
        with writing(self.name):
            self._f.flush()

    def close(self) -> None:
        with writing(self.name):
            if self._owned:
                self._f.close()
            else:
                self._f.flush()

    def __getattr__(self, attr: str) -> Any:   # seek, tell, truncate: as the file does
        return getattr(self._f, attr)


def open_files(bulk: Bulk, out_mode: str) -> tuple[BinaryIO, NamedOutput]:
    """The input stream and the output file (opened in `out_mode`), or a one-line failure."""
    try:
        source = (getattr(sys.stdin, "buffer", sys.stdin) if bulk.input_path == "-"
                  else open(bulk.input_path, "rb"))
        out = (sys.stdout.buffer if bulk.output_path == "-" else open(bulk.output_path, out_mode))
    except OSError as e:
        fail(f"{e.filename}: cannot open: {e.strerror or e}")
    return source, NamedOutput(out, bulk.out_name, bulk.output_path != "-")


def close_files(source: BinaryIO, out: NamedOutput) -> None:
    out.close()
    if source is not getattr(sys.stdin, "buffer", sys.stdin):
        source.close()


def rows_to_come(bulk: Bulk, skip: int) -> int | None:
    """Input rows after the `skip` already done, counted for the progress bar's ETA (only when
    the bar shows, on a terminal, and the input is a file)."""
    if os.path.isfile(bulk.input_path) and sys.stderr is not None and sys.stderr.isatty():
        return max(count_lines(bulk.input_path) - skip, 0)
    return None


def kept_note(bulk: Bulk, skip: int, cut: bool) -> str:
    """What the summary line says of the records a --resume kept."""
    kept = f" after the {skip} already in {bulk.out_name}" if skip else ""
    return kept + (" (an incomplete record there was dropped and written again)" if cut else "")


def run_bulk(m: Any, bulk: Bulk, task: str | None, options: dict) -> None:
    """Bulk mode: input rows -> JSON Lines records in input order, written as each window of
    rows is done (flushed then), so memory stays flat and an interrupted run can --resume."""
    skip, cut = resume_point(bulk.output_path, is_generate_record) if bulk.resume else (0, False)
    source, out = open_files(bulk, "ab" if bulk.resume else "wb")
    progress = Progress(rows_to_come(bulk, skip))
    failed, first, written = 0, None, 0
    try:
        rows = bulk_rows(source, bulk, skip)
        for (_, _, extra), results, window_done in results_in_order(m, rows, task, options, progress):
            record = _bulk_record(extra, results)
            # a lone surrogate (a "\ud800" escape in the input) is written back as that escape
            out.write(json.dumps(record, ensure_ascii=False).encode("utf-8", "backslashreplace")
                      + b"\n")
            written += 1
            if results[0].error is not None:
                failed += 1
                first = first or results[0].error
            if window_done:   # complete records reach the file a window at a time
                out.flush()
        out.flush()
    finally:
        progress.close()
        close_files(source, out)
    kept = kept_note(bulk, skip, cut)
    rate = (f"{progress.rows / progress.elapsed():.1f} prompts/s, "
            f"{progress.tokens / progress.elapsed():.1f} tokens/s")
    if failed:
        fail(f"{failed} of {written} rows failed{kept}, each written with an 'error' field to "
              f"{bulk.out_name} (first: {first}); {rate}")
    click.echo(f"minfer: {written} rows{kept} -> {bulk.out_name} in {progress.elapsed():.1f} s: "
               f"{rate}", err=True)
