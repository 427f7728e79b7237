"""ByT5's byte tokenizer (minfer.tokenizers.byt5) against transformers' ByT5Tokenizer: the ids,
decoded texts and invalid-byte decodings committed by weights/make_byt5_bpe_fixtures.py (4.57's,
and 5.x's where they differ: decoding, which minfer follows, see its V5_DIFFERENCES) for folders
saved the ways ByT5 repositories save them, and folders transformers 5 saves; streaming over
multi-byte characters; the folder's bad settings."""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path

import pytest

from minfer.errors import TokenizerError
from minfer.tokenizers import ByteTokenizer, IncrementalDecoder, has_tokenizer, load_tokenizer
from tokenizer_checks import (hold_to_versions, one_line_naming, stream, transformers_major,
                              weights_script)

ROOT = Path(__file__).resolve().parents[1]
BYT5 = ROOT / "weights" / "tokenizers" / "byt5"
EXPECTED = ROOT / "weights" / "tokenizers" / "byt5-bpe-expected.json"


@pytest.fixture(scope="module")
def fixtures():
    return weights_script("make_byt5_bpe_fixtures"), json.loads(EXPECTED.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def saved():
    return load_tokenizer(BYT5)


def test_fixtures_are_current_and_small(fixtures):
    module, data = fixtures
    assert data["transformers"] == "4.57.6"
    byt5 = data["byt5"]
    assert byt5["variants"] == module.BYT5_VARIANTS and byt5["texts"] == module.BYT5_TEXTS
    assert byt5["decode"] == module.BYT5_DECODE
    assert set(byt5["expected"]["variants"]) == set(module.BYT5_VARIANTS)
    v5 = data[module.V5_SECTION]
    assert v5["transformers"].startswith("5.") and set(v5["byt5"]) <= set(module.BYT5_VARIANTS)
    assert EXPECTED.stat().st_size < 48 * 1024
    assert sum(p.stat().st_size for p in BYT5.iterdir()) < 40 * 1024
    assert {p.name for p in BYT5.iterdir()} == {"tokenizer_config.json", "special_tokens_map.json",
                                                "added_tokens.json"}


@pytest.mark.parametrize("variant", weights_script("make_byt5_bpe_fixtures").BYT5_VARIANTS)
def test_matches_committed_transformers(fixtures, variant, tmp_path):
    """ids with and without </s>, decoded texts both ways, the decoding of invalid UTF-8, the
    vocabulary size: what ByT5Tokenizer gives for the same folder, each field as the transformers
    version minfer follows for it gives it (ids: 4.57 and 5.x alike; decoding: 5.x's)."""
    module, data = fixtures
    want = data["byt5"]["expected"]["variants"][variant]
    rows = {m: module.rows_for(data, "byt5", variant, m) for m in (4, 5)}
    tok = load_tokenizer(module.build_variant(BYT5, tmp_path / variant, module.BYT5_VARIANTS[variant]))
    assert isinstance(tok, ByteTokenizer)
    assert tok.vocab_size == want["end"]
    for k, text in enumerate(data["byt5"]["texts"]):
        row = {f: rows[module.follows("byt5", f)][k][f] for f in ("ids", "plain", "decoded")}
        assert tok.encode(text) == row["ids"], text
        assert tok.encode(text, add_eos=False) == row["plain"], text
        assert [tok.decode(row["ids"], skip) for skip in (True, False)] == row["decoded"], text
        assert "".join(stream(tok, row["ids"])) == tok.decode(row["ids"])
    decodes = module.decodes_for(data, variant, module.follows("byt5", "decode"))
    for ids, decoded in zip(data["byt5"]["decode"], decodes):
        if decoded is not None:
            assert [tok.decode(ids, skip) for skip in (True, False)] == decoded, ids
            assert "".join(stream(tok, ids, False)) == decoded[1]


def test_byte_and_sentinel_ids(saved):
    """The facts, readable: byte + 3; pad 0, eos 1, unk 2; 125 sentinels after the bytes,
    <extra_id_0> first (transformers 4.57 numbers them upwards from 259)."""
    assert (saved.pad_id, saved.eos_id, saved.unk_id, saved.vocab_size) == (0, 1, 2, 384)
    assert saved.encode("A\u00e9") == [ord("A") + 3, 0xC3 + 3, 0xA9 + 3, 1]
    assert [saved.token_to_id(f"<extra_id_{n}>") for n in (0, 1, 124)] == [259, 260, 383]
    assert saved.token_to_id("<extra_id_125>") is None
    assert saved.special_ids == frozenset({0, 1, 2, *range(259, 384)})
    assert saved.encode("x</s>") == [ord("x") + 3, 1]              # no second </s>
    assert saved.encode("a  </s>  b", add_eos=False) == [100, 1, 101]  # </s> swallows spaces
    # decoding adds no bytes: no spaces around sentinels (transformers 4.57 put some there)
    assert saved.decode([259, 100, 260], skip_special_tokens=False) == "<extra_id_0>a<extra_id_1>"
    text = "a <extra_id_0> b<extra_id_1>c<extra_id_2>"
    assert saved.decode(saved.encode(text), skip_special_tokens=False) == text + "</s>"
    assert saved.decode(saved.encode(text)) == "a  bc"
    assert saved.decode([0xFF + 3, 100, 0xE2 + 3]) == "a"            # invalid bytes dropped
    assert saved.decode([100, 384, 10**6]) == "a"                    # past the vocabulary: nothing


def _multibyte_ids(tok, rng: random.Random) -> list[int]:
    chars = "aé€😀日👍🏽\u0301ß\U0010ffff "
    return tok.encode("".join(rng.choice(chars) for _ in range(rng.randrange(1, 30))), add_eos=False)


def test_streaming_never_splits_a_character(saved):
    """After every id the streamed text is the decoding of the ids so far: a character appears
    whole with its last byte, never as a part or a replacement character before."""
    rng = random.Random(5)
    for _ in range(200):
        ids = _multibyte_ids(saved, rng)
        dec = IncrementalDecoder(saved)
        text = ""
        for k, i in enumerate(ids, 1):
            piece = dec.push(i)
            text += piece
            assert text == saved.decode(ids[:k]), ids[:k]
            assert "\ufffd" not in piece
        assert text + dec.flush() == saved.decode(ids)


def test_streaming_random_ids_join_to_decode(saved):
    """Any ids (invalid bytes, specials, sentinels, ids past the vocabulary), both skip modes."""
    rng = random.Random(6)
    pool = list(range(3, 259)) * 3 + [0, 1, 2, 259, 300, 383, 384, 500]
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randrange(0, 25))]
        for skip in (True, False):
            assert "".join(stream(saved, ids, skip)) == saved.decode(ids, skip), ids


