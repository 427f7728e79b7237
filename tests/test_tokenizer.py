"""minfer.tokenizers: both sources (tokenizer.json, spiece.model), T5 conventions, streaming.

Always runs on the committed tiny tokenizer (weights/tokenizers/tiny-t5, byte fallback); the real T5
vocabulary is read from ../shared/t5-tokenizer and those tests skip when it is absent, as do the
comparisons with `transformers` when it is not installed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from minfer.errors import InputError, TokenizerError
from minfer.tokenizers import (IncrementalDecoder, JsonTokenizer, SentencePieceTokenizer,
                               load_tokenizer)
from tokenizer_checks import weights_script

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "weights" / "tokenizers" / "tiny-t5"
REAL = Path(__file__).resolve().parents[2] / "shared" / "t5-tokenizer"
CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")
VARIANTS_SCRIPT = ROOT / "weights" / "make_tokenizer_fixtures.py"
VARIANTS_FILE = ROOT / "weights" / "tokenizers" / "hf-variants.json"

KNOWN_TEXT = "translate English to German: The house is wonderful."
KNOWN_IDS = [13959, 1566, 12, 2968, 10, 37, 629, 19, 1627, 5, 1]

SENTENCES = [
    KNOWN_TEXT,
    "summarize: studies have shown that owning a dog is good for you.",
    "Hello <extra_id_0> world <extra_id_1>.",
    "x<extra_id_0>.<extra_id_1> <extra_id_2>  y",
    "  leading and   repeated spaces  ",
    "tabs\tand\nnewlines\r\n",
    "Café naïve résumé Zürich, São Paulo! Ça va? ¿Dónde está?",
    "日本語のテキスト 日本",
    "emoji 😀👍🏽 and symbols © ™ € ½ ﬁ",
    "Numbers: 3.14159, 1,000,000 and -42% on March 5, 2021.",
    "</s> in the middle</s> end",
    "<pad><unk>x",
    "ＦＵＬＬＷＩＤＴＨ ｶﾀｶﾅ",
    "",
    " ",
    "quotes \"double\" 'single' `back` ~ { } < > \\ | ^",
    "\u00a0nbsp\u2003em space\u200bzero width",
    "ö vs o\u0308",
]


def one_line_naming(err: pytest.ExceptionInfo, what: Path | str) -> None:
    message = str(err.value)
    assert "\n" not in message
    assert str(what) in message, message
    # no library exception chained on (it would print as "During handling of ... another")
    assert err.value.__cause__ is None
    assert err.value.__context__ is None or err.value.__suppress_context__


def sp_only(src: Path, dest: Path) -> Path:
    """A folder with src's spiece.model and configs but no tokenizer.json (links, not copies)."""
    dest.mkdir()
    for name in ("spiece.model",) + CONFIGS:
        if (src / name).is_file():
            try:
                os.symlink(src / name, dest / name)
            except OSError:
                shutil.copy(src / name, dest / name)
    return dest


def stream(tok, ids, skip_special_tokens=True) -> list[str]:
    dec = IncrementalDecoder(tok, skip_special_tokens)
    return [dec.push(i) for i in ids] + [dec.flush()]


@pytest.fixture(scope="module")
def tiny():
    return load_tokenizer(TINY)


@pytest.fixture(scope="module")
def tiny_sp(tmp_path_factory):
    return load_tokenizer(sp_only(TINY, tmp_path_factory.mktemp("tiny") / "sp"))


@pytest.fixture(scope="module")
def real():
    if not (REAL / "tokenizer.json").is_file():
        pytest.skip(f"real T5 tokenizer not found at {REAL}")
    return load_tokenizer(REAL)


@pytest.fixture(scope="module")
def real_sp(tmp_path_factory):
    if not (REAL / "spiece.model").is_file():
        pytest.skip(f"real T5 tokenizer not found at {REAL}")
    return load_tokenizer(sp_only(REAL, tmp_path_factory.mktemp("real") / "sp"))


@pytest.fixture(params=["tiny", "tiny_sp", "real", "real_sp"])
def any_tok(request):
    return request.getfixturevalue(request.param)


# -- the committed tiny tokenizer -------------------------------------------------------------

