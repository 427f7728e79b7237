"""A GGUF file's own vocabulary as a tokenizer: llama.cpp's convert_hf_to_gguf.py stores a T5 /
UMT5 model's sentencepiece unigram model as metadata (`tokenizer.ggml.model` "t5": the pieces,
their scores and types, the normalizer's precompiled charsmap, whether a space is put before the
text and runs of spaces are removed). This writes the tokenizer.json transformers' converter
writes for a spiece.model from the same facts (a Unigram model; the Precompiled normalizer, then
runs of spaces collapsed and the ends trimmed; Metaspace; `</s>` appended), which the `tokenizers` library then runs
(hf_json.JsonTokenizer).

The converter pads the pieces to the model's vocabulary size with `[PAD<i>]` tokens (type
UNUSED; T5's `<extra_id_N>` sentinels are not in the file): they keep their ids, never win a
segmentation (their score is UNUSED_SCORE) and decode as their names.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from ..errors import TokenizerError
from .hf_json import JsonTokenizer

# llama.cpp's token types (gguf-py's TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNUSED_SCORE = -1e9     # below any path of real pieces: an UNUSED token is never chosen


def has_vocabulary(metadata: dict[str, Any]) -> bool:
    """Whether the metadata holds a vocabulary (of any kind: gguf_tokenizer says which it reads)."""
    return metadata.get("tokenizer.ggml.tokens") is not None


def gguf_tokenizer(metadata: dict[str, Any], origin: Path) -> JsonTokenizer:
    """The tokenizer of a GGUF file's metadata (`origin`: the file, for messages)."""
    return JsonTokenizer(origin, {}, built=tokenizer_json(metadata, origin))


def tokenizer_json(metadata: dict[str, Any], origin: Any = "the file") -> str:
    """The tokenizer.json text of a GGUF file's T5 vocabulary (see the module docstring)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "t5":
        raise TokenizerError(f"{origin}: its vocabulary is tokenizer.ggml.model {kind!r}; minfer "
                             "reads the sentencepiece unigram ('t5') ones of T5 / UMT5 files: "
                             "give tokenizer= a folder with the model's tokenizer files")
    tokens = metadata.get("tokenizer.ggml.tokens")
    scores = metadata.get("tokenizer.ggml.scores")
    types = metadata.get("tokenizer.ggml.token_type")
    if not (isinstance(tokens, list) and tokens and isinstance(scores, list)
            and isinstance(types, list) and len(tokens) == len(scores) == len(types)):
        raise TokenizerError(f"{origin}: its vocabulary's tokens, scores and token types are "
                             "missing or of different lengths (a damaged file?)")
    unk = next((i for i, t in enumerate(types) if t == UNKNOWN),
               metadata.get("tokenizer.ggml.unknown_token_id"))
    if not isinstance(unk, int) or not 0 <= unk < len(tokens):
        raise TokenizerError(f"{origin}: its vocabulary names no unknown token")
    vocab = [[t, UNUSED_SCORE if kind == UNUSED else float(s)]
             for t, s, kind in zip(tokens, scores, types)]
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": kind == USER_DEFINED, "special": kind != USER_DEFINED}
             for i, (t, kind) in enumerate(zip(tokens, types))
             if kind in (CONTROL, UNKNOWN, USER_DEFINED)]
    eos = metadata.get("tokenizer.ggml.eos_token_id", 1)
    if not isinstance(eos, int) or not 0 <= eos < len(tokens):
        raise TokenizerError(f"{origin}: tokenizer.ggml.eos_token_id {eos!r} is no token")
    charsmap = metadata.get("tokenizer.ggml.precompiled_charsmap") or []
    prefix = "always" if metadata.get("tokenizer.ggml.add_space_prefix", True) else "never"
    metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": prefix,
                 "split": True}
    normalizers = []
    if charsmap:
        normalizers.append({"type": "Precompiled",
                            "precompiled_charsmap": base64.b64encode(bytes(charsmap)).decode()})
    if metadata.get("tokenizer.ggml.remove_extra_whitespaces", True):
        # sentencepiece's remove_extra_whitespaces, after its normalisation: runs of spaces
        # (spaces only: a tab the charsmap keeps stays) become one, none at either end
        normalizers += [{"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
                        {"type": "Replace", "pattern": {"Regex": "\\A | \\z"}, "content": ""}]
    byte_fallback = BYTE in types
    decoder: dict[str, Any] = metaspace
    if byte_fallback:
        decoder = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, metaspace]}
    eos_piece = tokens[eos]
    data = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers} if normalizers else None,
        "pre_tokenizer": metaspace,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": eos_piece, "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": eos_piece, "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 0}},
                     {"SpecialToken": {"id": eos_piece, "type_id": 0}}],
            "special_tokens": {eos_piece: {"id": eos_piece, "ids": [eos], "tokens": [eos_piece]}}},
        "decoder": decoder,
        "model": {"type": "Unigram", "unk_id": unk, "vocab": vocab,
                  "byte_fallback": byte_fallback},
    }
    return json.dumps(data, ensure_ascii=False)
