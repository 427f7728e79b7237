"""`minfer convert`: rewrite a model folder as safetensors, optionally in another dtype."""

from __future__ import annotations

import click

from minfer.io.formats import INT4_GROUP

from .common import quiet_on_closed_pipe


@click.command()
@click.option("--model", "-m", required=True, metavar="PATH", help="Local model folder to convert.")
@click.option("--output", "-o", required=True, metavar="DIR", help="New folder to write.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16", "int8", "int4"]),
              default="float32", show_default=True,
              help="dtype of the written tensors (int8: linear matrices as int8 with one scale "
                   "per output channel; int4: two values a byte with one scale per group of "
                   f"{INT4_GROUP} input channels; the rest float32).")
@quiet_on_closed_pipe
def convert(model, output, dtype) -> None:
    """Write a model folder (e.g. one with pytorch_model.bin) as safetensors."""
    from minfer.convert import convert as run_convert
    from minfer.arena import format_bytes
    summary = run_convert(model, output, dtype)
    click.echo(f"wrote {summary['tensors']} tensors ({format_bytes(summary['bytes'])}) to "
               f"{summary['output']}/model.safetensors; copied {', '.join(summary['copied']) or 'nothing'}")
