"""Streaming detokenisation: ids in as they are generated, text pieces out, the way
text-generation servers do it (prefix/read offsets over a small window of ids), with the guarantee
that the pieces join to exactly `decode(all ids)`.
"""

from __future__ import annotations

from .base import Tokenizer


class IncrementalDecoder:
    """Streaming detokenisation: feed ids one at a time, get text pieces whose concatenation equals
    decode(all ids).

    Decoding single tokens does not work: a lone "▁house" decodes to "house" (first-token rule),
    and a character spelled by several byte-fallback pieces is U+FFFD until its last byte. So we
    keep a window of ids starting at `prefix` (the first id of the previously emitted stretch) and
    decode it with and without the ids after `read` (those not yet emitted); the difference is the
    new text. It is emitted when stable, i.e. it does not end in U+FFFD and the source does not
    hold the ids back (`Tokenizer._holds`: a byte-fallback run renders as all-or-nothing UTF-8, so
    it is final only once it ends; ByT5's bytes wait for the end of their character). Then
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
        if tok._holds(self._ids):
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
