"""The hand-off to torch (return_tensors="pt", minfer.integrations.diffusers) against the
pipelines' own steps written here in torch: the states of the HF tokenizer's ids, repeated per
image as `repeat(1, n, 1).view(B * n, T, C)`, cast; SD3's CLIP padding and join; Chroma's and
LTX's masks. Skipped without torch (CI installs none)."""
import numpy as np
import pytest
from conftest import TINY_TOKENIZER, make_text_model_folder
from tokenizers import Tokenizer

import minfer
from minfer.errors import InputError

torch = pytest.importorskip("torch")
from minfer.integrations.diffusers import pipeline_inputs  # noqa: E402

PROMPTS = ["a cat sat on the mat", "one two three four five six seven eight nine"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return minfer.load(make_text_model_folder(tmp_path_factory.mktemp("pt") / "m"))


def tokenized(length):
    tok = Tokenizer.from_file(str(TINY_TOKENIZER / "tokenizer.json"))
    tok.enable_truncation(length)
    tok.enable_padding(length=length, pad_id=0, pad_token="<pad>")
    rows = tok.encode_batch(PROMPTS)
    return (np.array([r.ids for r in rows]), torch.tensor([r.attention_mask for r in rows]))


def per_image(x, n):
    B, T = x.shape[:2]
    return x.repeat(1, n, *([1] * (x.ndim - 2))).view(B * n, T, *x.shape[2:])


def test_return_tensors_pt_is_the_array_without_a_copy(model):
    states = model.encode(PROMPTS, return_tensors="pt")
    assert isinstance(states, torch.Tensor)
    np.testing.assert_array_equal(states.numpy(), model.encode(PROMPTS))
    arr = np.ones((2, 3), np.float32)
    from minfer.encoding.tensors import as_tensors
    t = as_tensors(arr, "pt")
    arr[0, 0] = 7          # one memory: the tensor sees the array's write
    assert t[0, 0].item() == 7


def test_flux_and_wan_prompt_embeds(model):
    ids, mask = tokenized(10)
    states = torch.from_numpy(model.encode(ids, np.ones_like(ids)))
    got = pipeline_inputs(model, PROMPTS, "flux", max_sequence_length=10, num_images_per_prompt=2,
                          dtype=torch.bfloat16)
    assert set(got) == {"prompt_embeds"}
    assert torch.equal(got["prompt_embeds"], per_image(states.to(torch.bfloat16), 2))
    wan = model.encode(ids, mask.numpy())
    wan = torch.stack([torch.cat([u[:v], u.new_zeros(10 - v, u.size(1))])
                       for u, v in zip(torch.from_numpy(wan), mask.sum(1))])
    got = pipeline_inputs(model, PROMPTS, "wan", max_sequence_length=10)
    assert set(got) == {"prompt_embeds"} and torch.equal(got["prompt_embeds"], wan)


def test_chroma_and_ltx_masks(model):
    ids, mask = tokenized(10)
    got = pipeline_inputs(model, PROMPTS, "chroma", max_sequence_length=10, dtype=torch.float16)
    want_mask = (torch.arange(10).unsqueeze(0).expand(2, -1) <= mask.sum(1).unsqueeze(1))
    assert torch.equal(got["prompt_attention_mask"], want_mask.to(torch.float16))
    assert torch.equal(got["prompt_embeds"],
                       torch.from_numpy(model.encode(ids, mask.numpy())).to(torch.float16))
    got = pipeline_inputs(model, PROMPTS, "ltx", max_sequence_length=10)
    assert got["prompt_attention_mask"].dtype == torch.bool
    assert torch.equal(got["prompt_attention_mask"], mask.bool())


def test_sd3_joins_the_clip_states_first(model):
    ids, _ = tokenized(8)
    t5 = torch.from_numpy(model.encode(ids, np.ones_like(ids)))
    clip = torch.randn(2, 5, 20)
    got = pipeline_inputs(model, PROMPTS, "sd3", max_sequence_length=8, clip_prompt_embeds=clip)
    want = torch.cat([torch.nn.functional.pad(clip, (0, 32 - 20)), t5], dim=-2)
    assert torch.equal(got["prompt_embeds"], want) and got["prompt_embeds"].shape == (2, 13, 32)
    with pytest.raises(InputError, match="sd3 needs clip_prompt_embeds"):
        pipeline_inputs(model, PROMPTS, "sd3")
    with pytest.raises(InputError, match=r"must be a \(2, tokens, <= 32\) torch tensor"):
        pipeline_inputs(model, PROMPTS, "sd3", clip_prompt_embeds=torch.zeros(2, 5, 64))
    with pytest.raises(InputError, match="preset 'midjourney' is not one of"):
        pipeline_inputs(model, PROMPTS, "midjourney")
