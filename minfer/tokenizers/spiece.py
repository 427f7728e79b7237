"""A `spiece.model`, run by `sentencepiece`, with the T5 conventions of `transformers.T5Tokenizer`:
`</s>` appended, and `extra_ids` sentinels `<extra_id_N>` (not in the SentencePiece model) given the
ids `sp_vocab + extra_ids - 1 - N`, so `<extra_id_0>` is the last id (32099 for T5).

Read when a folder has no tokenizer.json: the tokens a config adds to a tokenizer.json are not
added here, and there is no saved padding to ignore. For T5 both files give the same ids for the
same text (checked on T5's vocabulary: the tests compare them with each other and with
`transformers`) and the same text for the same ids: decoding follows the `tokenizers` library's
ByteFallback + Metaspace decoders (hf_json.py's rules), `skip_special_tokens=True` dropping
`<pad>`, `</s>`, `<unk>` (the model's control and unknown pieces) and the sentinels, and ids at or
past `vocab_size` decode to nothing (T5's embedding has 28 rows more than its vocabulary).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import TokenizerError
from ..io.limits import is_int
from .added import DEFAULT_EXTRA_IDS, MAX_EXTRA_IDS
from .base import METASPACE, MissingLibrary, Tokenizer, first_line



def _bytes_text(run: bytes) -> str:
    """A run of byte-fallback pieces as the `tokenizers` ByteFallback decoder renders it."""
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


class SentencePieceTokenizer(Tokenizer):
    """A `spiece.model` with T5's conventions (sentinels after the SentencePiece vocabulary)."""

    def __init__(self, path: Path, settings: dict[str, Any]):
        try:
            import sentencepiece
        except ImportError:
            raise MissingLibrary(f"{path}: reading it needs the 'sentencepiece' package "
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
            raise TokenizerError(f"{path}: not a SentencePiece model ({first_line(e)})") from None
        n = sp.get_piece_size()
        if n == 0:
            raise TokenizerError(f"{path}: not a SentencePiece model (no pieces)")

        extra = settings.get("extra_ids", DEFAULT_EXTRA_IDS)
        if not is_int(extra) or not 0 <= extra <= MAX_EXTRA_IDS:
            raise TokenizerError(f"{path.parent / 'tokenizer_config.json'}: extra_ids must be an "
                                 f"integer from 0 to {MAX_EXTRA_IDS}, got {extra!r:.40}")
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
        self._probe_cuts()

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
        return parts[0].replace(METASPACE, "") + "".join(parts[1:]).replace(METASPACE, " ")

    def token_to_id(self, token: str) -> int | None:
        if token in self._sentinel_ids:
            return self._sentinel_ids[token]
        i = self._sp.piece_to_id(token)
        # SentencePiece answers unk_id for pieces it does not know
        return i if i < self._sp.get_piece_size() and self._pieces[i] == token else None

    def id_to_token(self, token_id: int) -> str | None:
        return self._pieces[token_id] if 0 <= token_id < self.vocab_size else None
