"""The interface every tokenizer source implements, and what the sources share: the text check,
the config files' reading, and the special tokens a prompt gets around its ids.

A source provides `_encode` (text -> ids, no special tokens added), `_decode` (checked ids ->
text), `token_to_id` / `id_to_token`, and says which ids are special, which are byte pieces,
what goes before and after a text's ids (`prefix_ids`, `_suffix`), where a text may be cut
without changing its ids (`_is_cut`, for `encode_window`) and when a streamed text is not final
yet (`_holds`, for `IncrementalDecoder`).
"""

from __future__ import annotations

import operator
import re
from pathlib import Path
from typing import Any, Iterable

from ..errors import InputError, TokenizerError
from ..io.limits import is_regular_file, read_json_text as _read_json
from . import window

SPECIAL_KEYS = ("eos_token", "pad_token", "unk_token")
# Texts whose cuts every source that works word by word keeps (Tokenizer._probe_cuts): runs of
# spaces, other whitespace before and after a space, punctuation, digits, accents, a line break.
_PROBES = ("a b", "a  b c", "ab. cd,\te f", "1 2  3", "x \ty\t z", "\u00e9t\u00e9 \u00fc", "a \nb\n c",
           "A B", "a\u3000 b")
_SPACE_RUN = re.compile(r"\s*")
METASPACE = "\u2581"                       # "▁", SentencePiece's word-start mark
# A lone UTF-16 half: a str that holds one is no text (see check_text).
_SURROGATE = re.compile("[\ud800-\udfff]")


class MissingLibrary(Exception):
    """A source file is present but the library that reads it is not installed."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def read_json_text(path: Path) -> tuple[Any, str]:
    """A JSON file, parsed, and its text; size, nesting and number lengths bounded first (a
    deeply nested or huge tokenizer.json is a one-line TokenizerError, not a RecursionError)."""
    return _read_json(path, TokenizerError)


def read_object(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} if there is no such file."""
    if not is_regular_file(path, TokenizerError):   # (a folder or a looping link: named)
        return {}
    data, _ = read_json_text(path)
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: not a JSON object")
    return data


