"""Queries of the manifest table through DuckDB: totals, filtered rows, and a sandboxed SQL view.

The connection may not read or write files or reach the network: `jobs.manifests --sql` runs a
user's query against the view `episodes` and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.store.catalogue.table import _ROW_GROUP, TABLE_SCHEMA, ManifestTable

VIEW = "episodes"  # the DuckDB view name of `jobs.manifests --sql`


def connect(table: ManifestTable, conversation_ids: Sequence[str] | None = None):
    """A DuckDB connection where the table is the view `episodes` (`VIEW`); it may not touch
    files or the network (`enable_external_access` off), so a query reads the table only."""
    import duckdb

    con = duckdb.connect(config={"enable_external_access": False})
    con.register(VIEW, table.dataset(conversation_ids))
    return con


def where(conversations: Sequence[str] | None = None, config_hashes: Sequence[str] | None = None,
          models: Sequence[str] | None = None) -> tuple[str, list[str]]:
    """A WHERE clause with parameters for the filters of `jobs.manifests` ('' for none)."""
    clauses, params = [], []
    for column, values in (("conversation_id", conversations), ("config_hash", config_hashes),
                           ("model_id", models)):
        if values:
            clauses.append(f"{column} IN ({', '.join('?' * len(values))})")
            params.extend(values)
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params


@dataclass(frozen=True)
class Totals:
    episodes: int
    conversations: int
    tokens: int
    object_bytes: int
    kv_bytes: int


def totals(table: ManifestTable, conversations: Sequence[str] | None = None,
           config_hashes: Sequence[str] | None = None,
           models: Sequence[str] | None = None) -> Totals:
    """Episodes, conversations, tokens and bytes of the rows the filters select."""
    clause, params = where(conversations, config_hashes, models)
    con = connect(table, conversations)
    query = ("SELECT count(*), count(DISTINCT conversation_id), sum(tokens), sum(object_bytes), "
             f"sum(kv_bytes) FROM {VIEW}{clause}")
    row = table.call("read", lambda: con.execute(query, params).fetchone())
    return Totals(*(int(v or 0) for v in row))


def select(table: ManifestTable, columns: Sequence[str], conversations: Sequence[str] | None = None,
           config_hashes: Sequence[str] | None = None,
           models: Sequence[str] | None = None) -> pa.RecordBatchReader:
    """The filtered rows' columns, by conversation and episode, streamed in batches. Named
    conversations are a point lookup: pyarrow reads the few files and row groups whose
    statistics may hold them (no DuckDB start-up); otherwise DuckDB sorts, spilling if need be."""
    unknown = set(columns) - set(TABLE_SCHEMA.names)
    if unknown:
        raise ValueError(f"not columns of the manifest table: {', '.join(sorted(unknown))}")
    if conversations:
        expr = None
        for column, values in (("conversation_id", conversations), ("config_hash", config_hashes),
                               ("model_id", models)):
            if values:
                term = pc.field(column).isin(list(values))
                expr = term if expr is None else expr & term
        found = table.call("read", table.dataset(conversations).to_table, filter=expr).sort_by(
            [("conversation_id", "ascending"), ("episode", "ascending")])
        for name in columns:  # a column added since the table was written reads as nulls
            if name not in found.column_names:
                found = found.append_column(TABLE_SCHEMA.field(name),
                                            pa.nulls(found.num_rows, TABLE_SCHEMA.field(name).type))
        found = found.select(list(columns))
        return pa.RecordBatchReader.from_batches(found.schema, found.to_batches())
    clause, params = where(conversations, config_hashes, models)
    con = connect(table)
    present = set(con.sql(f"SELECT * FROM {VIEW} LIMIT 0").columns)
    # a column added since the table was written (the fingerprints) reads as nulls
    listed = [c if c in present else f"NULL AS {c}" for c in columns]
    query = (f"SELECT {', '.join(listed)} FROM {VIEW}{clause} "
             "ORDER BY conversation_id, episode")
    # DuckDB scans the table here, sorting it: a data file gone or unreadable fails this call,
    # before the caller is handed a row
    return table.call("read", lambda: con.sql(query, params=params).to_arrow_reader(_ROW_GROUP))