def test_tiny_files_are_small_and_t5_shaped(tiny, tiny_sp):
    assert {p.name for p in TINY.iterdir()} == {"tokenizer.json", "spiece.model", *CONFIGS}
    assert sum(p.stat().st_size for p in TINY.iterdir()) < 100 * 1024
    assert isinstance(tiny, JsonTokenizer) and isinstance(tiny_sp, SentencePieceTokenizer)
    for tok in (tiny, tiny_sp):
        assert tok.vocab_size == 600
        assert (tok.pad_id, tok.eos_id, tok.unk_id) == (0, 1, 2)
        assert [tok.token_to_id(f"<extra_id_{n}>") for n in (0, 1, 9)] == [599, 598, 590]
        assert tok.token_to_id("<extra_id_10>") is None
        assert len(tok.byte_ids) == 256
        assert tok.special_ids == frozenset([0, 1, 2, *range(590, 600)])
    assert tiny.encode("") == [1]


def test_tiny_vocabulary_covers_dates_numbers_letters(tiny):
    words = ["January", "February", "September", "December", "march", "Monday", "Wednesday",
             "zero", "seven", "thirteen", "nineteen", "twenty", "ninety", "hundred", "thousand",
             "million"]
    for w in words:
        assert len(tiny.encode(w, add_eos=False)) == 1, w
    # every printable ASCII character is a piece of its own (no byte fallback), digits are split
    for c in (chr(i) for i in range(33, 127)):
        assert tiny.token_to_id(c) is not None, c
    assert not set(tiny.encode("The Quick BROWN fox: 0-9, $1.50 (50%) [ok]? ~`|")) & tiny.byte_ids
    digits = [tiny.id_to_token(i) for i in tiny.encode("2021", add_eos=False)]
    assert digits[-4:] == ["2", "0", "2", "1"]


def test_tiny_byte_fallback_instead_of_unk(tiny, tiny_sp):
    for tok in (tiny, tiny_sp):
        ids = tok.encode("日本 😀", add_eos=False)
        assert tok.unk_id not in ids
        assert [tok.id_to_token(i) for i in ids if i in tok.byte_ids] == [
            f"<0x{b:02X}>" for b in "日本😀".encode()]
        assert tok.decode(ids) == "日本 😀"


def test_tiny_both_sources_agree(tiny, tiny_sp):
    texts = SENTENCES + ["March 5, 2021", "2021-03-05", "one hundred twenty-three", "a  b"]
    for text in texts:
        assert tiny.encode(text) == tiny_sp.encode(text), text
        assert tiny_sp.decode(tiny.encode(text)) == tiny.decode(tiny.encode(text))
    rng = random.Random(1)
    bytes_ = sorted(tiny.byte_ids)
    for _ in range(300):  # half byte pieces, so that runs of valid and invalid UTF-8 occur
        ids = [rng.choice(bytes_) if rng.random() < 0.5 else rng.randrange(tiny.vocab_size)
               for _ in range(rng.randint(0, 25))]
        for skip in (True, False):
            assert tiny_sp.decode(ids, skip) == tiny.decode(ids, skip), ids


# -- the real T5 vocabulary -------------------------------------------------------------------

def test_real_known_ids_and_eos(real, real_sp):
    for tok in (real, real_sp):
        assert tok.vocab_size == 32100
        assert (tok.pad_id, tok.eos_id, tok.unk_id) == (0, 1, 2)
        assert tok.encode(KNOWN_TEXT) == KNOWN_IDS
        assert tok.encode(KNOWN_TEXT, add_eos=False) == KNOWN_IDS[:-1]
        assert tok.encode_batch([KNOWN_TEXT, "", "Hi"]) == [KNOWN_IDS, [1], tok.encode("Hi")]
        assert tok.encode_batch([KNOWN_TEXT], add_eos=False) == [KNOWN_IDS[:-1]]
        assert tok.decode(KNOWN_IDS) == KNOWN_TEXT
        assert tok.decode(KNOWN_IDS, skip_special_tokens=False) == KNOWN_TEXT + "</s>"
        assert tok.decode(np.array(KNOWN_IDS, dtype=np.int64)) == KNOWN_TEXT


def test_real_sentinels(real, real_sp):
    for tok in (real, real_sp):
        assert tok.token_to_id("<extra_id_0>") == 32099
        assert tok.token_to_id("<extra_id_99>") == 32000
        assert tok.id_to_token(32099) == "<extra_id_0>"
        ids = tok.encode("Hello <extra_id_0> world <extra_id_1>.")
        assert ids == [8774, 32099, 296, 32098, 3, 5, 1]
        # like transformers' fast tokenizer: the sentinels come back, glued to the previous word
        assert tok.decode(ids, skip_special_tokens=False) == "Hello<extra_id_0> world<extra_id_1> .</s>"
        # ... and, being additional_special_tokens, are skipped with skip_special_tokens=True
        assert tok.decode(ids) == "Hello world ."
        assert tok.encode(tok.decode(ids, skip_special_tokens=False), add_eos=False) == ids
        assert tok.encode("a</s>b<pad>", add_eos=False) == [3, 9, 1, 3, 115, 0]


