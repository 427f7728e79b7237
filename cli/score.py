"""`minfer score`: a Transformer-XL model's perplexity on a text, in segments with memory carried.

The text is read as the model's score() reads it (one WikiText line per line, <eos> after each)
and its ids are scored; when more than UNKNOWN_WARNING of the scored tokens are the vocabulary's
<unk>, stderr says so: the perplexity of such a text mostly measures how well the model predicts
<unk>. The progress bar (a terminal only) redraws at most every PROGRESS_SECONDS, not per
segment.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from .common import EXIT_USAGE, emit, fail, load_model, quiet_on_closed_pipe, read_text, with_model_options

# WikiText-103's own test text is about 2.5% <unk> (rare words were replaced by it): a text with
# four times that is far from what the model was trained on.
UNKNOWN_WARNING = 0.10
PROGRESS_SECONDS = 0.25


@click.command(help="Perplexity of a Transformer-XL model on FILE ('-' for stdin), one WT103 line "
                    f"per line. More than {UNKNOWN_WARNING:.0%} <unk> tokens is warned about on "
                    "stderr.")
@with_model_options
@click.argument("file", type=click.File("rb"))
@click.option("--segment-len", type=click.IntRange(min=1), default=None,
              help="Tokens per segment, memory carried between them  [default: the model's tgt_len].")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object instead of text (with unknown_tokens: the scored "
                   "tokens that are <unk>).")
@quiet_on_closed_pipe
def score(load, file, segment_len, as_json) -> None:
    """Perplexity of a text under a Transformer-XL model (the help is above: it names the
    warning's threshold)."""
    m = load_model(load)
    if not callable(getattr(m, "score", None)):   # (a family with score(): Transformer-XL)
        fail(f"score needs a Transformer-XL model; {m.folder} is {m.family.name}")
    if m.tokenizer is None:
        fail(f"{m.folder} has no tokenizer (vocab.txt or vocab.pkl): score reads text")
    name = getattr(file, "name", "-")
    name = "stdin" if name in ("-", "<stdin>") else name
    text = read_text(file, name)
    if not text.strip():
        fail(f"{name}: no text to score", EXIT_USAGE)
    ids = m.text_ids(text)   # the ids score() would read the text as
    unknown = unknown_tokens(m.tokenizer, ids)
    bar = _bar()

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)   # tqdm redraws when PROGRESS_SECONDS have passed

    try:
        result = m.score(ids, segment_len=segment_len, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    if unknown > UNKNOWN_WARNING * result["tokens"]:
        click.echo(f"minfer: warning: {unknown:,} of the {result['tokens']:,} scored tokens "
                   f"({unknown / result['tokens']:.0%}) are <unk>, words the vocabulary lacks: "
                   "the perplexity says little about this text", err=True)
    tps = result["tokens"] / result["seconds"] if result["seconds"] else float("inf")
    if as_json:
        emit(json.dumps({**result, "tokens_per_second": tps, "unknown_tokens": unknown}))
    else:
        emit(f"perplexity      {result['perplexity']:.4f}")
        emit(f"tokens          {result['tokens']}")
        emit(f"unknown tokens  {unknown}")
        emit(f"log-likelihood  {result['log_likelihood']:.4f}")
        emit(f"tokens/s        {tps:.1f}")


def unknown_tokens(tokenizer: Any, ids: list[int]) -> int:
    """How many of the scored ids (all but the first, which is only context) are <unk>."""
    unk = tokenizer.unk_id
    return 0 if unk is None else sum(1 for t in ids[1:] if t == unk)


def _bar() -> Any:
    if sys.stderr is None or not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=0, unit="tok", desc="scoring", file=sys.stderr, leave=False,
                mininterval=PROGRESS_SECONDS)
