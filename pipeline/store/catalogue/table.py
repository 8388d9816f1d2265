"""The manifest table: every committed episode of a store in one Delta Lake table.

The per-conversation manifests stay the commit point; this table is an index over them, so
"what was built" is one scan instead of a million small reads, and any engine that reads Delta
(DuckDB, Spark, Polars, delta-rs) can query it. It lives at `<store>/index/episodes` (a folder,
or `s3://bucket/prefix/index/episodes`) and holds the manifests' scalar columns (see
`TABLE_SCHEMA`). A batch replaces the earlier rows of its conversations in one Delta commit (an
overwrite with a predicate on their ids), so a rebuilt conversation never shows twice.

On S3 the table's credentials come from the store (`Store.storage_options`): resolved from
boto3's chain each time the table is opened, handed to delta-rs in memory only, never in a log
line or an error. Commits are put-if-absent (`AWS_CONDITIONAL_PUT=etag`), so a second writer can
never overwrite a commit. Keeping it equal to the manifests is
`pipeline.store.catalogue.table_sync`; querying it is `pipeline.store.catalogue.table_query`. A
table whose own files are damaged raises `TableDamagedError`, whatever call found it: readers fall
back to the manifests, and `table_sync.rebuild` removes it and creates it anew.
"""

from __future__ import annotations

import logging
import shlex
import tempfile
from collections.abc import Iterable, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from pipeline.corpus.schema import check_safe_id
from pipeline.store.backends.base import Store, StoreError
from pipeline.store.catalogue.manifest import MANIFEST_SCHEMA, STATE_SCHEMA, ManifestRecord

log = logging.getLogger(__name__)
TABLE_KEY = "index/episodes"
PENDING_PREFIX = "index/pending/"

# The manifest's scalar columns: what an index answers (which objects, the turn index's included,
# their checksums and sizes, tokens, who built them with which configuration, when). A column
# added since a table was written reads as null from its older rows (`table_query.select`), and
# the next write that carries it adds it (`schema_mode="merge"`). Left out, and read from a
# manifest when needed: centroid and window_embeddings (384 floats a window, ~1.5 KB each:
# routing reads one conversation's manifest anyway), medoid_text and medoid_turn_ids (the
# patched prompt, KBs), member_turn_ids (an episode's turns: what an append reads from the
# manifest), config_json (the same ~1 KB on every row of a configuration; config_hash names
# it), and the per-layer lists.
_LEFT_OUT = {"centroid", "window_embeddings", "medoid_text", "medoid_turn_ids", "member_turn_ids",
             "config_json", "layer_budgets",
             "entries_per_layer", "peak_entries_per_layer", "layer_byte_budgets", "oq_ratios"}
TABLE_SCHEMA = pa.schema([f for f in list(MANIFEST_SCHEMA) + list(STATE_SCHEMA)
                          if f.name not in _LEFT_OUT])

# Parquet as written into the table: zstd, and row groups small enough that a point lookup
# reads one of them (statistics on conversation_id prune the rest).
_ROW_GROUP = 65_536

# A checkpoint every 10 commits: opening the table replays at most 10 JSON log entries (a build
# commits every flush, hundreds of times in a million conversations).
_TABLE_CONFIG = {"delta.checkpointInterval": "10"}

# Conversations per replacing commit: delta-rs recurses over a predicate's IN list, and one of
# ~25,000 ids overflows an 8 MiB stack (measured; 20,000 passed).
_MAX_IDS = 4_000
_SORT_MEMORY = "1GB"  # DuckDB's memory for the compaction's sort (it spills past it)


class TableError(StoreError):
    """The manifest table cannot be read or written; the message names the table, never a
    credential."""


