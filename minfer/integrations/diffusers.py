"""diffusers' `prompt_embeds=` from minfer: a pipeline keeps its transformer and VAE and takes
the T5 / UMT5 states minfer computes (any file minfer loads, within a memory budget, or a
remote `minfer serve`'s /v1/encode), so a user replaces only the T5 call.

    import minfer, torch
    from diffusers import FluxPipeline
    from minfer.integrations.diffusers import pipeline_inputs
    t5 = minfer.load("t5xxl_fp8_e4m3fn_scaled.safetensors", tokenizer="t5-tokenizer/")
    pipe = FluxPipeline.from_pretrained("black-forest-labs/FLUX.1-dev", text_encoder_2=None,
                                        tokenizer_2=None, torch_dtype=torch.bfloat16)
    kwargs = pipeline_inputs(t5, "a cat", "flux", dtype=torch.bfloat16, device="cuda")
    image = pipe(pooled_prompt_embeds=..., **kwargs).images[0]   # pooled: Flux's CLIP

What each pipeline's `__call__` takes (diffusers 0.40.0.dev0, 58eb52c; the states as its
`_get_t5_prompt_embeds` makes them: encoding/presets.py), all (B * n, T, C) with each prompt's n
copies together, as the pipelines' repeat(1, n, 1).view(B * n, T, C) lays them out:
  flux    prompt_embeds (its pooled_prompt_embeds come from CLIP: the caller's)
  sd3     prompt_embeds = [CLIP states padded to the T5 width ; T5 states] along the tokens, as
          StableDiffusion3Pipeline.encode_prompt joins them: `clip_prompt_embeds` (B * n, 77,
          2048) from its two CLIP encoders is required (and its pooled_prompt_embeds)
  wan     prompt_embeds, zero past each prompt's tokens (WanPipeline takes no mask)
  chroma  prompt_embeds, prompt_attention_mask (the prompt's tokens and one padding token, in
          `dtype`, as ChromaPipeline casts it)
  ltx     prompt_embeds, prompt_attention_mask (bool; LTXPipeline tiles its mask over the
          batch, repeat(n, 1), unlike its states: here both keep each prompt's copies together)
torch is needed (diffusers is not imported); `dtype` / `device` are where the pipeline runs:
its transformer's dtype, its execution device (default: the model's own device, so a model on
a CUDA device hands its states over on that device, never through the host).
`num_images_per_prompt=n` repeats the states here, so call the pipeline with
num_images_per_prompt=1 (given prompt_embeds, it does not repeat them again) and n x B of
everything else it takes per image.
"""

from __future__ import annotations

from typing import Any

from ..encoding.presets import preset_named
from ..encoding.tensors import check_tensors_option
from ..errors import InputError

# what each pipeline takes beside prompt_embeds: its mask argument and the mask's dtype
_MASKS = {"chroma": "float", "ltx": "bool"}


def pipeline_inputs(model: Any, prompt: Any, pipeline: str, *, max_sequence_length: int | None
                    = None, num_images_per_prompt: int = 1, dtype: Any = None,
                    device: Any = None, clip_prompt_embeds: Any = None) -> dict[str, Any]:
    """The keyword arguments a diffusers pipeline takes instead of running its T5 encoder:
    {"prompt_embeds": ...} and, for chroma and ltx, "prompt_attention_mask"; see the module's
    table. prompt: a string or a list of strings. max_sequence_length: the pipeline's argument
    of that name (default its own). dtype: a torch dtype (default float32: the states before
    the pipeline's cast). device: a torch device (default the model's: "cpu", or its CUDA
    device)."""
    check_tensors_option("pt", "pipeline_inputs()")
    import torch
    rule = preset_named(pipeline, "pipeline_inputs()")
    if not isinstance(num_images_per_prompt, int) or num_images_per_prompt < 1:
        raise InputError("pipeline_inputs(): num_images_per_prompt must be a positive integer, "
                         f"got {num_images_per_prompt!r:.40}")
    dtype = torch.float32 if dtype is None else dtype
    # torch tensors on the model's device (DLPack: no copy), repeated there
    states, mask = model.encode(prompt, preset=rule.name, max_length=max_sequence_length,
                                return_mask=True, return_tensors="pt")
    device = states.device if device is None else device
    n = num_images_per_prompt
    if n > 1:   # (B * n, T, C): each prompt's n copies together
        states, mask = states.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
    embeds = states.to(device=device, dtype=dtype)
    if rule.name == "sd3":
        embeds = _with_clip(torch, embeds, clip_prompt_embeds)
    elif clip_prompt_embeds is not None:
        raise InputError(f"pipeline_inputs(): clip_prompt_embeds is for sd3, not {rule.name}")
    out = {"prompt_embeds": embeds}
    kind = _MASKS.get(rule.name)
    if kind is not None:
        handed_on = mask.to(device=device)
        out["prompt_attention_mask"] = handed_on.bool() if kind == "bool" else handed_on.to(dtype)
    return out


def _with_clip(torch: Any, t5: Any, clip: Any) -> Any:
    """SD3's prompt_embeds: the CLIP states (B, 77, 2048) zero-padded to the T5 width C, then
    the T5 states after them along the tokens -> (B, 77 + T, C)."""
    if clip is None:
        raise InputError("pipeline_inputs(): sd3 needs clip_prompt_embeds (its two CLIP "
                         "encoders' states, joined along the width): StableDiffusion3Pipeline's "
                         "prompt_embeds hold them before the T5 states")
    if not isinstance(clip, torch.Tensor) or clip.ndim != 3 or clip.shape[0] != t5.shape[0] \
            or clip.shape[2] > t5.shape[2]:
        shape = tuple(clip.shape) if hasattr(clip, "shape") else type(clip).__name__
        raise InputError(f"pipeline_inputs(): clip_prompt_embeds must be a ({t5.shape[0]}, "
                         f"tokens, <= {t5.shape[2]}) torch tensor, got {shape}")
    clip = torch.nn.functional.pad(clip.to(device=t5.device, dtype=t5.dtype),
                                   (0, t5.shape[-1] - clip.shape[-1]))
    return torch.cat([clip, t5], dim=-2)
