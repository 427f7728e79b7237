"""encode_window (minfer.tokenizers.window): the first or last n ids of a text's encoding from
pieces of the text, equal to slicing the full encoding, for every tokenizer source, on thousands
of random texts (words, runs of every kind of whitespace, punctuation, accents, CJK, emoji,
combining marks, special and added tokens glued to words), from both sides; and its work bounded
by n, not by the text."""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

import pytest

from minfer.errors import InputError
from minfer.tokenizers import load_tokenizer, window
from tokenizer_checks import weights_script

ROOT = Path(__file__).resolve().parents[1]
TOKENIZERS = ROOT / "weights" / "tokenizers"
REAL = ROOT.parent / "shared" / "t5-tokenizer"
XL_WORDS = ROOT / "weights" / "transfo_xl" / "adaptive_div4_bin"

WORDS = ["the", "The", "house", "is", "wonderful", "March", "5,", "2021", "Friday", "def", "add(a,",
         "b):", "return", "a", "+", "b", "x=1;", "print(i)", "don't", "U.S.", "1,000.5", "well-known",
         "naïve", "Zürich", "ﬁne", "日本語", "中文", "😀", "👍🏽", "e\u0301", "ÄÖÜ", "...", "(", ")",
         "\"quoted\"", "$5", "ｶﾀｶﾅ", "ＦＵＬＬ", "@-@", "<unk>", "\u2581", "a\u2581b", "\u0120x"]
SPACES = [" ", " ", " ", "  ", "   ", "\t", "\n", " \n ", "\r\n", "\u3000", "\xa0", " \t", "\n\n",
          "\u2003", ""]
SPECIALS = {
    "t5": ["<extra_id_0>", "<extra_id_9>", "</s>", "<pad>", "<unk>"],
    "t5-added": ["<extra_id_0>", "</s>", "<sep>", "<L>", "<R>", "ish", "Foo", "bar", " gap", "<B>",
                 "\ufb01ne"],
    "byt5": ["<extra_id_0>", "<extra_id_124>", "</s>", "<pad>", "<unk>", "<code>", "<R>", "<L>", "<w>",
             "\u00c3"],
    "bpe": ["<mask>", "<s>", "</s>", "<pad>", "<extra_id_0>", "<extra_id_99>", "<code>", "<py>", "<R>"],
    "words": ["<eos>", "<unk>"],
}


def random_text(rng: random.Random, specials: list[str]) -> str:
    parts = []
    for _ in range(rng.randrange(0, 40)):
        kind = rng.random()
        if kind < 0.55:
            parts.append(rng.choice(WORDS))
        elif kind < 0.65 and specials:
            parts.append(rng.choice(specials))
        elif kind < 0.7:
            parts.append("".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(1, 4))))
        parts.append(rng.choice(SPACES))
    text = "".join(parts)
    return rng.choice(["", " ", "\n"]) + text if rng.random() < 0.2 else text


def _variant(script: str, base: Path, name: str, tmp: Path) -> Path:
    module = weights_script(script)
    if script == "make_tokenizer_fixtures":
        return module.build_variant(base, tmp / name, module.VARIANTS[name])
    variants = module.BYT5_VARIANTS if base.name == "byt5" else module.BPE_VARIANTS
    return module.build_variant(base, tmp / name, variants[name])


def _sp_only(src: Path, dest: Path) -> Path:
    dest.mkdir()
    for name in ("spiece.model", "tokenizer_config.json", "special_tokens_map.json"):
        (dest / name).write_bytes((src / name).read_bytes())
    return dest


SOURCES = ["tiny-json", "tiny-sp", "tiny-json-added", "real-json", "real-sp", "real-json-added",
           "words-pkl", "words-lower", "byt5", "byt5-added", "bpe", "bpe-prefix-space", "bpe-added"]


@pytest.fixture(scope="module", params=SOURCES)
def source(request, tmp_path_factory):
    """(a tokenizer, the special strings its random texts use, its name)."""
    return (*_source(request.param, tmp_path_factory.mktemp("w")), request.param)


