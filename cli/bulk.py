"""Bulk mode (`generate --input PATH [--output PATH]`): input rows -> JSON Lines records, read and
written as it goes (a window of rows at a time), so memory stays flat however long the input; an
interrupted run continues with --resume, which recognises its own output (each line a record
this command writes for that input line: its copied fields and its prompt, which every record
names, equal to that line's) and refuses any other file, leaving it as it was. Also
the in-order decoding that the batched stdin output shares (the line reader and line counts
are minfer.io.lines', shared with the server's batch jobs).

Every input line is a row, so output line k always answers input line k: a row that cannot run
(a bad line, a blank, invalid UTF-8 or JSON, too long) is an `error` record and the run carries
on, ending with one line naming the count and the first error, status 1.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import stat
import sys
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterable, Iterator, NamedTuple

import click

# (MAX_LINE_BYTES and lines: generate's too, from here)
from minfer.io.lines import MAX_LINE_BYTES, count_lines, lines, lines_left  # noqa: F401

from .common import EXIT_USAGE, command_flags, fail, with_flags, writing

# What a record may hold beside the fields it copies from its row (generated text, an embedding,
# an error): --resume reads a record of row k within the size of row k's copied fields plus
# this, so a record of ours is never refused for its length (its copied fields alone may exceed
# MAX_LINE_BYTES: json.dumps writes 9e15 as 9000000000000000.0) and no line is read unbounded.
RESULT_BYTES = 64 << 20
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


def utf8(raw: bytes, where: str, offset: int) -> Any:
    """A line as text, or a BadRow naming the invalid byte by its offset in the stream."""
    from minfer.generation.planning import BadRow
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
    flags = command_flags(truncation="truncate")
    for result in results:
        row = pending.popleft()
        answered += 1
        for r in result:   # a row's error in the command line's words (--max-input-tokens ...)
            if r.error is not None:
                r.error = with_flags(r.error, flags)
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
    if output_path != "-" and os.path.isdir(output_path):
        fail(f"--output {output_path}: is a directory (name a file in it)", EXIT_USAGE)
    if output_path != "-" and same_file(input_path, output_path):
        fail(f"--output {output_path} is the input file: writing it would destroy the input",
              EXIT_USAGE)
    jsonl = fmt == "jsonl" or (fmt == "auto" and (field is not None or (
        input_path != "-" and input_path.lower().endswith(_JSONL_SUFFIXES))))
    if field is not None and not jsonl:
        fail("--input-field applies to JSON Lines input (--input-format jsonl)", EXIT_USAGE)
    return Bulk(input_path, output_path, jsonl, field or "text", resume)


def same_file(input_path: str, output_path: str) -> bool:
    """Whether the output is the input file (given twice, or stdin redirected from it); a
    device such as /dev/null may be both."""
    try:
        out = os.stat(output_path)
        if not stat.S_ISREG(out.st_mode):
            return False
        if input_path != "-":
            return os.path.samestat(os.stat(input_path), out)
        return sys.stdin is not None and os.path.samestat(os.fstat(sys.stdin.fileno()), out)
    except (OSError, ValueError, AttributeError):   # no output yet; a stdin without a file
        return False


def bulk_rows(stream: BinaryIO, bulk: Bulk, key: str) -> Iterator[tuple[Any, str, dict]]:
    """(prompt or BadRow, its name, the fields copied into its record) per input line, from the
    first. Every line is a row (an empty one too: it fails as a row), so output line k always
    answers input line k and --resume can count. The copied fields end with the row's prompt
    under `key` (None for a row without one), so a record names the input it answers and
    --resume can tell this input's output from another's."""
    for prompt, where, extra in _read_rows(stream, bulk):
        yield prompt, where, {**extra, key: prompt if isinstance(prompt, str) else None}


def _read_rows(stream: BinaryIO, bulk: Bulk) -> Iterator[tuple[Any, str, dict]]:
    """(prompt or BadRow, its name, the input object's other fields) per input line."""
    from minfer.errors import InputError
    from minfer.generation.planning import BadRow
    from minfer.io.limits import parse_json
    for number, offset, raw in lines(stream):
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
                          "many input rows and append the rest. Only this command's own output "
                          "for this input is continued; any other file is refused, untouched."),
    ]

    def apply(command):
        for option in reversed(options):
            command = option(command)
        return command
    return apply


# -- --resume: continue an earlier run's output, and only that -----------------------------------------
Checks = dict[str, Callable[[Any], bool]]   # a key of a record -> whether its value is one we write


