"""Stores for the tests: every backend as a fixture, a conversation committed as a build
commits it (tiny synthetic caches, then the manifest), and manifests broken on purpose."""

from __future__ import annotations

import io
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lab.rehearsal import SYNTHETIC_CONFIG, SYNTHETIC_FILES, synthetic_cache
from pipeline.store.backends.base import cache_key, manifest_key
from pipeline.store.backends.local import LocalStore
from pipeline.store.backends.uri import open_store
from pipeline.store.catalogue.manifest import MANIFEST_SCHEMA, ManifestRecord, write_manifest
from pipeline.store.objects import cache_format
from pipeline.store.objects.turn_index import IndexedTurn, TurnIndex, store_turn_index


def tiny_turn_index(cid: str, encoder_fingerprint: str = SYNTHETIC_FILES.encoder,
                    turns: int = 3, dim: int = 4, seed: int = 0) -> TurnIndex:
    """A conversation's turn index of a few turns, unit-norm random embeddings."""
    vectors = np.random.default_rng(seed).standard_normal((turns, dim))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return TurnIndex(cid, "synthetic", encoder_fingerprint,
                     tuple(IndexedTurn(f"{cid}-t{i}", i // 2, f"[session {i // 2}]",
                                       f"user: turn {i} of {cid}") for i in range(turns)),
                     vectors.astype(np.float16))


def put_conversation(store, cid: str, episodes: int = 2,
                     turn_index: bool = False) -> list[ManifestRecord]:
    """Committed like a build commits: the objects (with `turn_index`, the conversation's turn
    index too), then a manifest naming them with their sizes and SHA-256 (columns a test does
    not need stay null)."""
    index = store_turn_index(tiny_turn_index(cid), store) if turn_index else None
    rows = []
    for e in range(episodes):
        data = synthetic_cache(cid, e, 8, SYNTHETIC_CONFIG)
        key = cache_key(cid, SYNTHETIC_CONFIG.hash, e)
        store.put(key, data)
        rows.append(ManifestRecord.from_row({
            "conversation_id": cid, "episode": e, "object_key": key, "object_bytes": len(data),
            "sha256": cache_format.sha256(data), "centroid": [1.0, 0.0], "tokens": 8,
            "config_hash": SYNTHETIC_CONFIG.hash, "model_id": "synthetic",
            "encoder_id": "synthetic", "model_fingerprint": SYNTHETIC_FILES.model,
            "encoder_fingerprint": SYNTHETIC_FILES.encoder, "scorer": "epicache",
            **(index.fields() if index else {})}))
    write_manifest(store, cid, rows)
    return rows


def _parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def _with_object_keys(good: bytes, keys: list) -> bytes:
    table = pq.read_table(pa.BufferReader(good))
    column = MANIFEST_SCHEMA.names.index("object_key")
    return _parquet(table.set_column(column, "object_key", pa.array(keys, pa.string())))


CORRUPT = {  # bytes under manifests/<id>.parquet, and what the error says
    "not parquet": (lambda good: b"<html>not a manifest</html>", "not a readable Parquet file"),
    "truncated": (lambda good: good[: len(good) // 2], "not a readable Parquet file"),
    "empty object": (lambda good: b"", "not a readable Parquet file"),
    "columns missing": (lambda good: _parquet(pa.table({"conversation_id": ["bad"]})),
                        "missing column(s) episode, episodes_requested"),
    "no rows": (lambda good: _parquet(pq.read_table(pa.BufferReader(good)).slice(0, 0)),
                "it has no rows"),
    "unsafe object key": (lambda good: _with_object_keys(good, ["../../etc/passwd", None]),
                          "episode 0 names no valid object_key ('../../etc/passwd')"),
}


def plant_corrupt_manifest(store, how: str = "not parquet", cid: str = "bad") -> str:
    """A conversation whose objects are stored but whose manifest is broken `how`."""
    put_conversation(store, cid)
    key = manifest_key(cid)
    store.put(key, CORRUPT[how][0](store.get(key)))
    return key


@pytest.fixture(params=["local", "s3", "memory"])
def store(request, tmp_path):
    """An empty store of each backend: a folder, a fresh prefix in the SeaweedFS bucket, or a
    fresh in-memory store (dropped afterwards)."""
    if request.param == "local":
        yield LocalStore(tmp_path / "store")
    elif request.param == "s3":
        s3 = request.getfixturevalue("s3_env")
        yield open_store(s3.uri(f"contract/{uuid.uuid4().hex[:12]}"))
    else:
        memory = open_store(f"memory://contract-{uuid.uuid4().hex[:12]}")
        yield memory
        memory.drop()
