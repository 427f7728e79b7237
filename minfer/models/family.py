"""What a model family declares about itself (each family's family.py fills one in)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable


@dataclass(frozen=True)
class Family:
    name: str                       # "t5", "transfo-xl"
    model_types: tuple[str, ...]    # config.json model_type values it reads
    config: Any                     # the config class: from_hf(dict, source), token_ids(),
                                    # describe(), summary()
    weight_table: Callable[[Any], Any]       # config -> params.table.WeightTable
    run_bytes: Callable[..., dict[str, int]]  # (config, dtype, batch, input_len, max_new_tokens,
                                              # compute=, repeat=): the arena bytes of a run
                                              # of batch rows, repeat rows per prompt
    is_encoder_decoder: bool        # results keep the decoder start token (HF's convention)
    add_eos_to_prompt: bool         # prompts end with eos (T5) or not (Transformer-XL)
    # (config, checkpoint tensor names, parts asked or None, folder) -> the config restricted to
    # those parts (T5: "encoder" alone); None: the family loads whole
    with_parts: Callable[[Any, Iterable[str], Any, str], Any] | None = None
