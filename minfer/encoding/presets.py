"""Diffusion pipelines' text-encoder rules as data: how each diffusers pipeline tokenizes a
prompt for its T5 / UMT5 encoder, whether the encoder sees the attention mask, what it does to
the states afterwards and which mask it hands on to its transformer.

Read from huggingface/diffusers at commit 58eb52c0803ea9af3abec60841c2a093bdf1f951 (version
0.40.0.dev0, 2026-08-23), each pipeline's `_get_t5_prompt_embeds` and the
`max_sequence_length` default of its `__call__`:

- flux (pipelines/flux/pipeline_flux.py, FluxPipeline): padding="max_length" to 512,
  truncation, the encoder run on the ids alone (no attention mask: padding is attended to).
- sd3 (pipelines/stable_diffusion_3/pipeline_stable_diffusion_3.py, StableDiffusion3Pipeline):
  as Flux with 256 tokens (the pipeline then puts its CLIP states before these).
- wan (pipelines/wan/pipeline_wan.py, WanPipeline): each prompt cleaned (`prompt_clean`:
  ftfy.fix_text when ftfy is installed, html.unescape twice, runs of whitespace -> one space,
  stripped), padding to 512 (its `__call__`'s default; `_get_t5_prompt_embeds` alone says 226),
  the UMT5 encoder run with the mask, then every state past the prompt's tokens set to zero.
- chroma (pipelines/chroma/pipeline_chroma.py, ChromaPipeline): 512, the encoder run with the
  mask; its transformer's mask covers the prompt's tokens and the first padding token.
- ltx (pipelines/ltx/pipeline_ltx.py, LTXPipeline): 128, the encoder run without the mask; its
  transformer takes the tokenizer's mask.

The states are what the pipeline computes before it casts them to the encoder's dtype.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import InputError

# Python's \s also matches \x1c-\x1f, which the `regex` module's \s (diffusers' whitespace_clean
# uses it) does not: this class is regex's \s
_WHITESPACE = re.compile(r"[^\S\x1c-\x1f]+")


def wan_prompt_clean(text: str) -> str:
    """WanPipeline's prompt_clean: ftfy.fix_text when ftfy is installed (diffusers applies it
    only then, and so does minfer: ftfy is no dependency), HTML entities unescaped twice, every
    run of whitespace one space, both ends stripped."""
    try:
        import ftfy
    except ImportError:
        pass
    else:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return _WHITESPACE.sub(" ", text).strip()


@dataclass(frozen=True)
class Preset:
    """One pipeline's rule. Every prompt is padded to `max_length` tokens (`max_length=` at the
    call overrides it) and cut to it, as transformers' tokenizers cut (the closing `</s>` kept)."""
    name: str
    pipeline: str                 # the diffusers class whose rule this is
    max_length: int
    encoder_mask: bool            # the encoder attends only to the prompt's tokens
    zero_tail: bool               # states past each prompt's tokens are set to 0
    clean: Callable[[str], str] | None = None   # what the pipeline does to a prompt's text first
    extra_mask_tokens: int | None = None        # the transformer's mask: the prompt's tokens
    # plus this many padding tokens (None: the pipeline hands on no mask)

    def pipeline_mask(self, token_mask: np.ndarray) -> np.ndarray | None:
        """The (B, T) int64 mask the pipeline hands its transformer, from the tokenizer's (B, T)
        mask of real tokens (None for a pipeline that hands on none)."""
        if self.extra_mask_tokens is None:
            return None
        T = token_mask.shape[1]
        lengths = token_mask.sum(axis=1, keepdims=True)                 # (B, 1)
        return (np.arange(T)[None, :] < lengths + self.extra_mask_tokens).astype(np.int64)


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("flux", "FluxPipeline", 512, encoder_mask=False, zero_tail=False),
    Preset("sd3", "StableDiffusion3Pipeline", 256, encoder_mask=False, zero_tail=False),
    Preset("wan", "WanPipeline", 512, encoder_mask=True, zero_tail=True, clean=wan_prompt_clean),
    Preset("chroma", "ChromaPipeline", 512, encoder_mask=True, zero_tail=False,
           extra_mask_tokens=1),
    Preset("ltx", "LTXPipeline", 128, encoder_mask=False, zero_tail=False, extra_mask_tokens=0),
)}


def preset_named(name: object, what: str = "encode()") -> Preset:
    """The preset of that name, or a one-line InputError listing the known ones."""
    if isinstance(name, str) and name.strip().lower() in PRESETS:
        return PRESETS[name.strip().lower()]
    shown = repr(name)[:40] if isinstance(name, str) else type(name).__name__
    raise InputError(f"{what}: preset {shown} is not one of {', '.join(PRESETS)}")
