"""RoBERTa's byte-level BPE from vocab.json + merges.txt (minfer.tokenizers.bpe), as CodeT5 and
CodeT5+ ship it, against transformers 4.57's RobertaTokenizerFast and RobertaTokenizer (ids and
decoded texts committed by weights/make_byt5_bpe_fixtures.py, with 5.x's where they differ: minfer
keeps 4.57's, what CodeT5 was trained with, see its V5_DIFFERENCES); folders transformers saves;
which source reads a vocab.json (select.py); bad vocab.json / merges.txt files."""

from __future__ import annotations

import importlib.util
import json
import pickle
import shutil
from pathlib import Path

import pytest

from minfer.errors import TokenizerError
from minfer.tokenizers import BpeTokenizer, JsonTokenizer, WordTokenizer, load_tokenizer
from tokenizer_checks import (hold_to_versions, one_line_naming, stream, transformers_major,
                              weights_script)

ROOT = Path(__file__).resolve().parents[1]
BPE = ROOT / "weights" / "tokenizers" / "roberta-bpe"
EXPECTED = ROOT / "weights" / "tokenizers" / "byt5-bpe-expected.json"
CODE = "def add(a, b):\n    return a + b"


@pytest.fixture(scope="module")
def fixtures():
    return weights_script("make_byt5_bpe_fixtures"), json.loads(EXPECTED.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def codet5():
    return load_tokenizer(BPE)


@pytest.fixture(scope="module")
def resaved(tmp_path_factory):
    """The codet5 folder as transformers 4.57 saves it (AutoTokenizer.from_pretrained(...)
    .save_pretrained: a tokenizer.json beside the files, configs in the new format). Without
    transformers 4.x, rebuilt (64 KB not committed): the tokenizer.json is the library tokenizer
    minfer builds, which is what 4.57's `tok.backend_tokenizer` is, with RoBERTa's
    post-processor; the config has the added_tokens_decoder. (transformers 5 saves no vocab.json
    and merges.txt, and reads the codet5 folder otherwise: test_folder_saved_by_installed_
    transformers.)"""
    out = tmp_path_factory.mktemp("resaved")
    if importlib.util.find_spec("transformers") is not None:
        import transformers
        if transformers_major(transformers) == 4:
            transformers.AutoTokenizer.from_pretrained(str(BPE)).save_pretrained(str(out))
            return out
    from tokenizers import processors
    tok = load_tokenizer(BPE)
    backend = tok._tok                  # a tokenizer of this fixture's own: changed, then dropped
    backend.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 1))
    backend.save(str(out / "tokenizer.json"))
    for name in ("vocab.json", "merges.txt", "config.json"):
        shutil.copy(BPE / name, out)
    decoder = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                        "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
               for i, t in backend.get_added_tokens_decoder().items()}
    config = {**weights_script("make_byt5_bpe_fixtures").BPE_MAP,
              "tokenizer_class": "RobertaTokenizer", "added_tokens_decoder": decoder}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_fixtures_are_current_and_small(fixtures):
    module, data = fixtures
    bpe = data["bpe"]
    assert bpe["variants"] == module.BPE_VARIANTS and bpe["texts"] == module.BPE_TEXTS
    assert set(bpe["expected"]["variants"]) == set(module.BPE_VARIANTS)
    v5 = data[module.V5_SECTION]
    assert v5["transformers"].startswith("5.") and set(v5["bpe"]) <= set(module.BPE_VARIANTS)
    assert sum(p.stat().st_size for p in BPE.iterdir()) < 24 * 1024


