"""Per-conversation manifests: one Parquet row per episode, written after its objects.

The manifest is the commit point of a conversation's build: it exists only once every object
it names is stored and verified, and it records the configuration hash that built it, so a
re-run can tell finished work from stale work. The schema is documented in the README.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.store.base import ObjectNotFound, Store, StoreError, check_key, manifest_key

MANIFEST_SCHEMA = pa.schema([
    ("conversation_id", pa.string()),
    ("episode", pa.int32()),
    ("episodes_requested", pa.int32()),
    ("episodes_built", pa.int32()),
    ("episode_note", pa.string()),
    ("object_key", pa.string()),
    ("sha256", pa.string()),
    ("object_bytes", pa.int64()),
    ("kv_bytes", pa.int64()),
    ("centroid", pa.list_(pa.float32())),
    ("medoid_text", pa.string()),
    ("medoid_turn_ids", pa.list_(pa.string())),
    ("n_windows", pa.int32()),
    ("layer_budgets", pa.list_(pa.int32())),
    ("entries_per_layer", pa.list_(pa.float32())),
    ("peak_entries_per_layer", pa.list_(pa.float32())),
    ("tokens", pa.int64()),
    ("scorer", pa.string()),
    ("model_id", pa.string()),
    ("encoder_id", pa.string()),
    ("config_hash", pa.string()),
    ("config_json", pa.string()),
    ("cluster_seconds", pa.float64()),
    ("build_seconds", pa.float64()),
    ("worker", pa.string()),
    ("node_id", pa.string()),  # the Ray node that built the episode (None outside Ray)
    ("built_at", pa.string()),
])


# Columns added with tri-state compression and merging, after the columns above: written when
# the rows carry them (every build since), so rows of older writers read back as written.
STATE_SCHEMA = pa.schema([
    # Entries (token x KV head x layer) per state, and their bytes (evicted: what they would
    # take Original, i.e. the bytes saved); all Original/Evicted without tri-state compression.
    ("original_entries", pa.int64()),
    ("original_bytes", pa.int64()),
    ("quantized_entries", pa.int64()),
    ("quantized_bytes", pa.int64()),
    ("evicted_entries", pa.int64()),
    ("evicted_bytes", pa.int64()),
    ("merged_entries", pa.int64()),  # evicted entries merged into kept ones (D2O)
    ("layer_byte_budgets", pa.list_(pa.int64())),  # tri-state: bytes per layer (else null)
    ("oq_ratios", pa.list_(pa.float32())),  # tri-state: ARKV OQ ratio per layer, last step
])


# Every writer since the first has written these (node_id came later; the state columns later).
REQUIRED_COLUMNS = tuple(name for name in MANIFEST_SCHEMA.names if name != "node_id")


class ManifestError(StoreError):
    """A manifest that exists but cannot be read as one (not Parquet, truncated, columns
    missing, no rows). The message names the manifest, so every command that meets it can say
    which one is broken; `key` and `reason` are kept for reports."""

    def __init__(self, key: str, store_uri: str, reason: str):
        super().__init__(key, store_uri, reason)  # args as given, so it pickles (Ray)
        self.key, self.store_uri, self.reason = key, store_uri, reason

    def __str__(self) -> str:
        return f"manifest {self.key!r} in store {self.store_uri} is corrupt: {self.reason}"


def write_manifest(store: Store, conversation_id: str, rows: list[dict]) -> None:
    rows = sorted(rows, key=lambda r: r["episode"])
    schema = pa.schema(list(MANIFEST_SCHEMA) + [f for f in STATE_SCHEMA
                                                if any(f.name in r for r in rows)])
    table = pa.Table.from_pylist(rows, schema=schema)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    store.put(manifest_key(conversation_id), sink.getvalue().to_pybytes())


def read_manifest(store: Store, conversation_id: str) -> list[dict] | None:
    """The manifest rows of a conversation, or None if it has not been built; a manifest that
    cannot be read raises `ManifestError` naming it."""
    key = manifest_key(conversation_id)
    try:
        data = store.get(key)
    except ObjectNotFound:
        return None
    return parse_manifest(data, key, store.uri)


def parse_manifest(data: bytes, key: str, store_uri: str) -> list[dict]:
    """Rows of a manifest's bytes, or `ManifestError` saying why they are not a manifest."""
    def bad(reason: str) -> ManifestError:
        return ManifestError(key, store_uri, reason)

    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError, ValueError) as e:
        cause = (str(e).splitlines() or [type(e).__name__])[0]
        cause = cause.removeprefix("Could not open Parquet input source '<Buffer>': ")
        raise bad(f"not a readable Parquet file ({cause})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise bad(f"missing column(s) {', '.join(missing)}")
    rows = table.to_pylist()
    if not rows:
        raise bad("it has no rows")
    for r in rows:
        try:
            check_key(r["object_key"] if isinstance(r["object_key"], str) else "")
        except StoreError:
            raise bad(f"episode {r['episode']} names no valid object_key "
                      f"({r['object_key']!r})") from None
    return rows


def list_conversations(store: Store) -> list[str]:
    """Ids of the conversations with a manifest (built ones), sorted."""
    return [k.removeprefix("manifests/").removesuffix(".parquet") for k in store.list("manifests/")]
