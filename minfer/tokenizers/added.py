"""The added and special tokens that transformers' fast tokenizers take from a folder's config
files (tokenizer_config.json, special_tokens_map.json, added_tokens.json) and add to the
`tokenizers` library's tokenizer: for a tokenizer.json (hf_json.py) and for RoBERTa's BPE built
from vocab.json + merges.txt (bpe.py).

transformers (4.57 `PreTrainedTokenizerFast.__init__`, 5.x `TokenizersBackend.__init__`, same
rule) passes to the library's `add_tokens` the `added_tokens_decoder` entries whose content or
flags differ from all of the library tokenizer's added tokens (for a content already there the
library keeps its id), then each named special token whose content is neither an added token nor
a decoder entry, flagged special. Where tokenizer_config.json has no `added_tokens_decoder`,
`from_pretrained`'s legacy path (4.57 `_from_pretrained`) fills it: special_tokens_map.json's
values override the config's (its `additional_special_tokens` are appended to the config's list),
and added_tokens.json's {token: id} entries become decoder entries (special when a special token
names them; 5.x's legacy path differs, and bpe.py says where we keep 4.57's). The tokenizer
class completes the special tokens as its `__init__` does: a T5 class its `<extra_id_N>`
sentinels, a RoBERTa class its defaults (`<s>`, `</s>`, `<unk>`, `<pad>`, `<mask>`; `<mask>`
swallows the whitespace before it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from ..errors import TokenizerError
from ..io.limits import is_int, read_json_text
from .base import read_object, token_name

# What transformers' tokenizers call their special tokens, in the order it adds missing ones.
NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
_LISTED_SPECIALS = ("additional_special_tokens", "extra_special_tokens")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
T5_CLASSES = ("T5Tokenizer", "T5TokenizerFast", "MT5Tokenizer", "MT5TokenizerFast")
ROBERTA_CLASSES = ("RobertaTokenizer", "RobertaTokenizerFast")
T5_MODEL_TYPES = ("t5", "mt5", "umt5", "longt5")
DEFAULT_EXTRA_IDS = 100                     # T5's sentinels, if tokenizer_config.json is silent
# Sentinels a config may ask for: T5 has 100, ByT5 125; the bound keeps a hostile `extra_ids`
# from building a list of a billion strings (sources with a known vocabulary bound it tighter).
MAX_EXTRA_IDS = 1 << 16
# RobertaTokenizer(Fast)'s special tokens when the config names none (its __init__ defaults).
_ROBERTA_DEFAULTS = {"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>",
                     "cls_token": "<s>", "unk_token": "<unk>", "pad_token": "<pad>",
                     "mask_token": "<mask>"}


def declared_class(folder: Path) -> str | None:
    """The tokenizer class AutoTokenizer picks by name: tokenizer_config.json's `tokenizer_class`,
    else config.json's (ByT5 repositories name it there and have no tokenizer_config.json)."""
    for name in ("tokenizer_config.json", "config.json"):
        value = _object_or_empty(folder / name).get("tokenizer_class")
        if isinstance(value, str):
            return value
    return None


def model_type(folder: Path) -> str | None:
    value = _object_or_empty(folder / "config.json").get("model_type")
    return value if isinstance(value, str) else None


