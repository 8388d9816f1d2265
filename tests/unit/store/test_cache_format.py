"""Cache objects on disk (safetensors round trip, checksums, corruption), the local store
(atomic writes, safe keys) and manifests. The build configuration's hash: tests/unit/config."""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.answer.decode import generate_from_cache
from pipeline.config import CodeConfig
from pipeline.corpus.schema import UnsafeIdError
from pipeline.kv.methods.epicache import EpiCache
from pipeline.kv.prefill import PrefillConfig, block_prefill
from pipeline.store.backends.base import StoreError, cache_key, check_key, manifest_key
from pipeline.store.backends.local import LocalStore
from pipeline.store.backends.uri import open_store
from pipeline.store.catalogue.manifest import (
    MANIFEST_SCHEMA,
    ManifestRecord,
    list_conversations,
    read_manifest,
    write_manifest,
)
from pipeline.store.objects.cache_format import (
    FORMAT,
    CacheCorruptError,
    deserialize,
    read_header,
    serialize,
    sha256,
)
from pipeline.store.objects.zstd_object import MAX_ZSTD_RATIO, ZSTD_MAGIC, decompressed
from tests.support.tiny_models import StandIn, one_torch_thread, random_ids, tiny_model  # noqa: F401

NAME = "caches/conv-1/abcd/episode-0.safetensors"


@pytest.fixture(scope="module")
def built():
    """(model, cache) after a head-wise budgeted block prefill: heads of unequal lengths."""
    model = tiny_model("llama")
    cache, _ = block_prefill(model, random_ids(70, seed=1), EpiCache(patch=random_ids(5, seed=2)),
                             [10, 14, 18], PrefillConfig(block=8, selection="headwise"))
    assert any(len(set(layer.valid.sum(1).tolist())) > 1 for layer in cache.layers)  # ragged heads
    return model, cache


def per_head_entries(cache):
    """[(keys, values, positions) of the valid entries] per layer and head."""
    return [[(layer.keys[0, h][layer.valid[h]], layer.values[0, h][layer.valid[h]],
              layer.positions[h][layer.valid[h]])
             for h in range(layer.valid.shape[0])] for layer in cache.layers]


# --------------------------------------------------------------------------------------------
# serialize / deserialize
# --------------------------------------------------------------------------------------------

def test_round_trip_float32_is_exact(built):
    """float32 storage: every head's valid keys, values and positions come back bit for bit,
    padding per head is rebuilt, tokens_seen is kept, and decoding gives the same tokens."""
    model, cache = built
    data = serialize(cache, {"conversation_id": "conv-1"}, dtype=torch.float32)
    loaded, header = deserialize(data, sha256(data), NAME)
    assert loaded.tokens_seen == cache.tokens_seen == 70
    assert loaded.entries_per_layer() == cache.entries_per_layer()
    for a_layer, b_layer in zip(per_head_entries(cache), per_head_entries(loaded)):
        for (ka, va, pos_a), (kb, vb, pos_b) in zip(a_layer, b_layer):
            assert torch.equal(ka, kb) and torch.equal(va, vb) and torch.equal(pos_a, pos_b)
    for a, b in zip(cache.layers, loaded.layers):
        assert torch.equal(a.valid.sum(1), b.valid.sum(1))
        assert b.valid.shape[1] == int(b.valid.sum(1).max())  # padded to the longest head only
    question = random_ids(4, seed=3)
    assert generate_from_cache(StandIn(model), loaded, question, 6).tolist() == \
        generate_from_cache(StandIn(model), cache, question, 6).tolist()


def test_round_trip_float16_within_half_precision(built):
    """float16 storage: values come back within fp16 rounding, positions exactly, and the
    object is about half the size of float32."""
    _, cache = built
    data16 = serialize(cache, {}, dtype=torch.float16)
    data32 = serialize(cache, {}, dtype=torch.float32)
    assert len(data16) < 0.6 * len(data32)
    loaded, header = deserialize(data16, None, NAME, dtype=torch.float32)
    assert header["dtype"] == "float16"
    assert loaded.layers[0].keys.dtype == torch.float32
    for a_layer, b_layer in zip(per_head_entries(cache), per_head_entries(loaded)):
        for (ka, va, pos_a), (kb, vb, pos_b) in zip(a_layer, b_layer):
            torch.testing.assert_close(kb, ka, atol=1e-3, rtol=1e-3)
            torch.testing.assert_close(vb, va, atol=1e-3, rtol=1e-3)
            assert torch.equal(pos_a, pos_b)


