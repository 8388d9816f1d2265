"""Per-conversation manifests: one Parquet row per episode, written after its objects.

The manifest is the commit point of a conversation's build: it exists only once every object
it names is stored and verified, and it records the configuration hash that built it, so a
re-run can tell finished work from stale work. Its schema is `ManifestRecord`'s fields
(docs/store.md lists them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.store.backends.base import ObjectNotFound, Store, StoreError, check_key, manifest_key
from pipeline.store.objects.cache_ref import CacheRef
from pipeline.store.objects.turn_index import StoredIndex


def column(arrow: pa.DataType, *, state: bool = False, **kw: Any) -> Any:
    """A manifest column: the field's Arrow type (and whether it is a state column, written
    only once some episode carries it) in its metadata."""
    return field(metadata={"arrow": arrow, "state": state}, **kw)


@dataclass(frozen=True, kw_only=True)
class ManifestRecord:
    """One episode of a built conversation: a row of its manifest. The manifest's schema (and
    the manifest table's, a subset) is these fields, in this order."""
    conversation_id: str = column(pa.string())
    episode: int = column(pa.int32())
    # fewer episodes than requested, and why (short conversations)
    episodes_requested: int = column(pa.int32())
    episodes_built: int = column(pa.int32())
    episode_note: str = column(pa.string())
    object_key: str = column(pa.string())  # the cache object
    sha256: str = column(pa.string())  # of the object's bytes, checked by every reader
    object_bytes: int = column(pa.int64())
    kv_bytes: int = column(pa.int64())  # bytes of the kept keys and values
    centroid: list[float] = column(pa.list_(pa.float32()))  # unit norm, the encoder's space
    # each of the episode's windows, unit norm (the window routers); None in manifests written
    # before them: such a conversation is routed by its centroids
    window_embeddings: list[list[float]] | None = column(pa.list_(pa.list_(pa.float32())),
                                                         default=None)
    medoid_text: str = column(pa.string())  # the patched prompt
    medoid_turn_ids: list[str] = column(pa.list_(pa.string()))
    n_windows: int = column(pa.int32())
    layer_budgets: list[int] | None = column(pa.list_(pa.int32()))  # None: the full cache
    entries_per_layer: list[float] = column(pa.list_(pa.float32()))  # per KV head
    peak_entries_per_layer: list[float] = column(pa.list_(pa.float32()))
    tokens: int = column(pa.int64())  # of the conversation, fed to the model
    scorer: str = column(pa.string())
    model_id: str = column(pa.string())
    encoder_id: str = column(pa.string())
    # Of the model's and the encoder's files (pipeline.kv.fingerprint): a cache is served only
    # to a model with the same files. None in manifests written before they were recorded.
    model_fingerprint: str | None = column(pa.string(), default=None)
    encoder_fingerprint: str | None = column(pa.string(), default=None)
    config_hash: str = column(pa.string())  # of the BuildConfig alone
    # why the caches keep original positions though the configuration asked for "auto" (the
    # default, compact): DapQ's decode positions are not known before the end. None otherwise.
    positions_note: str | None = column(pa.string(), default=None)
    # The record's turns the build read (before any --max-context-tokens cut) and their digest
    # (pipeline.corpus.history): a changed or grown record is told apart from an unchanged one.
    source_turns: int | None = column(pa.int32(), default=None)
    source_digest: str | None = column(pa.string(), default=None)
    # What an append goes on from (pipeline.builder.growth): the turns the caches hold (the
    # record as built: after any cut), this episode's turns (its windows'), how many turns the
    # conversation had when it was last clustered, when, and the appends since. None in
    # manifests written before appends: such a conversation is rebuilt when it grows.
    cache_turns: int | None = column(pa.int32(), default=None)
    member_turn_ids: list[str] | None = column(pa.list_(pa.string()), default=None)
    clustered_turns: int | None = column(pa.int32(), default=None)
    clustered_at: str | None = column(pa.string(), default=None)
    appends: int | None = column(pa.int32(), default=None)
    # The conversation's turn index (pipeline.store.objects.turn_index), the same on every row: what
    # the question-time top-up searches. None in manifests written before it: their questions
    # are answered from their episodes alone.
    turn_index_key: str | None = column(pa.string(), default=None)
    turn_index_sha256: str | None = column(pa.string(), default=None)
    turn_index_bytes: int | None = column(pa.int64(), default=None)
    config_json: str = column(pa.string())
    cluster_seconds: float = column(pa.float64())
    build_seconds: float = column(pa.float64())
    worker: str = column(pa.string())  # host:pid
    node_id: str | None = column(pa.string(), default=None)  # the Ray node (None outside Ray)
    built_at: str = column(pa.string())
    # Added with tri-state compression and merging: entries (token x KV head x layer) per state
    # and their bytes (evicted: what they would take Original, i.e. the bytes saved); all
    # Original/Evicted without tri-state. Older manifests read back with these None.
    original_entries: int | None = column(pa.int64(), state=True, default=None)
    original_bytes: int | None = column(pa.int64(), state=True, default=None)
    quantized_entries: int | None = column(pa.int64(), state=True, default=None)
    quantized_bytes: int | None = column(pa.int64(), state=True, default=None)
    evicted_entries: int | None = column(pa.int64(), state=True, default=None)
    evicted_bytes: int | None = column(pa.int64(), state=True, default=None)
    merged_entries: int | None = column(pa.int64(), state=True, default=None)  # D2O merging
    # tri-state only (else None): bytes per layer, and ARKV's OQ ratio per layer at the last step
    layer_byte_budgets: list[int] | None = column(pa.list_(pa.int64()), state=True, default=None)
    oq_ratios: list[float] | None = column(pa.list_(pa.float32()), state=True, default=None)

    @property
    def turn_index(self) -> "StoredIndex | None":
        """The conversation's turn index object, None when the build wrote none."""
        if self.turn_index_key is None or self.turn_index_sha256 is None:
            return None
        return StoredIndex(self.turn_index_key, self.turn_index_sha256, self.turn_index_bytes)

    @property
    def ref(self) -> CacheRef:
        return CacheRef(**{f.name: getattr(self, f.name) for f in dataclasses.fields(CacheRef)})

    def to_row(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "ManifestRecord":
        """A record from a manifest row; columns a row lacks (an older writer's) are None."""
        return cls(**{f.name: row.get(f.name) for f in dataclasses.fields(cls)})


def _schema(state: bool) -> pa.Schema:
    return pa.schema([(f.name, f.metadata["arrow"]) for f in dataclasses.fields(ManifestRecord)
                      if f.metadata["state"] == state])


MANIFEST_SCHEMA = _schema(state=False)
STATE_SCHEMA = _schema(state=True)  # written once some episode carries them (every build since)


# Every writer since the first has written these (node_id, the fingerprints, the source's
# turns, the append state, window embeddings and the positions note came later; the state
# columns later).
_LATER_COLUMNS = ("window_embeddings", "positions_note", "node_id", "model_fingerprint",
                  "encoder_fingerprint", "source_turns", "source_digest", "cache_turns",
                  "member_turn_ids", "clustered_turns", "clustered_at", "appends",
                  "turn_index_key", "turn_index_sha256", "turn_index_bytes")
REQUIRED_COLUMNS = tuple(name for name in MANIFEST_SCHEMA.names if name not in _LATER_COLUMNS)


class ManifestError(StoreError):
    """A manifest that exists but cannot be read as one (not Parquet, truncated, columns
    missing, no rows). The message names the manifest, so every command that meets it can say
    which one is broken; `key` and `reason` are kept for reports."""

    def __init__(self, key: str, store_uri: str, reason: str):
        super().__init__(key, store_uri, reason)  # args as given, so it pickles (Ray)
        self.key, self.store_uri, self.reason = key, store_uri, reason

    def __str__(self) -> str:
        return (f"manifest {self.key!r} in store {self.store_uri} is corrupt: {self.reason} "
                "(the build run again rebuilds its conversation)")


def write_manifest(store: Store, conversation_id: str, records: list[ManifestRecord]) -> None:
    rows = [r.to_row() for r in sorted(records, key=lambda r: r.episode)]
    schema = pa.schema(list(MANIFEST_SCHEMA) + [f for f in STATE_SCHEMA
                                                if any(r[f.name] is not None for r in rows)])
    table = pa.Table.from_pylist(rows, schema=schema)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    store.put(manifest_key(conversation_id), sink.getvalue().to_pybytes())


def read_manifest(store: Store, conversation_id: str) -> list[ManifestRecord] | None:
    """The manifest records of a conversation, or None if it has not been built; a manifest that
    cannot be read raises `ManifestError` naming it."""
    key = manifest_key(conversation_id)
    try:
        data = store.get(key)
    except ObjectNotFound:
        return None
    return parse_manifest(data, key, store.uri)


def parse_manifest(data: bytes, key: str, store_uri: str) -> list[ManifestRecord]:
    """Records of a manifest's bytes, or `ManifestError` saying why they are not a manifest."""
    def bad(reason: str) -> ManifestError:
        return ManifestError(key, store_uri, reason)

    try:
        table = pq.read_table(pa.BufferReader(data))
        names = table.column_names  # a damaged name is not UTF-8: UnicodeDecodeError here
    except (pa.ArrowException, OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        cause = (str(e).splitlines() or [type(e).__name__])[0]
        cause = cause.removeprefix("Could not open Parquet input source '<Buffer>': ")
        raise bad(f"not a readable Parquet file ({cause})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise bad(f"missing column(s) {', '.join(missing)}")
    table = _typed(table, bad)
    try:
        rows = table.to_pylist()
    except UnicodeDecodeError as e:  # a damaged string column (Parquet does not check UTF-8)
        raise bad(f"a text column is not UTF-8 ({e.reason} at byte {e.start})") from None
    if not rows:
        raise bad("it has no rows")
    for r in rows:
        try:
            check_key(r["object_key"] if isinstance(r["object_key"], str) else "")
        except StoreError:
            raise bad(f"episode {r['episode']} names no valid object_key "
                      f"({r['object_key']!r})") from None
        if r.get("turn_index_key") is not None:
            try:
                check_key(r["turn_index_key"])
            except StoreError:
                raise bad(f"episode {r['episode']} names no valid turn_index_key "
                          f"({r['turn_index_key']!r})") from None
    return [ManifestRecord.from_row(r) for r in rows]


_EXPECTED = {f.name: f.type for f in list(MANIFEST_SCHEMA) + list(STATE_SCHEMA)}
_NOT_NULL = ("conversation_id", "episode", "sha256")  # what names an episode and checks it


def _same_kind(got: pa.DataType, expected: pa.DataType) -> bool:
    """Integers of another width, or floats of another precision, are the same kind: cast
    safely (a value that does not fit fails the cast)."""
    return any(is_kind(got) and is_kind(expected)
               for is_kind in (pa.types.is_integer, pa.types.is_floating))


def _typed(table: pa.Table, bad) -> pa.Table:
    """The manifest's columns in their declared types, so records hold what their fields say
    (a string where an id should be, an id that is null, fails here, not in a later reader)."""
    for i, name in enumerate(table.column_names):
        expected, got = _EXPECTED.get(name), table.schema.field(i).type
        if expected is None or got == expected:
            continue
        if not _same_kind(got, expected):
            raise bad(f"column {name} holds {got}, expected {expected}")
        try:
            table = table.set_column(i, name, table.column(i).cast(expected))
        except pa.ArrowInvalid:
            raise bad(f"column {name} holds values that do not fit {expected}") from None
    nulls = [name for name in _NOT_NULL if table.column(name).null_count]
    if nulls:
        raise bad(f"column(s) {', '.join(nulls)} hold nulls")
    return table


def list_conversations(store: Store) -> list[str]:
    """Ids of the conversations with a manifest (built ones), sorted."""
    return [k.removeprefix("manifests/").removesuffix(".parquet") for k in store.list("manifests/")]
