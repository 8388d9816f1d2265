"""The answer path's reads: an episode's cache as the store hands it over, verified, and the
cache a question reads through the in-memory LRU.

Fetching, the disk tier and the checksum (checked against the manifest beside the parse) are
the store's (`pipeline.store.objects.cache_read`): a bad object raises `CacheCorruptError` naming
it.
"""

from __future__ import annotations

from typing import Callable

import torch

from pipeline.answer.lru import CacheLRU
from pipeline.kv.cache import EpisodicCache
from pipeline.store.backends.base import Store
from pipeline.store.objects.cache_read import read_cache
from pipeline.store.objects.cache_ref import CacheRef
from pipeline.store.objects.disk_tier import DiskTier


def fetch_cache(store: Store, ref: CacheRef, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", disk: DiskTier | None = None) -> EpisodicCache:
    """An episode's cache (from the disk tier if given and holding it), its object's SHA-256
    checked against the manifest while it is parsed; a bad object raises `CacheCorruptError`
    naming it."""
    return read_cache(store, ref, disk, dtype, device).cache


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