def read_settings(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json overlaid with special_tokens_map.json (both optional)."""
    settings: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        settings.update(read_object(folder / name))
    return settings


def read_lines(path: Path, max_bytes: int) -> str:
    """A UTF-8 text file (vocab.txt, merges.txt), its size checked before it is read."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(raw) > max_bytes:
        raise TokenizerError(f"{path}: larger than the {max_bytes}-byte limit for a vocabulary file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 text ({first_line(e)})") from None


def token_name(value: Any) -> str | None:
    """A special token as configs write it: "</s>" or {"content": "</s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def check_text(text: Any, what: str) -> None:
    """Text the tokenizers can take: a str that is valid Unicode. A lone surrogate ("\\ud800",
    what a bad decode with errors="surrogateescape" leaves) is a str but no text: the libraries
    fail on it with a TypeError or a UnicodeEncodeError, so it is named here instead. No copy of
    the text: nothing for ASCII, else a regex scan (~3 ms per MB; encode_window relies on it)."""
    if not isinstance(text, str):
        raise InputError(f"{what} takes a str, got {type(text).__name__}")
    bad = None if text.isascii() else _SURROGATE.search(text)   # isascii: a flag, no scan
    if bad:
        raise InputError(f"{what}: character {bad.start()} ({bad.group()!r}) is a lone surrogate, "
                         "not valid Unicode text")


class Tokenizer:
    """The interface every source implements.

    vocab_size: ids 0..vocab_size-1 are meaningful; eos_id / pad_id / unk_id: None when the
    vocabulary has no such token; special_ids: what `skip_special_tokens=True` drops;
    byte_ids: byte-fallback pieces (text ending in one is not final until the run ends);
    prefix_ids: what `encode(add_eos=True)` puts before a text (RoBERTa's `<s>`; none for T5);
    path: the file read (for a ByT5 tokenizer, which has none, the folder).
    """

    vocab_size: int
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    special_ids: frozenset[int]
    byte_ids: frozenset[int]
    path: Path
    prefix_ids: tuple[int, ...] = ()
    # Added tokens, whose matching can reach across a cut (see `_is_cut`): their texts, and
    # those of the ones that swallow the whitespace after them (`rstrip`).
    _added_texts: tuple[str, ...] = ()
    _rstrip_texts: tuple[str, ...] = ()
    # Where encode_window may cut a text (window.py says why these keep the ids): the positions
    # this pattern finds that `_is_cut` accepts; None: the source cannot be cut. A space after a
    # character that is not whitespace: every source splits words there, and the space then
    # starts the next word (SentencePiece's "▁", byte-level BPE's "Ġ"). A "▁" in the text is
    # whitespace to SentencePiece (a space is one once normalised), so it counts as whitespace.
    _cut_points: re.Pattern | None = re.compile(f"(?<=[^\\s{METASPACE}]) ")

    # -- what a source provides -------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        """Ids of `text`, no special tokens added; special-token strings in the text become their
        ids."""
        raise NotImplementedError

    def _decode(self, ids: list[int]) -> str:
        """Text of ids already checked to lie in range and already filtered of skipped ones."""
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str | None:
        raise NotImplementedError

    def _suffix(self, ids: list[int]) -> list[int]:
        """What `encode(add_eos=True)` appends to a text's ids: `</s>` (T5's post-processor)."""
        return [self.eos_id] if self.eos_id is not None else []

    def _is_cut(self, text: str, k: int) -> bool:
        """Whether a cut at k, one of the `_cut_points`, keeps the text's ids (window.py). Not
        where the whitespace at k runs into a "▁" (the piece after the cut would start with it,
        and Metaspace then puts back no space that a normaliser stripped); and away from added
        tokens: none starts at k or right after its whitespace (a token matched after
        normalisation leaves the space before it to the text on its left, and one that starts
        with whitespace may match any of it), none that swallows the whitespace after it ends at
        k, none spans k."""
        after = _SPACE_RUN.match(text, k).end()
        return not (text.startswith(METASPACE, after)
                    or any(text.startswith(t, k) or text.startswith(t.lstrip(), after)
                           for t in self._added_texts)
                    or any(text.endswith(t, 0, k) for t in self._rstrip_texts)
                    or self._inside_added(text, k))

    def _inside_added(self, text: str, k: int) -> bool:
        """Whether an occurrence of an added token's text spans position k (starts before k and
        ends after it: `find` looks only where such an occurrence would lie)."""
        return any(text.find(t, max(0, k - len(t) + 1), k + len(t) - 1) >= 0
                   for t in self._added_texts)

    def _probe_cuts(self) -> None:
        """Switch cutting off (`_cut_points` None) if a cut changes the ids of a probe text: a file
        whose normaliser or pre-tokenizer does not work word by word (window.py)."""
        for text in _PROBES:
            ids = self._encode(text)
            for m in self._cut_points.finditer(text):
                k = m.start()
                if self._is_cut(text, k) and self._encode(text[:k]) + self._encode(text[k:]) != ids:
                    self._cut_points = None
                    return

    def _holds(self, ids: list[int]) -> bool:
        """Whether the text of `ids` may still change when more ids follow (a byte-fallback run:
        its UTF-8 renders only once complete), so that streaming waits."""
        return bool(ids) and ids[-1] in self.byte_ids

    # -- the shared interface ---------------------------------------------------------------
    def encode(self, text: str, add_eos: bool = True) -> list[int]:
        """Token ids of `text`. add_eos: the special tokens `transformers`' `tokenizer(text)` puts
        around a text (its add_special_tokens): `</s>` after (T5), `<s>` before and `</s>` after
        (RoBERTa BPE); False gives the text's own ids only."""
        check_text(text, "encode()")
        ids = self._encode(text)
        return self.around(ids) if add_eos else ids

    def around(self, ids: list[int]) -> list[int]:
        """A text's ids with the special tokens `encode(add_eos=True)` puts around them; len(
        around([])) is how many that is (ByT5 puts no second `</s>` after one)."""
        return [*self.prefix_ids, *ids, *self._suffix(ids)]

    def encode_batch(self, texts: Iterable[str], add_eos: bool = True) -> list[list[int]]:
        texts = list(texts)
        for k, t in enumerate(texts):  # checked first, so an error names the text's index
            check_text(t, f"encode_batch(): text {k}")
        return [self.encode(t, add_eos) for t in texts]

    def encode_window(self, text: str, n: int, side: str = "start",
                      add_eos: bool = True) -> tuple[list[int], bool]:
        """The first (side="start") or last (side="end") `n` ids of `encode(text, add_eos=False)`,
        and whether that encoding has more than n; with add_eos, the special tokens `encode` puts
        around a text are put around the window (`around`: a prompt of at most L ids in all takes
        n = L - len(around([]))). Work and memory grow with n, not with the text:
        the text is encoded in pieces, from the chosen side, until more than n ids are known
        (window.py says where it cuts and why the ids are those of the full encoding)."""
        check_text(text, "encode_window()")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InputError(f"encode_window(): n must be a non-negative integer, got {n!r:.40}")
        if side not in ("start", "end"):
            raise InputError(f"encode_window(): side must be 'start' or 'end', got {side!r:.40}")
        cuts = None if self._cut_points is None else window.Cuts(self._cut_points, self._is_cut)
        ids, cut = window.encode_window(self._encode, cuts, text, n, side)
        return (self.around(ids) if add_eos else ids), cut

    def encode_cut(self, text: str, limit: int, side: str = "start",
                   add_eos: bool = True) -> tuple[list[int], bool]:
        """`encode(text, add_eos)` cut to at most `limit` ids, as transformers truncates (the
        specials around a text kept: T5's closing `</s>`), and whether anything was cut; the
        work bounded by `limit` (`encode_window`), not by the text."""
        n = limit - (len(self.around([])) if add_eos else 0)
        if n < 1:   # no room for text beside the specials: the whole encoding, cut
            ids = self.encode(text, add_eos)
            return (ids[:limit] if side == "start" else ids[len(ids) - limit:]), len(ids) > limit
        return self.encode_window(text, n, side, add_eos)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (ints or NumPy integers); see each source for its rules."""
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
            name = token_name(settings.get(key))
            found = self.token_to_id(name) if name is not None else None
            found = found if found is not None else defaults[key]
            setattr(self, key.replace("_token", "_id"), found)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({str(self.path)!r}, vocab_size={self.vocab_size}, "
                f"eos_id={self.eos_id}, pad_id={self.pad_id}, unk_id={self.unk_id})")

