"""The first or last n ids of a text's encoding, without encoding the whole text.

A 10 MB prompt cut to 64 tokens should cost 64 tokens' work, not 10 MB's (encoding all of it
takes seconds and gigabytes in the tokenizer libraries). So the text is encoded in pieces, from
the chosen side, until more than n ids are known; each piece ends at a *cut*: a position k that
the source's `_cut_points` pattern matches and its `_is_cut(text, k)` accepts, meaning
encode(text) == encode(text[:k]) + encode(text[k:]).

Why cuts at spaces are exact (Tokenizer's `_cut_points`: a space after a character that is not
whitespace, nor a "▁", which SentencePiece takes for one; `_is_cut`: away from added tokens; checked by tests/test_tokenizer_window.py on
thousands of random texts for every source, against the full encoding, from both sides):
- every source splits its text into words at spaces before its model sees them, and each word
  is encoded alone: SentencePiece (`split_by_whitespace`) and tokenizer.json's Metaspace start a
  word at each "▁"; WhitespaceSplit / BERT split at whitespace; byte-level BPE's regex gives the
  space to the word after it (" b" -> "Ġb"), and a run of spaces keeps its last one for that word,
  so the piece after the cut starts the same way. Unknown words (`<unk>`, fused per word) and byte
  fallback (`<0xNN>` per character) are decided inside a word, so they never see a cut;
- the normalisers of these files act per character (NFKC, lower-casing, mapping whitespace to
  spaces) or on whitespace runs (collapsing them; stripping the text's first and last space), and
  a cut at the start of a run leaves the run whole in the second piece, where the same rules give
  the same "▁" (T5's normaliser strips that leading space and its Metaspace prepends "▁" again);
- added tokens are kept away from cuts: none spans one; none that swallows the whitespace after
  it (`rstrip`) ends at one; none starts at one or right after its whitespace (a token matched
  after normalisation leaves the space before it to the text on its left, and one whose text
  starts with whitespace may match anywhere in the run).
A tokenizer.json whose pre-tokenizer does not split at spaces (a Metaspace with `split: false`
lets a SentencePiece piece span words), or a file that fails the load-time probe
(`Tokenizer._probe_cuts`), is encoded whole and sliced: exact, but not bounded.
ByT5's bytes are independent of each other: it cuts anywhere between two characters that are not
whitespace (so no special token's stripping of whitespace reaches the cut) and outside its added
tokens. The Transformer-XL word vocabulary splits at whitespace and line breaks: exact.

The one inexact case is a text with no cut at all over MAX_RUN characters (a long run without a
space: base64, minified code): the piece is cut there anyway. Only the ids next to that cut can
differ from the full encoding's (a word cut in two), and they come after the ids of the run's
first MAX_RUN characters, so a window of n ids is still exact unless those characters make fewer
than n ids (the word vocabulary makes one `<unk>` of any such run, and one per piece of it).

Work and memory: each piece is at most max(MAX_RUN, MIN_SPAN + CHARS_PER_ID * (n + 1))
characters, and the pieces stop once n ids are passed, so both grow with n, not with the text.
Knowing that there is nothing more (`cut` False) needs the whole text, which is only read that
far when the text has no more than n ids.
"""

from __future__ import annotations

import re
from typing import Callable

MIN_SPAN = 256        # characters of a piece at least (a few words: the calls stay few)
CHARS_PER_ID = 8      # and this many per id still wanted (English T5 text: ~4-5 per id)
MAX_RUN = 1 << 16     # a piece with no cut point is cut here anyway (see the module docstring)

Encode = Callable[[str], list[int]]
IsCut = Callable[[str, int], bool]


class Cuts:
    """Where a text may be cut: the positions `points` matches (found by the regex engine, so a
    long run without one costs no Python loop) that `accept(text, k)` also allows."""

    def __init__(self, points: re.Pattern, accept: IsCut):
        self.points = points
        self.accept = accept

    def last(self, text: str, lo: int, hi: int) -> int | None:
        """The last cut k with lo < k <= hi (k < len(text))."""
        points = [m.start() for m in self.points.finditer(text, lo + 1, min(hi + 1, len(text)))]
        return next((k for k in reversed(points) if self.accept(text, k)), None)

    def first(self, text: str, lo: int, hi: int) -> int | None:
        """The first cut k with lo <= k < hi (k > 0)."""
        for m in self.points.finditer(text, max(lo, 1), hi):
            if self.accept(text, m.start()):
                return m.start()
        return None


def encode_window(encode: Encode, cuts: Cuts | None, text: str, n: int,
                  side: str) -> tuple[list[int], bool]:
    """(the first or last n ids of encode(text), whether encode(text) has more than n).
    cuts None: the source cannot be cut (see the module docstring); the text is encoded whole."""
    if cuts is None:
        ids = encode(text)
        return (ids[:n] if side == "start" else ids[len(ids) - n:] if n else []), len(ids) > n
    if side == "start":
        return _from_start(encode, cuts, text, n)
    return _from_end(encode, cuts, text, n)


def _span(wanted: int) -> int:
    return MIN_SPAN + CHARS_PER_ID * wanted


def _from_start(encode: Encode, cuts: Cuts, text: str, n: int) -> tuple[list[int], bool]:
    ids: list[int] = []
    pos = 0
    while pos < len(text) and len(ids) <= n:
        end = _piece_end(cuts, text, pos, _span(n + 1 - len(ids)))
        ids += encode(text[pos:end])
        pos = end
    return ids[:n], len(ids) > n


def _from_end(encode: Encode, cuts: Cuts, text: str, n: int) -> tuple[list[int], bool]:
    parts: list[list[int]] = []
    count = 0
    end = len(text)
    while end > 0 and count <= n:
        start = _piece_start(cuts, text, end, _span(n + 1 - count))
        parts.append(encode(text[start:end]))
        count += len(parts[-1])
        end = start
    ids = [i for part in reversed(parts) for i in part]
    return (ids[len(ids) - n:] if n else []), count > n


def _piece_end(cuts: Cuts, text: str, pos: int, span: int) -> int:
    """Where the piece starting at `pos` ends: the last cut within `span` characters, else the
    first one within MAX_RUN, else MAX_RUN characters on (or the end of the text)."""
    limit = pos + span
    if limit >= len(text):
        return len(text)
    far = min(len(text), pos + max(MAX_RUN, span))
    k = cuts.last(text, pos, limit)
    if k is None:
        k = cuts.first(text, limit + 1, far)
    return far if k is None else k


def _piece_start(cuts: Cuts, text: str, end: int, span: int) -> int:
    """Where the piece ending at `end` starts: the first cut within `span` characters before it,
    else the last one within MAX_RUN, else MAX_RUN characters back (or the start of the text)."""
    limit = end - span
    if limit <= 0:
        return 0
    far = max(0, end - max(MAX_RUN, span))
    k = cuts.first(text, limit, end)
    if k is None:
        k = cuts.last(text, far, limit - 1)
    return far if k is None else k
