"""Where objects live: bytes under keys, one backend a module and one entry in `BACKENDS`.

    base.py    Store (the interface and its capabilities), StoreOptions, StoreError, the
               object keys
    local.py   LocalStore: a directory (the default; file://)
    s3.py      S3Store: S3 or an S3-compatible server (s3://; endpoint resolved here,
               credentials from the AWS chain)
    memory.py  MemoryStore: a named dict of this process (memory://), for runs that keep
               nothing on disk
    uri.py     BACKENDS (URI scheme -> backend) and open_store, which resolves through it
"""
