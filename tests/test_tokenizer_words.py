"""The Transformer-XL word-level tokenizer (WikiText-103 conventions) in minfer.tokenizers (words.py)."""

from __future__ import annotations

import json
import os
import pickle
import random
from collections import Counter, OrderedDict
from pathlib import Path

import pytest

from minfer.errors import InputError, TokenizerError
from minfer.tokenizers import IncrementalDecoder, WordTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "weights" / "transfo_xl" / "adaptive_div4_bin"

WORDS = ["<eos>", "<unk>", "the", "The", "game", "'s", "1", "000", "5", "50", "3", "2011", "2012",
         "players", "paid", "about", "in", "did", "n't", "'t", "they", "He", "said", "hello",
         "and", "left", "then", "well", "known", "U.S.", "people", "came", "Mr.", "Smith", "don",
         "it", "is", "a", "of", "year", "=", "Valkyria", "Chronicles", "III",
         ",", ".", "(", ")", "$", "%", "@-@", "@,@", "@.@", '"', "[", "]", ":", ";", "!", "?",
         "£", "...", "'", "—"]
GLUE = {"@,@", "@.@", "@-@"}

SENTENCES = [
    "The game's 1,000 players paid $5.50 (about 3.5%) in 2011-2012, didn't they?",
    'He said "hello" and left... then well-known U.S. people came.',
    "Mr. Smith said: [hello]; it's well-known! Don't?",
    " = Valkyria Chronicles III = \n The game is a year of 2011 .\n",
    "unknown zebra words , and 12,345.678 ...",
    "",
    "\n\n",
]


