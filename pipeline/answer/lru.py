"""Values kept resident under a byte budget, least recently used evicted first: the decoder's
loaded caches, the router's conversation manifests (`pipeline.answer.plan`).

torch is imported only to size a cache (`resident_bytes`), so that the plan step, which keeps
manifests here, loads without it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pipeline.kv.cache import EpisodicCache


def resident_bytes(cache: EpisodicCache) -> int:
    """Bytes a loaded cache holds in memory (padded slots, masks and positions included)."""
    import torch

    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None), layer.valid,
                  layer.positions):
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total


class CacheLRU:
    """Loaded values (episodic caches by default, sized by `resident_bytes`) under a byte
    budget, least recently used evicted first.

    The most recently used entry is never evicted, whatever its size, so the cache of the
    previous turn is always resident (a budget of 0 keeps exactly that one). Concurrent
    requests for the same key load it once: the others wait and count as hits. Thread-safe.
    """

    def __init__(self, max_bytes: int, sizeof: Callable[[object], int] = resident_bytes):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes, self._sizeof = max_bytes, sizeof
        self._entries: OrderedDict[object, tuple[object, int]] = OrderedDict()
        self._loading: dict[object, threading.Event] = {}
        self._lock = threading.Lock()
        self.bytes = self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get_or_load(self, key: object, loader: Callable[[], object]) -> tuple[object, bool]:
        """(value, True) if resident, else (loader(), False) after inserting it."""
        while True:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                    self.hits += 1
                    return entry[0], True
                pending = self._loading.get(key)
                owner = pending is None
                if owner:
                    pending = self._loading[key] = threading.Event()
            if not owner:
                pending.wait()
                continue  # now resident (a hit), or that load failed and this thread tries
            try:
                value = loader()
                size = int(self._sizeof(value))
            except BaseException:
                with self._lock:
                    del self._loading[key]
                pending.set()
                raise
            with self._lock:
                self.misses += 1
                self._entries[key] = (value, size)
                self.bytes += size
                while self.bytes > self.max_bytes and len(self._entries) > 1:
                    _, (_, freed) = self._entries.popitem(last=False)
                    self.bytes -= freed
                    self.evictions += 1
                del self._loading[key]
            pending.set()
            return value, False

    def offer(self, key: object, value: object) -> bool:
        """Insert `value` as the least recently used entry if it fits in the budget without
        evicting anything (a speculative load, e.g. a prefetch); False if it does not fit or
        the key is resident or loading."""
        size = int(self._sizeof(value))
        with self._lock:
            if key in self._entries or key in self._loading or self.bytes + size > self.max_bytes:
                return False
            self._entries[key] = (value, size)
            self._entries.move_to_end(key, last=False)
            self.bytes += size
            return True

    def discard(self, key: object, value: object | None = None) -> bool:
        """Drop `key` (only while it still holds `value`, when given: a stale entry is dropped
        without dropping a fresher one another thread put there meanwhile); False if absent.
        Its next `get_or_load` loads it again, once, whoever asks."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or (value is not None and entry[0] is not value):
                return False
            del self._entries[key]
            self.bytes -= entry[1]
            return True

    def stats(self) -> dict:
        with self._lock:
            lookups = self.hits + self.misses
            return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                    "hit_rate": round(self.hits / lookups, 4) if lookups else None}
