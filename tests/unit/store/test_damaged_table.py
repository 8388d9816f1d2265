"""A damaged manifest table hides nothing (issue 38): with its data files deleted, or a junk,
overwritten, truncated or out-of-sequence entry in its Delta log, `jobs.manifests` says so in one
line and reads the per-conversation manifests instead (exit code 2), `--rebuild` recreates the
table from them (exit code 0), `--compact` and `--sql` name `--rebuild` in one line, and a
build's `IndexWriter` rebuilds a table damaged before it opens (one warning), or warns once and
goes on past one damaged while it writes. No model and no Ray: conversations are committed
as a build commits them (`put_conversation`), and the table is written by `IndexWriter`."""

from __future__ import annotations

import logging
import uuid

import pytest

from jobs import manifests
from pipeline.store.backends.local import LocalStore
from pipeline.store.backends.s3 import S3Store, parse_s3_uri
from pipeline.store.backends.uri import open_store
from pipeline.store.catalogue.table import (
    PENDING_PREFIX,
    TABLE_KEY,
    ManifestTable,
    TableDamagedError,
    TableError,
)
from pipeline.store.catalogue.table_sync import IndexWriter
from tests.support.stores import put_conversation

CONVERSATIONS = [f"conv-{i}" for i in range(4)]
LOG = f"{TABLE_KEY}/_delta_log/"


def entry(version: int) -> str:
    return f"{LOG}{version:020d}.json"


def delete_data_files(store) -> None:
    for key in store.list(f"{TABLE_KEY}/"):
        if key.endswith(".parquet") and not key.startswith(LOG):
            store.delete(key)


DAMAGE = {  # what is done to the table; each through the Store API, so on any backend
    "data files deleted": delete_data_files,
    "junk line appended to a log entry":
        lambda store: store.put(entry(1), store.get(entry(1)) + b"this is junk\n"),
    "log entry overwritten": lambda store: store.put(entry(1), b"garbage garbage\n"),
    "junk log entry after the last": lambda store: store.put(entry(9), b"junk\n"),
    "last log entry truncated": lambda store: store.put(entry(4), store.get(entry(4))[:200]),
}


def fill(store) -> None:
    """Four conversations of two episodes, committed as a build commits them, the table written
    by the build's writer: created empty (version 0), then four appends."""
    with IndexWriter(store, flush_rows=2) as writer:
        for cid in CONVERSATIONS:
            writer.begin(cid)
            writer.add(cid, put_conversation(store, cid))
    assert store.list(LOG)[-1] == entry(4)


