"""Transformer-XL's word-level WikiText-103 vocabulary (`WordTokenizer`): `vocab.pkl` or
`vocab.bin` (pickles, read by `io.torch_pickle.load_pickled_vocab`'s restricted unpickler), else
`vocab.json`, else `vocab.txt`. Its rules are in the `WordTokenizer` docstring.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Any

from ..errors import InputError, TokenizerError
from .base import Tokenizer, first_line, read_json_text

_GLUED = {"@,@": ",", "@.@": ".", "@-@": "-"}          # WikiText-103's intra-word separators
_NUMBER_SEP = re.compile(r"(?<=\d)[,.](?=\d)")         # 1,000 -> 1 @,@ 000 (HF tokenize_numbers)
_HYPHEN = re.compile(r"(?<=[^\W_])-(?=[^\W_])")         # well-known -> well @-@ known (Moses)
_APOSTROPHE = re.compile(r"(?<=[^\W\d_])'(?=[^\W\d_])")  # don't -> don 't (Moses, English)
_LEADING = frozenset("\"'([{\u00bf\u00a1")                # shed from an unknown word's start
_TRAILING = frozenset(",.!?;:\"')]}%")                   # ... and from its end
_CLOSING = re.compile(r"[,.?!:;\\%}\])]+")              # no space before (Moses "left shift")
_CONTRACTION = re.compile(r"'[^\W\d_]")                 # 's 're 'll...: no space before
_OPENING = re.compile(r"[(\[{\u00bf\u00a1]+")            # no space after (Moses "right shift")


def _is_currency(token: str) -> bool:
    return bool(token) and all(unicodedata.category(c) == "Sc" for c in token)


class WordTokenizer(Tokenizer):
    """Transformer-XL's word-level vocabulary, with the WikiText-103 conventions.

    The vocabulary: `vocab.pkl` / `vocab.bin` (the dict `transformers`' TransfoXLTokenizer
    pickles: `idx2sym` list and/or `sym2idx` mapping, optional `lower_case`, `unk_idx`,
    `eos_idx`), `vocab.json` (a list of symbols, a {symbol: id} object, or an object with
    idx2sym / sym2idx), or `vocab.txt` (one symbol per line, the first field of the line; id =
    line number). `<eos>` (id 0 in wt103) ends every WikiText line; `<unk>` is an ordinary word of
    the corpus (rare words were replaced by it) and is also what unknown words become.

    encode (`transformers` runs sacremoses' Moses tokenizer; we do not depend on it and apply
    this subset, which leaves already tokenized WikiText unchanged):
    - lower-cased if tokenizer_config.json's (else the pickle's) `lower_case` is true;
    - each line break is an `<eos>`; `add_eos` appends one more at the end;
    - words are split on whitespace; a word the vocabulary knows is kept whole;
    - an unknown word sheds leading ( [ { " ' ¿ ¡ and currency symbols, and trailing
      , . ! ? ; : " ' ) ] } % and "...", as separate tokens (but keeps a known word whole,
      and the final period of an abbreviation with periods inside, like "U.S.");
      inside what is left, "," / "." between digits become "@,@" / "@.@"
      (1,000.5 -> 1 @,@ 000 @.@ 5), "-" between letters or digits "@-@", and "x'y" becomes
      "x 'y" (don't -> don 't); the pieces the vocabulary lacks become `<unk>`.

    decode (`transformers` runs the Moses detokenizer, then @,@ / @.@ -> , / .): tokens joined by
    spaces, except that
    - `<eos>` is a line break "\n", with no space on either side;
    - "@,@", "@.@", "@-@" become ",", ".", "-" glued to both neighbours;
    - no space before closing punctuation (a token made of , . ? ! : ; % ) ] }) or an English
      contraction ('s, 're, 'll...); no space after an opening bracket or a currency symbol.
    Every rule looks only at a token and the one before it, so decode(ids[:k]) is always a
    prefix of decode(ids) and IncrementalDecoder streams it unchanged. Not done (they need the
    whole text or the next token): Moses' pairing of quotes, stripping the text's ends.
    Nothing is a special token here: `skip_special_tokens` changes nothing (HF would drop
    `<eos>` and `<unk>`; a streamed continuation should show its line breaks and its unknowns).
    """

    def __init__(self, path: Path, settings: dict[str, Any]):
        self.path = path
        symbols, extra = _read_word_vocab(path)
        self._symbols = symbols
        self._ids = {s: i for i, s in enumerate(symbols)}
        self.vocab_size = len(symbols)
        self.special_ids = frozenset()
        self.byte_ids = frozenset()
        lower = settings.get("lower_case", extra.get("lower_case", False))
        self.lower_case = bool(lower) if isinstance(lower, (bool, int)) else False

        def pickled(key: str) -> int | None:
            i = extra.get(key)
            return i if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(symbols) \
                else None

        unk = self._ids.get("<unk>", self._ids.get("<UNK>", pickled("unk_idx")))
        self._resolve_specials(settings, {"eos_token": self._ids.get("<eos>", pickled("eos_idx")),
                                          "pad_token": None, "unk_token": unk})

    def _words(self, word: str) -> list[str]:
        """The tokens of one whitespace-separated word (see the class docstring)."""
        if word in self._ids:
            return [word]
        i, j = 0, len(word)
        while i < j and (word[i] in _LEADING or _is_currency(word[i])):
            i += 1
        while j > i and word[j - 1] in _TRAILING:
            j -= 1
        core, trail = word[i:j], word[j:]
        for k in range(len(trail), 0, -1):        # keep a known "U.S." out of "(U.S.),"
            if core + trail[:k] in self._ids:
                core, trail = core + trail[:k], trail[k:]
                break
        else:                                     # Moses: "U.S." keeps its final period
            if trail[:1] == "." and "." in core and any(c.isalpha() for c in core):
                core, trail = core + ".", trail[1:]
        pieces = list(word[:i])
        if core in self._ids:
            pieces.append(core)
        elif core:
            core = _NUMBER_SEP.sub(r" @\g<0>@ ", core)
            core = _HYPHEN.sub(" @-@ ", core)
            pieces.extend(_APOSTROPHE.sub(" '", core).split())
        pieces.extend(re.findall(r"\.\.\.|.", trail, re.S))
        return pieces

    def _encode(self, text: str) -> list[int]:
        if self.lower_case:
            text = text.lower()
        lines = text.split("\n") if self.eos_id is not None else [text]
        ids: list[int] = []
        for k, line in enumerate(lines):
            if k:
                ids.append(self.eos_id)
            for word in line.split():
                for piece in self._words(word):
                    i = self._ids.get(piece, self.unk_id)
                    if i is None:
                        raise InputError(f"word {piece!r} is not in the vocabulary of {self.path}, "
                                         "which has no <unk>")
                    ids.append(i)
        return ids

    def _decode(self, ids: list[int]) -> str:
        parts: list[str] = []
        prev: str | None = None
        for i in ids:
            tok = self._symbols[i]
            eos = i == self.eos_id
            text = "\n" if eos else _GLUED.get(tok, tok)
            if prev is not None and not (
                    eos or prev == "\n" or tok in _GLUED or prev in _GLUED
                    or _CLOSING.fullmatch(tok) or _CONTRACTION.match(tok)
                    or _OPENING.fullmatch(prev) or _is_currency(prev)):
                parts.append(" ")
            parts.append(text)
            prev = "\n" if eos else tok
        return "".join(parts)

    def token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._symbols[token_id] if 0 <= token_id < self.vocab_size else None


def _read_word_vocab(path: Path) -> tuple[list[str], dict[str, Any]]:
    """The symbols (index = id) of a word vocabulary file, and the pickle's other entries."""
    if path.suffix in (".pkl", ".bin"):
        from ..io.torch_pickle import load_pickled_vocab
        data = load_pickled_vocab(path)
        return _symbols_of(path, data.get("idx2sym"), data.get("sym2idx")), data
    if path.suffix == ".json":
        data, _ = read_json_text(path)
        if isinstance(data, list):
            return _symbols_of(path, data, None), {}
        if isinstance(data, dict) and ("idx2sym" in data or "sym2idx" in data):
            return _symbols_of(path, data.get("idx2sym"), data.get("sym2idx")), data
        if isinstance(data, dict):
            return _symbols_of(path, None, data), {}
        raise TokenizerError(f"{path}: expected a JSON list of words or a {{word: id}} object")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 text ({first_line(e)})") from None
    symbols = []
    for n, line in enumerate(lines, 1):
        fields = line.split()
        if not fields:
            raise TokenizerError(f"{path}: line {n} is empty (expected one word per line)")
        symbols.append(fields[0])
    return _symbols_of(path, symbols, None), {}


def _symbols_of(path: Path, idx2sym: Any, sym2idx: Any) -> list[str]:
    """idx2sym, checked against sym2idx when both are given (or built from sym2idx)."""
    if idx2sym is None and sym2idx is None:
        raise TokenizerError(f"{path}: no word list (neither idx2sym nor sym2idx)")
    if idx2sym is not None:
        if not isinstance(idx2sym, list) or not all(isinstance(s, str) for s in idx2sym):
            raise TokenizerError(f"{path}: the word list is not a list of strings")
    if sym2idx is not None:
        if (not isinstance(sym2idx, dict)
                or not all(isinstance(s, str) and isinstance(i, int) and not isinstance(i, bool)
                           for s, i in sym2idx.items())):
            raise TokenizerError(f"{path}: the word ids are not a mapping of strings to integers")
        if idx2sym is None:
            idx2sym = [None] * len(sym2idx)
            for s, i in sym2idx.items():
                if not 0 <= i < len(idx2sym) or idx2sym[i] is not None:
                    raise TokenizerError(f"{path}: word {s!r} has id {i}: ids must number the "
                                         f"{len(sym2idx)} words 0..{len(sym2idx) - 1} once each")
                idx2sym[i] = s
    if not idx2sym:
        raise TokenizerError(f"{path}: the vocabulary is empty")
    seen: dict[str, int] = {}
    for i, s in enumerate(idx2sym):
        if s in seen:
            raise TokenizerError(f"{path}: word {s!r} appears twice (ids {seen[s]} and {i})")
        seen[s] = i
    if sym2idx is not None and sym2idx != seen:
        bad = next(s for s in set(seen) | set(sym2idx) if seen.get(s) != sym2idx.get(s))
        raise TokenizerError(f"{path}: idx2sym and sym2idx disagree on {bad!r} "
                             f"({seen.get(bad)} vs {sym2idx.get(bad)})")
    return idx2sym