def test_real_unknown_characters_become_unk(real, real_sp):
    for tok in (real, real_sp):
        ids = tok.encode("日本 é", add_eos=False)
        assert ids == [3, 2, 3, 154]           # "▁", <unk>, "▁", "é": one <unk> per unknown run
        assert tok.decode(ids, skip_special_tokens=False) == "<unk> é"
        assert tok.decode(ids) == " é"          # <unk> is special: skipped, its "▁" stays a space
        assert tok.token_to_id("日本") is None and tok.token_to_id("not-a-piece") is None


def test_leading_space_rules(real, real_sp):
    for tok in (real, real_sp):
        assert tok.id_to_token(37) == "▁The" and tok.id_to_token(629) == "▁house"
        assert tok.decode([37]) == "The"                 # the first token loses its "▁"
        assert tok.decode([629]) == "house"
        assert tok.decode([37, 629]) == "The house"
        assert tok.decode([1, 37]) == "The"              # ... counted after skipping specials
        assert tok.decode([0, 37], skip_special_tokens=False) == "<pad> The"
        assert tok.decode([3]) == "" and tok.decode([3, 3]) == " "
        assert tok.decode([37, 32105, 629]) == "The house"   # ids past the vocabulary: dropped
        assert tok.decode([]) == ""


def test_real_both_sources_agree(real, real_sp):
    for text in SENTENCES:
        assert real_sp.encode(text) == real.encode(text), text
    rng = random.Random(2)
    for _ in range(300):
        ids = [rng.randrange(real.vocab_size + 28) for _ in range(rng.randint(0, 30))]
        for skip in (True, False):
            assert real_sp.decode(ids, skip) == real.decode(ids, skip), ids


@pytest.mark.parametrize("name", ["tiny", "real"])
def test_decode_matches_the_tokenizers_library(request, name):
    tok = request.getfixturevalue(name)
    lib = pytest.importorskip("tokenizers").Tokenizer.from_file(str(tok.path))
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size + 5) for _ in range(rng.randint(0, 20))]
        for skip in (True, False):
            assert tok.decode(ids, skip) == lib.decode(ids, skip_special_tokens=skip)


# -- streaming --------------------------------------------------------------------------------

def test_streaming_random_ids(any_tok):
    tok = any_tok
    rng = random.Random(4)
    specials = sorted(tok.special_ids)
    bytes_ = sorted(tok.byte_ids) or [tok.unk_id]
    for _ in range(150):
        ids = []
        for _ in range(rng.randint(0, 40)):
            r = rng.random()
            ids.append(rng.choice(specials) if r < 0.1 else rng.choice(bytes_) if r < 0.4
                       else rng.randrange(tok.vocab_size))
        for skip in (True, False):
            assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip), ids


def test_streaming_sentences(any_tok):
    tok = any_tok
    for text in SENTENCES:
        ids = tok.encode(text)
        for skip in (True, False):
            pieces = stream(tok, ids, skip)
            assert "".join(pieces) == tok.decode(ids, skip), text


def test_streaming_keeps_spaces_between_tokens(real):
    pieces = stream(real, KNOWN_IDS)
    assert pieces[:10] == ["translate", " English", " to", " German", ":", " The", " house", " is",
                           " wonderful", "."]
    assert "".join(pieces) == KNOWN_TEXT
    # specials in the middle are skipped without eating the next word's space
    ids = [37, 1, 0, 32099, 629]
    assert stream(real, ids) == ["The", "", "", "", " house", ""]
    assert "".join(stream(real, ids, False)) == "The</s><pad><extra_id_0> house"


def test_streaming_multibyte_characters(tiny, tiny_sp):
    text = "Café 日本 😀!"
    for tok in (tiny, tiny_sp):
        ids = tok.encode(text, add_eos=False)
        dec = IncrementalDecoder(tok)
        pieces = []
        for i in ids:
            piece = dec.push(i)
            assert "\ufffd" not in piece                 # never half a character
            if i in tok.byte_ids:
                assert piece == ""                       # held until the byte run ends
            pieces.append(piece)
        pieces.append(dec.flush())
        assert "".join(pieces) == text
        assert "😀!" in pieces[-2] and "本" in "".join(pieces[:-2])   # the emoji came out whole


