"""A GGUF file's own T5 vocabulary as its tokenizer (tokenizers/gguf_vocab.py): the metadata
llama.cpp's convert_hf_to_gguf.py writes from a spiece.model (its pieces, scores and types as
sentencepiece reports them, padded to the model's vocabulary with UNUSED `[PAD<i>]` tokens, the
normalizer's precompiled charsmap) tokenizes and decodes as minfer's tokenizer of the folder the
spiece.model came from: the shipped tiny one (byte fallback, identity normalizer) and, where
present, T5's own (32,000 pieces, NFKC-like charsmap)."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT
from factories import t5_tensors

import minfer
from minfer.errors import TokenizerError
from minfer.tokenizers import load_tokenizer
from minfer.tokenizers.gguf_vocab import (BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, gguf_tokenizer,
                                          tokenizer_json)

spm = pytest.importorskip("sentencepiece")
TINY = ROOT / "weights" / "tokenizers" / "tiny-t5"
T5_TOKENIZER = Path("/work/shared/t5-tokenizer")
TEXTS = ["a photo of a cat", "  leading,   inner and trailing   spaces  ", "date: 4th of July 1976",
         "naïve café ☕ 🙂 — “quotes”", "tabs\tand\nnewlines", "Ｈｅｌｌｏ ﬁnancial ①② é",
         "[PAD600] </s> <unk> x", ""]


def convert_metadata(folder: Path, vocab_size: int) -> dict:
    """What convert_hf_to_gguf.py writes for a T5 tokenizer folder: sentencepiece's pieces,
    scores and types, [PAD<i>] up to vocab_size, the charsmap (here from tokenizer.json's
    Precompiled normalizer: the same bytes as the spiece.model's)."""
    sp = spm.SentencePieceProcessor(model_file=str(folder / "spiece.model"))
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(CONTROL if sp.is_control(i) else UNKNOWN if sp.is_unknown(i) else
                     BYTE if sp.is_byte(i) else UNUSED if sp.is_unused(i) else NORMAL)
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(UNUSED)
    normalizer = json.loads((folder / "tokenizer.json").read_text())["normalizer"] or {}
    charsmap = base64.b64decode(normalizer.get("precompiled_charsmap", "")) \
        if normalizer.get("type") == "Precompiled" else b""
    return {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.precompiled_charsmap": list(charsmap),
            "tokenizer.ggml.add_space_prefix": True,
            "tokenizer.ggml.remove_extra_whitespaces": True,
            "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 2,
            "tokenizer.ggml.padding_token_id": 0}


def same_tokenization(got, want, texts):
    for text in texts:
        ids = want.encode(text)
        assert got.encode(text) == ids, text
        assert got.encode(text, add_eos=False) == want.encode(text, add_eos=False), text
        assert got.decode(ids, skip_special_tokens=True) == \
            want.decode(ids, skip_special_tokens=True), text


def test_the_tiny_vocabulary_tokenizes_as_its_folder(tmp_path):
    got = gguf_tokenizer(convert_metadata(TINY, 600), tmp_path / "x.gguf")
    same_tokenization(got, load_tokenizer(TINY), TEXTS)


@pytest.mark.skipif(not T5_TOKENIZER.is_dir(), reason="the real T5 tokenizer is not here")
def test_t5s_own_vocabulary_tokenizes_as_its_folder(tmp_path):
    got = gguf_tokenizer(convert_metadata(T5_TOKENIZER, 32128), tmp_path / "x.gguf")
    same_tokenization(got, load_tokenizer(T5_TOKENIZER), TEXTS + [
        "translate English to German: The house is wonderful.", "Ａｂｃ　ｄｅｆ", "x\u00a0y",
        "Crème brûlée, Straße, Ærøskøbing", "e\u0301 e\u0300"])


def test_a_gguf_file_brings_its_tokenizer(tmp_path):
    """End to end: no tokenizer= needed; tokenizer= still wins."""
    gguf = pytest.importorskip("gguf")
    from test_gguf import KINDS, MIXES, SIZES, write_gguf
    config = {**SIZES, **KINDS["v1_1"]}
    path = tmp_path / "e.gguf"
    meta = convert_metadata(TINY, config["vocab_size"])
    write_gguf(path, config, t5_tensors(config), MIXES["Q8_0"],
               vocabulary=lambda w: _add_vocabulary(w, meta, gguf))
    m = minfer.load(path)
    want = load_tokenizer(TINY)
    same_tokenization(m.tokenizer, want, TEXTS[:4])
    np.testing.assert_array_equal(m.encode(TEXTS[0]), m.encode(np.array([want.encode(TEXTS[0])])))
    assert minfer.load(path, tokenizer=TINY).tokenizer.encode(TEXTS[2]) == want.encode(TEXTS[2])


def _add_vocabulary(w, meta: dict, gguf) -> None:
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_add_space_prefix(True)
    w.add_remove_extra_whitespaces(True)
    w.add_precompiled_charsmap(bytes(meta["tokenizer.ggml.precompiled_charsmap"]))
    w.add_eos_token_id(1)
    w.add_unk_token_id(2)
    w.add_pad_token_id(0)


@pytest.mark.parametrize("change,said", [
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model 'llama'"),
    ({"tokenizer.ggml.scores": [0.0]}, "of different lengths"),
    ({"tokenizer.ggml.token_type": None}, "missing"),
    ({"tokenizer.ggml.eos_token_id": 10 ** 6}, "eos_token_id"),
])
def test_a_damaged_vocabulary_is_one_line(tmp_path, change, said):
    meta = {**convert_metadata(TINY, 600), **change}
    with pytest.raises(TokenizerError, match=said) as e:
        tokenizer_json(meta, tmp_path / "x.gguf")
    assert "\n" not in str(e.value)