@pytest.mark.parametrize("variant", weights_script("make_byt5_bpe_fixtures").BPE_VARIANTS)
def test_matches_committed_transformers(fixtures, variant, tmp_path, resaved):
    """ids (`<s> ... </s>` with add_eos, the text's own without), decoded texts: what transformers
    4.57's AutoTokenizer (RobertaTokenizerFast) gives (each field as the version minfer follows
    for it gives it: 4.57 throughout); the slow RobertaTokenizer gives the same ids except where
    the fixture script lists why not (EXPECTED_SLOW_DIFFERENCES)."""
    module, data = fixtures
    want = data["bpe"]["expected"]["variants"][variant]
    rows = {m: module.rows_for(data, "bpe", variant, m) for m in (4, 5)}
    spec = module.BPE_VARIANTS[variant]
    tok = load_tokenizer(module.build_variant(BPE, tmp_path / variant, spec, resaved))
    assert isinstance(tok, JsonTokenizer if (tmp_path / variant / "tokenizer.json").is_file()
                      else BpeTokenizer)
    assert tok.vocab_size == want["len"]
    slow_differs = False
    for k, text in enumerate(data["bpe"]["texts"]):
        row = {f: rows[module.follows("bpe", f)][k][f] for f in ("ids", "plain", "decoded", "slow")}
        ids = tok.encode(text)
        assert ids == row["ids"], text
        slow_differs |= ids != row["slow"]
        assert tok.encode(text, add_eos=False) == row["plain"], text
        assert tok.encode_batch([text, text]) == [row["ids"]] * 2
        assert [tok.decode(ids, skip) for skip in (True, False)] == row["decoded"], text
        assert "".join(stream(tok, ids)) == tok.decode(ids)
    assert slow_differs == (variant in module.EXPECTED_SLOW_DIFFERENCES)


def test_code_is_never_unknown_words(codet5):
    """The bug this source fixes: vocab.json was read as a Transformer-XL word list, so `def add(a,
    b)` became <unk> ids. Now: byte-level BPE, <s> first, </s> last, nothing unknown, and the
    text comes back."""
    ids = codet5.encode(CODE)
    assert ids[0] == codet5.token_to_id("<s>") == 1 and ids[-1] == codet5.eos_id == 2
    assert codet5.unk_id == 3 and codet5.unk_id not in ids
    assert len(ids) < len(CODE)                        # merged, not one id per character
    assert codet5.decode(ids) == CODE
    assert codet5.token_to_id("<extra_id_0>") == codet5.vocab_size - 1
    sentinel = codet5.token_to_id("<extra_id_0>")
    assert codet5.decode([sentinel] + ids, False).startswith("<extra_id_0><s>def")


def test_resaved_tokenizer_json_gets_the_same_ids(codet5, resaved):
    """The same vocabulary as a tokenizer.json with RoBERTa's post-processor: hf_json.py puts its
    `<s>` first too."""
    tok = load_tokenizer(resaved)
    assert isinstance(tok, JsonTokenizer) and tok.prefix_ids == (1,)
    for text in (CODE, "x = a <mask> b<s>", ""):
        assert tok.encode(text) == codet5.encode(text)


# -- which source reads a vocab.json -------------------------------------------------------------
def _folder(tmp_path: Path, model_type: str | None, merges: bool, klass: str | None = None,
            files=("vocab.json",)) -> Path:
    for name in files:
        shutil.copy(BPE / name, tmp_path / name)
    if merges:
        shutil.copy(BPE / "merges.txt", tmp_path)
    if model_type:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    if klass:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": klass}))
    return tmp_path


@pytest.mark.parametrize("model_type, klass", [("t5", None), (None, None), ("t5", "RobertaTokenizer"),
                                               ("transfo-xl", None), ("t5", "RobertaTokenizerFast")])
def test_vocab_json_with_merges_is_bpe(tmp_path, model_type, klass):
    assert isinstance(load_tokenizer(_folder(tmp_path, model_type, True, klass)), BpeTokenizer)


@pytest.mark.parametrize("model_type, klass", [("t5", None), ("umt5", None), ("longt5", None),
                                               (None, "RobertaTokenizer"), ("t5", "T5Tokenizer")])
