"""The server starts on a store with a corrupt manifest: the models to serve are read from the
first conversation whose manifest reads, and the corrupt one is named in the log."""

from __future__ import annotations

import logging

from pipeline.serve.app import resolve_models
from pipeline.store.backends.base import manifest_key
from pipeline.store.backends.memory import MemoryStore
from tests.support.stores import CORRUPT, put_conversation


def test_a_corrupt_first_manifest_is_passed_over_and_logged(caplog):
    store = MemoryStore("resolve-models")
    put_conversation(store, "a-broken")
    put_conversation(store, "b-good")
    store.put(manifest_key("a-broken"), CORRUPT["not parquet"][0](b""))
    with caplog.at_level(logging.WARNING, "epicache.serve"):
        assert resolve_models(store, None, None) == ("synthetic", "synthetic")
    assert "conversation a-broken: its manifest cannot be read" in caplog.text
