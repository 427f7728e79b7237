"""Click commands only: parse options, call the library, print. No model logic lives here.

Every failure is one line on stderr ("minfer: error: ...") and a non-zero exit: 1 for a problem
with the model or input, 2 for a bad command line, 130 on Ctrl-C. Set MINFER_DEBUG=1 to see the
traceback of an unexpected error. Bare `minfer` prints the help on stdout and exits 2 (no command:
click's status for a group called without one). A reader that leaves early (`minfer generate ... |
head -1`) ends the run quietly with status 0. Text input (stdin, `score FILE`) must be UTF-8: an
invalid byte is named by its offset.

Runs over many prompts (generate --no-stream / --json over stdin, bulk mode --input) read and
write as they go, a window of prompts at a time (generation.text.run_iter), so memory stays flat
however long the input. There a prompt that cannot run (a bad line, a blank, invalid UTF-8 or
JSON, too long) is a row error: an `error` record (bulk, --json) or an empty line (--no-stream);
the run carries on, and ends with one line naming the count and the first error, status 1.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import os
import re
import sys
import time
from typing import Any, BinaryIO, Iterable, Iterator

import click

from minfer.generation.options import DEFAULT_MAX_BATCH_SIZE

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPT = 0, 1, 2, 130


def _fail(message: str, code: int = EXIT_ERROR) -> None:
    click.echo(f"minfer: error: {' '.join(str(message).split())}", err=True)
    sys.exit(code)


def _exit_on_closed_pipe() -> None:
    """The reader of stdout went away: nothing is wrong, stop quietly. stdout is pointed at
    /dev/null so that the interpreter's last flush cannot fail again (the Python docs' recipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(EXIT_OK)


def quiet_on_closed_pipe(command):
    """Click turns EPIPE inside a command into exit status 1; catch it first (see above)."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except BrokenPipeError:
            _exit_on_closed_pipe()
    return run


def _read_text(stream: BinaryIO, name: str) -> str:
    r"""All of a byte stream as UTF-8 text, newlines normalised as text mode would (\r\n, \r ->
    \n); an invalid byte is a one-line error naming the stream and the byte's offset."""
    data = stream.read()
    if isinstance(data, str):  # a text stream without .buffer (an embedding program's stdin)
        return data
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        _fail(f"{name}: not valid UTF-8 at byte {e.start} ({data[e.start:e.start + 1]!r}: {e.reason})")
    return text.replace("\r\n", "\n").replace("\r", "\n")


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


def _load(model: str, device: str, dtype: str | None, revision: str | None, workspace: str | None,
          memory_limit: str | None, offline: bool, threads: int | None) -> Any:
    import minfer
    return minfer.load(model, device=device, dtype=dtype, revision=revision, workspace=workspace,
                       memory_limit=memory_limit, offline=True if offline else None,
                       num_threads=threads)


model_options = [
    click.option("--model", "-m", required=True, metavar="NAME_OR_PATH",
                 help="Hub name (t5-small, google/flan-t5-base, ...) or a local folder in the HF layout."),
    click.option("--revision", default=None, help="Hub revision (branch, tag or commit)."),
    click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N or auto."),
    click.option("--dtype", default=None, metavar="DTYPE",
                 help="How weights are stored: float32 (CPU default), float16 (CUDA default), "
                      "bfloat16, int8 (weight-only, one scale per output channel) or auto (as the checkpoint "
                      "stores them)."),
    click.option("--workspace", default=None, metavar="SIZE",
                 help="Arena size for activations and caches, e.g. 512MiB  [default: 1GiB]; with "
                      "--memory-limit, the part of the limit kept for them."),
    click.option("--memory-limit", default=None, metavar="SIZE",
                 help="Whole memory budget incl. weights, e.g. 2GiB: layers that do not fit are "
                      "streamed in as needed."),
    click.option("--offline", is_flag=True, help="Use only the local cache; never contact the hub."),
    click.option("--threads", type=click.IntRange(min=1), default=None,
                 help="CPU threads for the model's work  [default: the cores this process may use]."),
]


