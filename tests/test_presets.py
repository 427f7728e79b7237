"""Pipeline presets (minfer/encoding/presets.py) against an independent computation of each
diffusers pipeline's rule: the HF `tokenizers` tokenizer padded and cut as the pipeline asks,
the encoder run on those ids with the mask or without it, the tail zeroed here."""
import html
import shutil

import numpy as np
import pytest
from conftest import TINY_TOKENIZER, make_text_model_folder
from factories import write_t5
from tokenizers import Tokenizer

import minfer
from minfer.encoding.presets import PRESETS, wan_prompt_clean
from minfer.errors import InputError

PROMPTS = ["a cat sat on the mat and looked at the birds in the garden for a long while",
           "hi", "one two three"]


@pytest.fixture(scope="module")
def t5_model(tmp_path_factory):
    return minfer.load(make_text_model_folder(tmp_path_factory.mktemp("p") / "m"))


@pytest.fixture(scope="module")
def umt5_model(tmp_path_factory):
    folder = write_t5(tmp_path_factory.mktemp("u") / "m", seed=11, model_type="umt5",
                      vocab_size=600, d_model=32, d_kv=8, num_heads=4, d_ff=64,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    for name in ("tokenizer.json", "spiece.model", "tokenizer_config.json",
                 "special_tokens_map.json"):
        shutil.copy(TINY_TOKENIZER / name, folder / name)
    return minfer.load(folder)


def pipeline_ids(texts, length):
    """What the pipelines' `tokenizer(prompt, padding="max_length", max_length=length,
    truncation=True)` gives: ids and mask (B, length)."""
    tok = Tokenizer.from_file(str(TINY_TOKENIZER / "tokenizer.json"))
    tok.enable_truncation(length)
    tok.enable_padding(length=length, pad_id=0, pad_token="<pad>")
    rows = tok.encode_batch(texts)
    return (np.array([r.ids for r in rows], np.int64),
            np.array([r.attention_mask for r in rows], np.int64))


@pytest.mark.parametrize("name", ["flux", "sd3", "ltx"])
def test_unmasked_presets_run_the_encoder_over_the_padding(t5_model, name):
    ids, mask = pipeline_ids(PROMPTS, 12)
    want = t5_model.encode(ids, np.ones_like(mask))     # every position attended
    got, handed_on = t5_model.encode(PROMPTS, preset=name, max_length=12, return_mask=True)
    np.testing.assert_array_equal(got, want)
    assert got.shape == (3, 12, 32)
    np.testing.assert_array_equal(handed_on, mask)      # ltx's mask; the tokens' otherwise
    # the first prompt was cut to 12 tokens, its closing </s> kept
    assert ids[0, -1] == 1 and mask[0].all()


def test_preset_lengths_are_the_pipelines_defaults(t5_model):
    assert {n: p.max_length for n, p in PRESETS.items()} == \
        {"flux": 512, "sd3": 256, "wan": 512, "chroma": 512, "ltx": 128}
    ids, _ = pipeline_ids(PROMPTS[1:], 256)
    np.testing.assert_array_equal(t5_model.encode(PROMPTS[1:], preset="sd3"),
                                  t5_model.encode(ids, np.ones_like(ids)))


def test_chroma_masks_the_encoder_and_hands_on_one_more_token(t5_model):
    ids, mask = pipeline_ids(PROMPTS, 12)
    got, handed_on = t5_model.encode(PROMPTS, preset="chroma", max_length=12, return_mask=True)
    np.testing.assert_array_equal(got, t5_model.encode(ids, mask))
    lengths = mask.sum(1)
    want = np.array([[int(t <= n) for t in range(12)] for n in lengths])   # arange <= seq_len
    np.testing.assert_array_equal(handed_on, want)


def reference_clean(text):
    """WanPipeline's prompt_clean with the `regex` module diffusers imports (no ftfy here)."""
    regex = pytest.importorskip("regex")
    text = html.unescape(html.unescape(text)).strip()
    return regex.sub(r"\s+", " ", text).strip()


def test_wan_cleans_masks_and_zeroes_the_tail(umt5_model):
    pytest.importorskip("regex")
    try:
        import ftfy  # noqa: F401
        pytest.skip("ftfy installed: the reference below leaves it out")
    except ImportError:
        pass
    raw = ["  a &amp;amp; cat\n\n\tsat \x1c on\u3000the mat ", "hi &lt;3"]
    cleaned = [reference_clean(t) for t in raw]
    assert cleaned[0] == "a & cat sat \x1c on the mat"
    assert [wan_prompt_clean(t) for t in raw] == cleaned
    ids, mask = pipeline_ids(cleaned, 16)
    want = umt5_model.encode(ids, mask).copy()
    want[mask == 0] = 0.0                               # u[:v] then zeros to max length
    got = umt5_model.encode(raw, preset="wan", max_length=16)
    np.testing.assert_array_equal(got, want)
    assert np.abs(got[1, mask[1].sum():]).max() == 0 and np.abs(got[1, 0]).max() > 0


def test_preset_errors_are_one_line(t5_model):
    with pytest.raises(InputError, match="preset 'dalle' is not one of flux, sd3, wan"):
        t5_model.encode("x", preset="dalle")
    with pytest.raises(InputError, match="preset 'flux' sets padding"):
        t5_model.encode("x", preset="flux", use_attention_mask=False)
    with pytest.raises(InputError, match="return_tensors 'tf' is not"):
        t5_model.encode("x", return_tensors="tf")
    # without a preset the return is unchanged: one array
    assert isinstance(t5_model.encode("x"), np.ndarray)


def test_return_tensors_pt_shares_memory(t5_model):
    torch = pytest.importorskip("torch")
    states, mask = t5_model.encode(PROMPTS, preset="flux", max_length=8, return_mask=True,
                                   return_tensors="pt")
    assert isinstance(states, torch.Tensor) and states.dtype == torch.float32
    np.testing.assert_array_equal(states.numpy(), t5_model.encode(PROMPTS, preset="flux",
                                                                  max_length=8))
    assert mask.dtype == torch.int64
