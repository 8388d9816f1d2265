"""A damaged store, each kind of damage against each command: the build repairs it (a plain
re-run what the sizes show, `--verify` the rest, nothing else rebuilt), readers name it with
what repairs it and never allocate what a damaged object claims, `jobs.gc` lists it, and the
other conversations are untouched.

The build runs the real driver on a real local Ray with the synthetic stages (tiny caches in the
real format, no model), so a repair writes the very bytes that were damaged.
"""

from __future__ import annotations

import struct

import pytest

from jobs import gc, manifests
from lab.rehearsal import (
    SYNTHETIC_CONFIG,
    SYNTHETIC_FILES,
    SYNTHETIC_STAGES,
    write_synthetic_corpus,
)
from pipeline.builder.conversation import is_built
from pipeline.builder.driver import run_build
from pipeline.builder.repair import find_damage
from pipeline.config import DriverOptions
from pipeline.serve.errors import classify
from pipeline.store.backends.base import ObjectNotFound
from pipeline.store.backends.local import LocalStore
from pipeline.store.catalogue.manifest import read_manifest
from pipeline.store.objects import cache_read
from pipeline.store.objects.cache_format import CacheCorruptError
from tests.support.stores import put_conversation, store  # noqa: F401  (every backend)


def _swap_with_sibling(store, key: str, rows) -> None:
    other = next(r.object_key for r in rows if r.object_key != key)
    a, b = store.get(key), store.get(other)
    store.put(key, b)
    store.put(other, a)


# each kind of damage the probe tried: how it is done to an episode's object, and whether a
# plain build's skip check sees it (the object's size changes) or only --verify (it reads)
DAMAGE = {
    "deleted": (lambda store, key, rows: store.delete(key), True),
    "truncated": (lambda store, key, rows: store.put(key, store.get(key)[:-1000]), True),
    "extended": (lambda store, key, rows: store.put(key, store.get(key) + b"\0" * 64), True),
    "bit-flipped": (lambda store, key, rows: store.put(
        key, (d := store.get(key))[:-100] + bytes([d[-100] ^ 0xFF]) + d[-99:]), False),
    "huge header": (lambda store, key, rows: store.put(  # claims a 4 EiB header, same size
        key, struct.pack("<Q", 2**62) + store.get(key)[8:]), False),
    "swapped": (lambda store, key, rows: _swap_with_sibling(store, key, rows), False),
}
SIZE_VISIBLE = [kind for kind, (_, visible) in DAMAGE.items() if visible]


def damage(kind: str, store, rows) -> str:
    """Damage episode 1 of the conversation `rows` describes; its key."""
    key = rows[1].object_key
    DAMAGE[kind][0](store, key, rows)
    return key


def _options(**kw) -> DriverOptions:
    return DriverOptions(progress=False, max_in_flight=4, **kw)


def _snapshot(store, cid: str) -> dict[str, bytes]:
    return {r.object_key: store.get(r.object_key) for r in read_manifest(store, cid)}


def test_each_damage_is_repaired_by_the_next_build_and_nothing_else_is_rebuilt(
        ray_local, tmp_path, capsys):
    """One conversation damaged each way: a plain re-run repairs the ones whose size changed
    (exactly their episode), `--verify` the others; then `jobs.gc --verify` is clean and every
    object holds what the first build wrote."""
    corpus = tmp_path / "corpus.jsonl"
    write_synthetic_corpus(corpus, len(DAMAGE) + 1)
    store = LocalStore(tmp_path / "store")
    first = run_build(str(corpus), store, SYNTHETIC_CONFIG, _options(), stages=SYNTHETIC_STAGES)
    assert first.built == len(DAMAGE) + 1
    cids = [f"bench-{i:07d}" for i in range(len(DAMAGE) + 1)]
    built = {cid: _snapshot(store, cid) for cid in cids}
    damaged = {kind: cid for kind, cid in zip(DAMAGE, cids)}  # the last one stays whole
    for kind, cid in damaged.items():
        damage(kind, store, read_manifest(store, cid))

    plain = run_build(str(corpus), store, SYNTHETIC_CONFIG, _options(), stages=SYNTHETIC_STAGES)
    n = len(SIZE_VISIBLE)
    assert (plain.built, plain.repaired_conversations, plain.repaired_episodes) == (0, n, n)
    assert plain.skipped == len(cids) - n and not plain.failed
    assert f"repaired {n} ({n} episode caches, 0 turn indexes; {n} conversations); " \
           f"skipped {len(cids) - n} up to date" in plain.line()
    assert plain.tasks == 2 * n  # a planning task and one episode task each
    for kind in SIZE_VISIBLE:
        assert _snapshot(store, damaged[kind]) == built[damaged[kind]]

    assert gc.main(["--store", store.uri, "--verify"]) == 1  # the rest: only a read finds them
    capsys.readouterr()
    verified = run_build(str(corpus), store, SYNTHETIC_CONFIG, _options(verify=True),
                         stages=SYNTHETIC_STAGES)
    rest = len(DAMAGE) - n
    assert (verified.repaired_conversations, verified.repaired_episodes) == (rest, rest + 1)
    assert verified.skipped == len(cids) - rest  # "swapped" damaged both of its episodes
    assert gc.main(["--store", store.uri, "--verify"]) == 0
    assert "no faults" in capsys.readouterr().out
    assert {cid: _snapshot(store, cid) for cid in cids} == built


