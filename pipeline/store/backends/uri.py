"""A store from a URI: its scheme names the backend (a path without one is a local folder).

Adding a backend is one module with a `Store` subclass (its `from_uri` reads the URI) and one
line in `BACKENDS`.
"""

from __future__ import annotations

from pipeline.store.backends.base import Store, StoreError, StoreOptions
from pipeline.store.backends.local import LocalStore
from pipeline.store.backends.memory import MemoryStore
from pipeline.store.backends.s3 import S3Store

BACKENDS: dict[str, type[Store]] = {
    "file": LocalStore,
    "s3": S3Store,
    "memory": MemoryStore,
}


def open_store(uri: str, options: StoreOptions | None = None, *, create: bool = True) -> Store:
    """The store `uri` names: a local folder (path or file://), `s3://bucket/prefix` or
    `memory://name`. `options` is how to reach it beyond the URI (S3: the endpoint, else as
    `pipeline.store.backends.s3.s3_endpoint` resolves it, and the region). Opening S3 checks
    the bucket: a missing bucket is a `StoreError` (buckets are never created; an empty prefix
    is an empty store). A folder or a memory store is created unless `create=False`, which
    read-only commands pass so that a store that does not exist is a `StoreError` naming it.
    """
    scheme, sep, _ = uri.partition("://")
    backend = BACKENDS.get(scheme if sep else "file")
    if backend is None:
        known = ", ".join(f"{s}://" for s in BACKENDS)
        raise StoreError(f"unsupported store URI {uri!r}: use a local folder or one of {known}")
    return backend.from_uri(uri, options or StoreOptions(), create=create)
