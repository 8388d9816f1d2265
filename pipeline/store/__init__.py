"""The store: where caches, manifests and profiles live, and the index over them.

    base.py         Store (the interface), StoreError, the object keys
    local.py        LocalStore: a directory (the default)
    s3.py           S3Store: S3 or an S3-compatible server (credentials from the AWS chain)
    uri.py          open_store: a store from a folder path, file:// or s3:// URI
    cache_format.py one episode's cache as safetensors (never pickle), checksummed
    format_version.py  the cache format's version (hashed into the build configuration)
    manifest.py     ManifestRecord (the schema), CacheRef, the per-conversation Parquet
                    manifest (the commit point)
    table.py        the manifest table: every episode of a store in one Delta table
    table_query.py  DuckDB queries of the table (totals, filters, a sandboxed SQL view)
    table_sync.py   the table kept equal to the manifests: IndexWriter, repair, rebuild
    garbage.py      what no manifest names (orphans, unfinished writes), and manifest faults
    disk_tier.py    a bounded local-disk tier of verified cache objects (serving)
    seaweedfs.py    a local S3 server (SeaweedFS) for trying the S3 path and for the tests

The layout of a store is documented in docs/store.md.
"""
