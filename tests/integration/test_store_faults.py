"""Bad stores, on every backend: read-only commands refuse a store that does not exist (and
never create it), every command names a corrupt manifest in one line, and `jobs.gc` finds
each kind of fault a store can have (with `--verify`, also objects whose bytes changed), for
cache objects and turn indexes alike.

Stores are filled with tiny caches in the real format (`jobs.bench.scale.synthetic_cache`)
and real manifests, so no model is loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import time
import uuid

import pytest

from jobs import answer, gc, manifests, serve
from lab.rehearsal import SYNTHETIC_CONFIG, SYNTHETIC_FILES
from pipeline.builder.conversation import is_built
from pipeline.serve.errors import classify
from pipeline.store.backends.base import StoreError
from pipeline.store.backends.local import LocalStore
from pipeline.store.backends.uri import open_store
from pipeline.store.catalogue.manifest import (
    ManifestError,
    list_conversations,
    read_manifest,
    write_manifest,
)
from pipeline.store.objects import cache_format
from pipeline.store.objects.turn_index import (
    StoredIndex,
    read_turn_index,
    serialize,
    store_turn_index,
    turn_index_key,
)
from tests.support.stores import (
    CORRUPT,
    plant_corrupt_manifest,
    put_conversation,
    store,  # noqa: F401  (a folder, a prefix in SeaweedFS, memory)
    tiny_turn_index,
)

COMMANDS = {  # every read-only command, with the arguments it needs besides --store
    "answer": (answer.main, ["--conversation", "conv-1", "--question", "Who?"]),
    "manifests": (manifests.main, []),
    "serve": (serve.main, ["--model", "m", "--encoder", "e"]),
    "gc": (gc.main, []),
}


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_read_only_commands_refuse_a_missing_folder_and_do_not_create_it(command, tmp_path,
                                                                          capsys):
    main, args = COMMANDS[command]
    missing = tmp_path / "typo" / "store"
    assert main(["--store", str(missing), *args]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"store folder {missing} does not exist" in line
    assert not missing.exists() and not missing.parent.exists()

    a_file = tmp_path / "a-file"
    a_file.write_text("not a store")
    assert main(["--store", f"file://{a_file}", *args]) == 2
    assert f"store {a_file} is not a folder" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("command", COMMANDS)
def test_read_only_commands_refuse_a_missing_bucket_at_the_given_endpoint(command, s3_env,
                                                                          monkeypatch, capsys):
    """--s3-endpoint is taken (the variable is unset, so only the option reaches SeaweedFS):
    an existing bucket with an empty prefix is an empty store, a missing bucket an error."""
    monkeypatch.delenv("EPICACHE_S3_ENDPOINT")
    main, args = COMMANDS[command]
    endpoint = ["--s3-endpoint", s3_env.endpoint]
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    assert main(["--store", f"s3://{bucket}/caches", *endpoint, *args]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"S3 bucket '{bucket}' does not exist" in line and s3_env.endpoint in line
    assert bucket not in {b["Name"] for b in s3_env.client().list_buckets()["Buckets"]}
    if command == "manifests":
        assert main(["--store", s3_env.uri(f"empty-{uuid.uuid4().hex[:8]}"), *endpoint]) == 0


def test_writers_still_create_a_new_store(tmp_path):
    """`jobs.build` opens with the default (create): a new folder is a new, empty store."""
    new = tmp_path / "new" / "store"
    store = open_store(str(new))
    assert new.is_dir() and store.list() == []
    assert open_store(str(new), create=False).root == new
    with pytest.raises(StoreError, match="does not exist"):
        LocalStore(tmp_path / "other", create=False)


@pytest.mark.parametrize("how", CORRUPT)
def test_read_manifest_names_a_corrupt_manifest(how, tmp_path):
    store = LocalStore(tmp_path)
    key = plant_corrupt_manifest(store, how)
    with pytest.raises(ManifestError) as e:
        read_manifest(store, "bad")
    assert str(e.value).startswith(f"manifest '{key}' in store {store.uri} is corrupt: ")
    assert CORRUPT[how][1] in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, StoreError) and e.value.key == key
    assert str(pickle.loads(pickle.dumps(e.value))) == str(e.value)  # crosses Ray intact
    assert not is_built(store, "bad", SYNTHETIC_CONFIG, SYNTHETIC_FILES)  # a build replaces it


def test_manifests_lists_the_readable_and_names_the_corrupt(store, capsys):
    put_conversation(store, "conv-1")
    key = plant_corrupt_manifest(store)
    assert manifests.main(["--store", store.uri]) == 2
    out, err = capsys.readouterr()
    assert f"manifest '{key}' in store {store.uri} is corrupt" in one_error_line(err)
    body = out.splitlines()[1:]
    assert len(body) == 2 and all(line.startswith("conv-1 ") for line in body)
    assert manifests.main(["--store", store.uri, "--json", "--conversation", "conv-1"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_answer_names_the_corrupt_manifest(store, capsys):
    key = plant_corrupt_manifest(store, cid="conv-1")
    assert answer.main(["--store", store.uri, "--conversation", "conv-1",
                        "--question", "Who?"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"manifest '{key}' in store {store.uri} is corrupt: not a readable Parquet" in line


def test_serve_answers_a_corrupt_manifest_with_a_503():
    status, message = classify(ManifestError("manifests/conv-1.parquet", "file:///s", "no rows"))
    assert status == 503 and message.startswith("this conversation's manifest is unreadable")
    assert "file:///s" not in message and "manifests/" not in message  # the log names them


def test_gc_reports_a_corrupt_manifest_and_keeps_its_objects(store, capsys):
    """Without --verify: the unreadable manifest is a fault (exit 1), and the objects of its
    conversation, which no readable manifest names, are not orphans: --delete keeps them."""
    put_conversation(store, "conv-1")
    key = plant_corrupt_manifest(store)
    objects = store.list("caches/bad/")
    assert len(objects) == 2
    assert gc.main(["--store", store.uri, "--min-age-seconds", "0", "--delete"]) == 1
    out = capsys.readouterr().out
    assert f"corrupt manifest  {key}: not a readable Parquet file" in out
    assert "orphan" not in out.split("removed")[0] and "removed 0 orphan objects" in out
    assert "store has faults: 1 corrupt manifest;" in out
    assert "2 objects of conversations with a corrupt manifest kept" in out
    assert store.list("caches/bad/") == objects and store.exists(key)


def plant_fault(fault: str, store, rows: list[dict]) -> str:
    """Break a store committed by `put_conversation` in one way; the key the fault names."""
    if fault == "corrupt manifest":
        return plant_corrupt_manifest(store)
    key = rows[1].object_key
    data = store.get(key)
    if fault == "missing object":
        store.delete(key)
    elif fault == "checksum failure":  # same size, one byte changed
        store.put(key, data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    elif fault == "wrong size":
        store.put(key, data + b"\0")
    return key


FOUND_WITHOUT_VERIFY = {"corrupt manifest": True, "missing object": True,
                        "checksum failure": False, "wrong size": False}


def test_gc_verify_passes_a_healthy_store(store, capsys):
    put_conversation(store, "conv-1", turn_index=True)
    put_conversation(store, "conv-2", episodes=1)
    assert gc.main(["--store", store.uri, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "no faults" in out and "4 objects verified (size and SHA-256)" in out
    assert "2 manifests name 4 objects (1 turn indexes)" in out
    assert gc.main(["--store", store.uri]) == 0
    assert "objects not read (--verify checks" in capsys.readouterr().out


@pytest.mark.parametrize("fault", [k for k in gc.FAULT_KINDS if k != "corrupt index"])
def test_gc_verify_finds_each_planted_fault(fault, store, capsys):
    rows = put_conversation(store, "conv-1")
    put_conversation(store, "conv-2", episodes=1)
    key = plant_fault(fault, store, rows)
    found_without_verify = FOUND_WITHOUT_VERIFY[fault]

    assert gc.main(["--store", store.uri, "--verify"]) == 1
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if line.startswith(fault)]
    assert line.startswith(f"{fault:<17} {key}: ")
    if fault == "checksum failure":
        assert f"records {rows[1].sha256[:16]}..." in line
    if fault == "wrong size":
        assert f"{rows[1].object_bytes + 1} bytes, manifests/conv-1.parquet records " \
               f"{rows[1].object_bytes}" in line
    if fault == "missing object":
        assert "named by manifests/conv-1.parquet" in line
    assert f"store has faults: 1 {fault};" in out

    code = gc.main(["--store", store.uri])  # without --verify no object is read
    out = capsys.readouterr().out
    assert code == (1 if found_without_verify else 0)
    assert (f"{fault:<17} {key}: " in out) == found_without_verify
    planted = ["bad"] if fault == "corrupt manifest" else []
    assert list_conversations(store) == planted + ["conv-1", "conv-2"]  # gc removed no manifest


def test_gc_keeps_named_turn_indexes_and_collects_the_others(store, capsys):
    """A turn index no manifest names (the version an append replaced, an interrupted build's)
    is an orphan once old enough, and --delete removes it; the named one stays readable, and
    the index of a conversation whose manifest is corrupt is kept for its rebuild."""
    rows = put_conversation(store, "conv-1", turn_index=True)
    named = rows[0].turn_index
    old = store_turn_index(tiny_turn_index("conv-1", seed=1), store)
    assert old.key != named.key and old.key.startswith("turns/conv-1/")
    kept = store_turn_index(tiny_turn_index("bad"), store)
    plant_corrupt_manifest(store)
    uri = ["--store", store.uri]
    if isinstance(store, LocalStore):  # an unfinished write of an index is listed too
        tmp = store.root / "turns" / "conv-1" / ".tmp-stale"
        tmp.write_bytes(b"half an index")
        os.utime(tmp, (time.time() - 7200, time.time() - 7200))

    assert gc.main(uri) == 1  # the corrupt manifest; the fresh old index is left alone
    out = capsys.readouterr().out
    assert old.key not in out and "found 0 orphan objects" in out
    assert "1 manifests name 3 objects (1 turn indexes); 1 younger than" in out

    assert gc.main(uri + ["--min-age-seconds", "0", "--delete"]) == 1
    out = capsys.readouterr().out
    orphans = [line.split()[1] for line in out.splitlines() if line.startswith("orphan ")]
    assert orphans == [old.key]
    assert out.count("partial ") == isinstance(store, LocalStore)
    assert "3 objects of conversations with a corrupt manifest kept" in out
    assert not store.exists(old.key) and store.exists(named.key) and store.exists(kept.key)
    assert read_turn_index(store, named, "conv-1", rows[0].encoder_fingerprint).turns == \
        tiny_turn_index("conv-1").turns
    assert store.list_partial() == []


def _flip(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]


def plant_index_fault(how: str, store, rows: list) -> str:
    """Break the turn index `put_conversation` stored for `rows` in one way; its key."""
    index = rows[0].turn_index
    if how == "missing object":
        store.delete(index.key)
    elif how == "wrong size":
        store.put(index.key, store.get(index.key) + b"\0")
    elif how == "checksum failure":
        store.put(index.key, _flip(store.get(index.key)))
    else:  # bytes the manifest records faithfully that a reader still refuses
        data = serialize(tiny_turn_index("conv-9")) if how == "another conversation's" \
            else b"not a safetensors file"
        sha = hashlib.sha256(data).hexdigest()
        index = StoredIndex(turn_index_key("conv-1", "f" * 16, sha), sha, len(data))
        store.put(index.key, data)
        write_manifest(store, "conv-1", [dataclasses.replace(r, **index.fields()) for r in rows])
    return index.key


INDEX_FAULTS = {  # how the index is broken: the fault gc reports, and what its line says
    "missing object": ("missing object", "named by manifests/conv-1.parquet"),
    "wrong size": ("wrong size", "bytes, manifests/conv-1.parquet records"),
    "checksum failure": ("checksum failure", "manifests/conv-1.parquet records"),
    "another conversation's": ("corrupt index", "belongs to conversation 'conv-9', not 'conv-1'"),
    "not an index": ("corrupt index", "is corrupt: "),
}


@pytest.mark.parametrize("how", INDEX_FAULTS)
def test_gc_verify_checks_each_named_turn_index(how, store, capsys):
    """--verify reads every turn index a manifest names and checks it as a reader does (size,
    SHA-256, then its parse and binding): each way it can be broken is one fault line naming
    its key; without --verify only a missing one is found (no object is read)."""
    rows = put_conversation(store, "conv-1", turn_index=True)
    put_conversation(store, "conv-2", episodes=1, turn_index=True)
    key = plant_index_fault(how, store, rows)
    fault, detail = INDEX_FAULTS[how]

    assert gc.main(["--store", store.uri, "--verify"]) == 1
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if line.startswith(fault)]
    assert line.startswith(f"{fault:<17} {key}: ") and detail in line
    assert f"store has faults: 1 {fault};" in out

    assert gc.main(["--store", store.uri]) == (1 if fault == "missing object" else 0)
    assert (key in capsys.readouterr().out) == (fault == "missing object")
    assert list_conversations(store) == ["conv-1", "conv-2"]


def test_commit_checks_the_objects_without_downloading_them(store, monkeypatch):
    """The manifest commit trusts the worker's SHA-256 and checks each object with one HEAD
    (present, at the size written): no GET of a cache object; a missing or short object is
    refused, so the manifest never names it."""
    from pipeline.builder.conversation import commit_manifest

    rows = put_conversation(store, "conv-1")
    gets: list[str] = []
    real_get = store.get
    monkeypatch.setattr(store, "get", lambda key: gets.append(key) or real_get(key))
    commit_manifest(store, "conv-1", rows)
    assert [k for k in gets if k.startswith("caches/")] == []
    assert read_manifest(store, "conv-1")[0].sha256 == rows[0].sha256

    store.put(rows[0].object_key, b"short")
    with pytest.raises(cache_format.CacheCorruptError, match=r"holds 5 bytes, \d+ were written"):
        commit_manifest(store, "conv-2", rows)
    store.delete(rows[1].object_key)
    with pytest.raises(cache_format.CacheCorruptError, match="is missing from the store"):
        commit_manifest(store, "conv-2", rows[1:])
    assert "conv-2" not in list_conversations(store)


def test_commit_refuses_a_turn_index_that_is_not_stored(store):
    """The manifest names a turn index only once it is in the store at the size written: a
    missing or short index fails the commit, as a cache object does."""
    from pipeline.builder.conversation import commit_manifest

    rows = put_conversation(store, "conv-1", turn_index=True)
    key = rows[0].turn_index_key
    store.put(key, b"short")
    with pytest.raises(cache_format.CacheCorruptError,
                       match=rf"turn index {key} holds 5 bytes, \d+ were written"):
        commit_manifest(store, "conv-2", rows)
    store.delete(key)
    with pytest.raises(cache_format.CacheCorruptError,
                       match=f"turn index {key} is missing from the store"):
        commit_manifest(store, "conv-2", rows)
    assert "conv-2" not in list_conversations(store)
