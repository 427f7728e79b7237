"""A `tokenizer.json`, run by the Hugging Face `tokenizers` library (what `transformers`' fast
tokenizers run), as `transformers`' plain `AutoTokenizer.from_pretrained(folder)(text)` runs it
(checked against transformers 4.57 with tests/test_tokenizer.py's fixtures; see
weights/make_tokenizer_fixtures.py):
- the padding and truncation a tokenizer.json may have been saved with are switched off: a prompt
  is never padded, and never cut (nor by tokenizer_config.json's `model_max_length`, which
  transformers only warns about);
- tokens that the config files declare but tokenizer.json lacks are added the way transformers
  adds them (added.py): the `added_tokens_decoder` entries (legacy folders: added_tokens.json's),
  then the special tokens the config names, for a T5 tokenizer class with its `<extra_id_N>`
  sentinels filled in the way T5Tokenizer does;
- `split_special_tokens: true` in tokenizer_config.json: special-token strings in the text are
  tokenized as text;
- `encode(add_eos=True)` puts before the text what the file's post-processor puts there (RoBERTa's
  `<s>`; nothing for T5) and appends `</s>`.
Not followed: tokenizer_config.json's `add_prefix_space` (transformers 4.57 then rebuilds the
tokenizer from spiece.model with protobuf, 5.x ignores it) and a tokenizer.json without a
post-processor (4.57's fast tokenizer then appends nothing; we append `</s>`, as 4.57's slow
T5Tokenizer and 5.x's T5Tokenizer do). transformers 5 builds T5-class tokenizers from scratch out
of the file's vocabulary (no byte fallback, its own pre-tokenizer): for files other than the
canonical T5 one we follow the file as written, as transformers 4.57, `tokenizers` and
`sentencepiece` do (tests/test_tokenizer.py, `test_tiny_matches_transformers`, says what 5.x does
instead).

Decoding follows the `tokenizers` library, i.e. `transformers`' fast tokenizers with
`clean_up_tokenization_spaces=False` (the legacy clean-up that turns "a ." into "a." and that T5's
tokenizer_config.json switches on is not applied: it edits the model's output and cannot be
streamed): for T5's files "▁" is a space except at the start, consecutive byte-fallback pieces
`<0xNN>` decode together as UTF-8 (a run that is not valid UTF-8 becomes one U+FFFD per byte), and
`skip_special_tokens=True` drops every token flagged special (T5: `<pad>`, `</s>`, `<unk>` and the
sentinels).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import TokenizerError
from .added import config_tokens
from .base import first_line, read_json_text
from .library import LibraryTokenizer, import_library

# Pre-tokenizers that split the text into words at spaces (window.py: only then can a text be
# encoded in pieces); Metaspace and ByteLevel only with their splitting switched on.
_WORD_SPLITTERS = {"WhitespaceSplit", "Whitespace", "BertPreTokenizer"}


class JsonTokenizer(LibraryTokenizer):
    """A `tokenizer.json` run by the `tokenizers` library."""

    def __init__(self, path: Path, settings: dict[str, Any], built: str | None = None):
        """`built`: the tokenizer.json text made from another source (a GGUF file's vocabulary:
        gguf_vocab.py), `path` that source; the folder's config files are then not read."""
        library = import_library(path)
        self.path = path
        data, text = read_json_text(path) if built is None else (json.loads(built), built)
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            raise TokenizerError(f"{path}: not a tokenizer.json (no 'model' object)")
        try:
            self._tok = library.Tokenizer.from_str(text)
        except Exception as e:  # the library raises a bare Exception for every kind of problem
            raise TokenizerError(f"{path}: not a usable tokenizer.json "
                                 f"({first_line(e)})") from None

        # A prompt is never padded or cut: transformers' plain `tok(text)` switches off the padding
        # and truncation a tokenizer.json may have been saved with (fine-tuned repositories often
        # are), whatever `model_max_length` says.
        self._tok.no_padding()
        self._tok.no_truncation()
        if built is None:
            self._add_config_tokens(config_tokens(path.parent, library.AddedToken))
        self._index(settings.get("split_special_tokens") is True)
        unk = data["model"].get("unk_id")
        self._resolve_specials(settings, {
            "eos_token": self.token_to_id("</s>"), "pad_token": self.token_to_id("<pad>"),
            "unk_token": unk if isinstance(unk, int) else self.token_to_id("<unk>")})
        self.prefix_ids = self._post_processor_prefix()
        if not _splits_words(data.get("pre_tokenizer")):
            self._cut_points = None
        else:
            self._probe_cuts()

    def _post_processor_prefix(self) -> tuple[int, ...]:
        """The ids the file's post-processor puts before a text (RoBERTa's and BERT's `<s>` /
        `[CLS]`; T5's puts none), found by encoding a probe with and without them."""
        if self._tok.post_processor is None:
            return ()
        with self._library_errors("encode"):
            plain = self._tok.encode("a", add_special_tokens=False).ids
            full = self._tok.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if plain and full[start:start + len(plain)] == plain:
                return tuple(full[:start])
        return ()


def _splits_words(pre: Any) -> bool:
    """Whether a tokenizer.json pre-tokenizer (its JSON) splits the text into words at spaces."""
    if not isinstance(pre, dict):
        return False
    kind = pre.get("type")
    if kind == "Sequence":
        return any(_splits_words(p) for p in pre.get("pretokenizers") or [])
    if kind == "Metaspace":
        return pre.get("split", True) is not False
    if kind == "ByteLevel":
        return pre.get("use_regex", True) is not False
    if kind == "CharDelimiterSplit":
        return pre.get("delimiter") == " "
    return kind in _WORD_SPLITTERS
