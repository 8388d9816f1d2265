"""The store: where caches, manifests and profiles live, and the index over them.

    base.py         Store (the interface and its capabilities), StoreOptions, StoreError, the
                    object keys
    local.py        LocalStore: a directory (the default; file://)
    s3.py           S3Store: S3 or an S3-compatible server (s3://; endpoint resolved here,
                    credentials from the AWS chain)
    memory.py       MemoryStore: a named dict of this process (memory://), for runs that keep
                    nothing on disk
    uri.py          BACKENDS (URI scheme -> backend) and open_store, which resolves through it
    cache_format.py one episode's cache as safetensors (never pickle), checksummed
                    (its format version: pipeline.config.format_version)
    turn_index.py   a conversation's turn index (every turn's text and embedding, for the
                    question-time top-up), checked as a cache object is
    manifest.py     ManifestRecord (the schema), CacheRef, the per-conversation Parquet
                    manifest (the commit point)
    table.py        the manifest table: every episode of a store in one Delta table
    table_query.py  DuckDB queries of the table (totals, filters, a sandboxed SQL view)
    table_sync.py   the table kept equal to the manifests: IndexWriter, repair, rebuild
    garbage.py      what no manifest names (orphans, unfinished writes), and manifest faults
    disk_tier.py    a bounded local-disk tier of cache objects (serving)
    cache_read.py   the read path's one way in: an episode's cache (or bytes), verified, from the
                    disk tier or the store

The layout of a store is documented in docs/store.md.
"""
