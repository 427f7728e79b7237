"""What the two sources run by the Hugging Face `tokenizers` library share: a tokenizer.json read
as written (hf_json.py) and RoBERTa's BPE built from vocab.json + merges.txt (bpe.py) both end as a
`tokenizers.Tokenizer`, completed with the config's added tokens as transformers completes it, and
encoded, decoded and looked up the same way.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterable, Iterator

from ..errors import TokenizerError
from .added import ConfigTokens, token_state
from .base import MissingLibrary, Tokenizer, check_text

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def import_library(path: Any) -> Any:
    """The `tokenizers` module, or MissingLibrary naming the file that needs it."""
    try:
        import tokenizers
    except ImportError:
        raise MissingLibrary(f"{path}: reading it needs the 'tokenizers' package "
                             "(pip install tokenizers)") from None
    return tokenizers


class LibraryTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (`self._tok`) behind the Tokenizer interface."""

    _tok: Any

    def _add_config_tokens(self, tokens: ConfigTokens) -> None:
        """Add what the config files declare and the library tokenizer lacks (see added.py)."""
        present = list(self._tok.get_added_tokens_decoder().values())
        states = {token_state(t) for t in present}
        todo = [t for t in tokens.decoder if token_state(t) not in states]
        known = {t.content for t in present} | {t.content for t in tokens.decoder}
        for token in tokens.specials:
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

    def _index(self, split_special_tokens: bool) -> None:
        """Sizes and id sets, once every token is added; `split_special_tokens: true` in the
        config (transformers' tok.split_special_tokens) tokenizes special-token strings as text."""
        if split_special_tokens:
            self._tok.encode_special_tokens = True
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()                       # {id: AddedToken}
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        vocab = self._tok.get_vocab(with_added_tokens=False)
        self.byte_ids = frozenset(i for piece, i in vocab.items() if _BYTE_PIECE.fullmatch(piece))
        self._added_texts = tuple(t.content for t in added.values())
        self._rstrip_texts = tuple(t.content for t in added.values() if t.rstrip)

    def _encode(self, text: str) -> list[int]:
        with self._library_errors("encode"):
            return list(self._tok.encode(text, add_special_tokens=False).ids)

    @contextlib.contextmanager
    def _library_errors(self, what: str) -> Iterator[None]:
        """The library raises a bare Exception for a model its file declares but cannot run (a
        Unigram vocabulary without its unk token: "Encountered an unknown token but unk_id is
        missing"): a one-line TokenizerError naming the file instead."""
        try:
            yield
        except TokenizerError:
            raise
        except Exception as e:   # (the Rust library's errors carry no finer type)
            text = " ".join(str(e).split())[:200]
            raise TokenizerError(f"{self.path}: the tokenizer cannot {what} with it: "
                                 f"{text}") from None

    def encode_batch(self, texts: Iterable[str], add_eos: bool = True) -> list[list[int]]:
        texts = list(texts)
        for k, t in enumerate(texts):
            check_text(t, f"encode_batch(): text {k}")
        with self._library_errors("encode"):
            out = [list(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        return [self.around(ids) for ids in out] if add_eos else out

    def _decode(self, ids: list[int]) -> str:
        with self._library_errors("decode"):
            return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None