def write_txt(folder: Path, words=WORDS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("".join(w + "\n" for w in words), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(write_txt(tmp_path_factory.mktemp("words")))


def ids_of(tok, *words):
    return [tok.token_to_id(w) for w in words]


def stream(tok, ids, skip=True):
    dec = IncrementalDecoder(tok, skip)
    return [dec.push(i) for i in ids] + [dec.flush()]


# -- the sources ----------------------------------------------------------------------------------
def test_vocab_txt(tok):
    assert isinstance(tok, WordTokenizer)
    assert tok.vocab_size == len(WORDS)
    assert (tok.eos_id, tok.unk_id, tok.pad_id) == (0, 1, None)
    assert tok.special_ids == frozenset() and tok.byte_ids == frozenset()
    assert tok.id_to_token(2) == "the" and tok.token_to_id("game") == 4
    assert tok.id_to_token(len(WORDS)) is None and tok.token_to_id("zebra") is None


def test_vocab_txt_takes_the_first_field(tmp_path):
    (tmp_path / "vocab.txt").write_text("<eos> 100\n<unk>\t7\nword 3\n")
    t = load_tokenizer(tmp_path)
    assert t.encode("word x") == [2, 1, 0]


@pytest.mark.parametrize("form", ["list", "dict", "idx2sym", "sym2idx"])
def test_vocab_json(tmp_path, form):
    data = {"list": WORDS, "dict": {w: i for i, w in enumerate(WORDS)},
            "idx2sym": {"idx2sym": WORDS, "lower_case": True},
            "sym2idx": {"sym2idx": {w: i for i, w in reversed(list(enumerate(WORDS)))}}}[form]
    (tmp_path / "vocab.json").write_text(json.dumps(data))
    t = load_tokenizer(tmp_path)
    assert t.path == tmp_path / "vocab.json" and t.vocab_size == len(WORDS)
    assert [t.id_to_token(i) for i in range(t.vocab_size)] == WORDS
    assert t.encode("The game") == (ids_of(t, "the", "game", "<eos>") if form == "idx2sym"
                                    else ids_of(t, "The", "game", "<eos>"))


def pickled_vocab(**extra) -> dict:
    return {"idx2sym": list(WORDS), "sym2idx": OrderedDict((w, i) for i, w in enumerate(WORDS)),
            "counter": Counter(WORDS), "special": ["<eos>"], "min_freq": 0, "max_size": None,
            "lower_case": False, "delimiter": None, "vocab_file": None, "eos_idx": 0, **extra}


@pytest.mark.parametrize("name", ["vocab.pkl", "vocab.bin"])
def test_pickled_vocab(tmp_path, name):
    (tmp_path / name).write_bytes(pickle.dumps(pickled_vocab(), protocol=2))
    t = load_tokenizer(tmp_path)
    assert isinstance(t, WordTokenizer) and t.path == tmp_path / name
    assert [t.id_to_token(i) for i in range(t.vocab_size)] == WORDS
    assert t.encode("the game") == [2, 4, 0]


def test_lower_case_from_the_pickle_unless_the_config_says(tmp_path):
    (tmp_path / "vocab.pkl").write_bytes(pickle.dumps(pickled_vocab(lower_case=True)))
    assert load_tokenizer(tmp_path).encode("The GAME", add_eos=False) == [2, 4]
    (tmp_path / "tokenizer_config.json").write_text('{"lower_case": false}')
    assert load_tokenizer(tmp_path).encode("The GAME", add_eos=False) == [3, 1]


def test_specials_from_the_pickle_or_config(tmp_path):
    words = ["x", "<s>", "<UNK>", "y"]
    (tmp_path / "vocab.pkl").write_bytes(pickle.dumps({"idx2sym": words, "eos_idx": 1}))
    t = load_tokenizer(tmp_path)
    assert (t.eos_id, t.unk_id) == (1, 2)                # "<UNK>" counts, as in transformers
    assert t.encode("y zz\ny") == [3, 2, 1, 3, 1]
    (tmp_path / "special_tokens_map.json").write_text('{"eos_token": "y", "unk_token": "x"}')
    t = load_tokenizer(tmp_path)
    assert (t.eos_id, t.unk_id) == (3, 0)


def test_no_unk_no_eos(tmp_path):
    write_txt(tmp_path, ["a", "b"])
    t = load_tokenizer(tmp_path)
    assert (t.eos_id, t.unk_id) == (None, None)
    assert t.encode("a b\na") == [0, 1, 0]                   # no <eos>: a line break is a space
    with pytest.raises(InputError, match="'c' is not in the vocabulary .* no <unk>"):
        t.encode("a c")


def test_order_of_preference(tmp_path):
    write_txt(tmp_path, ["from-txt"])
    (tmp_path / "vocab.json").write_text('["from-json"]')
    (tmp_path / "vocab.bin").write_bytes(pickle.dumps({"idx2sym": ["from-bin"]}))
    (tmp_path / "vocab.pkl").write_bytes(pickle.dumps({"idx2sym": ["from-pkl"]}))
    for name in ("vocab.pkl", "vocab.bin", "vocab.json", "vocab.txt"):
        t = load_tokenizer(tmp_path)
        assert t.id_to_token(0) == "from-" + name.split(".")[1]
        (tmp_path / name).unlink()


# -- encode ---------------------------------------------------------------------------------------
def test_encode_words_unknowns_and_eos(tok):
    assert tok.encode("the game") == ids_of(tok, "the", "game", "<eos>")
    assert tok.encode("the  zebra\tgame ", add_eos=False) == ids_of(tok, "the", "<unk>", "game")
    assert tok.encode("") == [0] and tok.encode("", add_eos=False) == []
    # a line break is an <eos>, as every WikiText line ends with one
    assert tok.encode("the\n\ngame") == ids_of(tok, "the", "<eos>", "<eos>", "game", "<eos>")
    # special-token strings are words like any other
    assert tok.encode("<unk> <eos>", add_eos=False) == [1, 0]
    assert tok.encode_batch(["the", "game"]) == [[2, 0], [4, 0]]


def test_wt103_number_convention(tok):
    def words(text):
        return [tok.id_to_token(i) for i in tok.encode(text, add_eos=False)]
    assert words("1,000") == ["1", "@,@", "000"]
    assert words("3.5") == ["3", "@.@", "5"]
    assert words("1,000.50") == ["1", "@,@", "000", "@.@", "50"]
    assert words("2011-2012") == ["2011", "@-@", "2012"]
    assert words("well-known") == ["well", "@-@", "known"]
    assert words("3.") == ["3", "."] and words("-5") == ["<unk>"]
    assert words("1 @,@ 000") == ["1", "@,@", "000"]          # already tokenised: unchanged


def test_punctuation_is_split_off_unknown_words(tok):
    def words(text):
        return [tok.id_to_token(i) for i in tok.encode(text, add_eos=False)]
    assert words("(hello), game's $5.") == ["(", "hello", ")", ",", "game", "'s", "$", "5", "."]
    assert words("U.S. (U.S.), Mr.") == ["U.S.", "(", "U.S.", ")", ",", "Mr."]
    assert words("A.B. left...") == ["<unk>", "left", "..."]    # abbreviation keeps its period
    assert words('"hello"!?') == ['"', "hello", '"', "!", "?"]
    assert words("didn't") == ["<unk>", "'t"]


@pytest.mark.parametrize("text", [
    "The game's 1,000 players paid $5.50 (about 3.5%) in 2011-2012, they?",
    'He said "hello" and left... then well-known U.S. people came.',
    "Mr. Smith said: [hello]; it's well-known!\n\nThe year of 2011 .",
])
def test_text_of_known_words_round_trips(tok, text):
    ids = tok.encode(text)
    assert tok.unk_id not in ids and ids[-1] == tok.eos_id
    # decoding and encoding again gives the same ids (the trailing line break is the <eos>)
    assert tok.encode(tok.decode(ids), add_eos=False) == ids


def test_encode_decode_examples(tok):
    text = "The game's 1,000 players paid $5.50 (about 3.5%) in 2011-2012, didn't they?"
    ids = tok.encode(text)
    assert tok.decode(ids) == text.replace("didn't", "<unk>'t") + "\n"
    assert tok.decode(tok.encode("said: [hello]; it's — well-known!")) == \
        "said: [hello]; it's — well-known!\n"


# -- decode ---------------------------------------------------------------------------------------
def test_decode_rules(tok):
    def text(*words):
        return tok.decode(ids_of(tok, *words))
    assert text("the", "game") == "the game"
    assert text("1", "@,@", "000", "@.@", "5") == "1,000.5"
    assert text("well", "@-@", "known") == "well-known"
    assert text("the", "<eos>", "game", "<eos>") == "the\ngame\n"
    assert text("<eos>", "<eos>", "the") == "\n\nthe"
    assert text("game", ",", "the", ".", "(", "hello", ")", "$", "5", "%", "!") == \
        "game, the. (hello) $5%!"
    assert text("game", "'s", "it", "'t") == "game's it't"
    assert text("[", "the", "]", ":", "a", ";", "a", "?") == "[the]: a; a?"
    assert text('"', "hello", '"') == '" hello "'              # quotes are not paired
    assert text("£", "5", "—", "the") == "£5 — the"
    assert text("<unk>", "the") == "<unk> the"


def test_skip_special_tokens_changes_nothing(tok):
    ids = tok.encode("the zebra game\nthe")
    assert tok.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=False) \
        == "the <unk> game\nthe\n"


def test_decode_ids_past_the_vocabulary_and_bad_ids(tok):
    assert tok.decode([2, len(WORDS), 4]) == "the game"
    with pytest.raises(InputError, match="negative"):
        tok.decode([-1])
    with pytest.raises(InputError, match="integers"):
        tok.decode(["the"])
    with pytest.raises(InputError, match="takes a str"):
        tok.encode(b"the")


def test_decode_is_prefix_stable(tok):
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size + 2) for _ in range(rng.randint(0, 15))]
        full = tok.decode(ids)
        for k in range(len(ids)):
            assert full.startswith(tok.decode(ids[:k])), ids


