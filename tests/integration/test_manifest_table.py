"""The manifest table (a Delta Lake index over the per-conversation manifests), local and on a
real S3 server (SeaweedFS).

Builds run on the real driver and a local Ray with the synthetic stages of `jobs.bench.scale`
(no model); the table is compared, row by row, with what the manifests say after builds,
re-runs, --force, a new configuration and gc; a crash between a manifest commit and the table
append is repaired by the next build and by `jobs.manifests --compact`; `--rebuild`, `--sql`
and the filters are exercised through the command itself.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import re
import uuid
from dataclasses import replace

import pytest

from jobs import gc, manifests
from lab.rehearsal import SYNTHETIC_CONFIG, SYNTHETIC_STAGES, write_synthetic_corpus
from pipeline.builder.driver import run_build
from pipeline.config import DriverOptions, GrowthConfig
from pipeline.episodes import EpisodeConfig
from pipeline.store.backends.base import manifest_key
from pipeline.store.backends.local import LocalStore
from pipeline.store.backends.s3 import S3Store, parse_s3_uri
from pipeline.store.backends.uri import open_store
from pipeline.store.catalogue import table as manifest_table
from pipeline.store.catalogue.manifest import list_conversations, read_manifest, write_manifest
from pipeline.store.catalogue.table import (
    PENDING_PREFIX,
    ManifestTable,
    TableError,
    pending_key,
    table_row,
)
from pipeline.store.catalogue.table_sync import IndexWriter, rebuild
from tests.support.stores import CORRUPT, plant_corrupt_manifest, put_conversation


def table_rows(store) -> list[dict]:
    rows = ManifestTable(store).dataset().to_table().to_pylist()
    return sorted(rows, key=lambda r: (r["conversation_id"], r["episode"]))


def manifest_rows(store) -> list[dict]:
    rows = [table_row(r)
            for cid in list_conversations(store) for r in read_manifest(store, cid)]
    return sorted(rows, key=lambda r: (r["conversation_id"], r["episode"]))


def assert_table_equals_manifests(store) -> list[dict]:
    rows = table_rows(store)
    assert rows == manifest_rows(store)
    assert store.list(PENDING_PREFIX) == []
    return rows


def run(corpus, store, config=SYNTHETIC_CONFIG, **options):
    options = {"progress": False, "index_flush_rows": 6} | options
    return run_build(str(corpus), store, config, DriverOptions(**options), stages=SYNTHETIC_STAGES)


# ---------------------------------------------------------------------------------------------
# The table follows the builds
# ---------------------------------------------------------------------------------------------

def test_table_equals_manifests_after_builds_reruns_force_new_config_and_gc(ray_local, tmp_path,
                                                                            capsys):
    corpus = tmp_path / "corpus.jsonl"
    write_synthetic_corpus(corpus, 9, failures={4: "raise"})
    store = LocalStore(tmp_path / "store")
    table = ManifestTable(store)

    first = run(corpus, store)  # flushes every 6 rows: several commits during the build
    assert first.built == 8 and list(first.failed) == ["bench-0000004"]
    rows = assert_table_equals_manifests(store)
    assert len(rows) == 16 and "bench-0000004" not in {r["conversation_id"] for r in rows}
    version = table.delta().version()
    assert version >= 3  # created, then more than one flush

    again = run(corpus, store)  # everything up to date: skipped, the table untouched
    assert again.skipped == 8 and table.delta().version() == version
    assert_table_equals_manifests(store)

    forced = run(corpus, store, force=True)  # rebuilt: rows replaced, never doubled
    assert forced.built == 8
    rows = assert_table_equals_manifests(store)
    assert len(rows) == 16

    three = replace(SYNTHETIC_CONFIG, episodes=EpisodeConfig(episodes=3))  # a new config hash
    run(corpus, store, three)
    rows = assert_table_equals_manifests(store)
    assert len(rows) == 24 and {r["config_hash"] for r in rows} == {three.hash}

    # gc removes the first configuration's objects (orphans now); manifests, and so the
    # table, stay as they are
    assert gc.main(["--store", store.uri, "--delete", "--min-age-seconds", "0"]) == 0
    assert int(re.search(r"removed (\d+) orphan objects", capsys.readouterr().out)[1]) >= 16
    rows = assert_table_equals_manifests(store)
    assert set(store.list("caches/")) == {r["object_key"] for r in rows}


def test_index_writer_memory_is_one_batch_and_markers_go_after_the_append(tmp_path):
    """Without Ray: the writer's buffer never holds more than a flush, and each marker is
    removed only once its conversation's rows are in the table."""
    store = LocalStore(tmp_path / "store")
    with IndexWriter(store, flush_rows=6, flush_seconds=3600) as writer:
        for i in range(10):
            cid = f"conv-{i}"
            writer.begin(cid)
            rows = put_conversation(store, cid)  # the commit: objects, then the manifest
            assert store.exists(pending_key(cid))
            writer.add(cid, rows)
            assert len(writer.rows) < 6
            if not writer.rows:  # flushed: nothing pending
                assert store.list(PENDING_PREFIX) == []
        assert writer.commits == 3 and store.list(PENDING_PREFIX) == [pending_key("conv-9")]
    assert writer.commits == 4  # the last flush, at exit
    assert len(assert_table_equals_manifests(store)) == 20