def test_vocab_json_without_merges_outside_transformer_xl_is_an_error(tmp_path, model_type, klass):
    folder = _folder(tmp_path, model_type, False, klass)
    with pytest.raises(TokenizerError, match="merges.txt") as err:
        load_tokenizer(folder)
    one_line_naming(err, folder / "vocab.json")


@pytest.mark.parametrize("model_type", [None, "transfo-xl"])
def test_word_vocabularies_stay_transformer_xl(tmp_path, model_type):
    """A bare vocab.json, or a Transformer-XL folder's, is still the word vocabulary."""
    (tmp_path / "vocab.json").write_text(json.dumps(["<eos>", "<unk>", "def", "add"]))
    if model_type:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, WordTokenizer) and tok.encode("def add x", add_eos=False) == [2, 3, 1]


def test_word_vocabulary_in_a_t5_folder_is_an_error(tmp_path):
    (tmp_path / "vocab.txt").write_text("<eos>\n<unk>\ndef\n")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(TokenizerError, match="only Transformer-XL") as err:
        load_tokenizer(tmp_path)
    one_line_naming(err, tmp_path / "vocab.txt")


def test_unsupported_bpe_class_is_an_error(tmp_path):
    folder = _folder(tmp_path, "t5", True, "GPT2Tokenizer")
    with pytest.raises(TokenizerError, match="GPT2Tokenizer") as err:
        load_tokenizer(folder)
    one_line_naming(err, folder / "vocab.json")


def test_files_are_fetched_and_copied():
    """The hub fetches, and `convert` copies, the files this source reads."""
    from minfer import convert, hub
    for name in ("merges.txt", "added_tokens.json", "vocab.json"):
        assert name in hub.OTHER_FILES and name in convert.COPY_FILES


# -- bad files ------------------------------------------------------------------------------------
@pytest.mark.parametrize("content, why", [
    ('["a", "b"]', "JSON object"),
    ("{}", "JSON object"),
    ('{"a": 0, "b": "1"}', "not an integer"),
    ('{"a": 0, "b": 1.0}', "not an integer"),
    ('{"a": 0, "b": true}', "not an integer"),
    ('{"a": 0, "b": 7}', "ids must number"),
    ('{"a": 0, "b": -1}', "ids must number"),
    ('{"a": 0, "b": 99999999999999999999}', "ids must number"),
    ('{"a": 1, "b": 1}', "share id 1"),
    ("{not json", "not valid JSON"),
])
def test_bad_vocab_json(tmp_path, content, why):
    _folder(tmp_path, "t5", True)
    (tmp_path / "vocab.json").write_text(content)
    with pytest.raises(TokenizerError, match=why) as err:
        load_tokenizer(tmp_path)
    one_line_naming(err, tmp_path / "vocab.json")


@pytest.mark.parametrize("lines, why", [
    (["Ġ a b"], "line 2 is not two tokens"),
    (["d e", "Ġ"], "line 3 is not two tokens"),
    (["d e", ""], "line 3 is not two tokens"),
    (["zz qq"], "vocab.json lacks"),
    (["d e"] * 2 + ["z q"], "line 4 .* needs .zq., which vocab.json lacks"),
])
def test_bad_merges_txt(tmp_path, lines, why):
    _folder(tmp_path, "t5", True)
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match=why) as err:
        load_tokenizer(tmp_path)
    one_line_naming(err, tmp_path / "merges.txt")


def test_merges_read_as_roberta_reads_them(tmp_path):
    """The first line is a header, what follows the last line break is not a merge (a file
    without a final line break loses its last merge, in transformers too)."""
    _folder(tmp_path, "t5", True)
    text = (BPE / "merges.txt").read_text(encoding="utf-8")
    full = load_tokenizer(tmp_path)
    (tmp_path / "merges.txt").write_text(text.rstrip("\n"), encoding="utf-8")
    cut = load_tokenizer(tmp_path)
    last = text.rstrip("\n").rsplit("\n", 1)[1].replace(" ", "").replace("\u0120", " ")
    assert full.encode(last, add_eos=False) != cut.encode(last, add_eos=False)
    (tmp_path / "merges.txt").write_bytes(b"#version: 0.2\n\xff\xfe\n")
    with pytest.raises(TokenizerError, match="not UTF-8") as err:
        load_tokenizer(tmp_path)
    one_line_naming(err, tmp_path / "merges.txt")