def with_model_options(f):
    for option in reversed(model_options):
        f = option(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="minfer")
def cli() -> None:
    """minfer: framework-free T5 and Transformer-XL inference."""


@cli.command()
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
@click.option("--input", "-i", "input_path", default=None, metavar="PATH",
              help="Bulk mode: read prompts from PATH ('-' for stdin), one per line, or JSON "
                   "Lines (see --input-format); write one JSON object per input line to --output.")
@click.option("--output", "-o", "output_path", default=None, metavar="PATH",
              help="Bulk mode: where the JSON Lines go ('-' for stdout)  [default: -].")
@click.option("--input-format", type=click.Choice(["auto", "text", "jsonl"]), default="auto",
              show_default=True,
              help="auto: JSON Lines for *.jsonl, *.ndjson, *.json or with --input-field, "
                   "else text (one prompt per line).")
@click.option("--input-field", default=None, metavar="NAME",
              help="JSON Lines: the field holding the prompt; the object's other fields are "
                   "copied into its output  [default: text].")
@click.option("--resume", is_flag=True,
              help="Bulk mode: keep the complete records already in --output, skip that many "
                   "input rows and append the rest.")
@quiet_on_closed_pipe
def generate(model, revision, device, dtype, workspace, memory_limit, offline, threads, prompts, max_new_tokens,
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
    bulk = _bulk_settings(prompts, input_path, output_path, input_format, input_field, resume,
                          truncate, max_input_tokens)
    stream = (bulk is None and not no_stream and not as_json
              and (num_return_sequences or 1) == 1)
    rows = None   # batched output: (prompt, its name, the prompt as --json shows it), read as needed
    if bulk is None and not prompts:
        if sys.stdin is None or sys.stdin.isatty():
            _fail("no prompt: give PROMPT arguments or pipe lines on stdin", EXIT_USAGE)
        stdin = getattr(sys.stdin, "buffer", sys.stdin)
        if stream:   # streamed output reads all of stdin first: a bad byte fails before any output
            prompts = tuple(line for line in _read_text(stdin, "stdin").split("\n") if line.strip())
            empty = not prompts
        else:        # batched output reads as it goes (a bad line is a row error)
            rows = _peeked(_stdin_prompts(stdin))
            empty = rows is None
        if empty:
            _fail("no prompt: stdin held no non-empty line", EXIT_USAGE)
    for i, prompt in enumerate(prompts, 1):
        # an argument that is not UTF-8 arrives with its bad bytes as lone surrogates
        # (surrogateescape): name it as bytes, which is what the user typed
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            _fail(f"PROMPT {i}: not valid UTF-8 at character {e.start} "
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
    m = _load(model, device, dtype, revision, workspace, memory_limit, offline, threads)
    if m.tokenizer is None:
        from minfer.generation.text import tokenizer_files  # the files this family would read
        _fail(f"{m.folder} has no tokenizer ({tokenizer_files(m)}): text prompts need one")
    if bulk is not None:
        _run_bulk(m, bulk, task, options)
        return
    if stream:
        for prompt in prompts:
            for piece in m.generate(prompt, stream=True, task=task, **options):
                click.echo(piece, nl=False)
                sys.stdout.flush()
            click.echo()
        return
    if rows is None:
        rows = ((p, f"PROMPT {i}", p) for i, p in enumerate(prompts, 1))
    _run_batched(m, rows, as_json, task, options)


# -- batched output: --no-stream / --json, and bulk mode ------------------------------------------------
# A line longer than this is a row error, read past in pieces, never held whole (json.loads of
# it would take ~10x its size).
MAX_LINE_BYTES = 16 << 20
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


def _lines(stream: BinaryIO) -> Iterator[tuple[int, int, bytes | None]]:
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


def _utf8(raw: bytes, where: str, offset: int) -> Any:
    """A line as text, or a BadRow naming the invalid byte by its offset in the stream."""
    from minfer.generation.text import BadRow
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadRow(f"{where}: not valid UTF-8 at byte {offset + e.start} "
                      f"({raw[e.start:e.start + 1]!r}: {e.reason})")


def _stdin_prompts(stream: BinaryIO) -> Iterator[tuple[Any, str, str | None]]:
    """(prompt or BadRow, its name, the prompt as --json shows it) per non-blank stdin line."""
    for number, offset, raw in _lines(stream):
        where = f"stdin: line {number}"
        if raw is None:
            from minfer.generation.text import BadRow
            yield BadRow(f"{where}: longer than {MAX_LINE_BYTES} bytes"), where, None
            continue
        text = _utf8(raw, where, offset)
        if isinstance(text, str) and not text.strip():
            continue   # blank lines separate prompts, as when stdin is read whole
        yield text, where, text if isinstance(text, str) else None


def _peeked(rows: Iterator) -> Iterator | None:
    """The same rows, or None when there are none (checked before the model loads)."""
    first = next(rows, None)
    return None if first is None else itertools.chain([first], rows)


def _results(m: Any, rows: Iterable[tuple], task: str | None, options: dict,
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


def _run_batched(m: Any, rows: Iterable[tuple], as_json: bool, task: str | None, options: dict) -> None:
    """--no-stream / --json: results printed in input order as each window of prompts is done.
    A row that cannot run prints an empty line (--json: its `error`); the run goes on and exits
    1 at the end, naming the first."""
    failed, first, total = 0, None, 0
    for (_, _, prompt), results, _ in _results(m, rows, task, options):
        total += 1
        if results[0].error is not None:
            failed += 1
            first = first or results[0].error
            click.echo(json.dumps({"prompt": prompt, "error": results[0].error}, ensure_ascii=False)
                       if as_json else "")
            continue
        for r in results:
            if as_json:
                click.echo(json.dumps({
                    "prompt": prompt, "text": r.text, "token_ids": r.token_ids,
                    "finish_reason": r.finish_reason, "prompt_tokens": r.prompt_tokens,
                    "new_tokens": r.new_tokens, "seconds": round(r.seconds, 6),
                    "tokens_per_second": round(r.new_tokens / r.seconds, 3) if r.seconds else None,
                    **({"score": r.score} if r.score is not None else {}),
                }, ensure_ascii=False))
            else:
                click.echo(r.text)
    if failed:
        _fail(f"{failed} of {total} prompts failed (first: {first})")


class _Bulk:
    """Bulk mode's settings, checked before the model loads."""

    def __init__(self, input_path: str, output_path: str, jsonl: bool, field: str, resume: bool):
        self.input_path, self.output_path = input_path, output_path
        self.jsonl, self.field, self.resume = jsonl, field, resume
        self.name = "stdin" if input_path == "-" else input_path
        self.out_name = "stdout" if output_path == "-" else output_path


def _bulk_settings(prompts: tuple, input_path: str | None, output_path: str | None, fmt: str,
                   field: str | None, resume: bool, truncate: bool,
                   max_input_tokens: int | None) -> _Bulk | None:
    if truncate and max_input_tokens is None:
        _fail("--truncate needs --max-input-tokens (the length to cut prompts to)", EXIT_USAGE)
    if input_path is None:
        given = [o for o, v in (("--output", output_path), ("--resume", resume),
                                ("--input-field", field), ("--input-format", fmt != "auto")) if v]
        if given:
            _fail(f"{given[0]} needs --input PATH (bulk mode)", EXIT_USAGE)
        return None
    if prompts:
        _fail("give prompts either as PROMPT arguments or with --input, not both", EXIT_USAGE)
    output_path = output_path or "-"
    if input_path == "-" and (sys.stdin is None or sys.stdin.isatty()):
        _fail("--input -: stdin is a terminal; pipe the prompts in or give a file", EXIT_USAGE)
    if resume and output_path == "-":
        _fail("--resume needs --output PATH: a file to continue", EXIT_USAGE)
    if input_path != "-" and not os.path.exists(input_path):
        _fail(f"--input {input_path}: no such file", EXIT_USAGE)
    if input_path != "-" and os.path.isdir(input_path):   # a pipe (<(zcat ...)) is fine
        _fail(f"--input {input_path}: is a directory", EXIT_USAGE)
    if (output_path != "-" and input_path != "-" and os.path.exists(output_path)
            and os.path.samefile(input_path, output_path)):
        _fail(f"--output {output_path} is the input file: writing it would destroy the input",
              EXIT_USAGE)
    jsonl = fmt == "jsonl" or (fmt == "auto" and (field is not None or (
        input_path != "-" and input_path.lower().endswith(_JSONL_SUFFIXES))))
    if field is not None and not jsonl:
        _fail("--input-field applies to JSON Lines input (--input-format jsonl)", EXIT_USAGE)
    return _Bulk(input_path, output_path, jsonl, field or "text", resume)


def _bulk_rows(stream: BinaryIO, bulk: _Bulk, skip: int) -> Iterator[tuple[Any, str, dict]]:
    """(prompt or BadRow, its name, the fields copied into its record) per input line after the
    first `skip`. Every line is a row (an empty one too: it fails as a row), so output line k
    always answers input line k and --resume can count."""
    from minfer.errors import InputError
    from minfer.generation.text import BadRow
    from minfer.io.limits import parse_json
    for number, offset, raw in _lines(stream):
        if number <= skip:
            continue
        where = f"{bulk.name}: line {number}"
        if raw is None:
            yield BadRow(f"{where}: longer than {MAX_LINE_BYTES} bytes"), where, {}
            continue
        if not bulk.jsonl:
            yield _utf8(raw, where, offset), where, {}
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
            yield BadRow(f"{where}: expected a JSON object, got {_json_type(obj)}"), where, {}
            continue
        extra = {k: v for k, v in obj.items() if k != bulk.field}
        prompt = obj.get(bulk.field)
        if bulk.field not in obj:
            prompt = BadRow(f"{where}: no {bulk.field!r} field (--input-field names the prompt's)")
        elif not isinstance(prompt, str):
            prompt = BadRow(f"{where}: field {bulk.field!r} is {_json_type(prompt)}, not a string")
        yield prompt, where, extra


def _json_type(value: Any) -> str:
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


def _resume_point(path: str) -> tuple[int, bool]:
    """(complete records already in `path`, whether anything after them was cut off). The file
    is cut after the last complete, valid record: a line the last run was writing when it
    stopped is dropped, to be written again. No file: (0, False)."""
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return 0, False
    except OSError as e:
        _fail(f"--output {path}: cannot open: {e.strerror or e}")
    with f:
        good = end = 0
        for line in f:   # our own records, one a line
            try:
                ok = line.endswith(b"\n") and isinstance(json.loads(line), dict)
            except (ValueError, RecursionError):
                ok = False
            if not ok:
                break
            good, end = good + 1, end + len(line)
        cut = f.seek(0, os.SEEK_END) > end
        if cut:   # (a character device such as /dev/null cannot be truncated, nor needs it)
            f.truncate(end)
    return good, cut


def _count_lines(path: str) -> int:
    """Lines of a file (a last one without a newline counts), read in bounded chunks."""
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n")


class _Progress:
    """Rows and new tokens done; a tqdm bar on stderr when it is a terminal (prompts/s,
    tokens/s, ETA when the number of rows is known)."""

    def __init__(self, total: int | None):
        self.rows = self.tokens = 0
        self.start = time.perf_counter()
        self.bar = None
        if sys.stderr is not None and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="prompt", file=sys.stderr, leave=False,
                            dynamic_ncols=True)

    def __call__(self, rows: int, tokens: int) -> None:
        self.rows += rows
        self.tokens += tokens
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.tokens / self.elapsed():.0f} tokens/s", refresh=False)
            self.bar.update(rows)

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.start, 1e-9)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run_bulk(m: Any, bulk: _Bulk, task: str | None, options: dict) -> None:
    """Bulk mode: input rows -> JSON Lines records in input order, written as each window of
    rows is done (flushed then), so memory stays flat and an interrupted run can --resume."""
    skip, cut = _resume_point(bulk.output_path) if bulk.resume else (0, False)
    try:
        source = (getattr(sys.stdin, "buffer", sys.stdin) if bulk.input_path == "-"
                  else open(bulk.input_path, "rb"))
        out = (sys.stdout.buffer if bulk.output_path == "-"
               else open(bulk.output_path, "ab" if bulk.resume else "wb"))
    except OSError as e:
        _fail(f"{e.filename}: cannot open: {e.strerror or e}")
    total = None
    if os.path.isfile(bulk.input_path) and sys.stderr is not None and sys.stderr.isatty():
        total = max(_count_lines(bulk.input_path) - skip, 0)
    progress = _Progress(total)
    failed, first, written = 0, None, 0
    try:
        rows = _bulk_rows(source, bulk, skip)
        for (_, _, extra), results, window_done in _results(m, rows, task, options, progress):
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
        if out is not sys.stdout.buffer:
            out.close()
        if source is not getattr(sys.stdin, "buffer", sys.stdin):
            source.close()
    kept = f" after the {skip} already in {bulk.out_name}" if skip else ""
    kept += " (an incomplete record there was dropped and written again)" if cut else ""
    rate = (f"{progress.rows / progress.elapsed():.1f} prompts/s, "
            f"{progress.tokens / progress.elapsed():.1f} tokens/s")
    if failed:
        _fail(f"{failed} of {written} rows failed{kept}, each written with an 'error' field to "
              f"{bulk.out_name} (first: {first}); {rate}")
    click.echo(f"minfer: {written} rows{kept} -> {bulk.out_name} in {progress.elapsed():.1f} s: "
               f"{rate}", err=True)


