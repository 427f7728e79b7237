"""Text <-> token ids behind one small interface, and streaming detokenisation.

`load_tokenizer(folder)` reads the first of these that the folder holds:

1. `tokenizer.json`, through the Hugging Face `tokenizers` library (what `transformers`' fast
   tokenizers run);
2. `spiece.model`, through `sentencepiece`, with the T5 conventions of `transformers.T5Tokenizer`:
   `</s>` appended, and `extra_ids` sentinels `<extra_id_N>` (not in the SentencePiece model) given
   the ids `sp_vocab + extra_ids - 1 - N`, so `<extra_id_0>` is the last id (32099 for T5);
3. Transformer-XL's word-level WikiText-103 vocabulary (`WordTokenizer`): `vocab.pkl` or
   `vocab.bin` (pickles, read by `io.torch_pickle.load_pickled_vocab`'s restricted unpickler), else
   `vocab.json`, else `vocab.txt`. Its rules are in the `WordTokenizer` docstring.

A tokenizer.json is run as `transformers`' plain `AutoTokenizer.from_pretrained(folder)(text)` runs
it (checked against transformers 4.57 with tests/test_tokenizer.py's fixtures; see
weights/make_tokenizer_fixtures.py):
- the padding and truncation a tokenizer.json may have been saved with are switched off: a prompt
  is never padded, and never cut (nor by tokenizer_config.json's `model_max_length`, which
  transformers only warns about);
- tokens that tokenizer_config.json declares but tokenizer.json lacks are added the way
  transformers adds them (`_config_tokens`): the `added_tokens_decoder` entries, then the special
  tokens it names (`eos_token`..., `additional_special_tokens`; special_tokens_map.json's only where
  the config has no `added_tokens_decoder`, as transformers reads it), for a T5 tokenizer class
  with its `<extra_id_N>` sentinels filled in the way T5Tokenizer does;
- `split_special_tokens: true` in tokenizer_config.json: special-token strings in the text are
  tokenized as text.
(spiece.model, read when there is no tokenizer.json, gets none of this: it has no saved padding,
and the tokens a config adds to it are not added.)
Not followed: tokenizer_config.json's `add_prefix_space` (transformers 4.57 then rebuilds the
tokenizer from spiece.model with protobuf, 5.x ignores it) and a tokenizer.json without a
post-processor (4.57's fast tokenizer then appends nothing; we append `</s>`, as 4.57's slow
T5Tokenizer and 5.x's T5Tokenizer do). transformers 5 builds T5-class tokenizers from scratch out of the file's vocabulary
(no byte fallback, its own pre-tokenizer): for files other than the canonical T5 one we follow
the file as written, as transformers 4.57, `tokenizers` and `sentencepiece` do (tests/test_tokenizer.py,
`test_tiny_matches_transformers`, says what 5.x does instead).

For T5, both sources give the same ids for the same text (checked on T5's vocabulary: the tests compare
them with each other and with `transformers`) and the same text for the same ids. Decoding
follows the `tokenizers` library, i.e. `transformers`' fast tokenizers with
`clean_up_tokenization_spaces=False` (the legacy clean-up that turns "a ." into "a." and that T5's
tokenizer_config.json switches on is not applied: it edits the model's output and cannot be
streamed). In detail:
- SentencePiece marks a word start with "▁"; it decodes to a space, except in the first token,
  which loses it (so decode([ids of "▁The", "▁house"]) is "The house");
- `skip_special_tokens=True` drops every special token: `<pad>`, `</s>`, `<unk>` and the sentinels
  (T5 declares them `additional_special_tokens`), before the "▁" rule applies;
- consecutive byte-fallback pieces `<0xNN>` decode together as UTF-8, and a run that is not valid
  UTF-8 becomes one U+FFFD per byte;
- ids at or past `vocab_size` decode to nothing (T5's embedding has 28 rows more than its
  vocabulary).

`IncrementalDecoder` turns ids into text pieces as they are generated, the way text-generation
servers do (prefix/read offsets over a small window of ids), with the guarantee that the pieces
join to exactly `decode(all ids)`.
"""

