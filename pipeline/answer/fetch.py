"""The answer path's reads: the cache a question reads through the in-memory LRU.

Fetching, the disk tier and the checksum (checked against the manifest beside the parse) are
the store's (`pipeline.store.objects.cache_read`): a bad object raises `CacheCorruptError` naming
it.
"""

from __future__ import annotations

from typing import Callable

from pipeline.answer.lru import CacheLRU
from pipeline.kv.cache import EpisodicCache
from pipeline.store.objects.cache_ref import CacheRef


def resident_read(caches: CacheLRU, refs: tuple[CacheRef, ...],
                  load: Callable[[CacheRef], EpisodicCache]) -> tuple[EpisodicCache, bool]:
    """The cache a question reads, through the LRU: its episode's (`load(ref)` when not
    resident), or two episodes' joined (`EpisodicCache.joined`, resident as one entry keyed by
    both objects); hit when nothing was fetched."""
    parts = [caches.get_or_load((ref.object_key, ref.sha256), lambda ref=ref: load(ref))
             for ref in refs]
    if len(parts) == 1:
        return parts[0]
    key = tuple(k for ref in refs for k in (ref.object_key, ref.sha256))
    joined, _ = caches.get_or_load(key, lambda: EpisodicCache.joined([c for c, _ in parts]))
    return joined, all(hit for _, hit in parts)
