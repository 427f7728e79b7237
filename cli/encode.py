"""`minfer encode`: per-token encoder states of prompts -> safetensors, for diffusion pipelines
and datasets of captions.

Prompts given as arguments (or one per line of stdin) go to one file, `-o x.safetensors`; bulk
mode (`-i prompts.jsonl -o FOLDER`) writes a folder of parts, one safetensors file per window
of rows (part-00000.safetensors, ...), each written whole (to a temporary name, then renamed),
so `--resume` keeps every part that answers this input's rows and runs the rest.

Tensor names (row: the prompt's index, from 0: its argument or input line, less one):
  states.<row>   (T, C) float32: the encoder states (`model.encode`, with --preset the
                 pipeline's rule: T is its length)
  mask.<row>     (T,) int64: the preset's pipeline mask (chroma, ltx), else which positions
                 hold the prompt's tokens (without --preset every position: T is its tokens)
Metadata (strings): "minfer" (the format: "encode 1"), "preset", "max_length", "model";
bulk parts also "first_row", "rows", "inputs" (a JSON list: each row's text hashed, as
`embed`'s .npy inputs file) and "errors" (a JSON object: row -> its one-line error; a failed
row has no tensors).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click
import numpy as np

from minfer.encoding.presets import PRESETS
from minfer.generation.planning import take_window

from .bulk import Bulk, Progress, bulk_rows, open_input, same_file
from .common import EXIT_USAGE, fail, load_model, quiet_on_closed_pipe, read_text, with_model_options
from .embed import _input_line

WINDOW = 64          # rows per part in bulk mode (a 512 x 4096 float32 row is 8 MiB)
FORMAT = "encode 1"  # the "minfer" metadata of the files this command writes
PART = "part-{:05d}.safetensors"


@click.command()
@with_model_options
@click.argument("prompts", nargs=-1)
@click.option("--preset", type=click.Choice(list(PRESETS)),
              default=None, help="A diffusers pipeline's tokenization and mask rule "
                                 "(minfer/encoding/presets.py).")
@click.option("--max-length", type=click.IntRange(min=1), default=None,
              help="Tokens per prompt (padded and cut to it)  [default: the preset's; without "
                   "one, each prompt's own tokens].")
@click.option("--output", "-o", "output_path", required=True, metavar="PATH",
              help="A .safetensors file (prompts as arguments or stdin), or with --input a "
                   "folder of parts.")
@click.option("--input", "-i", "input_path", default=None, metavar="PATH",
              help="Bulk mode: prompts from PATH ('-' for stdin), one per line or JSON Lines.")
@click.option("--input-format", type=click.Choice(["auto", "text", "jsonl"]), default="auto",
              show_default=True, help="auto: JSON Lines for *.jsonl, *.ndjson, *.json or with "
                                      "--input-field, else one prompt per line.")
@click.option("--input-field", default=None, metavar="NAME",
              help="JSON Lines: the field holding the prompt  [default: text].")
@click.option("--resume", is_flag=True,
              help="Bulk mode: keep the parts already in --output that answer this input's "
                   "rows and write the rest.")
@quiet_on_closed_pipe
def encode(load, prompts, preset, max_length, output_path, input_path, input_format,
           input_field, resume) -> None:
    """Encoder states of each PROMPT (or each line of stdin) -> one safetensors file; with
    --input, a folder of safetensors parts."""
    options = {"preset": preset, "max_length": max_length}
    if input_path is None:
        for flag, value in (("--resume", resume), ("--input-field", input_field),
                            ("--input-format", input_format != "auto")):
            if value:
                fail(f"{flag} needs --input PATH (bulk mode)", EXIT_USAGE)
        if not output_path.lower().endswith(".safetensors"):
            fail(f"--output {output_path}: name a .safetensors file", EXIT_USAGE)
        texts, names = _prompts(prompts)
        m = _model(load)
        rows = encode_rows(m, texts, names, options)
        failed = [r for r in rows if isinstance(r, str)]
        if failed:   # a file of some prompts would pass for all of them: nothing is written
            fail(f"{len(failed)} of {len(texts)} prompts failed, nothing written "
                 f"(first: {failed[0]})")
        _save(output_path, _tensors(range(len(rows)), rows), _metadata(m, options))
        click.echo(f"minfer: {len(rows)} prompts -> {output_path}", err=True)
        return
    if prompts:
        fail("give prompts either as PROMPT arguments or with --input, not both", EXIT_USAGE)
    bulk = _bulk(input_path, output_path, input_format, input_field, resume)
    _run_bulk(_model(load), bulk, options)


def _prompts(prompts: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The prompts and their names: the arguments, else stdin's lines."""
    if prompts:
        return list(prompts), [f"PROMPT {i}" for i in range(1, len(prompts) + 1)]
    if sys.stdin is None or sys.stdin.isatty():
        fail("no prompt: give PROMPT arguments or pipe lines on stdin", EXIT_USAGE)
    text = read_text(getattr(sys.stdin, "buffer", sys.stdin), "stdin")
    if not text:
        fail("no prompt: stdin was empty", EXIT_USAGE)
    texts = text.split("\n")[:-1] if text.endswith("\n") else text.split("\n")
    return texts, [f"stdin: line {i}" for i in range(1, len(texts) + 1)]


