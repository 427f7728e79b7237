"""ByT5's byte tokenizer: no vocabulary file, picked by the tokenizer class (`ByT5Tokenizer`) that
tokenizer_config.json, or config.json where a repository has no tokenizer_config.json, names.

transformers' ByT5Tokenizer (a Python tokenizer: there is no fast one), checked against 4.57 and
5.x by tests/test_tokenizer_byt5.py's fixtures (weights/make_byt5_bpe_fixtures.py), which give the
same ids and differ in decoding only (below):
- a byte b of the text's UTF-8 is id b + 3; `<pad>` 0, `</s>` 1, `<unk>` 2;
- the `extra_ids` sentinels (default 125) are added special tokens. Where no ids are saved for
  them, transformers 4.57 numbers them upwards after the bytes: `<extra_id_0>` 259 ..
  `<extra_id_124>` 383 (its docstring, and the original ByT5 preprocessing, count them down from
  the top; its code does not, and it is the oracle); a saved `added_tokens_decoder` or
  added_tokens.json keeps its ids. An `additional_special_tokens` list with sentinels in it must
  hold `extra_ids` of them (transformers refuses the folder otherwise, and so do we), and the
  sentinels must fit config.json's `vocab_size` after the 259 byte ids;
- added tokens in the text are split out first (longest first, leftmost first, as transformers'
  Trie); `<pad>`, `</s>`, `<unk>` given as plain strings swallow the whitespace on both sides
  (ByT5Tokenizer makes them lstrip/rstrip), flags saved with a token are kept;
  `split_special_tokens: true` turns the splitting off;
- `encode(add_eos=True)` appends `</s>` unless the ids already end with it (ByT5Tokenizer's
  `_add_eos_if_not_present`);
- decoding joins the bytes and the texts of the tokens kept (a byte whose character is an added
  token's text gives that text, as in transformers) and reads them as UTF-8, dropping invalid
  bytes (`errors="ignore"`), as transformers 5 does: with special tokens kept, the ids of "a",
  <extra_id_0>, "b" decode to "a<extra_id_0>b", the text they were encoded from. transformers
  4.57 put sentinels and other added tokens apart between spaces ("a <extra_id_0> b", its legacy
  `spaces_between_special_tokens`, dropped in 5.x); the ids are bytes, and decoding adds none.
  Ids past the vocabulary decode to nothing (transformers raises).
Streaming (`_holds`) waits while the ids end inside a UTF-8 sequence that can still complete, so
no streamed piece is cut inside a character.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import TokenizerError
from ..io.limits import is_int
from .added import (MAX_EXTRA_IDS, NAMED_SPECIALS, legacy_added, legacy_specials,
                    special_names)
from .base import Tokenizer, read_json_text, read_object, token_name

CLASS = "ByT5Tokenizer"
OFFSET = 3                       # ids 0..2 are <pad>, </s>, <unk>; byte b is id b + 3
BYTE_END = OFFSET + 256          # the first id after the bytes
DEFAULT_EXTRA_IDS = 125
_DEFAULTS = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}


@dataclass
class _Token:
    """An added token as transformers' slow tokenizers keep it (`normalized` plays no part: ByT5
    has no normaliser)."""
    content: str
    lstrip: bool = False
    rstrip: bool = False
    single_word: bool = False
    special: bool = False


def _name(value: Any) -> str | None:
    """A token's text: a _Token's, or as token_name reads a config's."""
    return value.content if isinstance(value, _Token) else token_name(value)


def _token(value: Any, strip: bool = False, special: bool = False) -> _Token | None:
    """A token as the config files write it: a string (`strip`: ByT5Tokenizer makes its pad, eos
    and unk strings swallow whitespace on both sides) or a {"content": ..., flags} object; or a
    saved _Token (copied)."""
    if isinstance(value, _Token):
        return replace(value, special=value.special or special)
    if isinstance(value, str) and value:
        return _Token(value, lstrip=strip, rstrip=strip, special=special)
    if isinstance(value, dict) and isinstance(value.get("content"), str) and value["content"]:
        flags = {k: value[k] for k in ("lstrip", "rstrip", "single_word", "special")
                 if isinstance(value.get(k), bool)}
        token = _Token(value["content"], **flags)
        token.special = token.special or special
        return token
    return None