@dataclass(frozen=True)
class RecordShape:
    """What a bulk command's records hold beside the fields they copy from their input row.

    first: the result key written first. keys: every key a result may hold. kind: a record ->
    (required, optional) checks of its result keys, chosen by what the record is (a result or
    an error), or None when it is neither. input_key: the copied field that holds the row's
    prompt (`bulk_rows`), what tells this input's records from another's."""
    first: str
    keys: frozenset[str]
    kind: Callable[[dict], tuple[Checks, Checks] | None]
    input_key: str

    def matches(self, record: Any, extra: dict) -> bool:
        """Whether `record` is what this command writes for an input row whose copied fields
        are `extra`: each key a result key holding a value of ours, or copied from the row with
        the row's value; every field of the row there."""
        if not isinstance(record, dict) or not all(k in record for k in extra):
            return False
        checks = self.kind(record)
        if checks is None:
            return False
        required, optional = checks
        if not all(k in record and ok(record[k]) for k, ok in required.items()):
            return False
        for key, value in record.items():
            if key in required:
                continue
            copied = key in extra and _same(value, extra[key])
            if not (copied or (key in optional and optional[key](value))):
                return False
        return True

    def head(self, extra: dict) -> bytes:
        """The bytes every record of a row with copied fields `extra` starts with: the copied
        fields written before the first result key, then that key."""
        before = {}
        for key in {**extra, self.first: None}:
            if key in self.keys:   # (a copied field named like a result key holds the result)
                break
            before[key] = extra[key]
        text = json.dumps(before, ensure_ascii=False)[:-1] + (", " if before else "")
        return (text + json.dumps(key, ensure_ascii=False) + ": ").encode("utf-8",
                                                                        "backslashreplace")


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON (NaN, written as such, equals itself)."""
    return json.dumps(a) == json.dumps(b)


def is_count(v: Any) -> bool:
    return type(v) is int and v >= 0


def is_number(v: Any) -> bool:
    return type(v) in (int, float)


class Resumed(NamedTuple):
    records: int          # complete records kept
    end: int              # the byte offset after them
    cut: bool             # whether bytes after them (a record cut short) are dropped
    rows: Iterator        # the input rows after the ones those records answer


def check_resume(bulk: Bulk, rows: Iterator[tuple], shape: RecordShape) -> Resumed:
    """An earlier run's --output, checked before anything is written to it: each line must be
    a record this command writes (`shape`) answering the input row of the same number (the
    fields it copied from that row equal the row's), except a last line cut short by an
    interrupted write, which must start as that row's record would. Anything else (a user's
    notes, another tool's JSON Lines, another input's output) is refused in one line and the
    file left as it was. No file, or an empty one: nothing to keep. `rows` is consumed as far
    as the records go; the rest come back in `rows`."""
    from minfer.errors import InputError
    from minfer.io.limits import parse_json
    out = bulk.out_name
    try:
        f = open(bulk.output_path, "rb")
    except FileNotFoundError:
        return Resumed(0, 0, False, rows)
    except OSError as e:
        fail(f"--output {out}: cannot open: {e.strerror or e}")
    with f:
        records = end = 0
        while True:
            number = records + 1
            row = next(rows, None)
            if row is None:
                more = lines_left(f)
                if more:
                    fail(f"--resume: {out} holds {records + more} lines but {bulk.name} has only "
                         f"{records}: it is not this input's output (remove it, or drop --resume)")
                return Resumed(records, end, False, rows)
            bound = _record_bytes(row[2])
            line = f.readline(bound + 1)
            if not line:
                return Resumed(records, end, False, itertools.chain([row], rows))
            if len(line) > bound:   # no newline within what we write for this row
                fail(f"--resume: {out} line {number} is longer than the {bound:,} bytes this "
                     f"command writes for {bulk.name} line {number}; resume only its own output "
                     "(or write to a new file)")
            if not line.endswith(b"\n"):   # cut short by an interrupted write: the last line
                head = shape.head(row[2])
                if f.read(1) or line[:len(head)] != head[:len(line)]:
                    fail(f"--resume: {out} line {number} is not a record minfer writes; it was "
                         f"not written by this command for {bulk.name} (resume only its own "
                         "output; write to a new file)")
                return Resumed(records, end, True, itertools.chain([row], rows))
            try:
                record = parse_json(line, out, InputError)
            except InputError:
                record = None
            if not shape.matches(record, row[2]):
                fail(f"--resume: {out} line {number} does not answer {bulk.name} line {number} "
                     f"({_mismatch(shape, record, row[2])}); resume only this command's output "
                     "for this input (or write to a new file)")
            records, end = number, end + len(line)


def _mismatch(shape: RecordShape, record: Any, extra: dict) -> str:
    """Why a line of ours (or not) does not answer the input row whose copied fields are
    `extra`."""
    key = shape.input_key
    ours = isinstance(record, dict) and shape.matches(
        record, {k: v for k, v in record.items() if k not in shape.keys})
    if not ours:
        return "it is not a record minfer writes"
    if key not in record:   # an earlier minfer's record: nothing in it names its input line
        return (f"it has no {key!r} field, so which input it answers cannot be checked: "
                "written by an earlier minfer")
    others = {k: v for k, v in extra.items() if k != key}
    if _same(record[key], extra[key]) or not shape.matches(record, {**others, key: record[key]}):
        return "the fields it copies differ from that line's"
    return f"its {key!r} is not that line's"


def _record_bytes(extra: dict) -> int:
    """The most bytes (newline included) a record of a row with copied fields `extra` takes."""
    copied = json.dumps(extra, ensure_ascii=False).encode("utf-8", "backslashreplace")
    return len(copied) + RESULT_BYTES


def open_output(bulk: Bulk, kept: Resumed) -> NamedOutput:
    """The JSON Lines output: a new file, or the resumed one cut after its kept records."""
    if bulk.resume and kept.cut:
        try:
            with open(bulk.output_path, "r+b") as f:
                f.truncate(kept.end)
        except OSError as e:
            fail(f"--output {bulk.out_name}: cannot cut its incomplete record: {e.strerror or e}")
    return open_output_file(bulk, "ab" if bulk.resume else "wb")


_FINISHED = ("eos", "length", "stop")
_SEQUENCE: Checks = {"text": lambda v: isinstance(v, str), "finish_reason": lambda v: v in _FINISHED,
                     "prompt_tokens": is_count, "new_tokens": is_count}


def _is_sequence(v: Any) -> bool:
    return (isinstance(v, dict) and all(k in v and ok(v[k]) for k, ok in _SEQUENCE.items())
            and set(v) <= {*_SEQUENCE, "score"} and is_number(v.get("score", 0)))


def _generate_kind(record: dict) -> tuple[Checks, Checks] | None:
    if record.get("finish_reason") == "error":
        return {"text": lambda v: v is None, "finish_reason": lambda v: v == "error",
                "error": lambda v: isinstance(v, str)}, {}
    return _SEQUENCE, {"score": is_number, "sequences": lambda v: (
        isinstance(v, list) and len(v) > 1 and all(map(_is_sequence, v)))}


# what _bulk_record writes: --resume continues only files of these records
GENERATE_RECORD = RecordShape("text", frozenset({*_SEQUENCE, "score", "sequences", "error"}),
                              _generate_kind, "prompt")


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


def open_input(bulk: Bulk) -> BinaryIO:
    """The input stream, or a one-line failure."""
    if bulk.input_path == "-":
        return getattr(sys.stdin, "buffer", sys.stdin)
    try:
        return open(bulk.input_path, "rb")
    except OSError as e:
        fail(f"--input {bulk.name}: cannot open: {e.strerror or e}")


def open_output_file(bulk: Bulk, mode: str) -> NamedOutput:
    """The output file (opened in `mode`) or stdout's bytes, or a one-line failure."""
    if bulk.output_path == "-":
        return NamedOutput(sys.stdout.buffer, bulk.out_name, False)
    try:
        return NamedOutput(open(bulk.output_path, mode), bulk.out_name, True)
    except OSError as e:
        fail(f"--output {bulk.out_name}: cannot open: {e.strerror or e}")


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
    source = open_input(bulk)
    rows: Iterator = bulk_rows(source, bulk, GENERATE_RECORD.input_key)
    kept = check_resume(bulk, rows, GENERATE_RECORD) if bulk.resume else Resumed(0, 0, False, rows)
    skip, cut, rows = kept.records, kept.cut, kept.rows
    out = open_output(bulk, kept)
    progress = Progress(rows_to_come(bulk, skip))
    failed, first, written = 0, None, 0
    try:
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
    kept_text = kept_note(bulk, skip, cut)
    rate = (f"{progress.rows / progress.elapsed():.1f} prompts/s, "
            f"{progress.tokens / progress.elapsed():.1f} tokens/s")
    if failed:
        fail(f"{failed} of {written} rows failed{kept_text}, each written with an 'error' field to "
              f"{bulk.out_name} (first: {first}); {rate}")
    click.echo(f"minfer: {written} rows{kept_text} -> {bulk.out_name} in {progress.elapsed():.1f} s: "
               f"{rate}", err=True)