class TableDamagedError(TableError):
    """The table's own files are damaged (a log entry or checkpoint that does not parse, a gap in
    the log, a data file gone or not Parquet), as against a store that cannot be reached. The
    manifests, the commit point, are untouched: readers fall back to them, a build goes on
    without the table, and `jobs.manifests --rebuild` recreates it from them."""

    def __init__(self, uri: str, reason: str, store_uri: str):
        self.uri, self.reason = uri, reason
        self.hint = (f"`python -m jobs.manifests --store {shlex.quote(store_uri)} --rebuild` "
                     "rebuilds it from the manifests")
        super().__init__(f"manifest table {uri} is damaged ({reason}); {self.hint}")

    def unreadable(self, consequence: str) -> str:
        """The one line a reader prints: the table, why it cannot be read, what the reader does
        instead (`consequence`), and the command that rebuilds it."""
        return f"manifest table {self.uri} cannot be read ({self.reason}){consequence}{self.hint}"


# How delta-rs words a store it cannot reach (the network, credentials) inside a `DeltaError`:
# not damage, though the exception type is the one a damaged log raises.
_UNREACHABLE = ("Generic S3 error", "necessary privileges")


def _is_damage(error: BaseException) -> bool:
    """Whether `error`, raised by delta-rs, pyarrow or DuckDB on the table, says its files are
    damaged. Measured (deltalake 1.6): a log entry that is not JSON, truncated, or a junk later
    version (a gap), a missing first entry, a checkpoint that is not Parquet: `DeltaError`
    ("Kernel error: ..."); a data file deleted: `FileNotFoundError` (pyarrow) or, through a
    DuckDB scan, a DuckDB error quoting it; a data file not Parquet: `ArrowInvalid` (DuckDB:
    "failed: Invalid:"). A store that cannot be reached raises a plain `OSError` instead."""
    import duckdb
    from deltalake.exceptions import (
        CommitFailedError,
        DeltaError,
        SchemaMismatchError,
        TableNotFoundError,
    )

    text = str(error)
    if isinstance(error, (FileNotFoundError, pa.ArrowInvalid)):
        return True
    if isinstance(error, DeltaError):
        return (not isinstance(error, (CommitFailedError, SchemaMismatchError, TableNotFoundError))
                and not any(marker in text for marker in _UNREACHABLE))
    return isinstance(error, duckdb.Error) and ("FileNotFoundError" in text
                                                or "failed: Invalid:" in text)


def pending_key(conversation_id: str) -> str:
    return PENDING_PREFIX + check_safe_id(conversation_id)


def table_row(record: ManifestRecord) -> dict:
    """A manifest record as a table row: its scalar columns (state counts None for older
    manifests)."""
    return {name: getattr(record, name) for name in TABLE_SCHEMA.names}


def table_rows(rows: Iterable[dict]) -> pa.Table:
    """Table rows (`table_row`s) as an Arrow table, sorted by conversation and episode so files
    and row groups cover narrow id ranges."""
    table = pa.Table.from_pylist(list(rows), schema=TABLE_SCHEMA)
    return table.sort_by([("conversation_id", "ascending"), ("episode", "ascending")])


def _id_predicate(ids: Sequence[str]) -> str:
    """A Delta predicate selecting these conversations' rows; the range lets delta-rs skip the
    files whose conversation_id statistics lie outside it (an IN list alone does not prune)."""
    quoted = [f"'{check_safe_id(i)}'" for i in ids]  # safe ids hold no quote
    return (f"conversation_id >= {quoted[0]} AND conversation_id <= {quoted[-1]} AND "
            f"conversation_id IN ({', '.join(quoted)})")


