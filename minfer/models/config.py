"""Typed reads of config.json values, shared by the model families' config parsers.

Every failure is a `ConfigError` of one line naming the file and the key.
"""

from __future__ import annotations

from ..errors import ConfigError


class ConfigReader:
    """Typed reads of config.json values with one-line errors naming the file and key (shared by
    the model families' config parsers)."""

    def __init__(self, cfg: dict, source: str):
        self.cfg, self.source = cfg, source

    def get_int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{self.source}: '{key}' must be an integer >= {minimum}, got {value!r}")
        return value

    def get_eps(self, key: str, default: float) -> float:
        value = self.cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ConfigError(f"{self.source}: '{key}' must be a small number, got {value!r}")
        return float(value)