class ByteTokenizer(Tokenizer):
    """ByT5's UTF-8 bytes (path: the folder; there is no vocabulary file)."""

    def __init__(self, folder: Path, settings: dict[str, Any]):
        # `settings` (the fast tokenizers' reading of the configs) is not used: a slow tokenizer
        # reads them its own way (_init_settings)
        self.path = folder
        config = folder / "tokenizer_config.json"
        where = config if config.is_file() else folder / "config.json"
        names, saved = _init_settings(folder)
        sentinels = _sentinels(names, where)
        # ByT5Tokenizer.__init__: its three specials first, then what the config saved, then
        # (PreTrainedTokenizer.__init__) every special token not yet added, after the vocabulary
        added: dict[int, _Token] = {}
        by_text = {t.content: t for t in saved.values()}
        for i, key in enumerate(("pad_token", "eos_token", "unk_token")):
            value = names.get(key, _DEFAULTS[key])
            # from_pretrained hands the class the saved token of that text, flags and all, in
            # place of the config's (4.57 and 5.x alike): a plain string then strips nothing
            # where the folder saved the token without lstrip/rstrip (transformers 5 saves so)
            if key in names and _name(value) in by_text:
                value = by_text[_name(value)]
            token = _token(value, strip=True)
            if token is None:
                raise TokenizerError(f"{where}: {key} must be a token, got {names.get(key)!r:.40}")
            added[i] = names[key] = token
        added.update(saved)
        listed = sentinels + _extra_specials(names, where)
        specials = _add_specials(added, names, listed)

        self._added = added
        self._ids = {t.content: i for i, t in added.items()}
        self.vocab_size = max(BYTE_END, max(added) + 1)
        _check_fits(folder, where, len({_name(v) for v in listed if "<extra_id_" in _name(v)}),
                    names.get("extra_ids", DEFAULT_EXTRA_IDS))
        self.special_ids = frozenset(i for i in map(self.token_to_id, specials) if i is not None)
        self.byte_ids = frozenset()
        by_length = sorted(self._ids, key=len, reverse=True)
        self._split = None if names.get("split_special_tokens") is True else \
            re.compile("|".join(map(re.escape, by_length)))
        self._resolve_specials({k: names[k].content for k in _DEFAULTS},
                               {"eos_token": 1, "pad_token": 0, "unk_token": 2})
        self._added_texts = tuple(by_length)
        self._rstrip_texts = tuple(t.content for t in added.values() if t.rstrip)
        self._byte_tokens = any(len(t) == 1 and ord(t) < 256 for t in self._ids)
        if any(t.single_word for t in added.values()):
            self._cut_points = Tokenizer._cut_points  # a single_word token looks at its neighbours

    # Cuts (window.py): between two characters that are not whitespace (bytes are independent,
    # and no token strips whitespace there), or at a space after one, as the other sources.
    _cut_points = re.compile(r"(?<=\S)(?=\S| )")

    def _encode(self, text: str) -> list[int]:
        if self._split is None:
            return self._bytes(text)
        ids: list[int] = []
        for piece in self._pieces(text):
            i = self._ids.get(piece)
            ids += [i] if i is not None else self._bytes(piece)
        return ids

    def _bytes(self, text: str) -> list[int]:
        """The ids of a text's UTF-8 bytes (an added token whose text is one byte's character,
        chr(b), stands for byte b, as in transformers)."""
        data = text.encode("utf-8")
        if self._byte_tokens:
            return [self._ids.get(chr(b), b + OFFSET) for b in data]
        return (np.frombuffer(data, np.uint8).astype(np.int64) + OFFSET).tolist()

    def _pieces(self, text: str) -> list[str]:
        """PreTrainedTokenizer.tokenize's pieces: the text cut around its added tokens (no empty
        pieces), then each token's neighbours stripped of whitespace, or glued to it, as its
        flags say; a piece that is an added token's text is that token."""
        pieces: list[str] = []
        at = 0
        for m in self._split.finditer(text):
            pieces += [text[at:m.start()], m.group()]
            at = m.end()
        pieces.append(text[at:])
        pieces = [p for p in pieces if p]
        for i, piece in enumerate(pieces):
            if piece not in self._ids:
                continue
            token = self._added[self._ids[piece]]
            left = pieces[i - 1] if i > 0 else None
            right = pieces[i + 1] if i + 1 < len(pieces) else None
            if token.rstrip and right:
                pieces[i + 1] = right.lstrip()
            if token.lstrip and left:
                pieces[i - 1] = left.rstrip()
            if token.single_word and left and left[-1] != " ":
                pieces[i - 1] += piece
                pieces[i] = ""
            elif token.single_word and right and right[0] != " ":
                pieces[i + 1] = piece + pieces[i + 1]
                pieces[i] = ""
        return [p for p in pieces if p]

    def _decode(self, ids: list[int]) -> str:
        data = bytearray()
        for i in ids:
            token = self._added.get(i)
            if token is not None:
                data += token.content.encode("utf-8")
            elif OFFSET <= i < BYTE_END:
                byte = i - OFFSET
                if self._byte_tokens and chr(byte) in self._ids:   # the added token's text
                    data += chr(byte).encode("utf-8")
                else:
                    data.append(byte)
            # else: an id between added ones that names nothing
        return data.decode("utf-8", "ignore")

    def _holds(self, ids: list[int]) -> bool:
        """Whether the ids end inside a UTF-8 sequence that can still be completed."""
        tail = bytearray()
        for i in ids[-3:]:
            if OFFSET <= i < BYTE_END and i not in self._added:
                tail.append(i - OFFSET)
            else:
                tail.clear()
        decoder = codecs.getincrementaldecoder("utf-8")("ignore")
        decoder.decode(bytes(tail), final=False)
        return bool(decoder.getstate()[0])

    def _suffix(self, ids: list[int]) -> list[int]:
        return [] if ids and ids[-1] == self.eos_id else [self.eos_id]

    def token_to_id(self, token: str) -> int | None:
        if token in self._ids:
            return self._ids[token]
        return ord(token) + OFFSET if len(token) == 1 and ord(token) < 256 else None

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._added:
            return self._added[token_id].content
        return chr(token_id - OFFSET) if OFFSET <= token_id < BYTE_END else None