from __future__ import annotations

import operator
import os
import re
import unicodedata
from pathlib import Path
from typing import Any, Iterable

from .errors import InputError, TokenizerError
from .io.limits import read_json_text

SPECIAL_KEYS = ("eos_token", "pad_token", "unk_token")
# What transformers' tokenizers call their special tokens, in the order it adds missing ones.
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")
_LISTED_SPECIALS = ("additional_special_tokens", "extra_special_tokens")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
_T5_CLASSES = ("T5Tokenizer", "T5TokenizerFast", "MT5Tokenizer", "MT5TokenizerFast")
_T5_MODEL_TYPES = ("t5", "mt5", "umt5")
DEFAULT_EXTRA_IDS = 100                     # T5's sentinels, if tokenizer_config.json is silent
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_METASPACE = "\u2581"                       # "▁", SentencePiece's word-start mark


class _MissingLibrary(Exception):
    """A source file is present but the library that reads it is not installed."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def _read_json_text(path: Path) -> tuple[Any, str]:
    """A JSON file, parsed, and its text; size, nesting and number lengths bounded first (a
    deeply nested or huge tokenizer.json is a one-line TokenizerError, not a RecursionError)."""
    return read_json_text(path, TokenizerError)


def _read_object(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} if there is no such file."""
    if not path.is_file():
        return {}
    data, _ = _read_json_text(path)
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: not a JSON object")
    return data


