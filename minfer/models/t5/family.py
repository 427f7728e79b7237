"""T5's declaration: the Family record that ties its config (config.py), weight table
(weights.py) and run buffers (buffers.py) together for the loader and the registry."""

from __future__ import annotations

from ..family import Family
from .buffers import run_bytes
from .config import MODEL_TYPES, T5Config
from .weights import weight_table

FAMILY = Family(name="t5", model_types=MODEL_TYPES, config=T5Config, weight_table=weight_table,
                run_bytes=run_bytes, is_encoder_decoder=True, add_eos_to_prompt=True,
                with_parts=T5Config.with_parts)
