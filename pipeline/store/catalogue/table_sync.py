"""Keeping the manifest table equal to the manifests: the build's writer, repair and rebuild.

The build's driver, the table's only writer, writes a small pending marker
(`index/pending/<conversation_id>`) before it commits a manifest, and removes it once the
conversation's rows are in the table (`IndexWriter`, which flushes in batches). A crash in
between leaves the marker, and `repair` (run by the next build and by `jobs.manifests
--compact`) re-reads only the marked conversations' manifests: nothing lists a million of them.
`rebuild` recreates the table from every manifest, whatever state the table is in (one whose
files are damaged is removed first). Keeping the markers right needs one writer
at a time (a build, or `jobs.manifests --compact/--rebuild`, not both). `mismatches` checks rows
read from the table against their manifests, so a listing never shows a conversation whose
manifest was since truncated, replaced or removed as if it were sound.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa

from pipeline.store.backends.base import Store, StoreError, manifest_key
from pipeline.store.catalogue.manifest import (
    ManifestError,
    ManifestRecord,
    list_conversations,
    read_manifest,
)
from pipeline.store.catalogue.table import (
    PENDING_PREFIX,
    TABLE_KEY,
    ManifestTable,
    TableDamagedError,
    pending_key,
    table_row,
    table_rows,
)

log = logging.getLogger(__name__)
_READ_THREADS = 16  # manifests read at once by repair and rebuild (S3 GETs are latency-bound)
_REBUILD_CHUNK = 2_000  # conversations per record batch of a rebuild


def _read_many(store: Store,
               ids: Sequence[str]) -> Iterator[tuple[str, list[ManifestRecord] | ManifestError]]:
    """(id, rows or the ManifestError) per conversation, read by a few threads, in order; an
    absent manifest gives no rows."""
    def read(cid: str):
        try:
            return cid, read_manifest(store, cid) or []
        except ManifestError as e:
            return cid, e

    with ThreadPoolExecutor(_READ_THREADS) as pool:
        yield from pool.map(read, ids)


@dataclass
class SyncResult:
    """What a repair or a rebuild did: conversations and rows written to the table, the
    manifests that could not be read (their rows are left out), and the damage of a table the
    rebuild removed first."""
    conversations: int = 0
    rows: int = 0
    corrupt: list[ManifestError] = field(default_factory=list)
    damage: str | None = None

    def manifest_rows(self, store: Store, ids: Sequence[str]) -> list[dict]:
        """The table rows of `ids`' manifests (read by a few threads); a corrupt manifest is
        recorded and gives no rows, as `is_built` counts it as not built."""
        rows: list[dict] = []
        for _, got in _read_many(store, ids):
            if isinstance(got, ManifestError):
                self.corrupt.append(got)
            else:
                rows.extend(table_row(r) for r in got)
        return rows


def repair(store: Store, table: ManifestTable | None = None, chunk: int = 1_000) -> SyncResult:
    """Bring the conversations with a pending marker up to date from their manifests (a build
    stopped between a manifest commit and the table append), then remove the markers."""
    table = table or ManifestTable(store)
    result = SyncResult()
    keys = store.list(PENDING_PREFIX)
    for start in range(0, len(keys), chunk):
        part = keys[start:start + chunk]
        ids = [k.removeprefix(PENDING_PREFIX) for k in part]
        rows = result.manifest_rows(store, ids)
        table.replace(ids, rows)
        _delete_all(store, part)
        result.conversations += len(ids)
        result.rows += len(rows)
    return result


def rebuild(store: Store, table: ManifestTable | None = None) -> SyncResult:
    """Recreate the table from every per-conversation manifest (one streamed commit, memory
    flat: the manifests are read `_REBUILD_CHUNK` at a time); a corrupt manifest is left out and
    reported. Pending markers seen before the rebuild are cleared. A table whose files are
    damaged is removed first, so it is created anew."""
    table = table or ManifestTable(store)
    result = SyncResult(damage=_remove_if_damaged(store, table))
    pending = store.list(PENDING_PREFIX)
    ids = list_conversations(store)

    def batches() -> Iterator[pa.RecordBatch]:
        for start in range(0, len(ids), _REBUILD_CHUNK):
            rows = result.manifest_rows(store, ids[start:start + _REBUILD_CHUNK])
            result.conversations += len({r["conversation_id"] for r in rows})
            result.rows += len(rows)
            yield from table_rows(rows).to_batches()

    table.overwrite(batches())
    _delete_all(store, pending)
    return result


def _remove_if_damaged(store: Store, table: ManifestTable) -> str | None:
    """delta-rs replays a table's log before it overwrites the table, so a damaged log or
    checkpoint would fail the rebuild too: a damaged table (`ManifestTable.check`) has every
    object under its key removed (through the store, any backend), and the rebuild creates it
    anew. The damage removed, or None where the table is sound (or there is none)."""
    if not table.exists() or (damage := table.damage()) is None:
        return None
    keys = store.list(f"{TABLE_KEY}/")
    _delete_all(store, keys)
    log.info("manifest table %s is damaged (%s): its %d objects removed, to be created anew",
             table.uri, damage.reason, len(keys))
    return damage.reason


def mismatches(store: Store, rows: Sequence[dict], whole: bool = True) -> dict[str, str]:
    """Why each conversation of `rows` (table rows) is not backed by its manifest, by id: the
    manifest cannot be read, is gone, or holds other values; none for a sound one. `whole`: the
    rows are all of a conversation's (no filter narrowed them), so an episode the manifest has
    and the table lacks is a mismatch too. One manifest GET per conversation (a few threads)."""
    table_side: dict[str, dict[int, dict]] = defaultdict(dict)
    for record in map(ManifestRecord.from_row, rows):
        table_side[record.conversation_id][record.episode] = table_row(record)
    found: dict[str, str] = {}
    for cid, got in _read_many(store, list(table_side)):
        where = f"manifest {manifest_key(cid)!r} in store {store.uri}"
        if isinstance(got, ManifestError):
            found[cid] = str(got)
            continue
        if not got:
            found[cid] = f"{where} is gone, but the manifest table lists conversation {cid!r}"
            continue
        # through the table's Arrow types, as the rows read back from it went
        typed = map(ManifestRecord.from_row, table_rows(map(table_row, got)).to_pylist())
        manifest = {r.episode: table_row(r) for r in typed}
        listed = table_side[cid]
        differ = sorted(e for e, r in listed.items() if manifest.get(e) != r)
        differ += sorted(set(manifest) - set(listed)) if whole else []
        if differ:
            found[cid] = (f"{where} does not match the manifest table (episodes "
                          f"{', '.join(map(str, sorted(differ)))})")
    return found


def _delete_all(store: Store, keys: Sequence[str]) -> None:
    if len(keys) < 8:
        for key in keys:
            store.delete(key)
        return
    with ThreadPoolExecutor(_READ_THREADS) as pool:
        list(pool.map(store.delete, keys))


class IndexWriter:
    """The driver's side of the table: a marker before each manifest commit (`begin`), the
    committed rows buffered (`add`) and appended every `flush_rows` rows or `flush_seconds`
    (checked at each commit) and at the end, then their markers removed. Memory holds one
    batch of scalar rows whatever the corpus size.

    Opening it makes the table equal to the manifests first: a store without one (built before
    the table existed) gets it rebuilt, and pending markers of an interrupted build are
    repaired. A table that cannot be written never fails the build: it is logged, the markers
    stay, and the next build or `jobs.manifests --compact` repairs them. A table whose files are
    damaged (`TableDamagedError`: its log does not read, a data file it names is gone) when the
    build opens it is rebuilt from the manifests, so the build heals it; one damaged during the
    build is warned about once, with the command that rebuilds it, and left alone for the rest
    of the build: the manifests are the commit point, and the markers (cleared by that rebuild)
    keep saying the table lags. A store that can hold no table (in
    memory) gets neither table nor markers."""

    def __init__(self, store: Store, flush_rows: int = 10_000, flush_seconds: float = 60.0):
        self.store, self.flush_rows, self.flush_seconds = store, flush_rows, flush_seconds
        self.table = ManifestTable(store)
        self.ids: list[str] = []
        self.rows: list[dict] = []  # table rows: the scalar columns only
        self.last_flush = time.monotonic()
        self.appended = self.commits = 0
        self.healthy = True

    def open(self) -> None:
        if self.table.located is None:
            self.healthy = False
            return
        try:
            if not self.table.exists():
                done = rebuild(self.store, self.table)
                log.info("manifest table created at %s from %d manifests (%d episodes)",
                         self.table.uri, done.conversations, done.rows)
            elif self.table.damage() is not None:  # found once, before the build's work
                done = rebuild(self.store, self.table)
                log.warning("manifest table %s was damaged (%s): rebuilt from %d manifests (%d "
                            "episodes)", self.table.uri, done.damage, done.conversations,
                            done.rows)
            else:
                done = repair(self.store, self.table)
                if done.conversations:
                    log.warning("manifest table: repaired %d conversations an earlier build left "
                                "pending", done.conversations)
            for e in done.corrupt:
                log.warning("%s; left out of the manifest table", e)
        except TableDamagedError as e:  # damaged again past its rebuild: left to --rebuild
            self._damaged(e)
        except StoreError as e:
            self.healthy = False
            log.error("%s; the build goes on, the table is repaired by the next build or "
                      "`python -m jobs.manifests --compact`", e)

    def begin(self, conversation_id: str) -> None:
        """Before the manifest commit: a marker saying the table may lag this conversation."""
        if self.table.located is not None:
            self.store.put(pending_key(conversation_id), b"")

    def add(self, conversation_id: str, records: list[ManifestRecord]) -> None:
        """After the manifest commit: buffer its rows (scalar columns only)."""
        self.ids.append(conversation_id)
        self.rows.extend(table_row(r) for r in records)
        if (len(self.rows) >= self.flush_rows
                or time.monotonic() - self.last_flush >= self.flush_seconds):
            self.flush()

    def flush(self) -> None:
        ids, rows = self.ids, self.rows
        self.ids, self.rows, self.last_flush = [], [], time.monotonic()
        if not ids or not self.healthy:
            return
        try:
            self.table.replace(ids, rows)
            _delete_all(self.store, [pending_key(cid) for cid in ids])
            self.appended += len(rows)
            self.commits += 1
        except TableDamagedError as e:
            self._damaged(e)
        except StoreError as e:  # the markers stay: repaired later
            log.error("%s; %d conversations stay pending for the next build or "
                      "`python -m jobs.manifests --compact`", e, len(ids))

    def _damaged(self, error: TableDamagedError) -> None:
        """One warning, and no more writes to the table this build (its markers stay)."""
        self.healthy = False
        log.warning("%s; the build goes on without the table (the manifests are the commit "
                    "point)", error)

    def __enter__(self) -> "IndexWriter":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.flush()
        if self.appended:
            log.info("manifest table: %d episodes appended in %d commits (%s)", self.appended,
                     self.commits, self.table.uri)
