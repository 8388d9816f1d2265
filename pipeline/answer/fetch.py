"""The read path of an episode's cache: from the local disk tier or the store, verified as parsed.

The object's SHA-256 is checked against the manifest while it is parsed
(`pipeline.store.cache_format.read_parsed`); a bad object raises `CacheCorruptError` naming it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from pipeline.answer.lru import CacheLRU
from pipeline.kv.cache import EpisodicCache
from pipeline.store import cache_format
from pipeline.store.base import Store
from pipeline.store.disk_tier import DiskTier
from pipeline.store.manifest import CacheRef


class Fetched(NamedTuple):
    data: bytes  # the object, verified against the manifest's SHA-256
    parsed: object  # what the fetch's `parse` made of it (None without one)
    from_disk: bool  # read from the local disk tier, not the store


def fetch_object(store: Store, ref: CacheRef, disk: DiskTier | None = None,
                 parse: Callable[[bytes], object] | None = None) -> Fetched:
    """An episode's object from the local disk tier if it holds it, else from the store (then
    kept in the tier), with `parse` run on it while its SHA-256 is checked against the manifest
    (`cache_format.read_parsed`). A bad object raises `CacheCorruptError` naming it; a bad disk file
    is fetched again."""
    key, expected = ref.object_key, ref.sha256

    def from_store() -> tuple[bytes, object]:
        with store.open(key) as f:
            return cache_format.read_parsed(f, expected, key, ref.object_bytes or None, parse)

    if disk is None:
        return Fetched(*from_store(), False)
    return Fetched(*disk.load(expected, key, from_store, parse))


def cache_parser(ref: CacheRef, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> Callable[[bytes], EpisodicCache]:
    """The `parse` of `fetch_object` that rebuilds an episode's `EpisodicCache`."""
    return lambda data: cache_format.parse(data, ref.object_key, dtype=dtype, device=device)[0]


def fetch_cache(store: Store, ref: CacheRef, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", disk: DiskTier | None = None) -> EpisodicCache:
    """An episode's cache (from the disk tier if given and holding it), its object's SHA-256
    checked against the manifest while it is parsed; a bad object raises `CacheCorruptError`
    naming it."""
    return fetch_object(store, ref, disk, cache_parser(ref, dtype, device)).parsed


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
