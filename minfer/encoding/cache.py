"""An exact cache of encoder outputs: one row's states (T, C) float32 on the host under the key
(model identity, the row's token ids, the mask the encoder saw), least recently used first out
of a byte budget. Beside the rows it keeps callers' renderings of them (`put_answer`: the
server's encoded answer of an input, per dtype and format), under keys of their own, in the same
budget and the same LRU order, so a repeated request is a lookup: no conversion, no copy.

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
from typing import Any

import numpy as np

from ..arena import parse_bytes
from ..errors import ConfigError

_KEY_OVERHEAD = 256   # bytes counted per entry beside its states (key, table slot, array header)


@dataclass
class CacheStats:
    """The counters /metrics reads: lookups that hit and missed, entries stored and evicted,
    bytes held against the budget."""
    hits: int = 0
    misses: int = 0
    stored: int = 0
    evicted: int = 0
    bytes: int = 0
    entries: int = 0
    budget: int = 0


def row_key(model_id: str, ids: np.ndarray | list[int], mask: np.ndarray) -> bytes:
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
    """Encoder rows (and callers' answers made from them) by key, within `budget` bytes, least
    recently used evicted first."""

    def __init__(self, budget: int | str):
        self.budget = parse_bytes(budget, "encode_cache")
        if self.budget <= 0:
            raise ConfigError(f"encode_cache: the budget must be positive, got {budget!r}")
        # key -> (the states or the caller's answer, the bytes it counts against the budget)
        self._rows: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = CacheStats(budget=self.budget)

    def get(self, key: bytes) -> np.ndarray | None:
        """The stored (T, C) states of that key (read-only: copy before writing), or None."""
        return self._take(key, count_miss=True)

    def get_answer(self, key: bytes) -> Any:
        """What `put_answer` kept under that key, or None. A miss is not counted: the caller
        then looks its row up (`get`, through the model), which counts it."""
        return self._take(key, count_miss=False)

    def _take(self, key: bytes, count_miss: bool) -> Any:
        with self._lock:
            entry = self._rows.get(key)
            if entry is None:
                self._stats.misses += int(count_miss)
                return None
            self._rows.move_to_end(key)
            self._stats.hits += 1
            return entry[0]

    def put(self, key: bytes, states: np.ndarray) -> None:
        """Keep a copy of (T, C) float32 states under `key`, evicting the least recently used
        entries until they fit; states bigger than the whole budget are not kept."""
        if states.nbytes + _KEY_OVERHEAD > self.budget:
            return
        kept = np.array(states, np.float32, copy=True)
        kept.flags.writeable = False
        self._keep(key, kept, kept.nbytes)

    def put_answer(self, key: bytes, answer: Any, nbytes: int) -> None:
        """Keep a caller's answer (immutable: kept as given, no copy) of `nbytes` bytes under
        `key`, as `put` keeps rows."""
        self._keep(key, answer, nbytes)

    def _keep(self, key: bytes, value: Any, nbytes: int) -> None:
        size = nbytes + _KEY_OVERHEAD
        if size > self.budget:
            return
        with self._lock:
            old = self._rows.pop(key, None)
            if old is not None:
                self._stats.bytes -= old[1]
            while self._rows and self._stats.bytes + size > self.budget:
                _, gone = self._rows.popitem(last=False)
                self._stats.bytes -= gone[1]
                self._stats.evicted += 1
            self._rows[key] = (value, size)
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