def test_streaming_window_stays_small(real):
    ids = real.encode(" ".join([KNOWN_TEXT, "Café, 日本 and emoji 😀."] * 50))
    dec = IncrementalDecoder(real)
    out, widest = [], 0
    for i in ids:
        out.append(dec.push(i))
        widest = max(widest, len(dec._ids))
    out.append(dec.flush())
    assert "".join(out) == real.decode(ids)
    assert widest <= 4, widest                            # O(window) per token, not O(length)


def test_streaming_flush_resets(real):
    dec = IncrementalDecoder(real)
    first = "".join([dec.push(i) for i in KNOWN_IDS] + [dec.flush()])
    second = "".join([dec.push(i) for i in KNOWN_IDS] + [dec.flush()])
    assert first == second == KNOWN_TEXT
    assert dec.flush() == ""


def test_streaming_rejects_bad_ids(tiny):
    dec = IncrementalDecoder(tiny)
    with pytest.raises(InputError, match="negative"):
        dec.push(-1)
    with pytest.raises(InputError, match="integers"):
        dec.push("5")
    assert dec.push(10_000) == ""                         # past the vocabulary: dropped, as decode


# -- transformers as the oracle ---------------------------------------------------------------

@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    if not (REAL / "tokenizer.json").is_file():
        pytest.skip(f"real T5 tokenizer not found at {REAL}")
    fast = transformers.T5TokenizerFast.from_pretrained(str(REAL))
    slow = transformers.T5Tokenizer.from_pretrained(str(REAL), legacy=True)
    return fast, slow


def test_matches_transformers(real, real_sp, hf):
    fast, slow = hf
    for text in SENTENCES:
        ids = real.encode(text)
        assert fast(text).input_ids == ids, text
        assert real_sp.encode(text) == ids
        if not text.rstrip().endswith("</s>"):            # the slow one won't add a second </s>
            assert slow(text).input_ids == ids, text
        assert fast(text, add_special_tokens=False).input_ids == real.encode(text, add_eos=False)
        for skip in (True, False):
            # transformers' T5 config asks for the legacy clean-up ("a ." -> "a."); we never do it
            want = fast.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert real.decode(ids, skip) == want and real_sp.decode(ids, skip) == want
    assert fast.convert_tokens_to_ids("<extra_id_0>") == real.token_to_id("<extra_id_0>") == 32099
    assert set(fast.all_special_ids) == set(real.special_ids) == set(real_sp.special_ids)


def _transformers_major(transformers) -> int:
    return int(transformers.__version__.split(".")[0])


def _byte_runs_as_unk(tok, ids: list[int]) -> list[int]:
    """ids with each run of byte-fallback pieces replaced by one <unk> (a Unigram model without
    byte fallback fuses the unknown characters of a word into one <unk>)."""
    out: list[int] = []
    for i in ids:
        if i in tok.byte_ids:
            if not out or out[-1] != tok.unk_id:
                out.append(tok.unk_id)
        else:
            out.append(i)
    return out