@cli.command()
@with_model_options
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Batch size for the memory estimate.")
@click.option("--src-len", type=click.IntRange(min=1), default=512, show_default=True,
              help="Input tokens for the memory estimate (T5: the source; XL: the prompt, which "
                   "runs in segments).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="New tokens for the memory estimate (T5).")
@quiet_on_closed_pipe
def info(model, revision, device, dtype, workspace, memory_limit, offline, threads, batch, src_len, max_new_tokens) -> None:
    """Architecture, parameters, files and memory needed by a model."""
    from minfer.arena import format_bytes
    m = _load(model, device, dtype, revision, workspace, memory_limit, offline, threads)
    params = m.parameter_count()
    plan = m.plan(batch, src_len, max_new_tokens)
    shape = (f"batch {batch} x {src_len} -> {max_new_tokens} new" if m.is_encoder_decoder
             else f"batch {batch}, prompt {src_len}")
    parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in plan.items()
                      if k != "peak")
    need = (f"workspace for {shape}", f"{format_bytes(plan['peak'])} ({parts})")
    files = sorted(p for p in os.listdir(m.folder) if not p.startswith("."))
    lines = [("model", m.folder), *m.describe(),
             ("parameters", f"{params:,}"),
             ("device / dtype", f"{m.backend.device} / {m.backend.weight_format}"),
             ("cpu threads", str(m.backend.num_threads)),
             *m.weight_plan.summary(),
             need,
             ("arena capacity", format_bytes(m.backend.arena.capacity)),
             ("tokenizer", type(m.tokenizer).__name__ if m.tokenizer is not None else "none"),
             ("files", ", ".join(files))]
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        click.echo(f"{key:<{width}}  {value}")


