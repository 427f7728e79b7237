"""`minfer embed`: sentence embeddings of texts from arguments, stdin or a bulk file -> JSON Lines
or a .npy file.

Each text's embedding is what `model.embed` gives (the folder's sentence-transformers modules, or
the mean of the encoder states). Texts given as arguments or on stdin print one JSON object per
text ({"text", "embedding"}). Bulk mode (--input PATH, one text per line or JSON Lines) reads and
writes a window of rows at a time, so memory stays flat; the output is JSON Lines (the input
object's other fields, the row's "text", then "embedding", or "error" for a row that could not
run) or, for an --output ending in .npy, one float32 (rows, dim) array whose failed rows are
NaN, with x.npy.inputs beside it (a hash of each row's text). The .npy file is valid after every
window (its header is rewritten with the rows written so far), so --resume continues either
kind of file, after checking that its rows answer this input's lines. Rows that fail do not stop the run; it ends with one line naming
the count and the first error, status 1. The input reading, resume and progress are cli/bulk.py's.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from typing import Any, BinaryIO, Iterator

import click
import numpy as np

from minfer.generation.planning import take_window

from .bulk import (Bulk, NamedOutput, Progress, RecordShape, Resumed, bulk_options, bulk_rows,
                   bulk_settings, check_resume, close_files, is_number, kept_note, open_input,
                   open_output, open_output_file, rows_to_come, same_file)
from .common import (EXIT_USAGE, command_flags, emit, fail, load_model, quiet_on_closed_pipe,
                     read_text, with_flags, with_model_options)

WINDOW = 256   # rows read, embedded and written at a time in bulk mode (and at most
               # generation.planning.WINDOW_CHARS characters of them)
NPY_HEADER = 128   # bytes of the .npy header we write: fixed, so it can be rewritten in place


@click.command()
@with_model_options
@click.argument("texts", nargs=-1)
@click.option("--prompt-name", default=None, metavar="NAME",
              help="Prepend the model's prompt of this name (config_sentence_transformers.json)  "
                   "[default: the model's default prompt, if any].")
@click.option("--prompt", default=None, metavar="TEXT", help="Prepend this text to every input.")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="Texts per encoder batch at most (fewer when the workspace cannot hold them).")
@bulk_options("text", "JSON Lines ('-' for stdout), or a .npy file of (rows, dim) float32")
@quiet_on_closed_pipe
def embed(load, texts, prompt_name, prompt, batch_size, input_path, output_path, input_format,
          input_field, resume) -> None:
    """Sentence embeddings of each TEXT (or each line of stdin when no TEXT is given; every
    line is a text, a blank one too, so output line k answers input line k)."""
    if prompt is not None and prompt_name is not None:
        fail("give --prompt or --prompt-name, not both", EXIT_USAGE)
    bulk = bulk_settings(texts, input_path, output_path, input_format, input_field, resume,
                         False, None)
    npy = bulk is not None and bulk.output_path.lower().endswith(".npy")
    if npy and same_file(bulk.input_path, bulk.output_path + INPUTS_SUFFIX):
        fail(f"--input {bulk.name} is {bulk.output_path}'s inputs file, which writing the .npy "
             "replaces: it would destroy the input", EXIT_USAGE)
    names = [f"TEXT {i}" for i in range(1, len(texts) + 1)]
    if not texts and bulk is None:
        if sys.stdin is None or sys.stdin.isatty():
            fail("no text: give TEXT arguments or pipe lines on stdin", EXIT_USAGE)
        text = read_text(getattr(sys.stdin, "buffer", sys.stdin), "stdin")
        if not text:
            fail("no text: stdin was empty", EXIT_USAGE)
        # every line is a text, a blank one too: output line k answers input line k
        texts = tuple(text.split("\n")[:-1] if text.endswith("\n") else text.split("\n"))
        names = [f"stdin: line {i}" for i in range(1, len(texts) + 1)]
    m = load_model(load)
    if m.tokenizer is None:
        fail(f"{m.folder} has no tokenizer: embed needs one to read text")
    _check_prompt(m, prompt_name, prompt)
    options = dict(prompt_name=prompt_name, prompt=prompt, batch_size=batch_size)
    if bulk is None:
        _print_embeddings(m, texts, names, options)
        return
    _run_bulk(m, bulk, npy, options)


def _check_prompt(m: Any, prompt_name: str | None, prompt: str | None) -> None:
    """A --prompt-name the model lacks is a usage error naming the flag (before any row runs)."""
    from minfer.embedding import prompt_for
    from minfer.errors import InputError
    try:
        prompt_for(getattr(m, "sentence_modules", None), prompt_name, prompt)
    except InputError as e:
        fail(with_flags(str(e).removeprefix("embed(): "), command_flags()), EXIT_USAGE)


def _print_embeddings(m: Any, texts: tuple[str, ...], names: list[str], options: dict) -> None:
    """One {"text", "embedding"} line per text, in order. A text that cannot be embedded (the
    library refuses it as input, or its vector holds NaN or infinity) is {"text", "embedding":
    null, "error"} (named by its argument or line) and the run goes on, ending with one line
    naming the count and the first, status 1, as bulk mode and generate do; any other failure
    ends the run in one line."""
    from minfer.errors import InputError, NonFiniteError
    row_errors = (InputError, NonFiniteError)
    try:
        results: list = list(m.embed(list(texts), **options))
    except row_errors:   # find the texts that fail, one at a time
        results = []
        for text, name in zip(texts, names):
            try:
                results.append(m.embed([text], **options)[0])
            except row_errors as e:
                results.append(f"{name}: {e}")
    failed = [r for r in results if isinstance(r, str)]
    for text, result in zip(texts, results):
        record = ({"text": text, "embedding": None, "error": result} if isinstance(result, str)
                  else {"text": text, "embedding": result.tolist()})
        emit(json.dumps(record, ensure_ascii=False))
    if failed:
        fail(f"{len(failed)} of {len(texts)} texts failed (first: {failed[0]})")


def embed_window(m: Any, texts: list[Any], options: dict) -> list[np.ndarray | str]:
    """Each row's embedding, or its error (a BadRow's, or what embedding that row alone
    raised): one call for the rows that read well, row by row only if that call fails."""
    from minfer.errors import MinferError
    from minfer.generation.planning import BadRow
    good = [i for i, t in enumerate(texts) if not isinstance(t, BadRow)]
    out: list[np.ndarray | str] = [t.error if isinstance(t, BadRow) else "" for t in texts]
    try:
        vectors = m.embed([texts[i] for i in good], **options) if good else []
        for i, v in zip(good, vectors):
            out[i] = v
    except MinferError:
        for i in good:
            try:
                out[i] = m.embed([texts[i]], **options)[0]
            except MinferError as e:
                out[i] = str(e)
    return out


def _run_bulk(m: Any, bulk: Bulk, npy: bool, options: dict) -> None:
    dim = _dimension(m, options)
    source = open_input(bulk)
    rows = bulk_rows(source, bulk, INPUT_KEY)
    if not bulk.resume:
        kept = Resumed(0, 0, False, rows)
    elif npy:
        kept = _npy_resume(bulk, rows, dim)
    else:
        kept = check_resume(bulk, rows, embed_record(dim))
    skip, cut, rows = kept.records, kept.cut, kept.rows
    out = _open_npy(bulk, kept, dim) if npy else open_output(bulk, kept)
    inputs = _open_inputs(bulk, kept.records) if npy else None
    progress = Progress(rows_to_come(bulk, skip), unit="text", tokens=False)
    written, failed, first = skip, 0, None
    try:
        while window := take_window(rows, WINDOW, text=lambda row: row[0]):
            results = embed_window(m, [row[0] for row in window], options)
            for (_, _, extra), result in zip(window, results):
                error = result if isinstance(result, str) else None
                failed += error is not None
                first = first or error
                if npy:
                    row = np.full(dim, np.nan, np.float32) if error else result
                    out.write(np.ascontiguousarray(row, "<f4").tobytes())
                    inputs.write(_input_line(extra))
                else:
                    record = ({**extra, "embedding": None, "error": error} if error
                              else {**extra, "embedding": result.tolist()})
                    out.write(json.dumps(record, ensure_ascii=False)
                              .encode("utf-8", "backslashreplace") + b"\n")
            written += len(window)
            if npy:   # the file is a valid .npy of every row so far
                _write_npy_header(out, written, dim)
                out.seek(0, os.SEEK_END)
            out.flush()
            if inputs is not None:   # after the rows: a resume keeps the rows both hold
                inputs.flush()
            progress(len(window))
    finally:
        progress.close()
        if inputs is not None:
            inputs.close()
        close_files(source, out)
    done = written - skip
    rate = f"{progress.rows / progress.elapsed():.1f} texts/s"
    what = "NaN rows" if npy else "records with an 'error' field"
    if failed:
        fail(f"{failed} of {done} rows failed{kept_note(bulk, skip, cut)}, written as {what} to "
             f"{bulk.out_name} (first: {first}); {rate}")
    click.echo(f"minfer: {done} rows{kept_note(bulk, skip, cut)} -> {bulk.out_name} "
               f"({dim} floats each) in {progress.elapsed():.1f} s: {rate}", err=True)


def _dimension(m: Any, options: dict) -> int:
    """The embedding width (what a .npy row holds), from one short text."""
    return int(m.embed(["x"], **options).shape[1])


def _npy_header(rows: int, dim: int) -> bytes:
    """A .npy version 1.0 header of exactly NPY_HEADER bytes for a (rows, dim) float32 array."""
    text = repr({"descr": "<f4", "fortran_order": False, "shape": (rows, dim)})
    body = text.encode("latin1")
    pad = NPY_HEADER - 10 - len(body) - 1
    if pad < 0:
        raise click.ClickException(f"{rows} x {dim} does not fit a {NPY_HEADER}-byte .npy header")
    return b"\x93NUMPY\x01\x00" + (NPY_HEADER - 10).to_bytes(2, "little") + body + b" " * pad + b"\n"


def _write_npy_header(out: BinaryIO, rows: int, dim: int) -> None:
    out.seek(0)
    out.write(_npy_header(rows, dim))


def embed_record(dim: int) -> RecordShape:
    """What a JSON Lines record of `embed --input` holds: its `dim` floats, or its error."""
    def kind(record: dict) -> tuple[dict, dict]:
        if record.get("embedding", 0) is None:
            return {"embedding": lambda v: v is None, "error": lambda v: isinstance(v, str)}, {}
        return {"embedding": lambda v: (isinstance(v, list) and len(v) == dim
                                        and all(map(is_number, v)))}, {}
    return RecordShape("embedding", frozenset({"embedding", "error"}), kind, INPUT_KEY)


def _npy_resume_point(path: str, dim: int) -> tuple[int, int, bool]:
    """(whole rows already in the .npy file at `path`, the byte offset after them, whether
    anything else is dropped or rewritten), read only. The file must be what this command
    writes: its header byte for byte ours for some (rows, dim) float32 (its count may lag the
    rows after it, written before the header counts them). An empty file, or one cut inside
    the first header, has no rows; anything else is refused in one line, the file untouched.
    No file: (0, 0, False)."""
    try:
        with open(path, "rb") as f:
            head = f.read(NPY_HEADER)
            size = f.seek(0, os.SEEK_END)
    except FileNotFoundError:
        return 0, 0, False
    except OSError as e:
        fail(f"--output {path}: cannot open: {e.strerror or e}")
    if len(head) < NPY_HEADER and _npy_header(0, dim).startswith(head):
        return 0, 0, bool(head)   # (cut while the first header was written)
    try:
        rows = np.lib.format.read_array_header_1_0(io.BytesIO(head[8:]))[0][0]
    except (ValueError, IndexError, TypeError, SyntaxError):
        rows = None
    if rows is None or head != _npy_header(rows, dim):
        fail(f"--output {path}: not a (rows, {dim}) float32 file written by minfer embed; "
             "resume only its own output (or write to a new file)")
    whole = (size - NPY_HEADER) // (4 * dim)
    end = NPY_HEADER + whole * 4 * dim
    return whole, end, size != end or whole != rows


# -- the .npy output's inputs file: which text each row embeds, so --resume can check them -------------
INPUT_KEY = "text"   # the copied field holding a row's text (JSON Lines records; .npy: hashed)
INPUTS_SUFFIX = ".inputs"   # x.npy's inputs file is x.npy.inputs
INPUTS_MAGIC = b"minfer embed inputs 1: the blake2b-128 of each row's text as JSON\n"
_HASH_LINE = 33   # 32 hex digits and a newline


def _input_line(extra: dict) -> bytes:
    """A row's line in the inputs file: a hash of its text (JSON, so a row without one, null,
    and lone surrogates hash too)."""
    text = json.dumps(extra[INPUT_KEY]).encode("ascii")
    return hashlib.blake2b(text, digest_size=16).hexdigest().encode("ascii") + b"\n"


def _npy_resume(bulk: Bulk, rows: Iterator[tuple], dim: int) -> Resumed:
    """The rows of an earlier run's .npy output to keep: its whole rows (`_npy_resume_point`)
    whose lines in the inputs file beside it are the hashes of this input's rows of the same
    number. A file with rows but no inputs file (an earlier minfer's, or moved without it) is
    refused in one line: which input it embeds cannot be checked. Read only."""
    done, end, cut = _npy_resume_point(bulk.output_path, dim)
    if not done:
        return Resumed(0, end, cut, rows)
    path = bulk.output_path + INPUTS_SUFFIX
    refuse = (f"--resume: {bulk.out_name} holds {done} rows but {path}, which names the texts "
              "they embed, is {}: which input they answer cannot be checked (write to a new "
              "file, or drop --resume)")
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        fail(refuse.format("missing (written by an earlier minfer, or moved without it)"))
    except OSError as e:
        fail(refuse.format(f"unreadable ({e.strerror or e})"))
    with f:
        if f.read(len(INPUTS_MAGIC)) != INPUTS_MAGIC:
            fail(refuse.format("not a file minfer embed writes"))
        kept = 0
        while kept < done:
            line = f.read(_HASH_LINE)
            if len(line) < _HASH_LINE:   # (cut short: that row and the ones after are redone)
                break
            row = next(rows, None)
            if row is None:
                fail(f"--resume: {bulk.out_name} holds {done} rows but {bulk.name} has only "
                     f"{kept} lines: it is not this input's output (remove it, or drop --resume)")
            if line != _input_line(row[2]):
                fail(f"--resume: {bulk.out_name} row {kept + 1} does not embed {bulk.name} line "
                     f"{kept + 1} (its text differs, by {path}); resume only this command's "
                     "output for this input (or write to a new file)")
            kept += 1
    if kept < done:   # rows whose hashes were not all written yet: redone
        end, cut = NPY_HEADER + kept * 4 * dim, True
    return Resumed(kept, end, cut, rows)


def _open_inputs(bulk: Bulk, kept: int) -> NamedOutput:
    """The .npy output's inputs file: new, or cut after the `kept` rows' lines."""
    path = bulk.output_path + INPUTS_SUFFIX
    try:
        f = open(path, "r+b" if kept else "wb")
        f.truncate(len(INPUTS_MAGIC) + kept * _HASH_LINE if kept else 0)
        f.seek(0, os.SEEK_END)
        if not kept:
            f.write(INPUTS_MAGIC)
    except OSError as e:
        fail(f"--output {bulk.out_name}: cannot write {path}: {e.strerror or e}")
    return NamedOutput(f, path, True)


def _open_npy(bulk: Bulk, kept: Resumed, dim: int) -> Any:
    """The .npy output: a new file with an empty (0, dim) header, or the resumed one cut after
    its kept rows with its header counting them; the position at its end."""
    out = open_output_file(bulk, "r+b" if kept.records or kept.cut else "w+b")
    if kept.records or kept.cut:
        out.truncate(kept.end if kept.records else 0)
    _write_npy_header(out, kept.records, dim)
    out.seek(0, os.SEEK_END)
    return out