def _source(name: str, tmp: Path):
    tiny = TOKENIZERS / "tiny-t5"
    if name.startswith("real") and not (REAL / "tokenizer.json").is_file():
        pytest.skip(f"real T5 tokenizer not found at {REAL}")
    base = REAL if name.startswith("real") else tiny
    if name in ("tiny-json", "real-json"):
        return load_tokenizer(base), SPECIALS["t5"]
    if name in ("tiny-sp", "real-sp"):
        return load_tokenizer(_sp_only(base, tmp / "sp")), SPECIALS["t5"]
    if name.endswith("json-added"):
        return load_tokenizer(_variant("make_tokenizer_fixtures", base, "added-tokens", tmp)), \
            SPECIALS["t5-added"]
    if name == "words-pkl":
        if not (XL_WORDS / "vocab.pkl").is_file():
            pytest.skip("no XL vocab.pkl fixture")
        return load_tokenizer(XL_WORDS), SPECIALS["words"]
    if name == "words-lower":
        (tmp / "vocab.txt").write_text("".join(w.lower() + "\n" for w in dict.fromkeys(
            ["<eos>", "<unk>"] + [w.lower() for w in WORDS])), encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text('{"lower_case": true}')
        return load_tokenizer(tmp), SPECIALS["words"]
    if name.startswith("byt5"):
        variant = "added-tokens-decoder" if name == "byt5-added" else "saved-4.57"
        return load_tokenizer(_variant("make_byt5_bpe_fixtures", TOKENIZERS / "byt5", variant, tmp)), \
            SPECIALS["byt5"]
    variant = {"bpe": "codet5", "bpe-prefix-space": "add-prefix-space", "bpe-added": "added-tokens"}[name]
    return load_tokenizer(_variant("make_byt5_bpe_fixtures", TOKENIZERS / "roberta-bpe", variant, tmp)), \
        SPECIALS["bpe"]


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of a few characters, so that short texts are cut many times."""
    monkeypatch.setattr(window, "MIN_SPAN", 3)
    monkeypatch.setattr(window, "CHARS_PER_ID", 1)


def test_window_equals_the_full_encoding(source, small_pieces):
    tok, specials, name = source
    assert tok._cut_points is not None            # every source here can be cut
    rng = random.Random(zlib.crc32(name.encode()))
    for _ in range(150):
        text = random_text(rng, specials)
        full = tok.encode(text, add_eos=False)
        for n in {0, 1, 2, 5, 13, len(full) // 2, max(len(full) - 1, 0), len(full), len(full) + 3}:
            start, cut = tok.encode_window(text, n, "start", add_eos=False)
            assert (start, cut) == (full[:n], len(full) > n), (text, n)
            end, cut = tok.encode_window(text, n, "end", add_eos=False)
            assert (end, cut) == (full[len(full) - n:] if n else [], len(full) > n), (text, n)


def test_window_gets_the_specials_around_it(source):
    """add_eos: what encode puts around a text goes around the window (`around`)."""
    tok, _, _ = source
    text = "The house is wonderful. " * 20
    plain = tok.encode(text, add_eos=False)
    assert tok.encode(text) == tok.around(plain)
    for side, part in (("start", plain[:7]), ("end", plain[-7:])):
        assert tok.encode_window(text, 7, side) == (tok.around(part), True)
    assert tok.encode_window(text, len(plain)) == (tok.encode(text), False)


def test_what_goes_around():
    """T5: `</s>` after; RoBERTa BPE: `<s>` before, `</s>` after; ByT5: `</s>` after unless the ids
    end with one (transformers' ByT5Tokenizer adds no second)."""
    t5 = load_tokenizer(TOKENIZERS / "tiny-t5")
    bpe = load_tokenizer(TOKENIZERS / "roberta-bpe")
    byt5 = load_tokenizer(TOKENIZERS / "byt5")
    assert t5.around([7]) == [7, 1] and t5.around([7, 1]) == [7, 1, 1]
    assert bpe.around([7]) == [1, 7, 2] and bpe.around([]) == [1, 2]
    assert byt5.around([7]) == [7, 1] and byt5.around([7, 1]) == [7, 1]


def test_large_text_on_the_real_vocabulary():
    """A 200 KB text on T5's own vocabulary, both files: the windows equal the full encoding's
    ends, with the default piece sizes."""
    if not (REAL / "tokenizer.json").is_file():
        pytest.skip(f"real T5 tokenizer not found at {REAL}")
    rng = random.Random(11)
    text = "".join(rng.choice(WORDS) + rng.choice(SPACES[:10]) for _ in range(30_000))
    for tok in (load_tokenizer(REAL),):
        full = tok.encode(text, add_eos=False)
        for n in (64, 512, 4096):
            assert tok.encode_window(text, n, "start", add_eos=False) == (full[:n], True)
            assert tok.encode_window(text, n, "end", add_eos=False) == (full[-n:], True)


def _counting(tok, monkeypatch) -> list[int]:
    """Record the length of every piece the source is asked to encode."""
    seen: list[int] = []
    encode = tok._encode

    def counted(text):
        seen.append(len(text))
        return encode(text)
    monkeypatch.setattr(tok, "_encode", counted)
    return seen


@pytest.mark.parametrize("side", ["start", "end"])
def test_work_grows_with_n_not_with_the_text(source, monkeypatch, side):
    """A 2 MB prompt cut to 64 ids: the text handed to the source is a few pieces of at most
    window.MAX_RUN characters, also for a run with no cut point at all (which the word vocabulary
    makes one <unk> of: there, there are no 64 ids to find before the end)."""
    tok, _, _ = source
    seen = _counting(tok, monkeypatch)
    bound = 2 * max(window.MAX_RUN, window.MIN_SPAN + window.CHARS_PER_ID * 65)
    for text in ("The house is wonderful. " * 90_000, "x" * 2_000_000, "word " + "y" * 2_000_000):
        seen.clear()
        ids, cut = tok.encode_window(text, 64, side, add_eos=False)
        assert cut or text[0] != "T"
        if cut:
            assert len(ids) == 64 and sum(seen) <= bound, (sum(seen), bound)
        else:
            assert max(seen) <= window.MAX_RUN


def test_no_cut_point_reads_whole_runs_from_the_chosen_side(monkeypatch):
    """A run longer than MAX_RUN with no cut is cut there: only ids next to that cut can differ,
    so a window that ends well before it equals the full encoding's."""
    tok = load_tokenizer(TOKENIZERS / "tiny-t5")
    monkeypatch.setattr(window, "MAX_RUN", 400)
    text = "March 5, 2021 is a Friday. " * 3 + "abcdefghij" * 100
    full = tok.encode(text, add_eos=False)
    assert tok.encode_window(text, 20, "start", add_eos=False) == (full[:20], True)


def test_sources_that_cannot_be_cut_are_encoded_whole(tmp_path):
    """A tokenizer.json whose Metaspace does not split words: no cuts, the windows still exact."""
    data = json.loads((TOKENIZERS / "tiny-t5" / "tokenizer.json").read_text(encoding="utf-8"))
    data["pre_tokenizer"]["split"] = False
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    tok = load_tokenizer(tmp_path)
    assert tok._cut_points is None
    text = "March 5, 2021 is a Friday.  And  more " * 10
    full = tok.encode(text, add_eos=False)
    assert tok.encode_window(text, 9, "end", add_eos=False) == (full[-9:], True)


@pytest.mark.parametrize("n, side, why", [(-1, "start", "non-negative"), (True, "start", "integer"),
                                          (2.0, "start", "integer"), ("3", "end", "integer"),
                                          (3, "middle", "side")])
def test_bad_arguments(n, side, why):
    tok = load_tokenizer(TOKENIZERS / "tiny-t5")
    with pytest.raises(InputError, match=why):
        tok.encode_window("a b c", n, side)


def test_lone_surrogates_anywhere_are_named():
    """As encode() would: a lone surrogate far past the window is still bad text."""
    tok = load_tokenizer(TOKENIZERS / "tiny-t5")
    text = "fine words " * 1000 + "\udc80"
    with pytest.raises(InputError, match=f"character {len(text) - 1} .* lone surrogate"):
        tok.encode_window(text, 4)