def test_header_fields(built):
    """The header keeps the caller's fields and adds format, tokens_seen, layers, KV heads,
    head dim and dtype; read_header reads it without loading tensors."""
    _, cache = built
    data = serialize(cache, {"conversation_id": "conv-1", "episode": 2, "config_hash": "abcd"},
                     dtype=torch.float16)
    header = read_header(data, NAME)
    assert header["conversation_id"] == "conv-1" and header["episode"] == 2
    assert header["config_hash"] == "abcd"
    assert header["format"] == FORMAT
    assert header["tokens_seen"] == 70 and header["num_layers"] == 3
    assert header["kv_heads"] == 2 and header["head_dim"] == 16 and header["dtype"] == "float16"
    assert deserialize(data, sha256(data), NAME)[1] == header


def test_flipped_byte_fails_checksum_naming_the_object(built):
    _, cache = built
    data = bytearray(serialize(cache, {}, dtype=torch.float16))
    expected = sha256(bytes(data))
    data[len(data) // 2] ^= 0x01  # inside the tensor data: parses fine, checksum must catch it
    with pytest.raises(CacheCorruptError, match="checksum") as info:
        deserialize(bytes(data), expected, NAME)
    assert NAME in str(info.value)


@pytest.mark.parametrize("garbage", [b"", b"not a cache at all", b"\xff" * 64,
                                     b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": [1, 2]}      "])
def test_garbage_bytes_are_corrupt_not_crashes(garbage):
    """Without a checksum, unparsable bytes still raise CacheCorruptError naming the object."""
    with pytest.raises(CacheCorruptError) as info:
        deserialize(garbage, None, NAME)
    assert NAME in str(info.value)


def test_truncated_object_is_corrupt(built):
    _, cache = built
    data = serialize(cache, {}, dtype=torch.float16)
    with pytest.raises(CacheCorruptError, match=NAME):
        deserialize(data[: len(data) - 100], None, NAME)


@pytest.mark.parametrize("code", [CodeConfig(zstd=1),
                                  CodeConfig(bits=4, value_bits=2, float_sinks=2, zstd=19)],
                         ids=["float16", "coded"])
def test_a_compressed_object_reads_back_as_the_plain_one(built, code):
    """`code.zstd` compresses the object whole (after its magic and length): fewer bytes, and
    the reader gives back exactly what the plain object gives, header and entries."""
    _, cache = built
    plain = serialize(cache, {"conversation_id": "conv-1"},
                      code=dataclasses.replace(code, zstd=None))
    packed = serialize(cache, {"conversation_id": "conv-1"}, code=code)
    assert packed[:8] == ZSTD_MAGIC and len(packed) < len(plain) and decompressed(plain) is plain
    assert decompressed(packed) == plain
    (a, a_header), (b, b_header) = (deserialize(d, sha256(d), NAME) for d in (plain, packed))
    assert a_header == b_header
    for a_layer, b_layer in zip(per_head_entries(a), per_head_entries(b)):
        for one, other in zip(a_layer, b_layer):
            assert all(torch.equal(x, y) for x, y in zip(one, other))


def test_a_damaged_compressed_object_is_corrupt_and_its_length_claim_is_bounded(built):
    """Every truncation and a length claim past `MAX_ZSTD_RATIO` times the object are
    `CacheCorruptError` naming it (the claim refused before anything is allocated); a flipped
    byte in the frame (zstd may decode it to other numbers) fails the object's checksum."""
    _, cache = built
    packed = serialize(cache, {}, code=CodeConfig(zstd=3))
    for cut in range(0, len(packed), max(1, len(packed) // 40)):
        with pytest.raises(CacheCorruptError, match=NAME):
            deserialize(packed[:cut], None, NAME)
    flipped = bytearray(packed)
    flipped[len(packed) // 2] ^= 0xFF
    with pytest.raises(CacheCorruptError, match=f"{NAME} failed its checksum"):
        deserialize(bytes(flipped), sha256(packed), NAME)
    claim = MAX_ZSTD_RATIO * len(packed) + 1
    huge = packed[:8] + struct.pack("<Q", claim) + packed[16:]
    with pytest.raises(CacheCorruptError, match=f"{claim:,} bytes"):
        deserialize(huge, None, NAME)
    short = packed[:8] + struct.pack("<Q", 10) + packed[16:]  # a length the frame does not have
    with pytest.raises(CacheCorruptError, match=NAME):
        deserialize(short, None, NAME)


def _object(header: dict, tensors: dict) -> bytes:
    import json

    from safetensors.torch import save
    return save(tensors, metadata={"header": json.dumps({"format": FORMAT} | header)})


INCONSISTENT = {
    "no layer count": _object({}, {"x": torch.zeros(1)}),
    "no layer tensors": _object({"num_layers": 1, "tokens_seen": 3}, {"x": torch.zeros(1)}),
    "lengths disagree with entries": _object(
        {"num_layers": 1, "tokens_seen": 4},
        {"layers.0.keys": torch.zeros(3, 4), "layers.0.values": torch.zeros(3, 4),
         "layers.0.lengths": torch.tensor([2, 2], dtype=torch.int32),
         "layers.0.positions": torch.arange(4)}),
}


@pytest.mark.parametrize("data", INCONSISTENT.values(), ids=INCONSISTENT.keys())
def test_inconsistent_object_is_corrupt(data):
    """An object with the right format marker whose contents do not add up (missing header
    field, missing layer tensors, per-head lengths that disagree with the entries) cannot be
    parsed: CacheCorruptError naming the object, not a bare KeyError / RuntimeError."""
    with pytest.raises(CacheCorruptError, match=NAME):
        deserialize(data, None, NAME)


def test_other_safetensors_file_is_rejected():
    """A valid safetensors file that is not an episodic cache: wrong format, named."""
    from safetensors.torch import save
    data = save({"x": torch.zeros(2)}, metadata={"header": '{"format": "something-else"}'})
    with pytest.raises(CacheCorruptError, match="something-else"):
        deserialize(data, None, NAME)


# --------------------------------------------------------------------------------------------
# LocalStore
# --------------------------------------------------------------------------------------------

def test_local_store_leaves_no_temporaries(tmp_path):
    """The put/get/list/delete contract is tested on both backends in test_store_backends.py;
    what is local only: writes, replacements and deletes leave no temporary file behind."""
    store = LocalStore(tmp_path / "store")
    store.put("caches/a/h/episode-0.safetensors", b"zero")
    store.put("manifests/a.parquet", b"m")
    store.put("manifests/a.parquet", b"replaced")
    store.delete("manifests/a.parquet")
    assert store.list() == ["caches/a/h/episode-0.safetensors"]
    leftovers = [p for p in Path(store.root).rglob("*") if p.name.startswith(".tmp-")]
    assert leftovers == []


def test_local_store_write_is_atomic(tmp_path, monkeypatch):
    """A write that fails before the rename leaves the old object whole and no temporary file
    (and temporaries are never listed)."""
    store = LocalStore(tmp_path)
    store.put("a/b.bin", b"old contents")

    def failing_replace(src, dst):
        raise OSError("disk went away")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk went away"):
        store.put("a/b.bin", b"new contents that never land")
    monkeypatch.undo()
    assert store.get("a/b.bin") == b"old contents"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.bin"]
    (tmp_path / "a" / ".tmp-stray").write_bytes(b"x")
    assert store.list() == ["a/b.bin"]


@pytest.mark.parametrize("key", ["..", "a/../b", "../etc/passwd", "/abs/key", "", "a//b", "a/./b",
                                 "a/", "a b", "a\\b", "caches/x\x00y"])
def test_check_key_rejects_unsafe_keys(tmp_path, key):
    with pytest.raises(StoreError, match="unsafe object key"):
        check_key(key)
    store = LocalStore(tmp_path / "s")
    with pytest.raises(StoreError):
        store.put(key, b"x")
    with pytest.raises(StoreError):
        store.get(key)
    assert not (tmp_path / "etc").exists()


def test_keys_from_ids(tmp_path):
    assert check_key(cache_key("conv-1", "abcd", 3)) == "caches/conv-1/abcd/episode-3.safetensors"
    assert manifest_key("conv-1") == "manifests/conv-1.parquet"
    for bad in ("../x", "a/b"):
        with pytest.raises(UnsafeIdError):
            cache_key(bad, "abcd", 0)
        with pytest.raises(UnsafeIdError):
            manifest_key(bad)


def test_open_store(tmp_path):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert open_store(f"file://{tmp_path}").root == tmp_path.resolve()
    with pytest.raises(StoreError, match="unsupported"):
        open_store("ftp://example/bucket")


# --------------------------------------------------------------------------------------------
# Manifests
# --------------------------------------------------------------------------------------------

def manifest_row(episode: int) -> ManifestRecord:
    return ManifestRecord(**{
        "conversation_id": "conv-1", "episode": episode, "episodes_requested": 4,
        "episodes_built": 2, "episode_note": "2 of 4 episodes",
        "object_key": cache_key("conv-1", "abcd", episode), "sha256": "f" * 64,
        "object_bytes": 1234 + episode, "kv_bytes": 1000, "centroid": [0.5, -0.25, 0.125],
        "medoid_text": f'Ann said, "episode {episode}"', "medoid_turn_ids": ["t1", "t2"],
        "n_windows": 3, "layer_budgets": [8, 16, 24], "entries_per_layer": [8.0, 16.0, 24.0],
        "peak_entries_per_layer": [16.0, 24.0, 32.0], "tokens": 700, "scorer": "epicache",
        "model_id": "tiny", "encoder_id": "bow", "config_hash": "abcd", "config_json": "{}",
        "cluster_seconds": 0.5, "build_seconds": 1.5, "worker": "w1", "node_id": "n1",
        "built_at": "2024-01-01T00:00:00Z",
    })


def test_manifest_round_trip(tmp_path):
    """Records come back equal, sorted by episode, every schema column written."""
    store = LocalStore(tmp_path)
    assert read_manifest(store, "conv-1") is None
    rows = [manifest_row(1), manifest_row(0)]
    write_manifest(store, "conv-1", rows)
    back = read_manifest(store, "conv-1")
    assert [r.episode for r in back] == [0, 1]
    assert back == [manifest_row(0), manifest_row(1)]  # the values chosen are exact in float32
    columns = pq.read_schema(pa.BufferReader(store.get("manifests/conv-1.parquet"))).names
    assert set(MANIFEST_SCHEMA.names) <= set(columns)
    assert list_conversations(store) == ["conv-1"]


def _synthetic_with(header_changes: dict | None = None, lengths=None) -> bytes:
    """A tiny valid cache (the rehearsal's), its header or layer 0's lengths replaced."""
    import json

    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    from lab.rehearsal import SYNTHETIC_CONFIG, synthetic_cache

    data = synthetic_cache("conv-1", 0, 4, SYNTHETIC_CONFIG)
    header = read_header(data) | (header_changes or {})
    tensors = st_load(data)
    if lengths is not None:
        tensors["layers.0.lengths"] = torch.tensor(lengths, dtype=torch.int32)
    return st_save(tensors, metadata={"header": json.dumps(header)})


@pytest.mark.parametrize("changes,lengths,says", [
    ({"num_layers": 10**12}, None, "the header says 1000000000000 layers, the object holds 2"),
    ({"num_layers": "2"}, None, "the header says '2' layers"),
    (None, [-(10**9), 10**9 + 8], "layer 0: a negative entry count"),
])
def test_sizes_an_object_claims_are_checked_before_anything_is_allocated(changes, lengths, says):
    """A header or a count that would size an allocation is held to what the object holds:
    the corrupt-object error, never a MemoryError."""
    data = _synthetic_with(changes, lengths)
    with pytest.raises(CacheCorruptError) as e:
        deserialize(data, None, NAME)
    assert says in str(e.value) and "is inconsistent" in str(e.value)
