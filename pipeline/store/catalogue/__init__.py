"""What a store holds: the manifests that name its objects, and the index over them.

    manifest.py     ManifestRecord (the schema), the per-conversation Parquet manifest (the
                    commit point)
    table.py        the manifest table: every episode of a store in one Delta table
    table_query.py  DuckDB queries of the table (totals, filters, a sandboxed SQL view)
    table_sync.py   the table kept equal to the manifests: IndexWriter, repair, rebuild
    garbage.py      what no manifest names (orphans, unfinished writes), and manifest faults
    audit.py        a listing of the store, checked: the table's rows against the manifests,
                    the filters, and each episode's model files (none, stale, unknown)
"""
