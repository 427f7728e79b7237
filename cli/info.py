"""`minfer info`: a model's architecture, parameters, files, weight placement and the memory a run
of a given shape needs."""

from __future__ import annotations

import os

import click

from minfer import kernels

from .common import emit, load_model, quiet_on_closed_pipe, with_model_options


def compute_line(be) -> str:
    """What the products compute in, and on which instructions when that is int8 or bfloat16."""
    if be.compute == "int8":
        return f"int8 x int8 products: {kernels.int8_products()}"
    if be.compute == "bfloat16":
        return f"bfloat16 x bfloat16 products: {kernels.bfloat16_instructions()}"
    return be.compute


def fits_verdict(need: int, free: int) -> str:
    """Whether a run that needs `need` arena bytes fits the `free` bytes the arena has when no
    run is in progress (what the batch planner compares), and what to change when it does not."""
    from minfer.arena import format_bytes
    if need <= free:
        return f"yes: {format_bytes(need)} of the {format_bytes(free)} free in the arena"
    return (f"no: needs {format_bytes(need)}, the arena has {format_bytes(free)} free (raise "
            "--workspace or --memory-limit, or lower --batch or the lengths)")


@click.command()
@with_model_options
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Batch size for the memory estimate.")
@click.option("--src-len", type=click.IntRange(min=1), default=512, show_default=True,
              help="Input tokens for the memory estimate (T5: the source; XL: the prompt, which "
                   "runs in segments).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="New tokens for the memory estimate (T5).")
@quiet_on_closed_pipe
def info(load, batch, src_len, max_new_tokens) -> None:
    """Architecture, parameters, files and memory needed by a model."""
    from minfer.arena import format_bytes
    m = load_model(load)
    params = m.parameter_count()
    plan = m.plan(batch, src_len, max_new_tokens)
    shape = (f"batch {batch}, prompt {src_len}" if not m.is_encoder_decoder
             else f"batch {batch} x {src_len}" if not m.can_generate
             else f"batch {batch} x {src_len} -> {max_new_tokens} new")
    parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in plan.items()
                      if k != "peak")
    need = (f"workspace for {shape}", f"{format_bytes(plan['peak'])} ({parts})")
    free = getattr(m, "free_when_idle", m.backend.arena.available)
    files = sorted(p for p in os.listdir(m.folder) if not p.startswith("."))
    head = getattr(m, "sentence_modules", None)
    lines = [("model", m.folder), ("parts", ", ".join(m.parts)), *m.describe(),
             *([("sentence embedding", head.describe())] if head is not None else []),
             ("parameters", f"{params:,}"),
             ("device / dtype", f"{m.backend.device} / {m.backend.weight_format}"),
             *([("weight formats", m.weight_formats)] if getattr(m, "weight_formats", "") else []),
             ("compute", compute_line(m.backend)),
             ("cpu threads", str(m.backend.num_threads)),
             *m.weight_plan.summary(),
             need,
             ("arena capacity", format_bytes(m.backend.arena.capacity)),
             ("fits", fits_verdict(plan["peak"], free)),
             ("tokenizer", type(m.tokenizer).__name__ if m.tokenizer is not None else "none"),
             ("files", ", ".join(files))]
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        emit(f"{key:<{width}}  {value}")