def _init_settings(folder: Path) -> tuple[dict[str, Any], dict[int, _Token]]:
    """The settings transformers' from_pretrained hands ByT5Tokenizer (tokenizer_config.json; in
    folders without `added_tokens_decoder`, special_tokens_map.json over it and added_tokens.json
    as saved ids), and the saved added tokens by id."""
    path = folder / "tokenizer_config.json"
    names = read_object(path)
    decoder = names.get("added_tokens_decoder")
    saved: dict[int, _Token] = {}
    if isinstance(decoder, dict):
        for key, value in decoder.items():
            token = _token(value) if isinstance(value, dict) else None
            if not key.isdigit() or token is None:
                raise TokenizerError(f"{path}: added_tokens_decoder entry {key!r:.40} is not an id "
                                     "with a {\"content\": ...} token")
            saved[int(key)] = token
        return names, saved
    names.update(legacy_specials(folder, names))
    for index, (content, special) in legacy_added(folder, special_names(names)).items():
        saved[index] = _Token(content, special=special)
    return names, saved


def _sentinels(names: dict[str, Any], where: Path) -> list[Any]:
    """additional_special_tokens as ByT5Tokenizer.__init__ completes it: `extra_ids` sentinels
    when there is no list; a list that holds sentinels must hold extra_ids of them."""
    extra = names.get("extra_ids", DEFAULT_EXTRA_IDS)
    if not is_int(extra) or not 0 <= extra <= MAX_EXTRA_IDS:
        raise TokenizerError(f"{where}: extra_ids must be an integer from 0 to {MAX_EXTRA_IDS}, "
                             f"got {extra!r:.40}")
    listed = names.get("additional_special_tokens")
    if listed is None:
        return [f"<extra_id_{i}>" for i in range(extra)]
    if not isinstance(listed, list) or any(_name(v) is None for v in listed):
        raise TokenizerError(f"{where}: additional_special_tokens must be a list of tokens")
    count = len({_name(v) for v in listed if "extra_id" in _name(v)})
    if extra > 0 and listed and count != extra:
        raise TokenizerError(f"{where}: extra_ids is {extra} but additional_special_tokens lists "
                             f"{count} <extra_id_N> tokens (transformers refuses this too)")
    return listed