@cli.command()
@with_model_options
@click.argument("file", type=click.File("rb"))
@click.option("--segment-len", type=click.IntRange(min=1), default=None,
              help="Tokens per segment, memory carried between them  [default: the model's tgt_len].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@quiet_on_closed_pipe
def score(model, revision, device, dtype, workspace, memory_limit, offline, threads, file, segment_len, as_json) -> None:
    """Perplexity of a Transformer-XL model on FILE ('-' for stdin), one WT103 line per line."""
    m = _load(model, device, dtype, revision, workspace, memory_limit, offline, threads)
    if m.family != "transfo-xl":
        _fail(f"score needs a Transformer-XL model; {m.folder} is {m.family}")
    name = getattr(file, "name", "-")
    name = "stdin" if name in ("-", "<stdin>") else name
    text = _read_text(file, name)
    if not text.strip():
        _fail(f"{name}: no text to score", EXIT_USAGE)
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=0, unit="tok", desc="scoring", file=sys.stderr, leave=False)

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.n = done
            bar.refresh()

    try:
        result = m.score(text, segment_len=segment_len, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    tps = result["tokens"] / result["seconds"] if result["seconds"] else float("inf")
    if as_json:
        click.echo(json.dumps({**result, "tokens_per_second": tps}))
    else:
        click.echo(f"perplexity      {result['perplexity']:.4f}")
        click.echo(f"tokens          {result['tokens']}")
        click.echo(f"log-likelihood  {result['log_likelihood']:.4f}")
        click.echo(f"tokens/s        {tps:.1f}")


@cli.command()
@click.option("--model", "-m", required=True, metavar="PATH", help="Local model folder to convert.")
@click.option("--output", "-o", required=True, metavar="DIR", help="New folder to write.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16", "int8"]),
              default="float32", show_default=True,
              help="dtype of the written tensors (int8: linear matrices as int8 with one scale "
                   "per output channel, the rest float32).")
