"""The cold path: checksums verified beside the parse, the bounded local-disk tier
(re-verified reads, corrupt files fetched again, restarts that never read the store) and the
decoder's prefetch of a conversation's other episodes. Tiny random models, local stores."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pipeline.kv import models
from pipeline.kv.methods.epicache import EpiCache
from pipeline.kv.prefill import PrefillConfig, block_prefill
from pipeline.store.backends.base import cache_key
from pipeline.store.backends.local import LocalStore
from pipeline.store.objects import cache_format
from pipeline.store.objects.cache_format import CacheCorruptError, ChecksumError, serialize, sha256
from pipeline.store.objects.cache_read import read_bytes, read_cache
from pipeline.store.objects.cache_ref import CacheRef
from pipeline.store.objects.disk_tier import DiskTier
from tests.support.tiny_models import StandIn, one_torch_thread, random_ids, tiny_model  # noqa: F401

MODEL = "tiny-llama"


class CountingStore(LocalStore):
    """A local store that counts the objects read from it (`open` and `get`), each read taking
    `delay` seconds."""

    def __init__(self, root, delay: float = 0.0):
        super().__init__(root)
        self.reads: list[str] = []
        self.delay = delay

    def open(self, key):
        self.reads.append(key)
        time.sleep(self.delay)
        return super().open(key)

    def get(self, key):
        self.reads.append(key)
        return super().get(key)


@pytest.fixture(scope="module")
def objects():
    """Three serialized caches of a tiny Llama (ragged heads), as a build stores them."""
    model = tiny_model("llama")
    out = []
    for seed in range(3):
        cache, _ = block_prefill(model, random_ids(60, seed=seed), EpiCache(patch=random_ids(5)),
                                 [10, 12, 14], PrefillConfig(block=8, selection="headwise"))
        out.append(serialize(cache, {"conversation_id": "conv-1", "episode": seed}))
    return model, out


def _rows(store, objects) -> list[CacheRef]:
    rows = []
    for episode, data in enumerate(objects):
        key = cache_key("conv-1", "abcd", episode)
        store.put(key, data)
        rows.append(CacheRef(conversation_id="conv-1", episode=episode, object_key=key,
                             sha256=sha256(data), object_bytes=len(data), model_id=MODEL,
                             encoder_id="enc", model_fingerprint=StandIn(None).fingerprint,
                             encoder_fingerprint="enc-files"))
    return rows


def _same(a, b) -> bool:
    return all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
               and torch.equal(x.valid, y.valid) and torch.equal(x.positions, y.positions)
               for x, y in zip(a.layers, b.layers))


# ---------------------------------------------------------------------------------------------
# Streaming checksum
# ---------------------------------------------------------------------------------------------

def test_read_checks_length_and_checksum_beside_the_parse(tmp_path, objects, monkeypatch):
    """The store hands over a cache only from bytes of the manifest's length and SHA-256; the
    hash runs beside the parse, and whatever the parse made of bad bytes is dropped."""
    data = objects[1][0]
    store = LocalStore(tmp_path)
    [ref] = _rows(store, [data])
    parsed, parse = [], cache_format.parse
    monkeypatch.setattr(cache_format, "parse", lambda *a, **k: parsed.append(1) or parse(*a, **k))
    for size in (len(data), None):  # the recorded size, and none
        read = read_cache(store, dataclasses.replace(ref, object_bytes=size))
        assert read.data == data and read.cache.tokens_seen == 60 and not read.from_disk
    assert read_bytes(store, ref)[:2] == (data, None) and len(parsed) == 2  # no parse
    flipped = bytearray(data)
    flipped[-50] ^= 0xFF
    store.put(ref.object_key, bytes(flipped))
    with pytest.raises(ChecksumError, match=f"cache object {ref.object_key} failed its "
                                            "checksum"):  # the parse ran, and is dropped
        read_cache(store, ref)
    assert len(parsed) == 3
    with pytest.raises(ChecksumError, match="failed its checksum"):
        read_bytes(store, ref)
    garbage = b"not a cache at all"
    store.put(ref.object_key, garbage)
    bad = dataclasses.replace(ref, object_bytes=len(garbage))
    with pytest.raises(ChecksumError, match="failed its checksum"):  # over the parse's own error
        read_cache(store, bad)
    with pytest.raises(CacheCorruptError, match="not a readable episodic cache") as e:
        read_cache(store, dataclasses.replace(bad, sha256=sha256(garbage)))
    assert not isinstance(e.value, ChecksumError)  # good bytes: the parse's error is the caller's
    for stored, error in ((data[:-10], "is truncated"), (data + b"x", "longer than its recorded")):
        store.put(ref.object_key, stored)
        with pytest.raises(ChecksumError, match=error):
            read_cache(store, ref)
    assert len(parsed) == 5  # a wrong length is found before any parse
    store.put(ref.object_key, data)
    huge = dataclasses.replace(ref, object_bytes=2**40)  # a manifest's size is not allocated
    with pytest.raises(ChecksumError, match=f"is truncated \\({len(data)} of {2**40} bytes"):
        read_cache(store, huge)


def test_fetch_of_a_corrupt_store_object_raises_naming_it(tmp_path, objects):
    store = LocalStore(tmp_path / "store")
    rows = _rows(store, objects[1])
    data = bytearray(store.get(rows[0].object_key))
    data[-100] ^= 0xFF
    store.put(rows[0].object_key, bytes(data))
    disk = DiskTier(tmp_path / "disk", 10**9)
    with pytest.raises(CacheCorruptError, match=rows[0].object_key):
        read_cache(store, rows[0], disk).cache
    assert rows[0].sha256 not in disk  # a bad object never reaches the tier


# ---------------------------------------------------------------------------------------------
# The disk tier
# ---------------------------------------------------------------------------------------------

def test_disk_tier_is_bounded_and_evicts_least_recently_read(tmp_path, objects):
    data = objects[1]
    size = max(len(d) for d in data)
    disk = DiskTier(tmp_path, 2 * size + size // 2)  # room for two objects, not three
    a, b, c = (sha256(d) for d in data)
    disk.put(a, data[0])
    time.sleep(0.01)
    disk.put(b, data[1])
    time.sleep(0.01)
    disk.touch(a)  # a is now the most recently read
    time.sleep(0.01)
    disk.put(c, data[2])
    assert a in disk and c in disk and b not in disk
    assert disk.bytes <= disk.max_bytes and disk.stats()["evictions"] == 1
    small = DiskTier(tmp_path / "small", size - 1)
    small.put(a, data[0])  # larger than the whole budget: not stored
    assert a not in small and small.bytes == 0
    assert not list(tmp_path.glob(".tmp-*"))  # temporaries renamed into place or removed


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_disk_file_is_deleted_and_fetched_again_never_served(tmp_path, objects, damage):
    model, data = objects
    store = CountingStore(tmp_path / "store")
    rows = _rows(store, data)
    disk = DiskTier(tmp_path / "disk", 10**9)
    reference = read_cache(store, rows[0], disk).cache
    assert len(store.reads) == 1 and rows[0].sha256 in disk
    path = disk.root / f"{rows[0].sha256}.safetensors"
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0xFF
    damaged = bytes(raw) if damage == "flip" else bytes(raw[: len(raw) // 2])
    path.write_bytes(damaged)
    assert read_bytes(store, rows[0], disk).from_disk is False  # deleted, fetched again
    assert len(store.reads) == 2 and path.read_bytes() == data[0]
    path.write_bytes(damaged)
    again = read_cache(store, rows[0], disk).cache  # detected, deleted, fetched from the store
    assert len(store.reads) == 3 and _same(again, reference)
    assert disk.stats()["corrupt"] == 2 and path.read_bytes() == data[0]


def test_restart_reads_nothing_from_the_store(tmp_path, objects):
    model, data = objects
    store = CountingStore(tmp_path / "store")
    rows = _rows(store, data)
    first = DiskTier(tmp_path / "disk", 10**9)
    loaded = [read_cache(store, r, first).cache for r in rows]
    assert len(store.reads) == 3
    restarted = DiskTier(tmp_path / "disk", 10**9)  # a new process over the same folder
    for row, before in zip(rows, loaded):
        assert _same(read_cache(store, row, restarted).cache, before)
    assert len(store.reads) == 3 and restarted.stats()["hits"] == 3


def test_concurrent_loads_of_one_object_fetch_once(tmp_path, objects):
    store = CountingStore(tmp_path / "store", delay=0.2)
    [ref] = _rows(store, objects[1][:1])
    disk = DiskTier(tmp_path / "disk", 10**9)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: read_bytes(store, ref, disk), range(6)))
    assert len(store.reads) == 1 and all(r.data == objects[1][0] for r in results)
    assert sum(not r.from_disk for r in results) == 1


def test_two_tiers_sharing_a_folder_keep_one_bound(tmp_path, objects):
    """Two replicas on one folder: the bound holds over both (eviction under one flock)."""
    data = objects[1]
    size = max(len(d) for d in data)
    one, two = DiskTier(tmp_path, 2 * size), DiskTier(tmp_path, 2 * size)
    threads = [threading.Thread(target=tier.put, args=(sha256(d), d))
               for tier, d in zip((one, two, one), data)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert one.bytes <= 2 * size and len(one.stats()["dir"]) > 0
    assert sum(sha256(d) in two for d in data) == 2


# ---------------------------------------------------------------------------------------------
# The decoder deployment's load path: restart from disk, prefetch
# ---------------------------------------------------------------------------------------------

def _decoder(tmp_path, model, monkeypatch, store, cache_bytes=10**9, disk=True):
    """A decoder replica (disk tier under `tmp_path`) reading `store` (a CountingStore)."""
    from pipeline.serve.decoder import Decoder
    from pipeline.serve.settings import ServeSettings

    monkeypatch.setattr(models, "load_llm", lambda name, device=None, dtype=None: StandIn(model))
    monkeypatch.setattr(gc, "freeze", lambda: None)  # a replica's process, not pytest's
    settings = ServeSettings(store=str(tmp_path / "store"), cache_bytes=cache_bytes,
                             disk_cache=str(tmp_path / "disk") if disk else None,
                             disk_cache_bytes=10**9, prefetch_workers=1)
    decoder = Decoder.func_or_class(settings, MODEL)
    decoder.store = store
    return decoder


def _wait(decoder, done, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        f = decoder.stats()
        if f["prefetch_fetched"] + f["prefetch_skipped"] + f["prefetch_failed"] >= done:
            return f
        time.sleep(0.05)
    raise AssertionError(f"prefetch did not finish: {decoder.stats()}")


def test_decoder_restart_is_served_from_the_disk_tier(tmp_path, objects, monkeypatch):
    model, data = objects
    store = CountingStore(tmp_path / "store")
    rows = _rows(store, data)
    decoder = _decoder(tmp_path, model, monkeypatch, store)
    for row in rows:
        assert decoder._cache(row)[1] is False
    assert len(store.reads) == 3 and decoder.stats()["store_reads"] == 3
    restarted = _decoder(tmp_path, model, monkeypatch, store)
    for row in rows:
        cache, hit, _ = restarted._cache(row)
        assert hit is False and _same(cache, decoder._cache(row)[0])
    stats = restarted.stats()
    assert len(store.reads) == 3 and (stats["store_reads"], stats["disk_reads"]) == (0, 3)


def test_prefetch_loads_the_other_episodes(tmp_path, objects, monkeypatch):
    model, data = objects
    store = CountingStore(tmp_path / "store")
    rows = _rows(store, data)
    decoder = _decoder(tmp_path, model, monkeypatch, store)
    decoder._cache(rows[0])
    assert decoder.prefetch(rows[1:]) == 2
    stats = _wait(decoder, 2)
    assert (stats["prefetch_fetched"], stats["prefetch_resident"], stats["prefetch_failed"]) == \
        (2, 2, 0)
    assert all(r.sha256 in decoder.disk for r in rows)
    assert decoder._cache(rows[2])[1] is True and len(store.reads) == 3  # resident: no fetch
    # A budget with no room: the prefetch goes to disk only, the cache in use stays resident.
    (tmp_path / "tight" / "store").mkdir(parents=True)
    tight = _decoder(tmp_path / "tight", model, monkeypatch, store, cache_bytes=0)
    tight._cache(rows[0])
    assert tight.prefetch(rows[1:]) == 2
    stats = _wait(tight, 2)
    assert stats["prefetch_resident"] == 0 and stats["entries"] == 1
    assert all(r.sha256 in tight.disk for r in rows[1:])


def test_prefetch_errors_are_counted_not_raised(tmp_path, objects, monkeypatch):
    model, data = objects
    store = CountingStore(tmp_path / "store")
    rows = _rows(store, data)
    decoder = _decoder(tmp_path, model, monkeypatch, store, disk=False)
    missing = dataclasses.replace(rows[1], object_key="caches/conv-1/abcd/episode-9.safetensors")
    wrong_model = dataclasses.replace(rows[2], model_id="another-model")
    assert decoder.prefetch([missing, wrong_model]) == 1  # the other model's is not queued
    stats = _wait(decoder, 2)
    assert stats["prefetch_failed"] == 2 and stats["entries"] == 0