def test_bad_settings(tmp_path):
    _folder(tmp_path, "t5", True, "RobertaTokenizer")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "RobertaTokenizer",
                                                                "add_prefix_space": "yes"}))
    with pytest.raises(TokenizerError, match="add_prefix_space") as err:
        load_tokenizer(tmp_path)
    one_line_naming(err, tmp_path / "tokenizer_config.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "RobertaTokenizer"}))
    (tmp_path / "added_tokens.json").write_text('{"<x>": "five"}')
    with pytest.raises(TokenizerError, match="<x>") as err:
        load_tokenizer(tmp_path)
    one_line_naming(err, tmp_path / "added_tokens.json")


def test_nothing_runs_from_a_vocab_file(tmp_path):
    """A pickle named vocab.json is not JSON: an error, never an unpickling."""
    _folder(tmp_path, "t5", True)
    (tmp_path / "vocab.json").write_bytes(pickle.dumps({"a": 0}))
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(tmp_path)
    one_line_naming(err, tmp_path / "vocab.json")


def _installed_transformers():
    transformers = pytest.importorskip("transformers")
    if transformers_major(transformers) not in (4, 5):
        pytest.skip(f"no results recorded for transformers {transformers.__version__}")
    return transformers


@pytest.mark.parametrize("variant", weights_script("make_byt5_bpe_fixtures").BPE_VARIANTS)
def test_matches_transformers_live(fixtures, variant, tmp_path, resaved):
    """The same folders against the installed transformers, fast and slow (skipped without it):
    under 4.x every field equal; under 5.x, which reads CodeT5's folder otherwise (`<mask>` keeps
    the space before it, the sentinels are not special), transformers gives what the fixtures
    recorded for 5.x and minfer 4.57's (tokenizer_checks.hold_to_versions). 5.x's
    RobertaTokenizer is the fast tokenizer, so there the slow ids are the fast ones."""
    transformers = _installed_transformers()
    major = transformers_major(transformers)
    module, data = fixtures
    folder = module.build_variant(BPE, tmp_path / variant, module.BPE_VARIANTS[variant], resaved)
    fast = transformers.AutoTokenizer.from_pretrained(str(folder))
    slow = transformers.RobertaTokenizer.from_pretrained(str(folder))
    tok = load_tokenizer(folder)
    rows = {m: module.rows_for(data, "bpe", variant, m) for m in (4, 5)}
    for k, text in enumerate(data["bpe"]["texts"]):
        theirs = module.results_row(fast, text)
        hold_to_versions(module, "bpe", module.minfer_row(tok, text), theirs,
                         {m: rows[m][k] for m in rows}, major, (variant, text))
        if major >= 5 or variant not in module.EXPECTED_SLOW_DIFFERENCES:
            assert slow(text).input_ids == theirs["ids"], text


def test_folder_saved_by_installed_transformers(fixtures, tmp_path):
    """The codet5 folder saved by the installed transformers (4.57: the saved-4.57 variants; 5.x:
    tokenizer.json and tokenizer_config.json only, holding 5.x's reading of the folder, `<mask>`
    without lstrip and the sentinels not special) is a tokenizer.json as written: minfer gives
    what transformers gives for it, every field."""
    transformers = _installed_transformers()
    module, data = fixtures
    transformers.AutoTokenizer.from_pretrained(str(BPE)).save_pretrained(str(tmp_path))
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, JsonTokenizer)
    for text in data["bpe"]["texts"]:
        assert module.minfer_row(tok, text) == module.results_row(fast, text), text
