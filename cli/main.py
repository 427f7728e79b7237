"""Click commands only: parse options, call the library, print. No model logic lives here.

Every failure is one line on stderr ("minfer: error: ...") and a non-zero exit: 1 for a problem
with the model or input, 2 for a bad command line, 130 on Ctrl-C. Set MINFER_DEBUG=1 to see the
traceback of an unexpected error.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPT = 1, 2, 130


def _fail(message: str, code: int = EXIT_ERROR) -> None:
    click.echo(f"minfer: error: {' '.join(str(message).split())}", err=True)
    sys.exit(code)


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
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable); it is not printed.")
@click.option("--seed", type=int, default=None, help="Random seed for sampling  [default: random].")
@click.option("--task", default=None,
              help="Apply the checkpoint's task settings and prefix, e.g. translation_en_to_de.")
@click.option("--no-stream", is_flag=True, help="Print each result whole when it is done.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per result: text, token ids, finish reason, timing.")
def generate(model, revision, device, dtype, workspace, memory_limit, offline, prompts, max_new_tokens,
             min_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty,
             no_repeat_ngram_size, num_beams, length_penalty, num_return_sequences, stop, seed,
             task, no_stream, as_json) -> None:
    """Generate text for each PROMPT (or each line of stdin when no PROMPT is given)."""
    if not prompts:
        if sys.stdin is None or sys.stdin.isatty():
            _fail("no prompt: give PROMPT arguments or pipe lines on stdin", EXIT_USAGE)
        prompts = tuple(line.rstrip("\n") for line in sys.stdin if line.strip())
        if not prompts:
            _fail("no prompt: stdin held no non-empty line", EXIT_USAGE)
    if do_sample is None and any(v is not None for v in (temperature, top_k, top_p)):
        do_sample = True
    options = dict(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                   do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                   repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                   num_beams=num_beams, length_penalty=length_penalty,
                   num_return_sequences=num_return_sequences, stop=list(stop) or None, seed=seed)
    m = _load(model, device, dtype, revision, workspace, memory_limit, offline)
    if m.tokenizer is None:
        _fail(f"{m.folder} has no tokenizer (tokenizer.json or spiece.model): text prompts need one")
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
@click.argument("file", type=click.File("r", encoding="utf-8"))
@click.option("--segment-len", type=click.IntRange(min=1), default=None,
              help="Tokens per segment, memory carried between them  [default: the model's tgt_len].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def score(model, revision, device, dtype, workspace, memory_limit, offline, file, segment_len, as_json) -> None:
    """Perplexity of a Transformer-XL model on FILE ('-' for stdin), one WT103 line per line."""
    m = _load(model, device, dtype, revision, workspace, memory_limit, offline)
    if m.family != "transfo-xl":
        _fail(f"score needs a Transformer-XL model; {m.folder} is {m.family}")
    text = file.read()
    if not text.strip():
        _fail(f"{file.name}: no text to score", EXIT_USAGE)
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
    except KeyboardInterrupt:
        click.echo("\nminfer: interrupted", err=True)
        sys.exit(EXIT_INTERRUPT)
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
        sys.exit(0)
    except Exception as e:  # a bug: still one line, the traceback on request
        if os.environ.get("MINFER_DEBUG"):
            raise
        _fail(f"unexpected {type(e).__name__}: {e} (set MINFER_DEBUG=1 for the traceback)")


if __name__ == "__main__":
    main()
