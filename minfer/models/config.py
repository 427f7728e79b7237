"""Typed reads of config.json values, shared by the model families' config parsers.

Every failure is a `ConfigError` of one line naming the file and the key. The rules are strict on
purpose (JSON is typed; a lenient read turns a typo into a silently different model):
- a boolean is a JSON boolean: "false" is not false, and 0/1 are not booleans;
- an integer is a JSON integer: not a boolean (true is not 1), not a float (2.0 is not 2);
- sizes have a cap (stated in the message) far above any real model, so that absurd values
  (d_model 10**400) fail here instead of overflowing in NumPy later;
- a token id is an integer in 0..vocab_size-1;
- JSON null means "absent" only for the keys a parser declares nullable (HF writes null for a few,
  e.g. num_decoder_layers: null = as many as the encoder).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import ConfigError
from ..io.limits import MAX_LENGTH, is_int
from ..io.limits import short_repr

# Caps on sizes (inclusive). Widths: the largest released models are ~2**15 wide; 2**20 leaves
# room and keeps (width x width) products far from int64 overflow. Counts of layers / heads /
# buckets: 2**16. Vocabularies, lengths: 2**31 - 1 (token ids are int32-sized everywhere else).
MAX_WIDTH = 2**20
MAX_COUNT = 2**16
MAX_VOCAB = MAX_LENGTH

_MISSING = object()


class ConfigReader:
    """Typed reads of config.json values with one-line errors naming the file and key (shared by
    the model families' config parsers)."""

    def __init__(self, cfg: dict, source: str):
        self.cfg, self.source = cfg, source

    def fail(self, key: str, what: str, value: Any) -> ConfigError:
        return ConfigError(f"{self.source}: '{key}' must be {what}, got {short_repr(value)}")

    def _get(self, key: str, default: Any, nullable: bool) -> Any:
        value = self.cfg.get(key, _MISSING)
        if value is _MISSING or (value is None and nullable):
            return default
        return value

    def get_int(self, key: str, default: int | None = None, minimum: int = 1,
                maximum: int = MAX_LENGTH, nullable: bool = False) -> int:
        value = self._get(key, default, nullable)
        if not is_int(value) or not minimum <= value <= maximum:
            raise self.fail(key, f"an integer in {minimum}..{maximum}", value)
        return value

    def get_bool(self, key: str, default: bool, nullable: bool = False) -> bool:
        value = self._get(key, default, nullable)
        if not isinstance(value, bool):
            raise self.fail(key, "a JSON boolean (true or false)", value)
        return value

    def get_str(self, key: str, default: str, choices: Sequence[str] | None = None,
                nullable: bool = False) -> str:
        value = self._get(key, default, nullable)
        if not isinstance(value, str) or (choices is not None and value not in choices):
            raise self.fail(key, "a string" if choices is None else
                            f"one of {', '.join(map(repr, choices))}", value)
        return value

    def get_eps(self, key: str, default: float) -> float:
        value = self._get(key, default, False)
        # float(value) cannot overflow: the bounds are checked on the JSON number first
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise self.fail(key, "a small number in [0, 1)", value)
        return float(value)

    def get_int_list(self, key: str, default: list[int], minimum: int = 0,
                     maximum: int = MAX_LENGTH) -> list[int]:
        value = self._get(key, default, False)
        if not isinstance(value, list) or not all(is_int(v) and minimum <= v <= maximum
                                                  for v in value):
            raise self.fail(key, f"a list of integers in {minimum}..{maximum}", value)
        return list(value)

    def get_bool_list(self, key: str, default: list[bool], length: int) -> list[bool]:
        value = self._get(key, default, False)
        if (not isinstance(value, list) or len(value) != length
                or not all(isinstance(v, bool) for v in value)):
            raise self.fail(key, f"a list of {length} JSON booleans", value)
        return list(value)

    def get_id(self, key: str, default: int | None, vocab_size: int,
               nullable: bool = False) -> int | None:
        """One token id in 0..vocab_size-1 (None only as the default of a nullable key)."""
        value = self._get(key, default, nullable)
        if value is None and nullable:
            return None
        if not is_int(value) or not 0 <= value < vocab_size:
            raise self.fail(key, f"a token id (an integer in 0..{vocab_size - 1})", value)
        return value

    def get_ids(self, key: str, default: int | list[int], vocab_size: int) -> tuple[int, ...]:
        """A token id or a non-empty list of them (HF allows both for eos_token_id)."""
        value = self._get(key, default, False)
        ids = value if isinstance(value, list) else [value]
        if not ids or not all(is_int(i) and 0 <= i < vocab_size for i in ids):
            raise self.fail(key, f"a token id or a non-empty list of token ids "
                                 f"(integers in 0..{vocab_size - 1})", value)
        return tuple(ids)


# Architecture-name prefixes -> model_type, for configs that omit model_type (old saves; some
# UMT5 text encoders name only "UMT5EncoderModel"); the first matching prefix wins
# (registry.register puts a new family's first).
ARCHITECTURE_TYPES = [("UMT5", "umt5"), ("MT5", "mt5"), ("LongT5", "longt5"), ("T5", "t5"),
                      ("TransfoXL", "transfo-xl")]


def model_type_of(cfg: dict, default: str = "t5") -> Any:
    """config.json's model_type; when absent, the one its `architectures` names (e.g.
    "UMT5EncoderModel" -> "umt5"); else `default` (old T5 saves have neither). A model_type that
    is present is returned as it is (its type is the caller's to check)."""
    if "model_type" in cfg:
        return cfg["model_type"]
    names = cfg.get("architectures")
    for name in names if isinstance(names, list) else ():
        for prefix, model_type in ARCHITECTURE_TYPES:
            if isinstance(name, str) and name.startswith(prefix):
                return model_type
    return default