def test_picked_by_class_in_either_config(tmp_path):
    """tokenizer_config.json's tokenizer_class, else config.json's (google/byt5-* have no
    tokenizer_config.json and no vocabulary file); the class wins over files beside it."""
    only_config = tmp_path / "c"
    only_config.mkdir()
    (only_config / "config.json").write_text(json.dumps({"model_type": "t5", "vocab_size": 384,
                                                         "tokenizer_class": "ByT5Tokenizer"}))
    assert has_tokenizer(only_config)
    tok = load_tokenizer(only_config)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 384
    assert not has_tokenizer(tmp_path)
    shutil.copy(ROOT / "weights" / "tokenizers" / "tiny-t5" / "spiece.model", only_config)
    assert isinstance(load_tokenizer(only_config), ByteTokenizer)


@pytest.mark.parametrize("config, field", [
    ({"extra_ids": 125, "additional_special_tokens": ["<extra_id_0>", "<extra_id_1>"]}, "extra_ids"),
    ({"extra_ids": -1}, "extra_ids"),
    ({"extra_ids": "125"}, "extra_ids"),
    ({"extra_ids": 10**12}, "extra_ids"),
    ({"additional_special_tokens": "<x>"}, "additional_special_tokens"),
    ({"eos_token": 7}, "eos_token"),
    ({"added_tokens_decoder": {"x": {"content": "<a>"}}}, "added_tokens_decoder"),
    ({"added_tokens_decoder": {"300": "<a>"}}, "added_tokens_decoder"),
])
def test_bad_settings_are_one_line_errors(tmp_path, config, field):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer",
                                                                **config}))
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(tmp_path)
    one_line_naming(err, tmp_path / "tokenizer_config.json", field)