def test_tiny_matches_transformers(tiny, tiny_sp):
    """The oracle for the tiny vocabulary is its tokenizer.json as written: byte fallback (characters
    outside the vocabulary become their UTF-8 byte pieces), its whitespace normaliser, its
    Metaspace pre-tokenizer. transformers 4.57 (the pinned dev version) runs exactly that, as the
    `tokenizers` library does, and `sentencepiece` gives the same ids from spiece.model; it is also
    what the tiny checkpoints were trained with (weights/train_tiny_t5.py encodes with `tokenizers`).

    transformers 5 is different by design: a tokenizer class with its own `__init__` (T5Tokenizer,
    which AutoTokenizer picks from tokenizer_class) takes only the vocabulary, the scores and a
    Precompiled normaliser from tokenizer.json and builds its fixed T5 pipeline around them
    (transformers/models/t5/tokenization_t5.py: `Unigram(..., byte_fallback=False)`, WhitespaceSplit +
    Metaspace, a Metaspace decoder without ByteFallback). On the tiny file that turns each byte-
    fallback run into one <unk> (and tabs/newlines into word breaks). The canonical T5 file has no
    byte fallback and a Precompiled normaliser, so there 5.x agrees (test_matches_transformers,
    test_variants_match_transformers_live). Loading the file as written, PreTrainedTokenizerFast
    (5.x: TokenizersBackend), agrees with us in both versions, and that is checked here too.
    """
    transformers = pytest.importorskip("transformers")
    texts = ["March 5, 2021 is a Friday.", "one hundred <extra_id_0> three", "Café 日本 😀",
             "tabs\tand\nnewlines", "  a  b  "]
    as_written = transformers.PreTrainedTokenizerFast.from_pretrained(str(TINY))
    for text in texts:
        ids = tiny.encode(text)
        assert as_written(text).input_ids == tiny_sp.encode(text) == ids, text
        for skip in (True, False):
            assert as_written.decode(ids, skip_special_tokens=skip,
                                     clean_up_tokenization_spaces=False) == tiny.decode(ids, skip)
    auto = transformers.AutoTokenizer.from_pretrained(str(TINY))
    assert set(auto.all_special_ids) == set(tiny.special_ids)
    if _transformers_major(transformers) < 5:
        slow = transformers.T5Tokenizer.from_pretrained(str(TINY), legacy=True)
        for text in texts:
            ids = tiny.encode(text)
            assert auto(text).input_ids == slow(text).input_ids == ids, text
            assert auto.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) \
                == tiny.decode(ids)
        return
    # transformers 5: the rebuilt pipeline, and what it gives instead
    assert json.loads(auto.backend_tokenizer.to_str())["model"]["byte_fallback"] is False
    for text in texts[:2]:                           # words of the vocabulary: the same ids
        assert auto(text).input_ids == tiny.encode(text), text
    ids = tiny.encode("Café 日本 😀")
    assert set(ids) & tiny.byte_ids
    assert auto("Café 日本 😀").input_ids == _byte_runs_as_unk(tiny, ids)


# -- tokenizer.json / tokenizer_config.json as hub repositories save them ----------------------

def _variants_module():
    return weights_script(VARIANTS_SCRIPT.stem)


@pytest.fixture(scope="module")
def variants():
    module = _variants_module()
    data = json.loads(VARIANTS_FILE.read_text(encoding="utf-8"))
    return module, data


def _source(kind: str) -> Path:
    src = TINY if kind == "tiny" else REAL
    if not (src / "tokenizer.json").is_file():
        pytest.skip(f"real T5 tokenizer not found at {REAL}")
    return src


def test_variant_fixtures_are_current_and_small(variants):
    module, data = variants
    assert VARIANTS_FILE.stat().st_size < 64 * 1024
    assert data["variants"] == module.VARIANTS and data["texts"] == module.TEXTS
    assert data["transformers"] == "4.57.6"
    assert set(data["ids"]) == {"tiny", "real"}
    for by_variant in data["ids"].values():
        assert set(by_variant) == set(module.VARIANTS)
        assert all(len(rows) == len(module.TEXTS) for rows in by_variant.values())


@pytest.mark.parametrize("kind", ["tiny", "real"])
def test_variants_match_committed_transformers_ids(kind, variants, tmp_path):
    """Token ids equal transformers' `AutoTokenizer.from_pretrained(folder)(text)` (4.57.6,
    committed by weights/make_tokenizer_fixtures.py) for folders saved with padding, truncation,
    added tokens and config-declared tokens: a prompt is never padded or cut."""
    module, data = variants
    src = _source(kind)
    for name, spec in data["variants"].items():
        tok = load_tokenizer(module.build_variant(src, tmp_path / name, spec))
        want = data["ids"][kind][name]
        for text, ids in zip(data["texts"], want):
            assert tok.encode(text) == ids, (name, text)
            assert tok.encode(text, add_eos=False) == ids[:-1]
            assert "".join(stream(tok, ids)) == tok.decode(ids)
        assert tok.encode_batch(data["texts"]) == want, name


def test_saved_padding_and_truncation_are_ignored(variants, tmp_path):
    module, data = variants
    long = data["texts"][1]
    for name in ("padding-fixed", "truncation", "truncation-left-and-padding", "model-max-length"):
        tok = load_tokenizer(module.build_variant(TINY, tmp_path / name, data["variants"][name]))
        assert tok.encode(long) == load_tokenizer(TINY).encode(long), name
        assert len(tok.encode(long)) > 24                           # past every saved length
        assert tok.encode("") == [tok.eos_id]                       # not padded
        short, longer = tok.encode_batch(["March", long])
        assert short == [tok.token_to_id("▁March"), tok.eos_id] and len(longer) > 24


