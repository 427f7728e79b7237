"""An exact cache of encoder outputs: one row's states (T, C) float32 on the host under the key
(model identity, the row's token ids, the mask the encoder saw), least recently used first out
of a byte budget.

Exact match only: a hit hands back the very bytes the miss stored (a copy of them), so a cached
call and an uncached one return the same result. The states live outside the arena (host
memory), counted against the budget; a row bigger than the whole budget is not kept. One lock
guards the table: threads share a model, and with it its cache.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..arena import parse_bytes
from ..errors import ConfigError

_KEY_OVERHEAD = 256   # bytes counted per entry beside its states (key, table slot, array header)


@dataclass
class CacheStats:
    """The counters /metrics reads: lookups that hit and missed, rows stored and evicted, bytes
    held against the budget."""
    hits: int = 0
    misses: int = 0
    stored: int = 0
    evicted: int = 0
    bytes: int = 0
    entries: int = 0
    budget: int = 0


def row_key(model_id: str, ids: np.ndarray, mask: np.ndarray) -> bytes:
    """The key of one encoder row: the model identity, its (T,) token ids and the (T,) mask the
    encoder attends with (ones when a pipeline runs it without a mask), as a 32-byte digest.
    BLAKE2b keeps a 512-token row's key small; a collision would need 2**128 rows."""
    h = hashlib.blake2b(digest_size=32)
    h.update(model_id.encode("utf-8", "surrogatepass") + b"\0")
    h.update(np.ascontiguousarray(ids, np.int64).tobytes())
    h.update(b"\0mask\0")
    h.update(np.ascontiguousarray(mask, np.int8).tobytes())
    return h.digest()


class EncodeCache:
    """Encoder rows by key, within `budget` bytes, least recently used evicted first."""

    def __init__(self, budget: int | str):
        self.budget = parse_bytes(budget, "encode_cache")
        if self.budget <= 0:
            raise ConfigError(f"encode_cache: the budget must be positive, got {budget!r}")
        self._rows: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = CacheStats(budget=self.budget)

    def get(self, key: bytes) -> np.ndarray | None:
        """The stored (T, C) states of that key (read-only: copy before writing), or None."""
        with self._lock:
            states = self._rows.get(key)
            if states is None:
                self._stats.misses += 1
                return None
            self._rows.move_to_end(key)
            self._stats.hits += 1
            return states

    def put(self, key: bytes, states: np.ndarray) -> None:
        """Keep a copy of (T, C) float32 states under `key`, evicting the least recently used
        rows until they fit; states bigger than the whole budget are not kept."""
        size = states.nbytes + _KEY_OVERHEAD
        if size > self.budget:
            return
        kept = np.array(states, np.float32, copy=True)
        kept.flags.writeable = False
        with self._lock:
            old = self._rows.pop(key, None)
            if old is not None:
                self._stats.bytes -= old.nbytes + _KEY_OVERHEAD
            while self._rows and self._stats.bytes + size > self.budget:
                _, gone = self._rows.popitem(last=False)
                self._stats.bytes -= gone.nbytes + _KEY_OVERHEAD
                self._stats.evicted += 1
            self._rows[key] = kept
            self._stats.bytes += size
            self._stats.stored += 1

    def stats(self) -> CacheStats:
        """A snapshot of the counters."""
        with self._lock:
            return CacheStats(**{**vars(self._stats), "entries": len(self._rows)})

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self._stats.bytes = 0
