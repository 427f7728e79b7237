"""Text <-> token ids behind one small interface (base.py), one file per tokenizer source:

- hf_json.py  `tokenizer.json`, through the Hugging Face `tokenizers` library;
- spiece.py   `spiece.model`, through `sentencepiece`, with T5's conventions;
- byt5.py     ByT5's UTF-8 bytes (no file: the tokenizer class the config names);
- bpe.py      RoBERTa's byte-level BPE from `vocab.json` + `merges.txt` (CodeT5, CodeT5+);
- words.py    Transformer-XL's WikiText-103 word vocabulary;
and what they share: added.py (the added and special tokens transformers takes from the config
files), library.py (the two sources run by `tokenizers`), window.py (`encode_window`: the first or
last n ids without encoding the whole text), streaming.py (`IncrementalDecoder`), select.py
(`load_tokenizer`: which source reads a folder, and the files that means).
"""

from .base import Tokenizer, check_text
from .bpe import BpeTokenizer
from .byt5 import ByteTokenizer
from .hf_json import JsonTokenizer
from .select import (PICKLED_VOCABULARIES, TOKENIZER_FILES, has_tokenizer, load_tokenizer,
                     need_tokenizer, source_files, tokenizer_files)
from .spiece import SentencePieceTokenizer
from .streaming import IncrementalDecoder
from .words import WordTokenizer

__all__ = ["Tokenizer", "check_text", "IncrementalDecoder", "load_tokenizer", "has_tokenizer",
           "source_files", "tokenizer_files", "need_tokenizer", "TOKENIZER_FILES", "PICKLED_VOCABULARIES", "JsonTokenizer",
           "SentencePieceTokenizer", "ByteTokenizer", "BpeTokenizer", "WordTokenizer"]