def test_config_declared_tokens_are_added(variants, tmp_path):
    module, data = variants
    tok = load_tokenizer(module.build_variant(TINY, tmp_path / "c", data["variants"]["config-only-tokens"]))
    assert [tok.token_to_id(t) for t in ("<cfg>", "<cfg2>", "<mapx>")] == [600, 601, 602]
    assert tok.vocab_size == 603
    assert {600, 602} <= tok.special_ids and 601 not in tok.special_ids
    ids = tok.encode("a<cfg>b<cfg2>c <mapx>", add_eos=False)
    assert [i for i in ids if i >= 600] == [600, 601, 602]
    assert tok.decode(ids, skip_special_tokens=False) == "a<cfg> b<cfg2> c<mapx>"
    # T5Tokenizer's sentinels when the config names none: <extra_id_0..99>, the 90 missing appended
    tok = load_tokenizer(module.build_variant(TINY, tmp_path / "s", data["variants"]["t5-default-sentinels"]))
    assert tok.vocab_size == 690
    assert [tok.token_to_id(f"<extra_id_{n}>") for n in (0, 9, 10, 99)] == [599, 590, 600, 689]
    assert set(range(590, 690)) <= tok.special_ids


def _as_transformers5_builds(folder: Path) -> None:
    """Rewrite the folder's tokenizer.json to the pipeline transformers 5's T5Tokenizer builds
    around the file's vocabulary and scores (transformers/models/t5/tokenization_t5.py): Unigram
    without byte fallback, the normaliser only if it is sentencepiece's Precompiled one,
    WhitespaceSplit then Metaspace, a Metaspace decoder (the added tokens and post-processor are
    the file's and the configs', as before)."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
                 "split": True}
    data["model"]["byte_fallback"] = False
    if (data.get("normalizer") or {}).get("type") != "Precompiled":
        data["normalizer"] = None
    data["pre_tokenizer"] = {"type": "Sequence",
                             "pretokenizers": [{"type": "WhitespaceSplit"}, metaspace]}
    data["decoder"] = metaspace
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


@pytest.mark.parametrize("kind", ["tiny", "real"])
def test_variants_match_transformers_live(kind, variants, tmp_path):
    """The same folders against the installed transformers, every text, ids and decoding both
    ways. transformers 5 rebuilds T5-class tokenizers around the file's vocabulary (see
    test_tiny_matches_transformers), on purpose: for the tiny vocabulary (byte fallback, its own
    normaliser) what 5.x gives is then what minfer gives for the folder rewritten to that
    pipeline (`_as_transformers5_builds`), while minfer reads the file as written, as 4.57 did and
    as the tiny checkpoints were trained (test_variants_match_committed_transformers_ids holds it
    to 4.57's ids). The folder loaded as written (`generic-class`) and the real T5 vocabulary (no
    byte fallback, a Precompiled normaliser: the rebuild changes nothing) are compared as they
    are under either version."""
    transformers = pytest.importorskip("transformers")
    module, data = variants
    src = _source(kind)
    v5 = _transformers_major(transformers) >= 5
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()   # "longer than model_max_length": a warning only
    try:
        for name, spec in data["variants"].items():
            folder = module.build_variant(src, tmp_path / name, spec)
            hf = transformers.AutoTokenizer.from_pretrained(str(folder))
            if v5 and kind == "tiny" and name != "generic-class":
                _as_transformers5_builds(folder)
            _assert_same_as(hf, load_tokenizer(folder), data["texts"], name)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _assert_same_as(hf, tok, texts, name):
    """minfer's tokenizer gives transformers' ids for every text, and its decoding of them with
    and without the special tokens."""
    for text in texts:
        ids = hf(text)["input_ids"]
        assert tok.encode(text) == ids, (name, text)
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), (name, text)


@pytest.mark.parametrize("kind", ["tiny", "real"])
def test_folder_saved_by_installed_transformers(kind, variants, tmp_path):
    """A folder as the installed transformers saves it (5.x: its rebuilt tokenizer.json and a
    tokenizer_config.json in its own format) gives what transformers gives for it."""
    transformers = pytest.importorskip("transformers")
    module, data = variants
    src = _source(kind)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        for name in ("as-shipped", "added-tokens", "t5-default-sentinels"):
            folder = module.build_variant(src, tmp_path / name, data["variants"][name])
            saved = tmp_path / f"{name}-saved"
            transformers.AutoTokenizer.from_pretrained(str(folder)).save_pretrained(str(saved))
            _assert_same_as(transformers.AutoTokenizer.from_pretrained(str(saved)),
                            load_tokenizer(saved), data["texts"], name)
    finally:
        transformers.logging.set_verbosity(verbosity)


# -- errors -----------------------------------------------------------------------------------

def test_missing_folder_and_files(tmp_path):
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(tmp_path / "nope")
    one_line_naming(err, tmp_path / "nope")
    with pytest.raises(TokenizerError, match="no tokenizer file") as err:
        load_tokenizer(tmp_path)
    one_line_naming(err, tmp_path)


@pytest.mark.parametrize("content, why", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "no 'model' object"),
    ('{"model": {"type": "NoSuchModel"}}', "not a usable tokenizer.json"),
    ('{"version": "1.0", "model": {"type": "Unigram", "vocab": 7}}', "not a usable tokenizer.json"),
    (b"\xff\xfe\x00junk", "not valid JSON"),
])
def test_corrupt_tokenizer_json(tmp_path, content, why):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    shutil.copy(TINY / "spiece.model", tmp_path)   # present, but a broken preferred file is an error
    with pytest.raises(TokenizerError, match=why) as err:
        load_tokenizer(tmp_path)
    one_line_naming(err, path)


def test_truncated_tokenizer_json(tmp_path):
    text = (TINY / "tokenizer.json").read_text(encoding="utf-8")
    (tmp_path / "tokenizer.json").write_text(text[: len(text) // 2], encoding="utf-8")
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(tmp_path)
    one_line_naming(err, tmp_path / "tokenizer.json")


@pytest.mark.parametrize("content", [b"", b"\x00" * 10, b"not a protobuf at all \xff\xff\xff",
                                     b"\x0a\x05hello"])
def test_corrupt_spiece_model(tmp_path, content):
    path = tmp_path / "spiece.model"
    path.write_bytes(content)
    with pytest.raises(TokenizerError, match="SentencePiece") as err:
        load_tokenizer(tmp_path)
    one_line_naming(err, path)


def test_truncated_spiece_model(tmp_path):
    data = (TINY / "spiece.model").read_bytes()
    (tmp_path / "spiece.model").write_bytes(data[: len(data) // 2])
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(tmp_path)
    one_line_naming(err, tmp_path / "spiece.model")


def test_bad_config_files(tmp_path):
    folder = sp_only(TINY, tmp_path / "t")
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").write_text('{"extra_ids": -3}')
    with pytest.raises(TokenizerError, match="extra_ids") as err:
        load_tokenizer(folder)
    one_line_naming(err, folder / "tokenizer_config.json")
    (folder / "special_tokens_map.json").unlink()
    (folder / "special_tokens_map.json").write_text("eos_token: </s>")
    with pytest.raises(TokenizerError, match="not valid JSON") as err:
        load_tokenizer(folder)
    one_line_naming(err, folder / "special_tokens_map.json")


def test_spiece_defaults_without_configs(tmp_path):
    """No tokenizer_config.json: T5's 100 sentinels, specials from the SentencePiece model."""
    folder = tmp_path / "t"
    folder.mkdir()
    shutil.copy(TINY / "spiece.model", folder)
    tok = load_tokenizer(folder)
    assert tok.vocab_size == 590 + 100
    assert tok.token_to_id("<extra_id_0>") == 689 and tok.token_to_id("<extra_id_99>") == 590
    assert (tok.pad_id, tok.eos_id, tok.unk_id) == (0, 1, 2)


