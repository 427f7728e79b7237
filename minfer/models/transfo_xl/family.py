"""Transformer-XL's declaration: the Family record that ties its config (config.py), weight
table (weights.py) and run buffers (buffers.py) together for the loader and the registry."""

from __future__ import annotations

from ..family import Family
from .buffers import run_bytes
from .config import XLConfig
from .weights import weight_table

FAMILY = Family(name="transfo-xl", model_types=("transfo-xl",), config=XLConfig,
                weight_table=weight_table, run_bytes=run_bytes, is_encoder_decoder=False,
                add_eos_to_prompt=False)