def _object_or_empty(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when it is absent or not an object (config.json is the model
    reader's to judge; a broken tokenizer_config.json is reported where it is read)."""
    try:
        data = read_json_text(path, TokenizerError)[0] if path.is_file() else {}
    except TokenizerError:
        return {}
    return data if isinstance(data, dict) else {}


def is_t5_class(folder: Path, config: dict[str, Any]) -> bool:
    """Whether AutoTokenizer loads the folder with a T5 tokenizer class: the config's
    `tokenizer_class`, else (as AutoTokenizer) config.json's `model_type`."""
    name = config.get("tokenizer_class")
    if isinstance(name, str):
        return name in T5_CLASSES
    return model_type(folder) in T5_MODEL_TYPES


class ConfigTokens(NamedTuple):
    decoder: list[Any]          # the `added_tokens_decoder` entries, by id
    specials: list[Any]         # the special tokens the config names, in transformers' order
    names: dict[str, Any]       # the config's settings, special tokens completed as above


def config_tokens(folder: Path, added_token: type, roberta: bool = False) -> ConfigTokens:
    """What transformers adds to the library tokenizer when it loads `folder`, as `added_token`
    (`tokenizers.AddedToken`) objects. roberta: the folder is read by a RoBERTa class (its
    defaults complete the special tokens); else a T5 class when `is_t5_class`."""
    config = read_object(folder / "tokenizer_config.json")
    decoder = config.get("added_tokens_decoder")
    names = dict(config)
    if not isinstance(decoder, dict):
        names.update(legacy_specials(folder, config))
        decoder = legacy_added(folder, special_names(names))
    if roberta:
        for key, default in _ROBERTA_DEFAULTS.items():
            names.setdefault(key, default)
        if isinstance(names["mask_token"], str):     # RobertaTokenizerFast.__init__
            names["mask_token"] = {"content": names["mask_token"], "lstrip": True,
                                   "rstrip": False, "normalized": False}
    elif is_t5_class(folder, config):
        names["additional_special_tokens"] = _t5_sentinels(folder, names)

    def make(value: Any, special: bool) -> Any:
        if isinstance(value, str):
            return added_token(value, special=True) if special else added_token(value)
        if isinstance(value, dict) and isinstance(value.get("content"), str) and value["content"]:
            fields = {k: value[k] for k in _ADDED_TOKEN_FIELDS[1:] if isinstance(value.get(k), bool)}
            fields["content"] = value["content"]
            token = added_token(**fields)
            if special:
                token.special = True
            return token
        return None

    specials = _specials(names)
    named = special_names(names)
    out: list[Any] = []
    for key in sorted((k for k in decoder if str(k).lstrip("-").isdigit()), key=int):
        entry = decoder[key]
        if isinstance(entry, tuple):          # added_tokens.json's (content, special)
            token = added_token(entry[0], rstrip=False, lstrip=False, normalized=not entry[1],
                                special=entry[1])
        else:
            token = make(entry, False)
        if token is not None:
            token.special = bool(token.special or token.content in named)
            out.append(token)
    return ConfigTokens(out, [t for t in (make(v, True) for v in specials) if t is not None], names)


def legacy_specials(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """special_tokens_map.json's values as transformers' legacy path takes them: each overrides
    the config's, flagged special; its additional_special_tokens follow the config's."""
    out: dict[str, Any] = {}
    for key, value in read_object(folder / "special_tokens_map.json").items():
        if isinstance(value, dict):
            value = {**value, "special": True}
        elif key == "additional_special_tokens" and isinstance(value, list):
            listed = config.get(key) if isinstance(config.get(key), list) else []
            seen = {token_name(v) for v in listed}
            value = listed + [{**v, "special": True} if isinstance(v, dict) else v
                              for v in value if token_name(v) not in seen]
        out[key] = value
    return out


def legacy_added(folder: Path, named: set[str]) -> dict[int, tuple[str, bool]]:
    """added_tokens.json ({token: id}) as decoder entries {id: (token, special)}: special when
    the settings name it so far (transformers decides before the class completes them)."""
    path = folder / "added_tokens.json"
    data = read_object(path)
    for token, index in data.items():
        if not is_int(index) or index < 0:
            raise TokenizerError(f"{path}: token {token!r:.60} has id {index!r:.40}, not a "
                                 "non-negative integer")
    return {index: (token, token in named) for token, index in data.items()}


def _specials(names: dict[str, Any]) -> list[Any]:
    """The special tokens the settings name, in transformers' order."""
    out: list[Any] = [names.get(key) for key in NAMED_SPECIALS]
    for key in _LISTED_SPECIALS:
        listed = names.get(key)
        out += list(listed.values()) if isinstance(listed, dict) else \
            list(listed) if isinstance(listed, list) else []
    return out


def special_names(names: dict[str, Any]) -> set[str]:
    """The texts of the special tokens the settings name."""
    return {token_name(v) for v in _specials(names)} - {None}


def token_state(token: Any) -> tuple:
    """An AddedToken's content and flags (what transformers compares, through its repr)."""
    return tuple(getattr(token, k) for k in _ADDED_TOKEN_FIELDS)


def _t5_sentinels(folder: Path, names: dict[str, Any]) -> list[Any]:
    """additional_special_tokens as T5Tokenizer completes it: `extra_ids` sentinels
    <extra_id_0>.. when the list is absent, or appended when it holds none."""
    listed = names.get("additional_special_tokens")
    extra = names.get("extra_ids", DEFAULT_EXTRA_IDS)
    extra = extra if is_int(extra) and extra >= 0 else 0
    if extra > MAX_EXTRA_IDS:
        raise TokenizerError(f"{folder / 'tokenizer_config.json'}: extra_ids {extra} is more "
                             f"sentinels than a vocabulary holds (at most {MAX_EXTRA_IDS})")
    sentinels = [f"<extra_id_{i}>" for i in range(extra)]
    if not isinstance(listed, list):
        return sentinels
    if not any("<extra_id_" in str(token_name(v)) for v in listed):
        return listed + sentinels
    return listed