def test_missing_library_falls_back_or_says_which(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)       # import tokenizers -> ImportError
    tok = load_tokenizer(TINY)
    assert isinstance(tok, SentencePieceTokenizer) and tok.encode("March") == [
        load_tokenizer(sp_only(TINY, tmp_path / "sp")).token_to_id("▁March"), 1]
    only_json = tmp_path / "json"
    only_json.mkdir()
    shutil.copy(TINY / "tokenizer.json", only_json)
    with pytest.raises(TokenizerError, match="'tokenizers' package") as err:
        load_tokenizer(only_json)
    one_line_naming(err, only_json / "tokenizer.json")


def test_bad_inputs(tiny):
    with pytest.raises(InputError):
        tiny.encode(b"bytes")
    with pytest.raises(InputError):
        tiny.encode_batch(["ok", None])
    with pytest.raises(InputError, match="negative"):
        tiny.decode([5, -1])
    with pytest.raises(InputError):
        tiny.decode([1.5])


# -- input checks: generated invalid texts and ids, for every tokenizer source ----------------------
XL_WORDS = Path(__file__).resolve().parent.parent / "weights" / "transfo_xl" / "adaptive_div4_bin"
SURROGATES = ["\ud800", "\udfff", "\udc80"]   # lone halves; "\udc80" is what surrogateescape leaves


