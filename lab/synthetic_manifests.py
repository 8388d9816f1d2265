"""A store of synthetic manifests made on demand: a corpus of any size in no memory, for the
router's soak (`jobs.bench.router_soak`) and the plan's tests.

Each conversation's manifest is a real Parquet manifest (`pipeline.store.catalogue.manifest`:
every column, read back by the real `read_manifest`), made from its id alone when it is read:
`episodes` episodes of `windows` window embeddings each in `dim` dimensions (unit norm, the
encoder's space), strings the size a real build writes. Nothing is kept, so a soak through tens
of thousands of conversations measures the reader's memory, not the store's. Read-only.
"""

from __future__ import annotations

import json
import threading
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.store.backends.base import ObjectInfo, ObjectNotFound, Store, StoreError, cache_key
from pipeline.store.catalogue.manifest import MANIFEST_SCHEMA, ManifestRecord

PREFIX, SUFFIX = "manifests/", ".parquet"
MODEL, ENCODER = "synthetic-model", "synthetic-encoder"
FINGERPRINTS = ("synthetic-model-files", "synthetic-encoder-files")


def conversation_id(i: int) -> str:
    """The id of the store's `i`th conversation."""
    return f"soak-{i:07d}"


class SyntheticManifests(Store):
    """`conversations` synthetic conversations' manifests, each made when it is read (`get`);
    `reads` counts the manifests read. A manifest never changes (`info` is the same at every
    check)."""

    def __init__(self, conversations: int, episodes: int = 4, windows: int = 20, dim: int = 384,
                 seed: int = 0):
        if min(conversations, episodes, windows, dim) < 1:
            raise ValueError("conversations, episodes, windows and dim must be >= 1")
        self.uri = f"synthetic://{conversations}x{episodes}x{windows}x{dim}"
        self.conversations, self.episodes, self.windows, self.dim = (conversations, episodes,
                                                                     windows, dim)
        self.seed = seed
        self.reads = 0
        self._lock = threading.Lock()
        self._base = self._template()

    def _template(self) -> pa.Table:
        """The columns every manifest shares (ids and embeddings are set per conversation)."""
        config_json = json.dumps({"model": MODEL, "encoder": ENCODER, "budget": 1024,
                                  "episodes": self.episodes, "note": "x" * 1500})
        rows = [ManifestRecord(
            conversation_id="template", episode=e, episodes_requested=self.episodes,
            episodes_built=self.episodes, episode_note="", object_key="template", sha256="0" * 64,
            object_bytes=4 << 20, kv_bytes=4 << 20, centroid=[0.0], window_embeddings=None,
            medoid_text="a medoid patch of a few sentences " * 12,
            medoid_turn_ids=[f"t{e}-{k}" for k in range(4)], n_windows=self.windows,
            layer_budgets=[1024] * 30, entries_per_layer=[1024.0] * 30,
            peak_entries_per_layer=[1280.0] * 30, tokens=40_000, scorer="epicache",
            model_id=MODEL, encoder_id=ENCODER, model_fingerprint=FINGERPRINTS[0],
            encoder_fingerprint=FINGERPRINTS[1], config_hash="c0ffee", config_json=config_json,
            cluster_seconds=1.0, build_seconds=10.0, worker="host:1",
            built_at="2026-01-01T00:00:00",
            member_turn_ids=[f"t{e}-{k}" for k in range(self.windows * 4)],
        ).to_row() for e in range(self.episodes)]
        return pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA)

    def _index(self, key: str) -> int:
        """The conversation a manifest key names; `ObjectNotFound` for any other key."""
        name = key.removeprefix(PREFIX).removesuffix(SUFFIX)
        number = name.removeprefix("soak-")
        if (not key.startswith(PREFIX) or not key.endswith(SUFFIX) or not number.isdigit()
                or conversation_id(int(number)) != name or int(number) >= self.conversations):
            raise ObjectNotFound(f"{key!r} is not in {self.uri}")
        return int(number)

    def manifest_bytes(self, i: int) -> bytes:
        """Conversation `i`'s manifest as Parquet bytes (the same at every call)."""
        cid = conversation_id(i)
        rng = np.random.default_rng([self.seed, zlib.crc32(cid.encode())])
        windows = rng.standard_normal((self.episodes * self.windows, self.dim)).astype(np.float32)
        windows /= np.linalg.norm(windows, axis=1, keepdims=True)
        centroids = windows.reshape(self.episodes, self.windows, self.dim).mean(axis=1)
        centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
        vectors = pa.ListArray.from_arrays(
            np.arange(0, windows.size + 1, self.dim, dtype=np.int32), pa.array(windows.ravel()))
        per_episode = pa.ListArray.from_arrays(
            np.arange(0, len(windows) + 1, self.windows, dtype=np.int32), vectors)
        centroid = pa.ListArray.from_arrays(
            np.arange(0, centroids.size + 1, self.dim, dtype=np.int32),
            pa.array(centroids.astype(np.float32).ravel()))
        table = self._base
        for name, column in (
                ("conversation_id", pa.array([cid] * self.episodes, pa.string())),
                ("object_key", pa.array([cache_key(cid, "c0ffee", e)
                                         for e in range(self.episodes)], pa.string())),
                ("centroid", centroid), ("window_embeddings", per_episode)):
            table = table.set_column(table.schema.get_field_index(name), name, column)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        return sink.getvalue().to_pybytes()

    # -- the Store interface: read-only ------------------------------------------------------
    def get(self, key: str) -> bytes:
        data = self.manifest_bytes(self._index(key))
        with self._lock:
            self.reads += 1
        return data

    def info(self, key: str) -> ObjectInfo:
        self._index(key)
        return ObjectInfo(size=1, modified=0.0)  # never changes

    def exists(self, key: str) -> bool:
        try:
            self._index(key)
        except ObjectNotFound:
            return False
        return True

    def list(self, prefix: str = "") -> list[str]:
        keys = (f"{PREFIX}{conversation_id(i)}{SUFFIX}" for i in range(self.conversations))
        return [k for k in keys if k.startswith(prefix)]

    def put(self, key: str, data: bytes) -> None:
        raise StoreError(f"{self.uri} is read-only")

    def delete(self, key: str) -> None:
        raise StoreError(f"{self.uri} is read-only")
