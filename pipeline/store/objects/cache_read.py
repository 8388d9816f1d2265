"""The read path's one way into the store: an episode's object, verified, handed over whole.

From the local disk tier when one is given and holds it, else from the store (then kept in the
tier). The object's length and SHA-256 are checked against the manifest here, and a cache is
parsed beside the hash (`cache_format.verifying`), so nothing made from bad bytes leaves this
module: a bad store object raises `CacheCorruptError` naming it; a bad disk file is deleted and
fetched again. Concurrent reads of one object through one tier fetch it once. The caller says
what it wants (the cache, at a dtype and device, or the bytes alone), never how to parse.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pipeline.kv.cache import EpisodicCache
from pipeline.store.backends.base import ObjectNotFound, Store
from pipeline.store.objects import cache_format
from pipeline.store.objects.cache_format import CacheCorruptError, ChecksumError
from pipeline.store.objects.cache_ref import CacheRef
from pipeline.store.objects.disk_tier import SUFFIX, DiskTier


class Verified(NamedTuple):
    data: bytes  # the object, its length and SHA-256 those the manifest records
    cache: EpisodicCache | None  # parsed from it (None from `read_bytes`)
    from_disk: bool  # read from the local disk tier, not the store


class _ParseAs(NamedTuple):
    dtype: torch.dtype
    device: str | torch.device


def read_cache(store: Store, ref: CacheRef, disk: DiskTier | None = None,
               dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> Verified:
    """An episode's cache, verified (its SHA-256 checked beside the parse), as `dtype` on
    `device`."""
    return _read(store, ref, disk, _ParseAs(dtype, device))


def read_bytes(store: Store, ref: CacheRef, disk: DiskTier | None = None) -> Verified:
    """An episode's object, verified, unparsed (a prefetch into the disk tier)."""
    return _read(store, ref, disk, None)


def _read(store: Store, ref: CacheRef, disk: DiskTier | None, parse_as: _ParseAs | None
          ) -> Verified:
    if disk is None:
        return _from_store(store, ref, parse_as)
    while True:
        found = _from_disk(disk, ref, parse_as)
        if found is not None:
            return found
        with disk.fetching(ref.sha256) as first:
            if first:
                got = _from_store(store, ref, parse_as)
                disk.put(ref.sha256, got.data)
                return got
        # another thread fetched it meanwhile (or failed, and this one tries): read the tier


# What a reader that meets a damaged object says repairs it (`pipeline.builder.repair`): a
# build's skip check finds a missing or resized object; --verify also reads and checksums
REPAIR_HINT = ("the build run again repairs it (python -m jobs.build, the same --corpus and "
               "--store, with --verify)")


def _from_store(store: Store, ref: CacheRef, parse_as: _ParseAs | None) -> Verified:
    """The store's object, verified; a damaged or missing one's error says what repairs it."""
    try:
        with store.open(ref.object_key) as f:
            data = cache_format.read_object(f, ref.object_key, ref.object_bytes or None)
        return Verified(data, _verify(data, ref.sha256, ref.object_key, parse_as), False)
    except (CacheCorruptError, ObjectNotFound) as e:
        raise type(e)(f"{e}; {REPAIR_HINT}") from None


def _from_disk(disk: DiskTier, ref: CacheRef, parse_as: _ParseAs | None) -> Verified | None:
    """The tier's copy, verified; None when it has none, or a corrupt one (then deleted). A
    parse error of verified bytes is raised: the store's copy is the same object."""
    data = disk.read(ref.sha256)
    if data is None:
        return None
    name = f"{ref.object_key} (disk tier {ref.sha256}{SUFFIX})"
    try:
        cache = _verify(data, ref.sha256, name, parse_as)
    except ChecksumError as e:
        disk.discard(ref.sha256, e)
        return None
    disk.touch(ref.sha256)
    return Verified(data, cache, True)


def _verify(data: bytes, sha256: str, name: str, parse_as: _ParseAs | None
            ) -> EpisodicCache | None:
    """The cache parsed from `data` (hashed beside the parse), or None with the hash alone;
    `ChecksumError` naming the object unless it is the manifest's."""
    if parse_as is None:
        cache_format.check_sha256(cache_format.sha256(data), sha256, name)
        return None
    with cache_format.verifying(data, sha256, name):
        return cache_format.parse(data, name, parse_as.dtype, parse_as.device)[0]