@quiet_on_closed_pipe
def convert(model, output, dtype) -> None:
    """Write a model folder (e.g. one with pytorch_model.bin) as safetensors."""
    from minfer.convert import convert as run_convert
    from minfer.arena import format_bytes
    summary = run_convert(model, output, dtype)
    click.echo(f"wrote {summary['tensors']} tensors ({format_bytes(summary['bytes'])}) to "
               f"{summary['output']}/model.safetensors; copied {', '.join(summary['copied']) or 'nothing'}")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run click without its own exit handling, so every error is one line."""
    from minfer.errors import MinferError
    if not (sys.argv[1:] if argv is None else argv):
        # the whole help, as help (not squeezed into one error line), and the usage status
        with cli.make_context("minfer", [], resilient_parsing=True) as ctx:
            click.echo(cli.get_help(ctx))
        sys.exit(EXIT_USAGE)
    try:
        cli.main(args=argv, prog_name="minfer", standalone_mode=False)
    except click.exceptions.Exit as e:  # --help / --version
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("minfer: interrupted", err=True)
        sys.exit(EXIT_INTERRUPT)
    except click.ClickException as e:
        _fail(e.format_message(), EXIT_USAGE)
    except MinferError as e:
        _fail(str(e))
    except MemoryError as e:  # the machine's memory, not a bug: say what to lower
        _fail(f"out of memory: {e} (lower --workspace, --memory-limit, the batch or the lengths)")
    except KeyboardInterrupt:
        click.echo("\nminfer: interrupted", err=True)
        sys.exit(EXIT_INTERRUPT)
    except BrokenPipeError:  # e.g. piped into `head`, outside a command
        _exit_on_closed_pipe()
    except Exception as e:  # a bug: still one line, the traceback on request
        if os.environ.get("MINFER_DEBUG"):
            raise
        _fail(f"unexpected {type(e).__name__}: {e} (set MINFER_DEBUG=1 for the traceback)")


if __name__ == "__main__":
    main()