def test_sentinels_must_fit_the_model_vocabulary(tmp_path):
    """259 byte ids + extra_ids sentinels larger than config.json's vocab_size: the file and field
    are named (in the file that sets it, or config.json's class default)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "vocab_size": 300,
                                                      "tokenizer_class": "ByT5Tokenizer"}))
    with pytest.raises(TokenizerError, match="extra_ids 125.*vocab_size 300") as err:
        load_tokenizer(tmp_path)
    one_line_naming(err, tmp_path / "config.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer",
                                                                "extra_ids": 41}))
    assert load_tokenizer(tmp_path).vocab_size == 300
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer",
                                                                "extra_ids": 42}))
    with pytest.raises(TokenizerError, match="extra_ids 42") as err:
        load_tokenizer(tmp_path)
    one_line_naming(err, tmp_path / "tokenizer_config.json")


def test_bad_added_tokens_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer"}))
    for content in ('["<a>"]', '{"<a>": "x"}', '{"<a>": -4}'):
        (tmp_path / "added_tokens.json").write_text(content)
        with pytest.raises(TokenizerError) as err:
            load_tokenizer(tmp_path)
        one_line_naming(err, tmp_path / "added_tokens.json")


def _installed_transformers():
    transformers = pytest.importorskip("transformers")
    if transformers_major(transformers) not in (4, 5):
        pytest.skip(f"no results recorded for transformers {transformers.__version__}")
    return transformers


@pytest.mark.parametrize("variant", weights_script("make_byt5_bpe_fixtures").BYT5_VARIANTS)
def test_matches_transformers_live(fixtures, variant, tmp_path):
    """The same folders against the installed transformers (skipped without it): every field
    equal where minfer follows the installed major version; where it follows the other (4.x:
    decoding), transformers gives what the fixtures recorded for its version and minfer what
    they recorded for the other (tokenizer_checks.hold_to_versions)."""
    transformers = _installed_transformers()
    major = transformers_major(transformers)
    module, data = fixtures
    folder = module.build_variant(BYT5, tmp_path / variant, module.BYT5_VARIANTS[variant])
    hf, tok = transformers.AutoTokenizer.from_pretrained(str(folder)), load_tokenizer(folder)
    rows = {m: module.rows_for(data, "byt5", variant, m) for m in (4, 5)}
    decodes = {m: module.decodes_for(data, variant, m) for m in (4, 5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # "This sequence already has </s>"
        for k, text in enumerate(data["byt5"]["texts"]):
            hold_to_versions(module, "byt5", module.minfer_row(tok, text),
                             module.results_row(hf, text), {m: rows[m][k] for m in rows}, major,
                             (variant, text))
        for k, ids in enumerate(data["byt5"]["decode"]):
            theirs = [hf.decode(ids, skip_special_tokens=skip) for skip in (True, False)] \
                if max(ids) < len(hf) else None     # else transformers raises
            mine = None if theirs is None else [tok.decode(ids, skip) for skip in (True, False)]
            hold_to_versions(module, "byt5", {"decode": mine}, {"decode": theirs},
                             {m: {"decode": decodes[m][k]} for m in decodes}, major, (variant, ids))


@pytest.mark.parametrize("variant", ["saved-4.57", "added-tokens", "added-tokens-decoder"])
def test_folder_saved_by_installed_transformers(fixtures, variant, tmp_path):
    """A folder as the installed transformers saves it (5.x: the sentinels in
    `extra_special_tokens`, `additional_special_tokens` null, every token's flags in
    added_tokens_decoder; 4.57 cannot read it) gives what transformers gives for it. Decoding is
    compared where minfer follows the installed version (under 4.57 the saved folder is the
    committed saved-4.57 one, whose decodings test_matches_committed_transformers holds)."""
    transformers = _installed_transformers()
    module, data = fixtures
    src = module.build_variant(BYT5, tmp_path / "src", module.BYT5_VARIANTS[variant])
    transformers.AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(tmp_path / "saved"))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    tok = load_tokenizer(tmp_path / "saved")
    fields = [f for f in ("ids", "plain", "decoded")
              if module.follows("byt5", f) == transformers_major(transformers)]
    assert set(tok.special_ids) == set(hf.all_special_ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for text in data["byt5"]["texts"]:
            mine, theirs = module.minfer_row(tok, text), module.results_row(hf, text)
            assert {f: mine[f] for f in fields} == {f: theirs[f] for f in fields}, text


def test_config_as_transformers_5_saves_it(tmp_path):
    """transformers 5's save of a ByT5 folder (as test_folder_saved_by_installed_transformers
    checks live): the sentinels listed in `extra_special_tokens` only are special tokens, and the
    specials' saved flags hold over ByT5Tokenizer's strip-both-sides default for a plain-string
    eos_token."""
    def entry(content, special, strip=False):
        return {"content": content, "lstrip": strip, "normalized": not special, "rstrip": strip,
                "single_word": False, "special": special}
    decoder = {"0": entry("<pad>", False), "1": entry("</s>", False),
               "2": entry("<unk>", False, True), "259": entry("<extra_id_0>", True),
               "260": entry("<extra_id_1>", True), "261": entry("<lang>", True)}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": decoder, "additional_special_tokens": None, "extra_ids": 0,
        "extra_special_tokens": ["<extra_id_0>", "<extra_id_1>", "<lang>"], "eos_token": "</s>",
        "pad_token": "<pad>", "unk_token": "<unk>", "tokenizer_class": "ByT5Tokenizer"}))
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == 262 and tok.special_ids == frozenset({0, 1, 2, 259, 260, 261})
    assert tok.encode("a </s> b <unk> c", add_eos=False) == [100, 35, 1, 35, 101, 2, 102]
    ids = tok.encode("x<extra_id_0>y <lang>")
    assert tok.decode(ids) == "xy " and tok.decode(ids, False) == "x<extra_id_0>y <lang></s>"


def test_a_byt5_model_folder_loads_with_its_tokenizer(tmp_path):
    """The issue's symptom: a ByT5 folder (config.json naming ByT5Tokenizer, no vocabulary file)
    loaded without a tokenizer, and generate("...") died on `None.encode`. Now it has one."""
    from factories import write_t5

    import minfer
    folder = write_t5(tmp_path / "byt5", vocab_size=384, tokenizer_class="ByT5Tokenizer")
    model = minfer.load(folder)
    assert isinstance(model.tokenizer, ByteTokenizer)
    out = model.generate("Grüße 😀", max_new_tokens=3)
    assert isinstance(out, str)
    assert model.tokenizer.encode("Grüße 😀")[-1] == 1