def _read_settings(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json overlaid with special_tokens_map.json (both optional)."""
    settings: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        settings.update(_read_object(folder / name))
    return settings


def _config_tokens(folder: Path, added_token: type) -> tuple[list[Any], list[Any]]:
    """What transformers adds to a tokenizer.json when it loads `folder`, as `added_token`
    (`tokenizers.AddedToken`) objects: (the `added_tokens_decoder` entries of
    tokenizer_config.json, by id; the special tokens the config names, in transformers' order).

    transformers (4.57 `PreTrainedTokenizerFast.__init__`, 5.x `TokenizersBackend.__init__`, same
    rule) passes to the library's `add_tokens` the decoder entries whose content or flags differ
    from all of the file's added tokens (for a content already there the library keeps its id),
    then each named special token whose content is neither an added token nor a decoder entry,
    flagged special. The
    special tokens come from tokenizer_config.json, overlaid with special_tokens_map.json only where
    the config has no `added_tokens_decoder` (transformers' legacy path reads the map only then).
    """
    config = _read_object(folder / "tokenizer_config.json")
    decoder = config.get("added_tokens_decoder")
    names = dict(config)
    if not isinstance(decoder, dict):
        decoder = {}
        for key, value in _read_object(folder / "special_tokens_map.json").items():
            if isinstance(value, dict):
                value = {**value, "special": True}
            elif isinstance(value, list):
                value = [{**v, "special": True} if isinstance(v, dict) else v for v in value]
            names[key] = value
    if _is_t5_class(folder, config):
        names["additional_special_tokens"] = _t5_sentinels(names)

    def make(value: Any, special: bool) -> Any:
        if isinstance(value, str):
            return added_token(value, special=True) if special else added_token(value)
        if isinstance(value, dict) and isinstance(value.get("content"), str) and value["content"]:
            fields = {k: value[k] for k in _ADDED_TOKEN_FIELDS[1:] if isinstance(value.get(k), bool)}
            fields["content"] = value["content"]
            token = added_token(**fields)
            if special:
                token.special = True
            return token
        return None

    specials: list[Any] = [names.get(key) for key in _NAMED_SPECIALS]
    for key in _LISTED_SPECIALS:
        listed = names.get(key)
        specials += list(listed.values()) if isinstance(listed, dict) else \
            list(listed) if isinstance(listed, list) else []
    special_names = {_token_name(v) for v in specials} - {None}

    out: list[Any] = []
    for key in sorted((k for k in decoder if k.lstrip("-").isdigit()), key=int):
        token = make(decoder[key], False)
        if token is not None:
            token.special = bool(token.special or token.content in special_names)
            out.append(token)
    return out, [t for t in (make(v, True) for v in specials) if t is not None]


def _token_state(token: Any) -> tuple:
    """An AddedToken's content and flags (what transformers compares, through its repr)."""
    return tuple(getattr(token, k) for k in _ADDED_TOKEN_FIELDS)


def _is_t5_class(folder: Path, config: dict[str, Any]) -> bool:
    """Whether AutoTokenizer loads the folder with a T5 tokenizer class: the config's
    `tokenizer_class`, else (as AutoTokenizer) config.json's `model_type`."""
    name = config.get("tokenizer_class")
    if isinstance(name, str):
        return name in _T5_CLASSES
    try:
        model_type = read_json_text(folder / "config.json", TokenizerError)[0].get("model_type")
    except (TokenizerError, AttributeError):
        return False
    return model_type in _T5_MODEL_TYPES


def _t5_sentinels(names: dict[str, Any]) -> list[Any]:
    """additional_special_tokens as T5Tokenizer completes it: `extra_ids` sentinels
    <extra_id_0>.. when the list is absent, or appended when it holds none."""
    listed = names.get("additional_special_tokens")
    extra = names.get("extra_ids", DEFAULT_EXTRA_IDS)
    extra = extra if isinstance(extra, int) and not isinstance(extra, bool) and extra >= 0 else 0
    sentinels = [f"<extra_id_{i}>" for i in range(extra)]
    if not isinstance(listed, list):
        return sentinels
    if not any("<extra_id_" in str(_token_name(v)) for v in listed):
        return listed + sentinels
    return listed


def _token_name(value: Any) -> str | None:
    """A special token as configs write it: "</s>" or {"content": "</s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _bytes_text(run: bytes) -> str:
    """A run of byte-fallback pieces as the `tokenizers` ByteFallback decoder renders it."""
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


def check_text(text: Any, what: str) -> None:
    """Text the tokenizers can take: a str that is valid Unicode. A lone surrogate ("\\ud800",
    what a bad decode with errors="surrogateescape" leaves) is a str but no text: the libraries
    fail on it with a TypeError or a UnicodeEncodeError, so it is named here instead."""
    if not isinstance(text, str):
        raise InputError(f"{what} takes a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{what}: character {e.start} ({text[e.start]!r}) is a lone surrogate, "
                         "not valid Unicode text") from None


class Tokenizer:
    """The interface every source implements.

    vocab_size: ids 0..vocab_size-1 are meaningful; eos_id / pad_id / unk_id: None when the
    vocabulary has no such token; special_ids: what `skip_special_tokens=True` drops;
    byte_ids: byte-fallback pieces (text ending in one is not final until the run ends);
    path: the file read.
    """

    vocab_size: int
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    special_ids: frozenset[int]
    byte_ids: frozenset[int]
    path: Path

    # -- what a source provides -------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        """Ids of `text`, no `</s>` added; special-token strings in the text become their ids."""
        raise NotImplementedError

    def _decode(self, ids: list[int]) -> str:
        """Text of ids already checked to lie in range and already filtered of skipped ones."""
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str | None:
        raise NotImplementedError

    # -- the shared interface ---------------------------------------------------------------
    def encode(self, text: str, add_eos: bool = True) -> list[int]:
        """Token ids of `text`, with `</s>` appended when add_eos (as T5's post-processor does)."""
        check_text(text, "encode()")
        ids = self._encode(text)
        if add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Iterable[str], add_eos: bool = True) -> list[list[int]]:
        texts = list(texts)
        for k, t in enumerate(texts):  # checked first, so an error names the text's index
            check_text(t, f"encode_batch(): text {k}")
        return [self.encode(t, add_eos) for t in texts]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (ints or NumPy integers); see the module docstring for the rules."""
        checked = map(self._check_id, ids)
        return self._decode([i for i in checked if self._shown(i, skip_special_tokens)])

    def _check_id(self, token_id: Any) -> int:
        try:  # a bool is an index (True is 1) but never a token id (NumPy's bool is no index)
            i = operator.index(token_id)
            if isinstance(token_id, bool):
                raise TypeError
        except TypeError:
            raise InputError(f"token ids must be integers, got {token_id!r:.60}") from None
        if i < 0:
            raise InputError(f"token id {i} is negative")
        return i

    def _shown(self, token_id: int, skip_special_tokens: bool) -> bool:
        """Whether decode() renders this (checked) id at all."""
        if token_id >= self.vocab_size:
            return False
        return not (skip_special_tokens and token_id in self.special_ids)

    def _resolve_specials(self, settings: dict[str, Any], defaults: dict[str, int | None]) -> None:
        """eos/pad/unk ids: the token named by the config files if the vocabulary has it, else the
        source's own default."""
        for key in SPECIAL_KEYS:
            name = _token_name(settings.get(key))
            found = self.token_to_id(name) if name is not None else None
            found = found if found is not None else defaults[key]
            setattr(self, key.replace("_token", "_id"), found)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({str(self.path)!r}, vocab_size={self.vocab_size}, "
                f"eos_id={self.eos_id}, pad_id={self.pad_id}, unk_id={self.unk_id})")


class JsonTokenizer(Tokenizer):
    """A `tokenizer.json` run by the `tokenizers` library."""

    def __init__(self, path: Path, settings: dict[str, Any]):
        try:
            from tokenizers import AddedToken, Tokenizer as RustTokenizer
        except ImportError:
            raise _MissingLibrary(f"{path}: reading it needs the 'tokenizers' package "
                                  "(pip install tokenizers)") from None
        self.path = path
        data, text = _read_json_text(path)
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            raise TokenizerError(f"{path}: not a tokenizer.json (no 'model' object)")
        try:
            self._tok = RustTokenizer.from_str(text)
        except Exception as e:  # the library raises a bare Exception for every kind of problem
            raise TokenizerError(f"{path}: not a usable tokenizer.json "
                                 f"({_first_line(e)})") from None

        # A prompt is never padded or cut: transformers' plain `tok(text)` switches off the padding
        # and truncation a tokenizer.json may have been saved with (fine-tuned repositories often
        # are), whatever `model_max_length` says.
        self._tok.no_padding()
        self._tok.no_truncation()
        self._add_config_tokens(AddedToken)
        if settings.get("split_special_tokens") is True:       # transformers' tok.split_special_tokens
            self._tok.encode_special_tokens = True

        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()                       # {id: AddedToken}
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        vocab = self._tok.get_vocab(with_added_tokens=False)
        self.byte_ids = frozenset(i for piece, i in vocab.items() if _BYTE_PIECE.fullmatch(piece))
        unk = data["model"].get("unk_id")
        self._resolve_specials(settings, {
            "eos_token": self.token_to_id("</s>"), "pad_token": self.token_to_id("<pad>"),
            "unk_token": unk if isinstance(unk, int) else self.token_to_id("<unk>")})

    def _add_config_tokens(self, added_token: type) -> None:
        """Add what tokenizer_config.json declares and tokenizer.json lacks (see `_config_tokens`)."""
        decoder_tokens, special_tokens = _config_tokens(self.path.parent, added_token)
        present = list(self._tok.get_added_tokens_decoder().values())
        states = {_token_state(t) for t in present}
        todo = [t for t in decoder_tokens if _token_state(t) not in states]
        known = {t.content for t in present} | {t.content for t in decoder_tokens}
        for token in special_tokens:
            if token.content not in known:
                known.add(token.content)
                todo.append(token)
        # transformers hands them all to `add_tokens` with their `special` flag set, which recent
        # `tokenizers` honour (0.22, 0.23 checked); 0.19's `add_tokens` makes every token it adds
        # non-special, so special ones go through `add_special_tokens` (in order: the same ids).
        while todo:
            special = todo[0].special
            run = 1
            while run < len(todo) and todo[run].special == special:
                run += 1
            (self._tok.add_special_tokens if special else self._tok.add_tokens)(todo[:run])
            todo = todo[run:]

    def _encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Iterable[str], add_eos: bool = True) -> list[list[int]]:
        texts = list(texts)
        for k, t in enumerate(texts):
            check_text(t, f"encode_batch(): text {k}")
        out = [list(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        if add_eos and self.eos_id is not None:
            for ids in out:
                ids.append(self.eos_id)
        return out

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None


class SentencePieceTokenizer(Tokenizer):
    """A `spiece.model` with T5's conventions (sentinels after the SentencePiece vocabulary)."""

    def __init__(self, path: Path, settings: dict[str, Any]):
        try:
            import sentencepiece
        except ImportError:
            raise _MissingLibrary(f"{path}: reading it needs the 'sentencepiece' package "
                                  "(pip install sentencepiece)") from None
        self.path = path
        try:
            proto = path.read_bytes()
        except OSError as e:
            raise TokenizerError(f"{path}: cannot read: {e.strerror or e}") from None
        sp = sentencepiece.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(proto)
        except Exception as e:  # RuntimeError / OSError with the C++ parser's message
            raise TokenizerError(f"{path}: not a SentencePiece model ({_first_line(e)})") from None
        n = sp.get_piece_size()
        if n == 0:
            raise TokenizerError(f"{path}: not a SentencePiece model (no pieces)")

        extra = settings.get("extra_ids", DEFAULT_EXTRA_IDS)
        if isinstance(extra, bool) or not isinstance(extra, int) or extra < 0:
            raise TokenizerError(f"{path.parent / 'tokenizer_config.json'}: extra_ids must be a "
                                 f"non-negative integer, got {extra!r}")
        self._sp = sp
        self.vocab_size = n + extra
        # <extra_id_0> is the last id, <extra_id_{extra-1}> the first after the SentencePiece pieces
        sentinels = [f"<extra_id_{extra - 1 - k}>" for k in range(extra)]
        self._pieces: list[str] = sp.id_to_piece(list(range(n))) + sentinels
        self._sentinel_ids = {self._pieces[i]: i for i in range(n, n + extra)}
        specials = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
        self.special_ids = frozenset(specials) | frozenset(range(n, n + extra))
        self.byte_ids = frozenset(i for i in range(n) if sp.is_byte(i))
        # Special-token strings in the text are split out first and map to their ids, as in
        # transformers (longest first, so that no token is cut by a shorter one).
        strings = sorted({self._pieces[i] for i in self.special_ids}, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, strings)) + ")") if strings else None
        self._resolve_specials(settings, {
            "eos_token": sp.eos_id() if sp.eos_id() >= 0 else None,
            "pad_token": sp.pad_id() if sp.pad_id() >= 0 else None,
            "unk_token": sp.unk_id() if sp.unk_id() >= 0 else None})

    def _encode(self, text: str) -> list[int]:
        if self._split is None:
            return list(self._sp.encode(text))
        ids: list[int] = []
        for k, part in enumerate(self._split.split(text)):
            if k % 2:                                  # a special-token string
                ids.append(self.token_to_id(part))
            elif part:
                ids.extend(self._sp.encode(part))
        return ids

    def _decode(self, ids: list[int]) -> str:
        # The `tokenizers` decoder chain ByteFallback + Metaspace, so both sources agree: byte
        # runs join as UTF-8; "▁" becomes a space except in the first token, which drops it.
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            if i in self.byte_ids:
                run.append(int(self._pieces[i][3:5], 16))
                continue
            if run:
                parts.append(_bytes_text(bytes(run)))
                run.clear()
            parts.append(self._pieces[i])
        if run:
            parts.append(_bytes_text(bytes(run)))
        if not parts:
            return ""
        return parts[0].replace(_METASPACE, "") + "".join(parts[1:]).replace(_METASPACE, " ")

    def token_to_id(self, token: str) -> int | None:
        if token in self._sentinel_ids:
            return self._sentinel_ids[token]
        i = self._sp.piece_to_id(token)
        # SentencePiece answers unk_id for pieces it does not know
        return i if i < self._sp.get_piece_size() and self._pieces[i] == token else None

    def id_to_token(self, token_id: int) -> str | None:
        return self._pieces[token_id] if 0 <= token_id < self.vocab_size else None


# -- Transformer-XL's word-level vocabulary ----------------------------------------------------
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
        from .io.torch_pickle import load_pickled_vocab
        data = load_pickled_vocab(path)
        return _symbols_of(path, data.get("idx2sym"), data.get("sym2idx")), data
    if path.suffix == ".json":
        data, _ = _read_json_text(path)
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
        raise TokenizerError(f"{path}: not UTF-8 text ({_first_line(e)})") from None
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


# What load_tokenizer looks for, in order of preference. Of Transformer-XL's files, the pickles
# come first: they are what `transformers` reads, so their ids are right by definition.
_SOURCES: tuple[tuple[str, type[Tokenizer]], ...] = (
    ("tokenizer.json", JsonTokenizer),
    ("spiece.model", SentencePieceTokenizer),
    ("vocab.pkl", WordTokenizer),
    ("vocab.bin", WordTokenizer),
    ("vocab.json", WordTokenizer),
    ("vocab.txt", WordTokenizer),
)


def load_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a model folder (see the module docstring for which file wins)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TokenizerError(f"{folder}: no such tokenizer folder")
    settings = _read_settings(folder)
    missing: list[str] = []
    for filename, source in _SOURCES:
        path = folder / filename
        if path.is_file():
            try:
                return source(path, settings)
            except _MissingLibrary as e:   # try the next file, report if none works
                missing.append(str(e))
    if missing:
        raise TokenizerError(missing[0])
    raise TokenizerError(f"{folder}: no tokenizer file (looked for "
                         f"{', '.join(name for name, _ in _SOURCES)})")


class IncrementalDecoder:
    """Streaming detokenisation: feed ids one at a time, get text pieces whose concatenation equals
    decode(all ids).

    Decoding single tokens does not work: a lone "▁house" decodes to "house" (first-token rule),
    and a character spelled by several byte-fallback pieces is U+FFFD until its last byte. So we
    keep a window of ids starting at `prefix` (the first id of the previously emitted stretch) and
    decode it with and without the ids after `read` (those not yet emitted); the difference is the
    new text. It is emitted when stable, i.e. it does not end in U+FFFD and the last id is not a
    byte piece (a byte run renders as all-or-nothing UTF-8, so it is final only once it ends). Then
    the window moves on, so each push costs O(window), not O(length). Ids that decode() drops
    (skipped special tokens, ids past the vocabulary) never enter the window.

    One decoder per sequence; flush() at the end returns what is held back and resets it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []   # the window: all ids from `prefix` on
        self._read = 0              # window index of the first id whose text is not emitted yet

    def push(self, token_id: int) -> str:
        """Add one id; return the new stable text (often "", e.g. inside a multi-byte character)."""
        tok = self.tokenizer
        i = tok._check_id(token_id)
        if not tok._shown(i, self.skip_special_tokens):
            return ""
        self._ids.append(i)
        if i in tok.byte_ids:
            return ""
        done = tok._decode(self._ids[:self._read])
        text = tok._decode(self._ids)
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        return text[len(done):]

    def flush(self) -> str:
        """The text still held back; the decoder is then ready for a new sequence."""
        tok = self.tokenizer
        rest = ""
        if self._ids:
            rest = tok._decode(self._ids)[len(tok._decode(self._ids[:self._read])):]
        self._ids, self._read = [], 0
        return rest