# ---------------------------------------------------------------------------------------------
# A crash between the manifest commit and the table append
# ---------------------------------------------------------------------------------------------

def crashed_build(corpus, store, monkeypatch):
    """A build whose driver dies after committing manifests and before appending them: its
    flushes never happen (the state a killed driver leaves)."""
    with monkeypatch.context() as m:
        m.setattr(IndexWriter, "flush", lambda self: None)
        summary = run(corpus, store)
    assert summary.built == 5
    assert len(store.list(PENDING_PREFIX)) == 5
    assert len(table_rows(store)) == 0 and len(manifest_rows(store)) == 10


def test_crash_before_the_table_append_is_repaired_by_the_next_build(ray_local, tmp_path,
                                                                     monkeypatch, caplog):
    corpus = tmp_path / "corpus.jsonl"
    write_synthetic_corpus(corpus, 5)
    store = LocalStore(tmp_path / "store")
    crashed_build(corpus, store, monkeypatch)
    # and a conversation whose commit never happened: its marker, no manifest
    store.put(pending_key("never-committed"), b"")
    summary = run(corpus, store)
    assert summary.skipped == 5  # nothing rebuilt: the repair read the 6 marked manifests
    assert "repaired 6 conversations" in caplog.text
    assert len(assert_table_equals_manifests(store)) == 10


def test_crash_before_the_table_append_is_repaired_by_compact(ray_local, tmp_path, monkeypatch,
                                                              capsys):
    corpus = tmp_path / "corpus.jsonl"
    write_synthetic_corpus(corpus, 5)
    store = LocalStore(tmp_path / "store")
    crashed_build(corpus, store, monkeypatch)
    assert manifests.main(["--store", store.uri, "--totals"]) == 0
    out, err = capsys.readouterr()
    assert "5 conversation(s) committed since the table's last append" in err
    assert manifests.main(["--store", store.uri, "--compact", "--retain-hours", "0"]) == 0
    out = capsys.readouterr().out
    assert "5 pending conversation(s) brought up to date" in out and "old files removed" in out
    assert len(assert_table_equals_manifests(store)) == 10
    assert len(ManifestTable(store).delta().file_uris()) == 1  # rewritten sorted, one file


# ---------------------------------------------------------------------------------------------
# jobs.manifests: --rebuild, filters, totals, --sql
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def filled(tmp_path):
    """A store of 4 conversations x 2 episodes (two models, two configuration hashes)."""
    store = LocalStore(tmp_path / "store")
    for i in range(4):
        rows = put_conversation(store, f"conv-{i}")
        if i >= 2:  # as if built by another model and configuration
            write_manifest(store, f"conv-{i}", [
                dataclasses.replace(r, model_id="other-model", config_hash="feedfacecafebeef")
                for r in rows])
    return store


def test_rebuild_recreates_the_table_and_names_corrupt_manifests(filled, capsys):
    store = filled
    assert manifests.main(["--store", store.uri, "--rebuild"]) == 0
    assert "rebuilt the manifest table from 4 manifests (8 episodes)" in capsys.readouterr().out
    assert len(assert_table_equals_manifests(store)) == 8
    # a table gone wrong (rows of a conversation that does not exist) is recreated
    ManifestTable(store).replace(["ghost"], [dict(table_rows(store)[0], conversation_id="ghost")])
    assert len(table_rows(store)) == 9
    key = plant_corrupt_manifest(store, cid="conv-9")
    assert manifests.main(["--store", store.uri, "--rebuild"]) == 2
    out, err = capsys.readouterr()
    assert f"manifest '{key}'" in err and "is corrupt" in err
    assert "from 4 manifests" in out
    assert table_rows(store) == manifest_rows_without(store, "conv-9")