def surrogate_texts():
    """(text, index of the bad character): each lone surrogate at the start, middle and end."""
    for s in SURROGATES:
        yield s, 0
        yield "date " + s + " x", 5
        yield "the game" + s, 8


@pytest.fixture(params=["tiny", "tiny_sp", "words"])
def each_source(request, tmp_path_factory):
    if request.param == "words":
        if not (XL_WORDS / "vocab.pkl").is_file():
            pytest.skip("no XL vocab.pkl fixture")
        return load_tokenizer(XL_WORDS)
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("text,at", list(surrogate_texts()))
def test_lone_surrogates_are_named_not_raised_raw(each_source, text, at):
    with pytest.raises(InputError, match=f"encode\\(\\): character {at} .* lone surrogate") as e:
        each_source.encode(text)
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match=f"text 1: character {at}"):
        each_source.encode_batch(["fine", text])


@pytest.mark.parametrize("bad", [True, False, 1.0, np.float32(2), "3", None, [1], np.bool_(True)],
                         ids=repr)
def test_non_integer_ids_are_refused_by_decode_and_streaming(each_source, bad):
    with pytest.raises(InputError, match="token ids must be integers"):
        each_source.decode([5, bad])
    with pytest.raises(InputError, match="token ids must be integers"):
        IncrementalDecoder(each_source).push(bad)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
@pytest.mark.parametrize("text", ["[" * 100_000, '{"a": ' * 50_000, "[1" + "0" * 5000 + "]"])
def test_hostile_json_tokenizer_files_are_one_line_errors(tmp_path, name, text):
    import shutil
    for f in ("tokenizer.json", "spiece.model"):
        shutil.copy(TINY / f, tmp_path / f)
    (tmp_path / name).write_text(text)
    with pytest.raises(TokenizerError, match=name.replace(".", r"\.")) as e:
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["tokenizer.json", "spiece.model", "special_tokens_map.json"])
@pytest.mark.parametrize("kind", ["loop", "dangling", "folder"])
def test_a_tokenizer_file_that_is_no_readable_file_is_named_not_skipped(tmp_path, name, kind):
    """A looping tokenizer.json beside spiece.model fell back to spiece.model without a word
    (and every file looping: 'has no tokenizer'); a file that is there but cannot be read is
    named, in one line, by the reader and by `minfer convert`."""
    from minfer.tokenizers import has_tokenizer, load_tokenizer
    folder = tmp_path / "tok"
    shutil.copytree(TINY, folder)
    path = folder / name
    path.unlink()
    if kind == "loop":
        path.symlink_to(path.name)
    elif kind == "dangling":
        path.symlink_to("nowhere")
    else:
        path.mkdir()
    want = {"loop": "a link that loops back on itself", "dangling": "a link to nothing",
            "folder": "a folder"}[kind]
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(folder)
    assert str(e.value) == f"{path}: not a readable file ({want})"
    if name == "tokenizer.json":   # the first file has_tokenizer looks for
        with pytest.raises(TokenizerError, match="not a readable file"):
            has_tokenizer(folder)


@pytest.mark.parametrize("post_processor", [True, False])
def test_a_tokenizer_json_the_library_cannot_run_is_a_one_line_error(tmp_path, post_processor):
    """A Unigram model without its unk token: the library raises a bare Exception ("Encountered
    an unknown token but unk_id is missing"), at load (the post-processor probe) or at the first
    encode; minfer names the file in a TokenizerError."""
    folder = tmp_path / "tok"
    shutil.copytree(TINY, folder)
    (folder / "spiece.model").unlink()
    data = json.loads((folder / "tokenizer.json").read_text())
    data["model"] = {"type": "Unigram", "vocab": []}
    if not post_processor:
        data["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: the tokenizer cannot encode with "
                                             r"it: Encountered an unknown token"):
        load_tokenizer(folder).encode("date: 1999")