class ManifestTable:
    """The Delta table of one store's episodes; every call reopens the latest version."""

    def __init__(self, store: Store):
        """A store that no outside engine can read (`Store.location` None: in memory) has no
        table: it never `exists`, and reading or writing it is a `TableError`."""
        self.store = store
        self.located = store.location(TABLE_KEY)
        self.uri = self.located or f"{store.uri}/{TABLE_KEY}"

    # -- where and how -------------------------------------------------------------------------
    def _where(self) -> str:
        """The table's path or URL for delta-rs; `TableError` for a store that has none."""
        if self.located is None:
            raise TableError(f"store {self.store.uri} has no manifest table (a folder or S3 "
                             "only)")
        return self.located

    def _options(self) -> dict[str, str] | None:
        """delta-rs storage options of the store (credentials read now, never kept)."""
        try:
            return self.store.storage_options(f"the manifest table {self.uri}")
        except StoreError as e:
            raise TableError(str(e)) from None

    def call(self, what: str, fn, *args, **kwargs):
        """Run a call that reads or writes the table (delta-rs, pyarrow, or DuckDB scanning its
        dataset); its failure becomes one line naming the table (`failure`)."""
        try:
            return fn(*args, **kwargs)
        except (StoreError, KeyboardInterrupt):
            raise
        except Exception as e:
            raise self.failure(what, e) from None

    def failure(self, what: str, error: Exception) -> TableError:
        """`error` as one line naming the table, any credential it might quote masked: a
        `TableDamagedError` where it says the table's files are damaged (`_is_damage`)."""
        text = (str(error).strip().splitlines() or [type(error).__name__])[0]
        text = text.split(" { ")[0][:300]  # not the Rust structure delta-rs may quote
        options = self._options() or {}
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            if options.get(key):
                text = text.replace(options[key], "***")
        reason = f"{what} failed: {type(error).__name__}: {text}"
        if _is_damage(error):
            return TableDamagedError(self.uri, reason, self.store.uri)
        return TableError(f"manifest table {self.uri}: {reason}")

    def exists(self) -> bool:
        from deltalake import DeltaTable

        if self.located is None:
            return False
        return self.call("open", DeltaTable.is_deltatable, self.located,
                         storage_options=self._options())

    def delta(self):
        """The table at its latest version; `TableError` when there is none."""
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        where, options = self._where(), self._options()
        try:
            return DeltaTable(where, storage_options=options)
        except TableNotFoundError:
            raise TableError(f"no manifest table at {self.uri}: `python -m jobs.manifests "
                             "--rebuild` makes one from the manifests") from None
        except Exception:  # any other failure: one line, as every call gives it
            return self.call("open", DeltaTable, where, storage_options=options)

    def check(self):
        """The table at its latest version, once its log reads and every data file the log
        names is stored (one listing; no data read): `TableDamagedError` otherwise. A build
        checks it before writing, so a damaged table is rebuilt, not appended to."""
        table = self.delta()
        base = self._where().rstrip("/") + "/"
        stored = {key.removeprefix(f"{TABLE_KEY}/") for key in self.store.list(f"{TABLE_KEY}/")}
        named = [uri.removeprefix(base) for uri in self.call("open", table.file_uris)]
        missing = [name for name in named if name not in stored]
        if missing:
            raise TableDamagedError(self.uri, f"{len(missing)} of the {len(named)} data files its "
                                    f"log names are gone (e.g. {missing[0]})", self.store.uri)
        return table

    def damage(self) -> TableDamagedError | None:
        """What `check` finds damaged in the table's files, None when they are sound."""
        try:
            self.check()
        except TableDamagedError as e:
            return e
        return None

    def dataset(self, conversation_ids: Sequence[str] | None = None) -> pads.Dataset:
        """A pyarrow dataset of the table (DuckDB scans it as a view); with ids, only the files
        whose statistics may hold them."""
        table = self.delta()
        pruning = None
        if conversation_ids:
            pruning = [("conversation_id", "in", sorted(set(conversation_ids)))]
        return self.call("read", table.to_pyarrow_dataset, file_pruning_predicate=pruning)

    # -- writing ---------------------------------------------------------------------------------
    def _write(self, what: str, data, **kwargs) -> None:
        from deltalake import WriterProperties, write_deltalake

        props = WriterProperties(compression="ZSTD", max_row_group_size=_ROW_GROUP)
        self.call(what, write_deltalake, self._where(), data, writer_properties=props,
                  configuration=_TABLE_CONFIG, storage_options=self._options(), **kwargs)

    def replace(self, conversation_ids: Sequence[str],
                rows: list[dict] | pa.Table) -> None:
        """These conversations' rows become `rows` (`table_row`s, or a table of `TABLE_SCHEMA`;
        none: they are removed): one commit per `_MAX_IDS` conversations, so each
        conversation's rows change in one commit."""
        ids = sorted(set(conversation_ids))
        data = rows if isinstance(rows, pa.Table) else table_rows(rows)
        for start in range(0, len(ids), _MAX_IDS):
            part = ids[start:start + _MAX_IDS]
            if len(part) < len(ids):
                data_part = data.filter(pc.is_in(data["conversation_id"], pa.array(part)))
            else:
                data_part = data
            self._replace(part, data_part)

    def _replace(self, ids: list[str], data: pa.Table) -> None:
        try:
            table = self.delta()
        except TableError:
            if not self.exists():  # none yet (any other failure is raised again below)
                self._write("create", data, mode="append")
                return
            table = self.delta()
        # schema_mode="merge": a table written before a column existed (the fingerprints)
        # gains it, its older rows null
        if not self._holds_any(table, ids):  # new conversations only: a plain append
            if data.num_rows:
                self._write("append rows", data, mode="append", schema_mode="merge")
        elif data.num_rows:
            self._write("replace rows", data, mode="overwrite", predicate=_id_predicate(ids),
                        schema_mode="merge")
        else:
            self.call("delete rows", table.delete, _id_predicate(ids))

    def _holds_any(self, table, ids: list[str]) -> bool:
        """Whether the table has rows of any of these conversations: the files' id ranges
        first (a build in id order never reads a row), then those files' ids."""
        files = pa.table(self.call("read", table.get_add_actions, flatten=True))
        if not files.num_rows:
            return False
        if "min.conversation_id" not in files.column_names:  # files without statistics
            return True
        low, high = files["min.conversation_id"], files["max.conversation_id"]
        overlap = pc.and_(pc.less_equal(low, ids[-1]), pc.greater_equal(high, ids[0]))
        if not pc.any(overlap).as_py():
            return False
        dataset = self.call("read", table.to_pyarrow_dataset,
                            file_pruning_predicate=[("conversation_id", "in", ids)])
        found = self.call("read", dataset.to_table, columns=["conversation_id"],
                          filter=pc.field("conversation_id").isin(ids))
        return found.num_rows > 0

    def overwrite(self, batches: Iterable[pa.RecordBatch]) -> None:
        """Replace the whole table by these batches, streamed, in one commit (readers see the
        old table until it lands)."""
        reader = pa.RecordBatchReader.from_batches(TABLE_SCHEMA, iter(batches))
        self._write("rewrite", reader, mode="overwrite", schema_mode="overwrite")

    def compact(self, retain_hours: float = 168.0) -> dict:
        """Rewrite the table sorted by conversation_id, in one commit (DuckDB sorts it, spilling
        to a temporary folder past `_SORT_MEMORY`): few large files whose id ranges do not
        overlap, so a point lookup opens one file and one row group. Then vacuum the files no
        version younger than `retain_hours` needs. (Delta's own Z-order keys strings on their
        first bytes, which ids with a common prefix share: it does not sort them.)"""
        import duckdb

        before = len(self.delta().file_uris())
        with tempfile.TemporaryDirectory(prefix="epicache-compact-") as spill:
            con = duckdb.connect(config={"memory_limit": _SORT_MEMORY, "temp_directory": spill})
            con.register("episodes", self.dataset())
            query = "SELECT * FROM episodes ORDER BY conversation_id, episode"
            sorted_rows = self.call("compact", lambda: con.sql(query).to_arrow_reader(_ROW_GROUP))
            self._write("compact", sorted_rows, mode="overwrite")
            con.close()
        table = self.delta()
        removed = self.call("vacuum", table.vacuum, retention_hours=int(retain_hours),
                            dry_run=False, enforce_retention_duration=False)
        table = self.delta()
        return {"files_before": before, "files_after": len(table.file_uris()),
                "vacuumed": len(removed), "version": table.version()}
