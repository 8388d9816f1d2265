"""The backends by scheme: the registry `open_store` resolves through, the capabilities callers
ask instead of a store's class, and what only the in-memory backend has (a name shared within
the process, and a clear error in another). The contract every backend keeps is
tests/integration/test_store_backends.py's, run on each."""

from __future__ import annotations

import pickle
import uuid

import pytest

from pipeline.store.backends.base import StoreError, StoreOptions
from pipeline.store.backends.local import LocalStore
from pipeline.store.backends.memory import MemoryStore
from pipeline.store.backends.s3 import S3Store
from pipeline.store.backends.uri import BACKENDS, open_store
from pipeline.store.catalogue.table import ManifestTable, TableError
from pipeline.store.catalogue.table_sync import IndexWriter


def _name() -> str:
    return f"unit-{uuid.uuid4().hex[:12]}"


def test_every_scheme_opens_its_backend(tmp_path):
    assert BACKENDS == {"file": LocalStore, "s3": S3Store, "memory": MemoryStore}
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    assert isinstance(open_store(f"memory://{_name()}"), MemoryStore)
    with pytest.raises(StoreError, match=r"unsupported store URI 'gs://b/x': use a local folder "
                                         r"or one of file://, s3://, memory://"):
        open_store("gs://b/x")


def test_s3_options_reach_the_client_without_credentials(monkeypatch):
    """The endpoint and region come in one options object (the older keywords fold into it);
    the store reports them back for a sibling URI, and credentials are nowhere in them."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret")
    monkeypatch.setattr(S3Store, "check", lambda self: None)  # no server here
    store = open_store("s3://bucket/prefix", StoreOptions("http://127.0.0.1:1", "eu-west-1"))
    assert (store.endpoint_url, store.region) == ("http://127.0.0.1:1", "eu-west-1")
    assert store.options == StoreOptions("http://127.0.0.1:1", "eu-west-1")
    assert "not-a-real-secret" not in repr(store.options) + repr(store)
    assert repr(StoreOptions("http://user:pw@h:1")) == \
        "StoreOptions(endpoint='http://h:1', region=None)"  # a URL's password never printed
    assert store.location("index/episodes") == "s3://bucket/prefix/index/episodes"
    options = store.storage_options("the manifest table")
    assert options["AWS_ENDPOINT_URL"] == "http://127.0.0.1:1"
    assert options["AWS_ALLOW_HTTP"] == "true"


def test_local_capabilities(tmp_path):
    store = LocalStore(tmp_path)
    assert store.location("index/episodes") == str(tmp_path.resolve() / "index" / "episodes")
    assert store.storage_options("x") is None and store.options == StoreOptions()
    assert ManifestTable(store).uri == str(tmp_path.resolve() / "index" / "episodes")


def test_memory_stores_of_one_name_share_their_objects():
    name = _name()
    with pytest.raises(StoreError, match=f"memory store memory://{name} does not exist"):
        open_store(f"memory://{name}", create=False)  # a read-only command's typo
    store = open_store(f"memory://{name}")
    store.put("a/b", b"x")
    assert open_store(f"memory://{name}", create=False).get("a/b") == b"x"
    assert pickle.loads(pickle.dumps(store)).get("a/b") == b"x"  # in this process
    assert open_store(f"memory://{_name()}").list() == []  # another name: another store
    with pytest.raises(StoreError, match="needs a name"):
        open_store("memory://")
    store.drop()
    with pytest.raises(StoreError, match="is not in this process"):  # as in another process
        store.get("a/b")


def test_memory_store_has_no_manifest_table_and_a_build_index_skips_it():
    store = MemoryStore(_name())
    assert store.location("index/episodes") is None and store.storage_options("x") is None
    table = ManifestTable(store)
    assert not table.exists()
    with pytest.raises(TableError, match="has no manifest table"):
        table.delta()
    with pytest.raises(TableError, match="has no manifest table"):
        table.replace(["c"], [])
    with IndexWriter(store) as index:
        index.begin("c")
        index.add("c", [])
    assert store.list() == []  # no pending marker, no table
    store.drop()
