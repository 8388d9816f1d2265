"""A store from a URI: a local folder (path or file://) or `s3://bucket/prefix`."""

from __future__ import annotations

from pipeline.store.base import Store, StoreError
from pipeline.store.local import LocalStore
from pipeline.store.s3 import S3Store, parse_s3_uri


def open_store(uri: str, *, endpoint_url: str | None = None, region: str | None = None,
               create: bool = True) -> Store:
    """A store from a URI: a local folder (path or file://) or `s3://bucket/prefix`.

    For S3, the endpoint is `endpoint_url`, else as `pipeline.store.s3.s3_endpoint` resolves
    it (the environment, or AWS). Opening checks the bucket: a
    missing bucket is a `StoreError` (buckets are never created; an empty prefix is an empty
    store). A local folder is created unless `create=False`, which read-only commands pass so
    that a store that does not exist is a `StoreError` naming it.
    """
    if uri.startswith("s3://"):
        bucket, prefix = parse_s3_uri(uri)
        return S3Store(bucket, prefix, region=region, endpoint_url=endpoint_url)
    if uri.startswith("file://"):
        return LocalStore(uri.removeprefix("file://"), create=create)
    if "://" in uri:
        raise StoreError(f"unsupported store URI {uri!r}: use a local folder or s3://bucket/prefix")
    return LocalStore(uri, create=create)
