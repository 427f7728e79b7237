"""`minfer score`: a Transformer-XL model's perplexity on a text, in segments with memory carried."""

from __future__ import annotations

import json
import sys

import click

from .common import EXIT_USAGE, emit, fail, load_model, quiet_on_closed_pipe, read_text, with_model_options


@click.command()
@with_model_options
@click.argument("file", type=click.File("rb"))
@click.option("--segment-len", type=click.IntRange(min=1), default=None,
              help="Tokens per segment, memory carried between them  [default: the model's tgt_len].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@quiet_on_closed_pipe
def score(load, file, segment_len, as_json) -> None:
    """Perplexity of a Transformer-XL model on FILE ('-' for stdin), one WT103 line per line."""
    m = load_model(load)
    if m.family != "transfo-xl":
        fail(f"score needs a Transformer-XL model; {m.folder} is {m.family}")
    name = getattr(file, "name", "-")
    name = "stdin" if name in ("-", "<stdin>") else name
    text = read_text(file, name)
    if not text.strip():
        fail(f"{name}: no text to score", EXIT_USAGE)
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
        emit(json.dumps({**result, "tokens_per_second": tps}))
    else:
        emit(f"perplexity      {result['perplexity']:.4f}")
        emit(f"tokens          {result['tokens']}")
        emit(f"log-likelihood  {result['log_likelihood']:.4f}")
        emit(f"tokens/s        {tps:.1f}")