def _model(load: Any) -> Any:
    m = load_model(load)
    if not callable(getattr(m, "encoder_states", None)):
        fail(f"{m.folder}: a {type(m).__name__} has no encoder to encode with")
    if m.tokenizer is None:
        fail(f"{m.folder} has no tokenizer: give --tokenizer FOLDER (a single file has none)")
    return m


def encode_rows(m: Any, texts: list[Any], names: list[str], options: dict) -> list[Any]:
    """Each row's (states (T, C), mask (T,)), or its one-line error: one call for the rows that
    read well, then row by row only if that call fails."""
    from minfer.errors import MinferError
    from minfer.generation.planning import BadRow
    good = [i for i, t in enumerate(texts) if not isinstance(t, BadRow)]
    out: list[Any] = [t.error if isinstance(t, BadRow) else None for t in texts]
    try:
        for i, row in zip(good, _encoded(m, [texts[i] for i in good], options)):
            out[i] = row
    except MinferError:
        for i in good:
            try:
                out[i] = _encoded(m, [texts[i]], options)[0]
            except MinferError as e:
                out[i] = f"{names[i]}: {e}"
    return out


def _encoded(m: Any, texts: list[str], options: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """(states, mask) per text: with a preset its whole length, without one each row cut to
    its own tokens (a batch pads to its longest)."""
    if not texts:
        return []
    if options["preset"] is not None:
        states, mask = m.encode(texts, preset=options["preset"], return_mask=True,
                                max_length=options["max_length"])
        return list(zip(states, mask))
    cut = options["max_length"] is not None
    states, mask = m.encode(texts, max_length=options["max_length"], truncation=cut,
                            return_mask=True)
    return [(s[:n], k[:n]) for s, k, n in zip(states, mask, mask.sum(axis=1))]


def _tensors(indices: Any, rows: list[Any]) -> dict[str, np.ndarray]:
    out = {}
    for i, row in zip(indices, rows):
        if not isinstance(row, str):
            out[f"states.{i}"] = np.ascontiguousarray(row[0], np.float32)
            out[f"mask.{i}"] = np.ascontiguousarray(row[1], np.int64)
    return out


def _metadata(m: Any, options: dict) -> dict[str, str]:
    return {"minfer": FORMAT, "preset": options["preset"] or "",
            "max_length": "" if options["max_length"] is None else str(options["max_length"]),
            "model": str(m.folder)}


def _save(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """The file written whole: to a temporary name beside it, then renamed over it."""
    from safetensors.numpy import save_file
    temporary = f"{path}.partial"
    try:
        save_file(tensors, temporary, metadata=metadata)
        os.replace(temporary, path)
    except OSError as e:
        fail(f"--output {path}: cannot write: {e.strerror or e}")


def _bulk(input_path: str, output_path: str, fmt: str, field: str | None, resume: bool) -> Bulk:
    if input_path == "-" and (sys.stdin is None or sys.stdin.isatty()):
        fail("--input -: stdin is a terminal; pipe the prompts in or give a file", EXIT_USAGE)
    if input_path != "-" and not os.path.isfile(input_path):
        fail(f"--input {input_path}: no such file", EXIT_USAGE)
    if os.path.exists(output_path) and not os.path.isdir(output_path):
        fail(f"--output {output_path}: is a file; bulk mode writes a folder of parts", EXIT_USAGE)
    if same_file(input_path, output_path):
        fail(f"--output {output_path} is the input file", EXIT_USAGE)
    jsonl = fmt == "jsonl" or (fmt == "auto" and (field is not None or (
        input_path != "-" and input_path.lower().endswith((".jsonl", ".ndjson", ".json")))))
    if field is not None and not jsonl:
        fail("--input-field applies to JSON Lines input (--input-format jsonl)", EXIT_USAGE)
    return Bulk(input_path, output_path, jsonl, field or "text", resume)


def _kept_parts(bulk: Bulk, rows: Any) -> int:
    """--resume: how many parts of --output answer this input's first rows (each part's
    "inputs" against the rows' hashes, which it consumes); any other file is refused."""
    from safetensors import safe_open
    part = 0
    while os.path.exists(path := os.path.join(bulk.output_path, PART.format(part))):
        try:
            with safe_open(path, "np") as f:
                meta = f.metadata() or {}
            hashes = json.loads(meta.get("inputs", "null"))
        except Exception as e:   # a file that is not ours: named, never overwritten
            fail(f"--resume: {path} is not a part minfer encode wrote ({type(e).__name__})")
        if meta.get("minfer") != FORMAT or not isinstance(hashes, list):
            fail(f"--resume: {path} is not a part minfer encode wrote")
        for k, want in enumerate(hashes):
            row = next(rows, None)
            if row is None or _input_line(row[2]).decode("ascii").strip() != want:
                fail(f"--resume: {path} row {int(meta.get('first_row', 0)) + k} does not answer "
                     f"{bulk.name} line {int(meta.get('first_row', 0)) + k + 1}; resume only "
                     "this command's output for this input (or write to a new folder)")
        part += 1
    return part


def _run_bulk(m: Any, bulk: Bulk, options: dict) -> None:
    source = open_input(bulk)
    rows = bulk_rows(source, bulk, "text")
    if os.path.isdir(bulk.output_path) and not bulk.resume and any(
            n.startswith("part-") for n in os.listdir(bulk.output_path)):
        fail(f"--output {bulk.output_path} already holds parts: --resume continues them, or "
             "write to a new folder", EXIT_USAGE)
    part = _kept_parts(bulk, rows) if bulk.resume else 0
    os.makedirs(bulk.output_path, exist_ok=True)
    first_row = sum(len(_part_rows(bulk, k)) for k in range(part))
    skip = first_row
    progress = Progress(None, unit="prompt", tokens=False)
    failed, first = 0, None
    try:
        while window := take_window(rows, WINDOW, text=lambda row: row[0]):
            results = encode_rows(m, [r[0] for r in window], [r[1] for r in window], options)
            errors = {str(first_row + k): r for k, r in enumerate(results) if isinstance(r, str)}
            failed += len(errors)
            first = first or next(iter(errors.values()), None)
            meta = {**_metadata(m, options), "first_row": str(first_row),
                    "rows": str(len(window)), "errors": json.dumps(errors, ensure_ascii=False),
                    "inputs": json.dumps([_input_line(r[2]).decode("ascii").strip()
                                          for r in window])}
            _save(os.path.join(bulk.output_path, PART.format(part)),
                  _tensors(range(first_row, first_row + len(window)), results), meta)
            part, first_row = part + 1, first_row + len(window)
            progress(len(window))
    finally:
        progress.close()
        if source is not getattr(sys.stdin, "buffer", sys.stdin):
            source.close()
    done = first_row - skip
    kept = f" after the {skip} already there" if skip else ""
    if failed:
        fail(f"{failed} of {done} rows failed{kept} (no tensors; named in their part's "
             f"'errors'), parts in {bulk.output_path} (first: {first})")
    click.echo(f"minfer: {done} rows{kept} -> {bulk.output_path} ({part} parts) in "
               f"{progress.elapsed():.1f} s", err=True)


def _part_rows(bulk: Bulk, k: int) -> list:
    from safetensors import safe_open
    with safe_open(os.path.join(bulk.output_path, PART.format(k)), "np") as f:
        return json.loads((f.metadata() or {}).get("inputs", "[]"))
