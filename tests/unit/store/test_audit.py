"""The store's listing rules (`pipeline.store.catalogue.audit`), as `jobs.manifests` uses them:
the filters, the manifests' rows and the ones that cannot be read, the table's rows checked
against their manifests a chunk at a time (a pending conversation passed unchecked), and the
model-files rule ("none", "stale", "unknown", and what needs a rebuild)."""

from __future__ import annotations

import dataclasses

from pipeline.store.backends.base import manifest_key
from pipeline.store.backends.local import LocalStore
from pipeline.store.catalogue import audit
from pipeline.store.catalogue.audit import Filters, ModelFiles, checked_rows, manifest_rows
from pipeline.store.catalogue.manifest import write_manifest
from pipeline.store.catalogue.table import table_row, table_rows
from tests.support.stores import plant_corrupt_manifest, put_conversation


def test_the_manifests_rows_keep_what_the_filters_say(tmp_path):
    store = LocalStore(tmp_path / "store")
    put_conversation(store, "conv-a")
    put_conversation(store, "conv-b", episodes=3)
    plant_corrupt_manifest(store, cid="conv-bad")
    rows, corrupt = manifest_rows(store, Filters())
    assert sorted({r["conversation_id"] for r in rows}) == ["conv-a", "conv-b"] and len(rows) == 5
    assert len(corrupt) == 1 and "conv-bad" in str(corrupt[0])
    totals = audit.rows_totals(rows)
    assert (totals.episodes, totals.conversations, totals.tokens) == (5, 2, 40)
    rows, _ = manifest_rows(store, Filters(conversations=["conv-b"], models=["synthetic"]))
    assert len(rows) == 3
    assert manifest_rows(store, Filters(["conv-a"], config_hashes=["other"])) == ([], [])
    assert Filters().whole and not Filters(models=["m"]).whole


def test_the_tables_rows_are_shown_only_where_their_manifest_backs_them(tmp_path, monkeypatch):
    monkeypatch.setattr(audit, "CHECK_CHUNK", 1)  # one conversation at a time
    store = LocalStore(tmp_path / "store")
    listed = [put_conversation(store, cid) for cid in ("conv-a", "conv-b", "conv-c")]
    batches = table_rows(table_row(r) for records in listed for r in records).to_batches()
    changed = [dataclasses.replace(r, tokens=9) for r in listed[1]]
    write_manifest(store, "conv-b", changed)  # rewritten since the table was written
    store.delete(manifest_key("conv-c"))  # pending: a build is committing it
    faults: dict[str, str] = {}
    rows = list(checked_rows(store, batches, {"conv-c"}, True, faults))
    assert [r["conversation_id"] for r in rows] == ["conv-a"] * 2 + ["conv-c"] * 2
    assert list(faults) == ["conv-b"] and "does not match the manifest table" in faults["conv-b"]


def test_the_model_files_rule():
    here = {("model", "llm"): "m-now", ("encoder", "enc"): "e-now"}
    files = ModelFiles(lambda kind, name: here.get((kind, name)))
    row = {"model_id": "llm", "encoder_id": "enc", "model_fingerprint": "m-now",
           "encoder_fingerprint": "e-now"}
    assert files.flag(row) == "m-now"
    assert files.flag(row | {"model_fingerprint": "m-old"}) == "m-old stale"
    assert files.flag(row | {"model_id": "gone"}) == "m-now unknown"
    assert files.flag(row | {"encoder_fingerprint": None}) == "none"
    assert (files.stale, files.unbound) == (1, 1) and len(files.warnings()) == 2
    unchecked = ModelFiles()
    assert unchecked.flag(row | {"model_fingerprint": "m-old"}) == "m-old"
    marked = dict(row)
    unchecked.mark(marked)
    assert "model_files" not in unchecked.shown(marked) and unchecked.warnings() == []
    assert files.shown(marked)["model_files"] == "m-now"
