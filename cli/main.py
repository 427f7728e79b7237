"""Click commands only: parse options, call the library, print. No model logic lives here.

Every failure is one line on stderr ("minfer: error: ...") and a non-zero exit: 1 for a problem
with the model or input, 2 for a bad command line, 130 on Ctrl-C. Set MINFER_DEBUG=1 to see the
traceback of an unexpected error. Bare `minfer` prints the help on stdout and exits 2 (no command:
click's status for a group called without one). A reader that leaves early (`minfer generate ... |
head -1`) ends the run quietly with status 0. Text input (stdin, `score FILE`) must be UTF-8: an
invalid byte is named by its offset.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from typing import Any, BinaryIO

import click

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
        def one(m: re.Match) -> str:
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
          memory_limit: str | None, offline: bool) -> Any:
    import minfer
    return minfer.load(model, device=device, dtype=dtype, revision=revision, workspace=workspace,
                       memory_limit=memory_limit, offline=True if offline else None)


model_options = [
    click.option("--model", "-m", required=True, metavar="NAME_OR_PATH",
                 help="Hub name (t5-small, google/flan-t5-base, ...) or a local folder in the HF layout."),
    click.option("--revision", default=None, help="Hub revision (branch, tag or commit)."),
    click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N or auto."),
    click.option("--dtype", default=None, metavar="DTYPE",
                 help="float32 (CPU default), float16 (CUDA default) or int8 (weight-only int8 "
                      "linear layers)."),
    click.option("--workspace", default=None, metavar="SIZE",
                 help="Arena size for activations and caches, e.g. 512MiB  [default: 1GiB]; with "
                      "--memory-limit, the part of the limit kept for them."),
    click.option("--memory-limit", default=None, metavar="SIZE",
                 help="Whole memory budget incl. weights, e.g. 2GiB: layers that do not fit are "
                      "streamed in as needed."),
    click.option("--offline", is_flag=True, help="Use only the local cache; never contact the hub."),
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
@quiet_on_closed_pipe
def generate(model, revision, device, dtype, workspace, memory_limit, offline, prompts, max_new_tokens,
             min_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty,
             no_repeat_ngram_size, num_beams, length_penalty, num_return_sequences, stop, seed,
             task, no_stream, as_json) -> None:
    """Generate text for each PROMPT (or each line of stdin when no PROMPT is given)."""
    if not prompts:
        if sys.stdin is None or sys.stdin.isatty():
            _fail("no prompt: give PROMPT arguments or pipe lines on stdin", EXIT_USAGE)
        text = _read_text(getattr(sys.stdin, "buffer", sys.stdin), "stdin")
        prompts = tuple(line for line in text.split("\n") if line.strip())
        if not prompts:
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
                   num_return_sequences=num_return_sequences, stop=list(stop) or None, seed=seed)
    m = _load(model, device, dtype, revision, workspace, memory_limit, offline)
    if m.tokenizer is None:
        from minfer.generation.text import tokenizer_files  # the files this family would read
        _fail(f"{m.folder} has no tokenizer ({tokenizer_files(m)}): text prompts need one")
    stream = not no_stream and not as_json and (num_return_sequences or 1) == 1
    if stream:
        for prompt in prompts:
            for piece in m.generate(prompt, stream=True, task=task, **options):
                click.echo(piece, nl=False)
                sys.stdout.flush()
            click.echo()
        return
    results = m.generate(list(prompts), task=task, return_details=True, **options)
    for prompt, row in zip(prompts, results):
        for r in row:
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


@cli.command()
@with_model_options
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Batch size for the memory estimate.")
@click.option("--src-len", type=click.IntRange(min=1), default=512, show_default=True,
              help="Input tokens for the memory estimate (T5) / segment length (XL).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="New tokens for the memory estimate (T5).")
@quiet_on_closed_pipe
def info(model, revision, device, dtype, workspace, memory_limit, offline, batch, src_len, max_new_tokens) -> None:
    """Architecture, parameters, files and memory needed by a model."""
    from minfer.arena import format_bytes
    m = _load(model, device, dtype, revision, workspace, memory_limit, offline)
    params = m.parameter_count()
    plan = m.plan(batch, src_len, max_new_tokens)
    shape = (f"batch {batch} x {src_len} -> {max_new_tokens} new" if m.is_encoder_decoder
             else f"batch {batch}, segment {src_len}")
    parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in plan.items()
                      if k != "peak")
    need = (f"workspace for {shape}", f"{format_bytes(plan['peak'])} ({parts})")
    files = sorted(p for p in os.listdir(m.folder) if not p.startswith("."))
    lines = [("model", m.folder), *m.describe(),
             ("parameters", f"{params:,}"),
             ("device / dtype", f"{m.backend.device} / {m.backend.weight_format}"),
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
def score(model, revision, device, dtype, workspace, memory_limit, offline, file, segment_len, as_json) -> None:
    """Perplexity of a Transformer-XL model on FILE ('-' for stdin), one WT103 line per line."""
    m = _load(model, device, dtype, revision, workspace, memory_limit, offline)
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
@click.option("--dtype", type=click.Choice(["float32", "float16", "int8"]), default="float32",
              show_default=True, help="dtype of the written tensors (int8: layer matrices as int8 "
                                      "with per-row scales, the rest float32).")
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
