"""Cache objects on disk (safetensors round trip, checksums, corruption), the local store
(atomic writes, safe keys), manifests, and the build configuration hash."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.answer.decode import generate_from_cache
from pipeline.builder.config import BuildConfig
from pipeline.corpus.schema import UnsafeIdError
from pipeline.episodes import EpisodeConfig
from pipeline.kv.budgets import CalibrationConfig
from pipeline.kv.merging import MergeConfig
from pipeline.kv.prefill import PrefillConfig, block_prefill
from pipeline.kv.scorers import EpiCacheScorer, ScoringConfig
from pipeline.kv.tristate import TriStateConfig
from pipeline.store.base import StoreError, cache_key, check_key, manifest_key
from pipeline.store.cache_format import (FORMAT, CacheCorruptError, deserialize, read_header,
                                         serialize, sha256)
from pipeline.store.local import LocalStore
from pipeline.store.manifest import (MANIFEST_SCHEMA, ManifestRecord, list_conversations,
                                     read_manifest, write_manifest)
from pipeline.store.uri import open_store
from tests.support.tiny_models import StandIn, one_torch_thread, random_ids, tiny_model  # noqa: F401

NAME = "caches/conv-1/abcd/episode-0.safetensors"


@pytest.fixture(scope="module")
def built():
    """(model, cache) after a head-wise budgeted block prefill: heads of unequal lengths."""
    model = tiny_model("llama")
    cache, _ = block_prefill(model, random_ids(70, seed=1), EpiCacheScorer(random_ids(5, seed=2)),
                             [10, 14, 18], PrefillConfig(block=8, selection="headwise"))
    assert any(len(set(l.valid.sum(1).tolist())) > 1 for l in cache.layers)  # ragged heads
    return model, cache


def per_head_entries(cache):
    """[(keys, values, positions) of the valid entries] per layer and head."""
    return [[(l.keys[0, h][l.valid[h]], l.values[0, h][l.valid[h]], l.positions[h][l.valid[h]])
             for h in range(l.valid.shape[0])] for l in cache.layers]


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
        for (ka, va, pa), (kb, vb, pb) in zip(a_layer, b_layer):
            assert torch.equal(ka, kb) and torch.equal(va, vb) and torch.equal(pa, pb)
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
        for (ka, va, pa), (kb, vb, pb) in zip(a_layer, b_layer):
            torch.testing.assert_close(kb, ka, atol=1e-3, rtol=1e-3)
            torch.testing.assert_close(vb, va, atol=1e-3, rtol=1e-3)
            assert torch.equal(pa, pb)


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


# --------------------------------------------------------------------------------------------
# BuildConfig
# --------------------------------------------------------------------------------------------

def _changed(value):
    """A different value of the same kind."""
    if dataclasses.is_dataclass(value):
        return None  # handled field by field
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return {"float16": "bfloat16", "headwise": "perhead", "max": "mean",
                "original": "compact", "auto": "original"}.get(value, value + "-x")
    if value is None:
        return 7
    raise TypeError(value)


def _variants(config):
    """(path, config with that one field changed) for every field, nested ones included."""
    out = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            for path, inner in _variants(value):
                out.append((f"{f.name}.{path}", dataclasses.replace(config, **{f.name: inner})))
        else:
            out.append((f.name, dataclasses.replace(config, **{f.name: _changed(value)})))
    return out


def test_build_config_hash_is_stable():
    a, b = BuildConfig(), BuildConfig(episodes=EpisodeConfig(), prefill=PrefillConfig(),
                                      calibration=CalibrationConfig())
    assert a.hash == b.hash
    assert len(a.hash) == 16 and int(a.hash, 16) >= 0
    assert BuildConfig.from_json(a.to_json()).hash == a.hash


# Every field given explicitly, so a change of a default value does not move this hash, but a
# change of what is hashed does: a field added, removed or renamed, FORMAT, the JSON encoding.
PINNED_CONFIG = BuildConfig(
    model="SmolLM2-135M-Instruct", encoder="all-MiniLM-L6-v2", scorer="epicache", budget=512,
    alpha=1.5, allocator="sensitivity", variance_temperature=1.0, store_dtype="float16",
    max_context_tokens=16000,
    episodes=EpisodeConfig(window=4, episodes=3, medoids=2, seed=7, n_init=10),
    scoring=ScoringConfig(reduce="max", include_patch=True, pool=0, utterance=True, focus=10.0,
                          sink=4, recent=32, patch_tokens=256),
    prefill=PrefillConfig(block=256, selection="headwise", head_floor=0.1, decode_positions=False,
                          positions="original",
                          tristate=TriStateConfig(enabled=True, fp8=False, window=32, gamma=263.81,
                                                  tau_entropy=7.774, tau_variance=5.407,
                                                  tau_kurtosis=5.528, original_scale=1.0,
                                                  slack=0.75, heavy_hitter=True),
                          merge=MergeConfig(enabled=False, beta=0.7, min_threshold=-1.0)),
    calibration=CalibrationConfig(tokens=2048, sink=64, window=512, seed=0))
# CHANGE ON PURPOSE ONLY. Every stored manifest carries its configuration's hash, and a build
# rebuilds every conversation whose hash differs: a new literal here means every existing store
# is rebuilt. When the configuration's format changes on purpose (a field added to BuildConfig
# or to one of its parts, cache_format.FORMAT bumped), set the new field in PINNED_CONFIG above and
# put the new hash here, and say so in the change.
PINNED_HASH = "3930c653d0aa42f3"  # prefill.positions added (compact positions)


def test_build_config_hash_of_a_fixed_configuration_is_pinned():
    """The hash of a fixed configuration is a literal: a change that would silently invalidate
    every stored manifest fails here instead."""
    assert PINNED_CONFIG.hash == PINNED_HASH, (
        f"the configuration hash changed ({PINNED_CONFIG.hash}); every stored manifest would be "
        f"rebuilt. If that is intended, update PINNED_HASH. Hashed JSON: {PINNED_CONFIG.to_json()}")


def test_build_config_hash_changes_with_every_field():
    """Changing any one field, at any depth, changes the hash; all variants differ."""
    base = BuildConfig()
    variants = _variants(base)
    paths = [p for p, _ in variants]
    assert {"model", "budget", "alpha", "store_dtype", "episodes.window", "episodes.seed",
            "scoring.focus", "scoring.utterance", "prefill.head_floor",
            "prefill.block", "prefill.selection", "prefill.positions", "calibration.sink",
            "scoring.shared", "episodes.adopt"} <= set(paths)
    hashes = [v.hash for _, v in variants]
    assert base.hash not in hashes
    assert len(set(hashes)) == len(hashes)
    assert BuildConfig(budget=None).hash != base.hash


@pytest.mark.parametrize("config", [
    BuildConfig(),
    BuildConfig(budget=None, alpha=0.0, store_dtype="float32", scorer="streamingllm"),
    BuildConfig(model="/models/x", budget=256, alpha=2.5, episodes=EpisodeConfig(window=6, episodes=3),
                prefill=PrefillConfig(block=128, selection="perhead"),
                calibration=CalibrationConfig(tokens=2048, sink=64, window=512, seed=3)),
    BuildConfig(scoring=ScoringConfig(shared=0.25), episodes=EpisodeConfig(adopt=True)),
])
def test_build_config_json_round_trip(config):
    back = BuildConfig.from_json(config.to_json())
    assert back == config and back.hash == config.hash


def test_auto_positions_hash_as_what_they_resolve_to():
    """`auto` (the default) is compact positions, or original where the entries cannot be
    re-rotated, with the reason for the manifest; either way it shares the hash of the mode it
    resolves to, and `compact_recent` is not hashed under original positions."""
    tri = TriStateConfig(enabled=True)
    compact = PrefillConfig(positions="compact", compact_recent=2048)
    assert PrefillConfig().position_mode == "compact" and PrefillConfig().positions_note is None
    assert BuildConfig().hash == BuildConfig(prefill=compact).hash
    for auto, original in [(PrefillConfig(tristate=tri),
                            PrefillConfig(tristate=tri, positions="original", compact_recent=0)),
                           (PrefillConfig(decode_positions=True),
                            PrefillConfig(decode_positions=True, positions="original"))]:
        assert auto.position_mode == "original"
        assert "original positions" in auto.positions_note and original.positions_note is None
        assert BuildConfig(prefill=auto).hash == BuildConfig(prefill=original).hash
    with pytest.raises(ValueError, match="tri-state"):
        PrefillConfig(tristate=tri, positions="compact")
    # a configuration written before positions existed (or before compact_recent) reads back
    # as what those builds were: original positions, every compacted entry packed
    old = json.loads(BuildConfig(prefill=compact).to_json())
    del old["prefill"]["positions"], old["prefill"]["compact_recent"]
    back = BuildConfig.from_json(json.dumps(old)).prefill
    assert (back.positions, back.compact_recent) == ("original", 0)


def test_build_config_validates():
    with pytest.raises(ValueError):
        BuildConfig(budget=0)
    with pytest.raises(ValueError):
        BuildConfig(alpha=-1.0)
    with pytest.raises(ValueError):
        BuildConfig(store_dtype="int4")
