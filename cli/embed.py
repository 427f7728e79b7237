"""`minfer embed`: sentence embeddings of texts from arguments, stdin or a bulk file -> JSON Lines
or a .npy file.

Each text's embedding is what `model.embed` gives (the folder's sentence-transformers modules, or
the mean of the encoder states). Texts given as arguments or on stdin print one JSON object per
text ({"text", "embedding"}). Bulk mode (--input PATH, one text per line or JSON Lines) reads and
writes a window of rows at a time, so memory stays flat; the output is JSON Lines (the input
object's other fields, then "embedding", or "error" for a row that could not run) or, for an
--output ending in .npy, one float32 (rows, dim) array whose failed rows are NaN. The .npy file
is valid after every window (its header is rewritten with the rows written so far), so --resume
continues either kind of file. Rows that fail do not stop the run; it ends with one line naming
the count and the first error, status 1. The input reading, resume and progress are cli/bulk.py's.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, BinaryIO

import click
import numpy as np

from minfer.generation.text import take_window

from .bulk import (Bulk, Progress, bulk_options, bulk_rows, bulk_settings, close_files, kept_note,
                   open_files, open_to_resume, resume_point, rows_to_come)
from .common import EXIT_USAGE, emit, fail, load_model, quiet_on_closed_pipe, read_text, with_model_options

WINDOW = 256   # rows read, embedded and written at a time in bulk mode (and at most
               # generation.text.WINDOW_CHARS characters of them)
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
    """Sentence embeddings of each TEXT (or each line of stdin when no TEXT is given)."""
    if prompt is not None and prompt_name is not None:
        fail("give --prompt or --prompt-name, not both", EXIT_USAGE)
    bulk = bulk_settings(texts, input_path, output_path, input_format, input_field, resume,
                         False, None)
    npy = bulk is not None and bulk.output_path.lower().endswith(".npy")
    if not texts and bulk is None:
        if sys.stdin is None or sys.stdin.isatty():
            fail("no text: give TEXT arguments or pipe lines on stdin", EXIT_USAGE)
        texts = tuple(line for line in read_text(getattr(sys.stdin, "buffer", sys.stdin), "stdin")
                      .split("\n") if line.strip())
        if not texts:
            fail("no text: stdin held no non-empty line", EXIT_USAGE)
    m = load_model(load)
    if m.tokenizer is None:
        fail(f"{m.folder} has no tokenizer: embed needs one to read text")
    options = dict(prompt_name=prompt_name, prompt=prompt, batch_size=batch_size)
    if bulk is None:
        vectors = m.embed(list(texts), **options)
        for text, vector in zip(texts, vectors):
            emit(json.dumps({"text": text, "embedding": vector.tolist()}, ensure_ascii=False))
        return
    _run_bulk(m, bulk, npy, options)


def embed_window(m: Any, texts: list[Any], options: dict) -> list[np.ndarray | str]:
    """Each row's embedding, or its error (a BadRow's, or what embedding that row alone
    raised): one call for the rows that read well, row by row only if that call fails."""
    from minfer.errors import MinferError
    from minfer.generation.text import BadRow
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
    if npy:
        skip, cut = _npy_resume_point(bulk.output_path, dim) if bulk.resume else (0, False)
    else:
        skip, cut = resume_point(bulk.output_path, _is_embed_record) if bulk.resume else (0, False)
    source, out = open_files(bulk, ("r+b" if skip or cut else "w+b") if npy
                             else ("ab" if bulk.resume else "wb"))
    progress = Progress(rows_to_come(bulk, skip), unit="text", tokens=False)
    written, failed, first = skip, 0, None
    try:
        if npy:
            out.seek(0, os.SEEK_END)
            if out.tell() == 0:
                _write_npy_header(out, 0, dim)
        rows = bulk_rows(source, bulk, skip)
        while window := take_window(rows, WINDOW, text=lambda row: row[0]):
            results = embed_window(m, [row[0] for row in window], options)
            for (_, _, extra), result in zip(window, results):
                error = result if isinstance(result, str) else None
                failed += error is not None
                first = first or error
                if npy:
                    row = np.full(dim, np.nan, np.float32) if error else result
                    out.write(np.ascontiguousarray(row, "<f4").tobytes())
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
            progress(len(window))
    finally:
        progress.close()
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


def _write_npy_header(out: BinaryIO, rows: int, dim: int) -> None:
    """A .npy version 1.0 header of exactly NPY_HEADER bytes for a (rows, dim) float32 array."""
    text = repr({"descr": "<f4", "fortran_order": False, "shape": (rows, dim)})
    body = text.encode("latin1")
    pad = NPY_HEADER - 10 - len(body) - 1
    if pad < 0:
        raise click.ClickException(f"{rows} x {dim} does not fit a {NPY_HEADER}-byte .npy header")
    out.seek(0)
    out.write(b"\x93NUMPY\x01\x00" + (NPY_HEADER - 10).to_bytes(2, "little") + body
              + b" " * pad + b"\n")


def _is_embed_record(obj: Any) -> bool:
    """Whether a JSON value is a record `embed --input` writes: its vector, or its error."""
    return isinstance(obj, dict) and (
        isinstance(obj.get("embedding"), list) or (obj.get("embedding", 0) is None and "error" in obj))


def _npy_resume_point(path: str, dim: int) -> tuple[int, bool]:
    """(whole rows already in the .npy file at `path`, whether a partial row was cut off). The
    file is cut after its last whole row and its header says that many. No file: (0, False)."""
    f = open_to_resume(path)
    if f is None:
        return 0, False
    with f:
        try:
            version = np.lib.format.read_magic(f)
            shape, fortran, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                                     else np.lib.format.read_array_header_2_0(f))
        except ValueError as e:
            fail(f"--output {path}: not a .npy file to resume ({e})")
        if f.tell() != NPY_HEADER or fortran or dtype != np.dtype("<f4") or len(shape) != 2 \
                or shape[1] != dim:
            fail(f"--output {path}: not a (rows, {dim}) float32 file written by minfer embed; "
                 "resume into a new file")
        size = f.seek(0, os.SEEK_END) - NPY_HEADER
        rows = size // (4 * dim)
        cut = rows * 4 * dim != size or rows != shape[0]
        f.truncate(NPY_HEADER + rows * 4 * dim)
        _write_npy_header(f, rows, dim)
    return rows, cut
