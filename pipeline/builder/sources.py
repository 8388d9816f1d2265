"""A corpus's objects: a local path, or s3:// objects streamed through the store layer."""

from __future__ import annotations

from pipeline.corpus.reader import CorpusObject, local_objects
from pipeline.corpus.schema import CorpusError
from pipeline.store.backends.base import Store, StoreOptions
from pipeline.store.backends.s3 import parse_s3_uri
from pipeline.store.backends.uri import open_store


def corpus_objects(uri: str, options: StoreOptions | None = None) -> list[CorpusObject]:
    """The objects of a corpus: a local file or folder, `s3://bucket/key.jsonl` (one object)
    or `s3://bucket/folder` (the .jsonl/.json objects directly under it, in key order), reached
    with the store's `options`. Only the listing happens here; records are streamed from S3
    (GetObject) as the build reads them, never copied to the driver's disk."""
    if not uri.startswith("s3://"):
        return local_objects(uri)
    bucket, key = parse_s3_uri(uri)
    if not key:
        raise CorpusError(f"{uri}: give an object (.jsonl/.json) or a folder inside the bucket")
    parent, _, name = key.rpartition("/")
    if name.endswith((".jsonl", ".json")):
        folder = open_store(f"s3://{bucket}/{parent}", options, create=False)
        size = folder.info(name).size  # a missing object fails here, in one line
        return [_object(folder, name, size)]
    folder = open_store(f"s3://{bucket}/{key}", options, create=False)
    names = [k for k in folder.list() if "/" not in k and k.endswith((".jsonl", ".json"))]
    if not names:
        raise CorpusError(f"{uri}: no such object, and no .jsonl or .json objects under it")
    return [_object(folder, n) for n in names]


def _object(folder: Store, name: str, size: int | None = None) -> CorpusObject:
    return CorpusObject(name, lambda: folder.open(name),
                        (lambda: size) if size is not None else (lambda: folder.info(name).size))