# -- streaming ------------------------------------------------------------------------------------
def test_streaming_random_ids(tok):
    rng = random.Random(3)
    glue = ids_of(tok, *sorted(GLUE)) + [0]
    for _ in range(300):
        ids = [rng.choice(glue) if rng.random() < 0.3 else rng.randrange(tok.vocab_size + 3)
               for _ in range(rng.randint(0, 30))]
        for skip in (True, False):
            assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip), ids


@pytest.mark.parametrize("text", SENTENCES)
def test_streaming_sentences(tok, text):
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert pieces[-1] == ""                               # nothing held back: words are final


def test_streaming_pieces(tok):
    ids = tok.encode("the game's 1,000 players\nthe")
    assert stream(tok, ids) == ["the", " game", "'s", " 1", ",", "000", " players", "\n", "the",
                                "\n", ""]


# -- bad files ------------------------------------------------------------------------------------
def one_line(err, *needles):
    text = str(err.value)
    assert "\n" not in text
    for needle in needles:
        assert needle in text, text
    assert err.value.__cause__ is None


@pytest.mark.parametrize("name, content, needle", [
    ("vocab.txt", "a\n\nb\n", "line 2 is empty"),
    ("vocab.txt", "a\nb\na\n", "word 'a' appears twice (ids 0 and 2)"),
    ("vocab.txt", "", "the vocabulary is empty"),
    ("vocab.txt", b"\xff\xfe", "not UTF-8"),
    ("vocab.json", "{not json", "not valid JSON"),
    ("vocab.json", "42", "expected a JSON list of words"),
    ("vocab.json", '["a", 3]', "not a list of strings"),
    ("vocab.json", '{"a": 0, "b": 2}', "word 'b' has id 2"),
    ("vocab.json", '{"a": 0, "b": 0}', "has id 0"),
    ("vocab.json", '{"a": "0"}', "not a mapping of strings to integers"),
    ("vocab.json", '{"idx2sym": ["a", "b"], "sym2idx": {"a": 1, "b": 0}}', "disagree on"),
    ("vocab.json", '{"lower_case": true, "idx2sym": null}', "neither idx2sym nor sym2idx"),
    ("vocab.pkl", pickle.dumps({"counter": Counter()}), "neither idx2sym nor sym2idx"),
    ("vocab.pkl", pickle.dumps(["a"]), "holds a list, expected a pickled dict"),
    ("vocab.pkl", b"", "empty file"),
])
def test_bad_vocab_files(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(tmp_path)
    one_line(err, str(path), needle)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("name", ["vocab.pkl", "vocab.bin"])
def test_malicious_vocab_is_refused(tmp_path, name):
    marker = tmp_path / "marker"
    vocab = pickled_vocab(never_split=_Payload(marker))
    (tmp_path / name).write_bytes(pickle.dumps(vocab))
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(tmp_path)
    one_line(err, str(tmp_path / name), "refuses to unpickle global 'posix.system'")
    assert not marker.exists()


# -- the committed vocabulary written by transformers, and transformers itself ------------------
def committed():
    if not (COMMITTED / "vocab.pkl").is_file():
        pytest.skip(f"no committed vocab.pkl at {COMMITTED}")
    return load_tokenizer(COMMITTED)


def test_committed_hf_vocab_pkl():
    t = committed()
    assert isinstance(t, WordTokenizer) and t.path.name == "vocab.pkl"
    words = (COMMITTED / "vocab_words.txt").read_text(encoding="utf-8").splitlines()
    assert [t.id_to_token(i) for i in range(t.vocab_size)] == words
    assert (t.eos_id, t.unk_id) == (words.index("<eos>"), words.index("<unk>"))
    ids = t.encode(" ".join(words[2:40]))
    assert [t.id_to_token(i) for i in ids[:-1]] == words[2:40] and ids[-1] == t.eos_id
    assert "".join(stream(t, ids)) == t.decode(ids)


def transformers_tokenizer(vocab_folder: Path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("sacremoses")
    transformers.logging.set_verbosity_error()
    return transformers.TransfoXLTokenizer(vocab_file=str(vocab_folder / "vocab.txt"))


def test_encode_matches_transformers(tmp_path, tok):
    hf = transformers_tokenizer(write_txt(tmp_path))
    for text in SENTENCES[:4]:
        text = text.replace("\n", " ")               # we read a line break as <eos>; HF does not
        assert tok.encode(text, add_eos=False) == hf.encode(text, add_special_tokens=False), text


def test_decode_matches_transformers(tmp_path, tok):
    """Same text as transformers (Moses detokenizer + detokenize_numbers, stripped), for random
    ids without quotes (Moses pairs them) whose @,@ / @.@ / @-@ sit between two words (HF's
    string replacement needs a space on both sides, so it leaves them alone elsewhere)."""
    hf = transformers_tokenizer(write_txt(tmp_path))
    plain = [i for i, w in enumerate(WORDS) if w not in GLUE and w not in ('"', "'", "<eos>")]
    words = [i for i in plain if WORDS[i][0].isalnum()]
    glue = ids_of(tok, *sorted(GLUE))
    rng = random.Random(5)
    for _ in range(2000):
        ids = []
        for _ in range(rng.randint(1, 12)):
            if ids and ids[-1] in words and rng.random() < 0.2:
                ids += [rng.choice(glue), rng.choice(words)]
            else:
                ids.append(rng.choice(plain))
        want = hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert tok.decode(ids) == want, [WORDS[i] for i in ids]