def _extra_specials(names: dict[str, Any], where: Path) -> list[Any]:
    """tokenizer_config.json's `extra_special_tokens`, special tokens too: transformers 5 saves
    its additional special tokens (the sentinels) there, a list, with `additional_special_tokens`
    null and `extra_ids` 0; 4.57 wrote a {name: token} object there (model-specific specials)."""
    value = names.get("extra_special_tokens")
    listed = list(value.values()) if isinstance(value, dict) else value
    if listed is None:
        return []
    if not isinstance(listed, list) or any(_name(v) is None for v in listed):
        raise TokenizerError(f"{where}: extra_special_tokens must be a list of tokens")
    return listed


def _add_specials(added: dict[int, _Token], names: dict[str, Any], sentinels: list[Any]) -> set[str]:
    """Add the special tokens not added yet, as PreTrainedTokenizer.__init__ (`_add_tokens` of
    `all_special_tokens_extended`): an unknown one takes the next id after the vocabulary (the
    bytes and the added tokens), a known one its id; a token object (not a plain string) also
    replaces the flags of the token it names. Returns every special token's text."""
    ordered: list[Any] = []
    seen: set[str] = set()
    for value in [names.get(k) for k in NAMED_SPECIALS] + [sentinels]:
        group = value if isinstance(value, list) else [value] if value else []
        group = [v for v in group if _name(v) is not None and _name(v) not in seen]
        seen.update(_name(v) for v in group)      # after the group: its repeats stay, as in HF
        ordered += group
    vocab = {added[i].content if i in added else chr(i - OFFSET): i for i in range(BYTE_END)}
    vocab.update({t.content: i for i, t in sorted(added.items())})
    ids = {t.content: i for i, t in added.items()}
    next_id = len(vocab)
    for value in ordered:
        if isinstance(value, str):
            if value in ids:
                continue
            token = _Token(value, special=True)
        else:
            token = value if isinstance(value, _Token) else _token(value)
            token.special = True
        if token.content in vocab:
            index = vocab[token.content]
        else:
            index = vocab[token.content] = next_id
            next_id += 1
        added[index] = token
        ids[token.content] = index
    return {_name(v) for v in ordered}


def _check_fits(folder: Path, where: Path, sentinels: int, extra: Any) -> None:
    """The sentinels must fit the model's vocabulary (config.json's vocab_size) after the bytes."""
    path = folder / "config.json"
    try:
        size = read_json_text(path)[0].get("vocab_size") if path.is_file() else None
    except (TokenizerError, AttributeError):
        return                         # config.json is the model reader's to judge
    if is_int(size) and BYTE_END + sentinels > size:
        raise TokenizerError(f"{where}: extra_ids {extra}: the {BYTE_END} byte ids and "
                             f"{sentinels} sentinels do not fit config.json's vocab_size {size}")
