"""RoBERTa's byte-level BPE given as `vocab.json` + `merges.txt` with no tokenizer.json (CodeT5 and
CodeT5+ T5 checkpoints), as transformers 4.57's `AutoTokenizer` reads such a folder: a
RobertaTokenizer converted to RobertaTokenizerFast (`convert_slow_tokenizer.RobertaConverter`).
The files go into the `tokenizers` library's own BPE model, ByteLevel pre-tokenizer and ByteLevel
decoder (BPE is not rewritten here), then:
- merges.txt is read as RobertaTokenizer reads it: its first line (the "#version" header) and
  what follows the last line break are not merges, and each line is two tokens;
- the special tokens are RobertaTokenizer's (`<s>`, `</s>`, `<unk>`, `<pad>`, `<mask>`, the last
  swallowing the whitespace before it) unless the config files name others, and the added tokens
  of tokenizer_config.json / special_tokens_map.json / added_tokens.json are added as
  transformers adds them (added.py);
- `add_prefix_space` (tokenizer_config.json, default false) puts a space before the text and
  before the text after each added token, as the fast tokenizer's ByteLevel pre-tokenizer does
  (the slow RobertaTokenizer only puts one before the whole text: the two differ after an added
  token; we follow the fast one, which AutoTokenizer loads);
- `encode(text, add_eos=True)` is `<s> ... </s>` (cls, then sep), exactly `tokenizer(text)`'s
  ids, so a T5 family that appends `</s>` to prompts gets RoBERTa's own pair and no second `</s>`;
  add_eos=False is `tokenizer(text, add_special_tokens=False)`;
- decoding is the fast tokenizer's (`tokenizers`' ByteLevel decoder: bytes that are not valid
  UTF-8 become U+FFFD; the config's `errors` only changes the slow tokenizer), without
  `clean_up_tokenization_spaces`.
transformers 5 reads such a folder otherwise: its RobertaTokenizer no longer makes `<mask>`
swallow the whitespace before it, and its legacy reader leaves the added_tokens.json sentinels
that special_tokens_map.json lists as additional special tokens not special (kept by
`skip_special_tokens`, not split by `split_special_tokens`). CodeT5 was trained with 4.x's reading,
and its own tokenizer_config.json saves `<mask>` with lstrip: we keep 4.57's
(weights/make_byt5_bpe_fixtures.py, V5_DIFFERENCES). A folder transformers 5 saved holds its
reading in a tokenizer.json, which hf_json.py runs as written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import TokenizerError
from ..io.limits import MAX_JSON_BYTES, is_int, is_regular_file, quoted
from .added import config_tokens
from .base import read_json_text, read_lines, read_object, token_name
from .library import LibraryTokenizer, import_library


class BpeTokenizer(LibraryTokenizer):
    """vocab.json + merges.txt, RoBERTa's byte-level BPE (path: vocab.json)."""

    def __init__(self, path: Path, settings: dict[str, Any]):
        library = import_library(path)
        self.path = path
        folder = path.parent
        vocab = read_vocab(path)
        merges = read_merges(folder / "merges.txt", vocab)
        config = read_object(folder / "tokenizer_config.json")
        prefix_space = config.get("add_prefix_space", False)
        if not isinstance(prefix_space, bool):
            raise TokenizerError(f"{folder / 'tokenizer_config.json'}: add_prefix_space must be "
                                 f"true or false, got {prefix_space!r:.40}")
        try:
            model = library.models.BPE(vocab, merges, dropout=None, continuing_subword_prefix="",
                                       end_of_word_suffix="", fuse_unk=False)
        except Exception as e:  # checked above; the library's own refusal, should it have one more
            raise TokenizerError(f"{path}: the library refuses this BPE vocabulary ({e})") from None
        self._tok = library.Tokenizer(model)
        self._tok.pre_tokenizer = library.pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
        self._tok.decoder = library.decoders.ByteLevel()
        tokens = config_tokens(folder, library.AddedToken, roberta=True)
        self._add_config_tokens(tokens)
        self._index(config.get("split_special_tokens") is True)
        names = tokens.names
        self._resolve_specials(names, {"eos_token": None, "pad_token": None, "unk_token": None})
        # RoBERTa's single-text template is `cls text sep` (RobertaProcessing)
        cls_id, self._sep_id = (self._named_id(names, key) for key in ("cls_token", "sep_token"))
        self.prefix_ids = () if cls_id is None else (cls_id,)
        self._probe_cuts()

    def _named_id(self, names: dict[str, Any], key: str) -> int | None:
        name = token_name(names.get(key))
        return None if name is None else self.token_to_id(name)

    def _suffix(self, ids: list[int]) -> list[int]:
        return [] if self._sep_id is None else [self._sep_id]


def read_vocab(path: Path) -> dict[str, int]:
    """vocab.json: a {token: id} object whose ids number its tokens 0..N-1, once each."""
    data, _ = read_json_text(path)
    if not isinstance(data, dict) or not data:
        raise TokenizerError(f"{path}: expected a non-empty JSON object of {{token: id}}")
    seen: dict[int, str] = {}
    for token, i in data.items():
        if not is_int(i):
            raise TokenizerError(f"{path}: token '{quoted(token, 60)}' has id {i!r:.40}, not an "
                                 "integer")
        if not 0 <= i < len(data):
            raise TokenizerError(f"{path}: token '{quoted(token, 60)}' has id {i}: ids must number "
                                 f"the {len(data)} tokens 0..{len(data) - 1}")
        if i in seen:
            raise TokenizerError(f"{path}: tokens '{quoted(seen[i], 60)}' and '{quoted(token, 60)}' "
                                 f"share id {i}")
        seen[i] = token
    return data


def read_merges(path: Path, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """merges.txt as RobertaTokenizer reads it (`text.split("\\n")[1:-1]`, each line split at
    whitespace), every line two tokens of the vocabulary whose join is one too (the `tokenizers`
    BPE refuses anything else, without saying which line)."""
    if not is_regular_file(path, TokenizerError):
        raise TokenizerError(f"{path.parent / 'vocab.json'}: a byte-level BPE vocabulary needs "
                             f"merges.txt beside it, and {path.parent} has none")
    lines = read_lines(path, MAX_JSON_BYTES).split("\n")[1:-1]
    merges = []
    for n, line in enumerate(lines, 2):
        pair = tuple(line.split())
        if len(pair) != 2:
            raise TokenizerError(f"{path}: line {n} is not two tokens: '{quoted(line, 60)}'")
        for token in (*pair, pair[0] + pair[1]):
            if token not in vocab:
                raise TokenizerError(f"{path}: line {n} ('{quoted(line, 60)}') needs "
                                     f"'{quoted(token, 60)}', which vocab.json lacks")
        merges.append(pair)
    return merges
