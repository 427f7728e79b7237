"""Which source reads a model folder's tokenizer (`load_tokenizer`), and the files that means.

The rule, first match wins:
1. the tokenizer class the folder names (tokenizer_config.json's `tokenizer_class`, else
   config.json's, as AutoTokenizer reads it) is `ByT5Tokenizer`: ByT5's bytes (byt5.py), whatever
   files are there (ByT5 repositories have no vocabulary file);
2. `tokenizer.json` (hf_json.py);
3. `spiece.model` (spiece.py);
4. `vocab.json` + `merges.txt`: RoBERTa's byte-level BPE (bpe.py; CodeT5, CodeT5+), when the
   named class is a RoBERTa one or none;
5. a word vocabulary (words.py): `vocab.pkl`, `vocab.bin`, `vocab.json`, `vocab.txt` in that
   order, only for a Transformer-XL folder: config.json's `model_type` is `transfo-xl`, or there is
   no config.json (a bare vocabulary), and the class named is `TransfoXLTokenizer` or none.
A vocab.json beside merges.txt is never read as words. A `vocab.json` that is neither (a T5
folder's vocab.json without merges.txt, which was once read as words and turned `def add(a, b)`
into unknown words) is a one-line error naming what is missing, as is any other folder with
vocabulary files no source takes. A present file whose library is not installed is skipped for
the next source, and named if none is left.
"""

from __future__ import annotations

import os
from typing import Any
from pathlib import Path

from ..errors import InputError, TokenizerError
from ..io.limits import is_regular_file
from .added import ROBERTA_CLASSES, declared_class, model_type
from .base import MissingLibrary, Tokenizer, read_settings
from .bpe import BpeTokenizer
from .byt5 import CLASS as BYT5_CLASS, ByteTokenizer
from .hf_json import JsonTokenizer
from .spiece import SentencePieceTokenizer
from .words import WordTokenizer

# The files whose presence means a folder carries a tokenizer (ByT5's is named, not a file).
VOCABULARY_FILES = ("tokenizer.json", "spiece.model", "vocab.json", "vocab.pkl", "vocab.bin",
                    "vocab.txt")
# Every file a source reads, settings included (what the hub fetches and `convert` copies); the
# pickled word vocabularies apart: `convert` rewrites them as vocab.txt.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "spiece.model", "vocab.json", "merges.txt", "vocab.txt")
PICKLED_VOCABULARIES = ("vocab.pkl", "vocab.bin")
_WORD_FILES = ("vocab.pkl", "vocab.bin", "vocab.json", "vocab.txt")
_XL_TYPES = (None, "transfo-xl")
_XL_CLASSES = (None, "TransfoXLTokenizer")


def _present(path: Path) -> bool:
    """A tokenizer file is there: a regular file; a folder, a FIFO or a link to nothing or to
    itself by its name is a one-line error, never taken for absent (a looping tokenizer.json
    would otherwise fall back to spiece.model without a word)."""
    return is_regular_file(path, TokenizerError)


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether `load_tokenizer(folder)` has something to read."""
    folder = Path(folder)
    return any(_present(folder / f) for f in VOCABULARY_FILES) or \
        declared_class(folder) == BYT5_CLASS


def source_files(encoder_decoder: bool) -> str:
    """The vocabulary files a model of this kind can have its tokenizer read from (for messages)."""
    if encoder_decoder:
        return f"tokenizer.json, spiece.model, vocab.json + merges.txt or tokenizer_class {BYT5_CLASS}"
    return "vocab.txt, vocab.pkl, vocab.bin or vocab.json"


def load_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a model folder (see the module docstring for which source wins)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TokenizerError(f"{folder}: no such tokenizer folder")
    settings = read_settings(folder)
    named = declared_class(folder)
    if named == BYT5_CLASS:
        return ByteTokenizer(folder, settings)
    missing: list[str] = []
    for path, source in _candidates(folder, named):
        try:
            return source(path, settings)
        except MissingLibrary as e:   # try the next file, report if none works
            missing.append(str(e))
    if missing:
        raise TokenizerError(missing[0])
    raise TokenizerError(f"{folder}: no tokenizer file (looked for "
                         f"{', '.join(VOCABULARY_FILES)}, or tokenizer_class {BYT5_CLASS})")


def _candidates(folder: Path, named: str | None) -> list[tuple[Path, type[Tokenizer]]]:
    """The sources that may read the folder, in order of preference (the module docstring)."""
    out: list[tuple[Path, type[Tokenizer]]] = [
        (folder / name, source) for name, source in (("tokenizer.json", JsonTokenizer),
                                                     ("spiece.model", SentencePieceTokenizer))
        if _present(folder / name)]
    vocab_json = folder / "vocab.json"
    if _present(vocab_json) and _present(folder / "merges.txt"):   # never a word vocabulary
        if named in (None, *ROBERTA_CLASSES):
            out.append((vocab_json, BpeTokenizer))
        elif not out:
            raise TokenizerError(f"{vocab_json}: with merges.txt, a byte-level BPE vocabulary, "
                                 f"which RobertaTokenizer reads; tokenizer_class {named} is not "
                                 "supported")
        return out
    words = [folder / name for name in _WORD_FILES if _present(folder / name)]
    if not words:
        return out
    if model_type(folder) in _XL_TYPES and named in _XL_CLASSES:
        return out + [(path, WordTokenizer) for path in words]
    if out:                     # a word file beside the folder's own vocabulary: not read
        return out
    kind = f"tokenizer_class {named}" if named else f"model_type {model_type(folder)}"
    if _present(vocab_json):
        raise TokenizerError(f"{vocab_json}: no merges.txt beside it; in this folder ({kind}) a "
                             "vocab.json is a byte-level BPE vocabulary, which needs merges.txt "
                             "(word vocabularies are Transformer-XL's)")
    raise TokenizerError(f"{words[0]}: a word vocabulary, which only Transformer-XL reads; this "
                         f"folder ({kind}) needs tokenizer.json, spiece.model or vocab.json + "
                         "merges.txt")


def tokenizer_files(model: Any) -> str:
    """The vocabulary files a model of this kind (anything with `is_encoder_decoder`) would have
    its tokenizer read from."""
    return source_files(bool(model.is_encoder_decoder))


def need_tokenizer(model: Any, why: str) -> Tokenizer:
    """The model's tokenizer, or a one-line InputError saying what needed it and which files
    would have given one (`model`: anything with `tokenizer`, `folder`, `is_encoder_decoder`)."""
    if model.tokenizer is None:
        raise InputError(f"{why} requires a tokenizer, and {model.folder} has none "
                         f"({tokenizer_files(model)}): pass token ids instead")
    return model.tokenizer