def show(capsys, store, *args: str) -> tuple[int, str, str]:
    code = manifests.main(["--store", store.uri, *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def table_rows(store) -> list[dict]:
    rows = ManifestTable(store).dataset().to_table().to_pylist()
    return sorted(rows, key=lambda r: (r["conversation_id"], r["episode"]))


@pytest.fixture
def store(tmp_path):
    store = LocalStore(tmp_path / "store")
    fill(store)
    return store


def assert_one_line_naming_rebuild(err: str, store, says: str) -> None:
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: manifest table {store.uri}/{TABLE_KEY} cannot be read (")
    assert says in err
    assert f"`python -m jobs.manifests --store {store.uri} --rebuild`" in err


@pytest.mark.parametrize("damage", DAMAGE)
def test_the_listing_falls_back_to_the_manifests(store, capsys, damage):
    _, from_manifests, _ = show(capsys, store, "--manifests")
    DAMAGE[damage](store)
    code, out, err = show(capsys, store)
    assert code == 2
    assert_one_line_naming_rebuild(err, store, "; reading the manifests instead; ")
    assert out == from_manifests  # every conversation, each row once
    assert {line.split()[0] for line in out.splitlines()[1:]} == set(CONVERSATIONS)

    code, out, err = show(capsys, store, "--conversation", "conv-2")  # a point lookup
    assert code == 2 and "reading the manifests instead" in err
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["conv-2", "conv-2"]

    code, out, err = show(capsys, store, "--totals")
    assert code == 2 and "reading the manifests instead" in err
    assert out.startswith("total: 8 episodes of 4 conversations; 64 tokens; ")
    assert out.rstrip().endswith("; from the manifests")


@pytest.mark.parametrize("damage", DAMAGE)
def test_rebuild_recreates_the_table_whatever_its_state(store, capsys, damage):
    before = table_rows(store)
    _, listed, _ = show(capsys, store)
    DAMAGE[damage](store)
    code, out, err = show(capsys, store, "--rebuild")
    assert code == 0 and err == ""
    assert out.startswith("rebuilt the manifest table from 4 manifests (8 episodes)")
    assert show(capsys, store) == (0, listed, "")  # read from the table again, the same rows
    assert table_rows(store) == before


@pytest.mark.parametrize("damage", DAMAGE)
def test_compact_and_sql_need_the_table_and_name_rebuild(store, capsys, damage):
    DAMAGE[damage](store)
    code, out, err = show(capsys, store, "--compact")
    assert code == 2 and out == ""
    assert_one_line_naming_rebuild(err, store, "): --compact needs it; ")
    code, out, err = show(capsys, store, "--sql", "SELECT count(*) FROM episodes")
    assert code == 2 and out == ""
    assert_one_line_naming_rebuild(err, store, "): --sql needs it; ")
    if damage == "data files deleted":  # the log opens: a query's own error is still its own
        assert show(capsys, store, "--sql", "SELEC 1")[2].startswith("error: --sql: Parser Error")


def build_three(store, caplog, damage_once_open=None) -> tuple[IndexWriter, list[str]]:
    """What a build's writer does committing conv-0 again (3 episodes) and two new
    conversations, `damage_once_open` done to the table after the writer opened it; the writer
    and its warnings."""
    with (caplog.at_level(logging.WARNING, "pipeline.store.catalogue.table_sync"),
          IndexWriter(store, flush_rows=2) as writer):
        if damage_once_open is not None:
            damage_once_open(store)
        for cid in ("conv-0", "conv-new", "conv-other"):
            writer.begin(cid)
            writer.add(cid, put_conversation(store, cid, episodes=3))
    return writer, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_build_rebuilds_a_table_damaged_before_it(store, capsys, caplog, damage):
    """The writer finds the damage when it opens (a log that does not read, a data file gone),
    says so once and rebuilds the table from the manifests: the build heals it, and what it
    commits goes into the new table."""
    DAMAGE[damage](store)
    writer, warnings = build_three(store, caplog)
    assert len(warnings) == 1 and " was damaged (" in warnings[0], warnings
    assert "): rebuilt from 4 manifests (8 episodes)" in warnings[0]
    assert writer.healthy and store.list(PENDING_PREFIX) == []
    assert show(capsys, store)[0] == 0  # the table reads again
    rows = table_rows(store)
    assert len(rows) == 3 * 3 + 3 * 2  # conv-0 rebuilt with 3 episodes, two new, three as were


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_build_goes_on_past_a_table_damaged_during_it(store, capsys, caplog, damage):
    """Damage met while the build writes: one warning naming --rebuild, no more writes to the
    table, the markers kept; the rebuild brings in what was committed meanwhile."""
    writer, warnings = build_three(store, caplog, DAMAGE[damage])
    assert len(warnings) == 1 and "is damaged (" in warnings[0], warnings
    assert "--rebuild` rebuilds it from the manifests" in warnings[0]
    assert not writer.healthy and store.list(PENDING_PREFIX)
    assert show(capsys, store, "--rebuild")[0] == 0
    assert store.list(PENDING_PREFIX) == []
    rows = table_rows(store)
    assert len(rows) == 3 * 3 + 3 * 2


def test_rebuild_on_s3_replaces_a_garbage_log(s3_env, capsys):
    """On S3 the damaged table's objects are removed through the store, then created anew. A
    store that cannot be reached is not damage: it is never removed."""
    store = open_store(s3_env.uri(f"damaged/{uuid.uuid4().hex[:12]}"))
    fill(store)
    before = table_rows(store)
    ManifestTable(store).check()  # a sound table on S3: every data file its log names is found
    DAMAGE["log entry overwritten"](store)
    code, out, err = show(capsys, store)
    assert code == 2 and {line.split()[0] for line in out.splitlines()[1:]} == set(CONVERSATIONS)
    assert_one_line_naming_rebuild(err, store, "; reading the manifests instead; ")
    assert show(capsys, store, "--rebuild")[0] == 0
    assert show(capsys, store)[0] == 0 and table_rows(store) == before

    refused = S3Store(*parse_s3_uri(store.uri), check=False)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-1234567890")
        with pytest.raises(TableError) as e:
            ManifestTable(refused).delta()
    assert not isinstance(e.value, TableDamagedError)
    assert table_rows(store) == before