def manifest_rows_without(store, bad: str) -> list[dict]:
    rows = [table_row(r)
            for cid in list_conversations(store) if cid != bad
            for r in read_manifest(store, cid)]
    return sorted(rows, key=lambda r: (r["conversation_id"], r["episode"]))


def test_filters_and_totals_read_the_table(filled, capsys):
    store = filled
    rebuild(store)
    every = manifest_rows(store)

    def shown(*args) -> list[dict]:
        assert manifests.main(["--store", store.uri, "--json", *args]) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    assert shown() == every
    assert shown("--conversation", "conv-1") == \
        [r for r in every if r["conversation_id"] == "conv-1"]
    assert {r["conversation_id"] for r in shown("--config-hash", "feedfacecafebeef")} == \
        {"conv-2", "conv-3"}
    assert {r["conversation_id"] for r in shown("--model", "synthetic")} == {"conv-0", "conv-1"}
    assert shown("--model", "synthetic", "--config-hash", "feedfacecafebeef") == []
    (totals,) = shown("--totals", "--model", "other-model")
    assert totals["totals"] == {
        "episodes": 4, "conversations": 2, "tokens": 4 * 8,
        "object_bytes": sum(r["object_bytes"] for r in every if r["model_id"] == "other-model"),
        "kv_bytes": 0}
    # the table view: one line per episode, then the totals line
    assert manifests.main(["--store", store.uri, "--conversation", "conv-3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[1].startswith("conv-3 ") and \
        lines[-1].startswith("total: 2 episodes of 1 conversations; 16 tokens;")
    # --manifests reads the per-conversation manifests, with the same filters
    assert manifests.main(["--store", store.uri, "--manifests", "--json", "--model",
                           "other-model"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["conversation_id"] for r in rows} == {"conv-2", "conv-3"} and "mean_budget" in rows[0]


def test_listing_checks_each_conversation_against_its_manifest(filled, capsys):
    """A manifest truncated, removed or rewritten after the table was written: the listing (both
    of its read paths, text and JSON) names it on stderr, leaves its rows out and exits 2;
    --totals reads the table alone and says so; a pending conversation is not checked."""
    store = filled
    rebuild(store)
    key = manifest_key("conv-1")
    store.put(key, CORRUPT["truncated"][0](store.get(key)))
    store.delete(manifest_key("conv-2"))
    rows = read_manifest(store, "conv-0")
    write_manifest(store, "conv-0", [rows[0], dataclasses.replace(rows[1], tokens=9)])

    assert manifests.main(["--store", store.uri]) == 2
    out, err = capsys.readouterr()
    listed = {line.split()[0] for line in out.splitlines()[1:-1]}
    assert listed == {"conv-3"}
    assert "every conversation listed checked against its manifest" in out.splitlines()[-1]
    errors = err.strip().splitlines()
    assert errors[0] == (f"error: manifest 'manifests/conv-0.parquet' in store {store.uri} does "
                         "not match the manifest table (episodes 1)")
    assert errors[1].startswith(f"error: manifest '{key}' in store {store.uri} is corrupt: "
                                "not a readable Parquet file")
    assert errors[2] == (f"error: manifest 'manifests/conv-2.parquet' in store {store.uri} is "
                         "gone, but the manifest table lists conversation 'conv-2'")
    assert errors[3].startswith("error: 3 conversation(s) of the table left out: ")

    assert manifests.main(["--store", store.uri, "--json", "--conversation", "conv-1",
                           "--conversation", "conv-3"]) == 2  # the point lookup's path
    out, err = capsys.readouterr()
    assert {json.loads(line)["conversation_id"] for line in out.splitlines()} == {"conv-3"}
    assert f"manifest '{key}' in store {store.uri} is corrupt" in err

    assert manifests.main(["--store", store.uri, "--totals"]) == 0
    assert "manifests not read" in capsys.readouterr().out

    store.put(pending_key("conv-0"), b"")  # a build is committing it: the table lags, known
    assert manifests.main(["--store", store.uri, "--conversation", "conv-0"]) == 0
    out, err = capsys.readouterr()
    assert "(1 pending: not checked)" in out and "warning: 1 conversation(s)" in err


def test_sql_runs_duckdb_over_the_view_episodes(filled, capsys):
    store = filled
    rebuild(store)
    query = ("SELECT config_hash, count(*) AS n, sum(object_bytes) AS bytes FROM episodes "
             "GROUP BY config_hash ORDER BY config_hash")
    assert manifests.main(["--store", store.uri, "--sql", query]) == 0
    got = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    every = manifest_rows(store)
    want = {}
    for r in every:
        n, b = want.get(r["config_hash"], (0, 0))
        want[r["config_hash"]] = (n + 1, b + r["object_bytes"])
    assert {g["config_hash"]: (int(g["n"]), int(g["bytes"])) for g in got} == want
    assert manifests.main(["--store", store.uri, "--json", "--sql",
                           "SELECT conversation_id FROM episodes WHERE episode = 1 "
                           "ORDER BY 1"]) == 0
    assert [json.loads(x)["conversation_id"] for x in capsys.readouterr().out.splitlines()] == \
        [f"conv-{i}" for i in range(4)]
    # one error line for bad SQL, and the query may read nothing but the table
    for bad, why in [("SELEC 1", "syntax error"),
                     ("SELECT * FROM read_csv('/etc/hostname')", "disabled by configuration")]:
        assert manifests.main(["--store", store.uri, "--sql", bad]) == 2
        out, err = capsys.readouterr()
        assert err.startswith("error: --sql: ") and why in err and len(err.splitlines()) == 1
    assert manifests.main(["--store", store.uri, "--sql", "SELECT 1", "--model", "m"]) == 2
    assert "put the conditions in the query" in capsys.readouterr().err


def test_store_without_a_table_is_read_from_its_manifests(filled, capsys):
    """A store built before the table: jobs.manifests reads the manifests as it always did;
    --sql says how to make the table; the next build creates it from the manifests."""
    store = filled
    assert not ManifestTable(store).exists()
    assert manifests.main(["--store", store.uri]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 9 and "budget" in out[0]
    assert manifests.main(["--store", store.uri, "--sql", "SELECT 1"]) == 2
    assert "--rebuild` makes one" in capsys.readouterr().err
    with IndexWriter(store):
        pass
    assert len(assert_table_equals_manifests(store)) == 8


# ---------------------------------------------------------------------------------------------
# The turn index columns, and tables written before them
# ---------------------------------------------------------------------------------------------

INDEX_COLUMNS = ["turn_index_key", "turn_index_sha256", "turn_index_bytes"]


def test_the_table_and_the_listing_carry_each_conversations_turn_index(tmp_path, capsys):
    """The turn index a manifest names is in the table (key, SHA-256, bytes), in --json rows
    and --sql, and in the listing's "index KiB" column ('-' for a conversation without one)."""
    store = LocalStore(tmp_path / "store")
    indexed = put_conversation(store, "conv-0", turn_index=True)
    put_conversation(store, "conv-1")
    assert set(INDEX_COLUMNS) <= set(manifest_table.TABLE_SCHEMA.names)
    rebuild(store)
    rows = assert_table_equals_manifests(store)
    assert {(r["conversation_id"], r["turn_index_key"], r["turn_index_bytes"]) for r in rows} == \
        {("conv-0", indexed[0].turn_index_key, indexed[0].turn_index_bytes),
         ("conv-1", None, None)}
    for extra in ([], ["--manifests"]):
        assert manifests.main(["--store", store.uri, "--json", *extra]) == 0
        shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [(r["turn_index_key"], r["turn_index_bytes"]) for r in shown] == \
            [(r["turn_index_key"], r["turn_index_bytes"]) for r in rows]
        assert manifests.main(["--store", store.uri, *extra]) == 0
        lines = capsys.readouterr().out.splitlines()
        column = lines[0].index("index KiB") + len("index KiB")  # right-aligned cells
        cells = [line[column - 9:column].strip() for line in lines[1:5]]
        assert cells == [f"{indexed[0].turn_index_bytes / 1024:.1f}"] * 2 + ["-"] * 2
    assert manifests.main(["--store", store.uri, "--sql", "SELECT DISTINCT conversation_id, "
                           "turn_index_bytes FROM episodes ORDER BY 1"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "conversation_id,turn_index_bytes", f"conv-0,{indexed[0].turn_index_bytes}", "conv-1,"]


def test_a_table_written_before_the_turn_index_columns_reads_appends_and_rebuilds(tmp_path,
                                                                                    capsys):
    """A table of a store built before turn indexes: listed as before (the columns null), then
    a conversation built since is appended and a grown one replaced, each adding the columns
    (their older rows null); --compact keeps them, --rebuild recreates the table."""
    store = LocalStore(tmp_path / "store")
    for i in range(3):
        put_conversation(store, f"conv-{i}")
    table = ManifestTable(store)
    old = manifest_table.table_rows(manifest_rows(store)).drop_columns(INDEX_COLUMNS)
    table._write("create", old, mode="append")  # as a writer before the columns wrote it
    assert not set(INDEX_COLUMNS) & set(table.dataset().schema.names)

    assert manifests.main(["--store", store.uri, "--json"]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(listed) == 6 and {r["turn_index_key"] for r in listed} == {None}
    assert manifests.main(["--store", store.uri, "--conversation", "conv-1", "--json"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2  # the point lookup's path
    assert manifests.main(["--store", store.uri, "--sql", "SELECT count(*) FROM episodes"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "6"

    new = put_conversation(store, "conv-3", turn_index=True)  # built since: appended
    table.replace(["conv-3"], [table_row(r) for r in new])
    grown = put_conversation(store, "conv-0", turn_index=True)  # rebuilt: its rows replaced
    table.replace(["conv-0"], [table_row(r) for r in grown])
    rows = assert_table_equals_manifests(store)
    assert {r["conversation_id"] for r in rows if r["turn_index_key"]} == {"conv-0", "conv-3"}
    assert manifests.main(["--store", store.uri]) == 0  # every row matches its manifest
    out = capsys.readouterr().out
    assert "total: 8 episodes of 4 conversations" in out

    assert manifests.main(["--store", store.uri, "--compact"]) == 0
    assert "compacted the manifest table" in capsys.readouterr().out
    assert_table_equals_manifests(store)
    assert manifests.main(["--store", store.uri, "--rebuild"]) == 0
    assert "rebuilt the manifest table from 4 manifests (8 episodes)" in capsys.readouterr().out
    assert_table_equals_manifests(store)
    assert set(INDEX_COLUMNS) <= set(table.dataset().schema.names)


# ---------------------------------------------------------------------------------------------
# On S3 (SeaweedFS)
# ---------------------------------------------------------------------------------------------

def test_table_on_s3(s3_env, capsys):
    """The table under s3://bucket/prefix/index/episodes: written by the driver's writer,
    repaired, rebuilt, compacted, queried; two writers cannot lose a commit (put-if-absent)."""
    store = open_store(s3_env.uri(f"table/{uuid.uuid4().hex[:12]}"))
    table = ManifestTable(store)
    assert table.uri == f"{store.uri}/index/episodes"
    with IndexWriter(store, flush_rows=4) as writer:
        for i in range(5):
            writer.begin(f"conv-{i}")
            writer.add(f"conv-{i}", put_conversation(store, f"conv-{i}"))
    assert len(assert_table_equals_manifests(store)) == 10
    keys = store.list("index/episodes/")
    assert any(k.startswith("index/episodes/_delta_log/") for k in keys)
    assert any(k.endswith(".parquet") for k in keys)

    store.put(pending_key("conv-0"), b"")  # an interrupted commit of a rebuilt conversation
    put_conversation(store, "conv-0", episodes=3)
    assert manifests.main(["--store", store.uri, "--compact", "--retain-hours", "0"]) == 0
    assert "1 pending conversation(s) brought up to date" in capsys.readouterr().out
    assert len(assert_table_equals_manifests(store)) == 11
    assert manifests.main(["--store", store.uri, "--sql",
                           "SELECT count(*) AS n FROM episodes "
                           "WHERE conversation_id = 'conv-0'"]) == 0
    assert capsys.readouterr().out.splitlines() == ["n", "3"]
    assert manifests.main(["--store", store.uri, "--rebuild"]) == 0
    assert len(assert_table_equals_manifests(store)) == 11

    # two writers that both loaded the same version: the second commit does not overwrite the
    # first (the log entry is put-if-absent), it lands as the next version
    from deltalake import write_deltalake

    base = ManifestTable(store)
    stale_a, stale_b = base.delta(), base.delta()
    one = [dict(table_rows(store)[0], conversation_id=f"extra-{n}") for n in "ab"]
    write_deltalake(stale_a, manifest_table.table_rows(one[:1]), mode="append")
    write_deltalake(stale_b, manifest_table.table_rows(one[1:]), mode="append")
    ids = {r["conversation_id"] for r in table_rows(store)}
    assert {"extra-a", "extra-b"} <= ids


def test_s3_table_errors_are_one_line_without_credentials(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-1234567890")
    store = S3Store(*parse_s3_uri(s3_env.uri(f"table/{uuid.uuid4().hex[:12]}")), check=False)
    with pytest.raises(TableError) as e:
        ManifestTable(store).replace(["conv-0"], [])  # create on a refused store
    text = str(e.value)
    assert text.startswith(f"manifest table {store.uri}/index/episodes: ") and "\n" not in text
    assert "wrong-secret" not in text and s3_env.access_key not in text


def test_replace_splits_large_batches_and_replaces_only_named_conversations(filled, monkeypatch):
    """A batch larger than one predicate may hold goes in several commits (delta-rs recurses
    over an IN list: ~25,000 ids overflow the stack), each replacing its conversations whole."""
    store = filled
    rebuild(store)
    table = ManifestTable(store)
    before = table_rows(store)
    monkeypatch.setattr(manifest_table, "_MAX_IDS", 2)
    version = table.delta().version()
    new = [dict(r, tokens=99) for r in before if r["conversation_id"] in ("conv-0", "conv-2")]
    new += [dict(before[0], conversation_id="conv-new", episode=e) for e in range(3)]
    table.replace(["conv-0", "conv-2", "conv-new", "conv-3"], new)  # conv-3: removed
    assert table.delta().version() == version + 2
    after = table_rows(store)
    assert [r for r in after if r["conversation_id"] == "conv-1"] == \
        [r for r in before if r["conversation_id"] == "conv-1"]
    assert {r["tokens"] for r in after if r["conversation_id"] in ("conv-0", "conv-2")} == {99}
    assert [r["episode"] for r in after if r["conversation_id"] == "conv-new"] == [0, 1, 2]
    assert not [r for r in after if r["conversation_id"] == "conv-3"]


def test_a_grown_record_is_appended_to_an_edited_one_rebuilt(ray_local, tmp_path):
    """The manifest records the turns it was built from; a record that gained turns (grown) is
    appended to (new objects, its manifest and table rows replaced in one commit), one whose
    covered turns changed (edited) is rebuilt, an unchanged one is skipped."""
    from pipeline.corpus.reader import read_corpus, write_jsonl

    corpus = tmp_path / "corpus.jsonl"
    write_synthetic_corpus(corpus, 3)
    store = LocalStore(tmp_path / "store")
    assert run(corpus, store).built == 3
    convs, _ = read_corpus(corpus)
    for conv in convs:
        [record] = {(r.source_turns, r.source_digest) for r in
                    read_manifest(store, conv.conversation_id)}
        assert record[0] == len(conv.turns)
    last = convs[0].turns[-1]
    session = [replace(t, turn_id=f"new-{i}", session=last.session + 1)
               for i, t in enumerate(convs[0].turns[:4])]  # a new session, after the others
    grown = dataclasses.replace(convs[0], turns=(*convs[0].turns, *session))
    edited = dataclasses.replace(convs[1], turns=(
        replace(convs[1].turns[0], text="an edit"), *convs[1].turns[1:]))
    write_jsonl([grown, edited, convs[2]], corpus)

    before = read_manifest(store, grown.conversation_id)
    again = run(corpus, store)
    assert (again.built, again.appended, again.skipped) == (1, 1, 1)
    assert dict(again.rebuilt) == {"edited": 1}
    assert "appended to 1 (" in again.line()
    assert "of which rebuilt 1 (edited 1); skipped 1 up to date" in again.line()
    after = read_manifest(store, grown.conversation_id)
    assert {(r.source_turns, r.cache_turns, r.appends) for r in after} == \
        {(len(grown.turns), len(grown.turns), 1)}
    assert {r.object_key for r in before}.isdisjoint(r.object_key for r in after)
    rows = assert_table_equals_manifests(store)  # the appended rows replaced, not added
    assert len(rows) == 6
    assert (run(corpus, store).built, run(corpus, store).skipped) == (0, 3)
    no_append = run(corpus, store, force=False, growth=GrowthConfig(append=False))
    assert no_append.skipped == 3  # nothing grew since