def test_a_deleted_object_is_repaired_alone_and_the_summary_says_so(ray_local, tmp_path,
                                                                     capsys):
    """The issue's run: an object deleted, the same build command again repairs exactly that
    episode ("repaired 1"), and `jobs.gc --verify` is then clean."""
    from jobs import build

    corpus = tmp_path / "corpus.jsonl"
    write_synthetic_corpus(corpus, 3)
    store = LocalStore(tmp_path / "store")
    run_build(str(corpus), store, SYNTHETIC_CONFIG, _options(), stages=SYNTHETIC_STAGES)
    rows = read_manifest(store, "bench-0000001")
    mtimes = {r.object_key: store.info(r.object_key).modified for r in rows}
    key = damage("deleted", store, rows)
    assert gc.main(["--store", store.uri]) == 1
    assert f"missing object    {key}: named by manifests/bench-0000001.parquet" in \
        capsys.readouterr().out
    assert not is_built(store, "bench-0000001", SYNTHETIC_CONFIG, SYNTHETIC_FILES)

    summary = run_build(str(corpus), store, SYNTHETIC_CONFIG, _options(), stages=SYNTHETIC_STAGES)
    build.print_outcome(summary, summary.seconds, store)
    out = capsys.readouterr().out
    assert "built 0 conversations, appended to 0 (1 episode cache," in out
    assert "repaired 1 (1 episode cache, 0 turn indexes; 1 conversation); skipped 2 up to " \
           "date; failed 0" in out
    assert store.exists(key)
    assert store.info(rows[0].object_key).modified == mtimes[rows[0].object_key]  # kept
    assert gc.main(["--store", store.uri, "--verify"]) == 0
    assert "no faults" in capsys.readouterr().out
    assert is_built(store, "bench-0000001", SYNTHETIC_CONFIG, SYNTHETIC_FILES)


# ---------------------------------------------------------------------------------------------
# The readers, on every backend: each damage is the corrupt-object error naming what repairs it
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", DAMAGE)
def test_readers_name_the_damage_and_what_repairs_it(kind, store, capsys):  # noqa: F811
    rows = put_conversation(store, "conv-1")
    put_conversation(store, "conv-2")
    key = damage(kind, store, rows)
    with pytest.raises((CacheCorruptError, ObjectNotFound)) as e:
        cache_read.read_cache(store, rows[1].ref)  # never a MemoryError, whatever it claims
    assert cache_read.REPAIR_HINT in str(e.value)
    status, message = classify(e.value, "conv-1")
    assert status == 503 and message.startswith("conversation 'conv-1': ")
    assert key not in message and store.uri not in message
    cache_read.read_cache(store, rows[0].ref if kind != "swapped" else
                          read_manifest(store, "conv-2")[0].ref)  # the others still read

    found = find_damage(store, rows, verify=False)
    assert (found is not None) == DAMAGE[kind][1]
    verified = find_damage(store, rows, verify=True)
    assert verified.episodes == ((0, 1) if kind == "swapped" else (1,))
    assert not verified.turn_index
    assert gc.main(["--store", store.uri, "--verify"]) == 1
    assert key in capsys.readouterr().out
    assert manifests.main(["--store", store.uri, "--manifests"]) == 0  # sizes from manifests
    assert "conv-1" in capsys.readouterr().out


def test_a_damaged_turn_index_is_found_by_size_or_by_a_read(store):  # noqa: F811
    rows = put_conversation(store, "conv-1", turn_index=True)
    index = rows[0].turn_index
    data = store.get(index.key)
    store.put(index.key, data[:-1] + bytes([data[-1] ^ 1]))
    assert find_damage(store, rows) is None
    found = find_damage(store, rows, verify=True)
    assert found.turn_index and found.episodes == ()
    store.delete(index.key)
    assert find_damage(store, rows).turn_index


def test_s3_sizes_are_one_listing_per_folder(s3_env):
    """The skip check asks S3 for a conversation's sizes in one ListObjectsV2, not a HEAD per
    object."""
    import uuid

    from lab.rehearsal import S3Requests
    from pipeline.store.backends.uri import open_store

    s3 = open_store(s3_env.uri(f"sizes/{uuid.uuid4().hex[:12]}"))
    rows = put_conversation(s3, "conv-1", episodes=3)
    s3.delete(rows[2].object_key)
    requests = S3Requests(s3)
    assert s3.sizes(r.object_key for r in rows) == {
        rows[0].object_key: rows[0].object_bytes, rows[1].object_key: rows[1].object_bytes,
        rows[2].object_key: None}
    assert requests("ListObjectsV2", "") == 1 and requests("HeadObject", "caches") == 0
