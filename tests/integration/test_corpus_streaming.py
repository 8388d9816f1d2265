"""A corpus is streamed, never held: an s3:// corpus is read with GetObject streams and never
written to the driver's disk, each object is checked before its conversations are scheduled
(a bad record still fails before any model work, naming object, record and field), the first
conversations are built before the last object is even opened, and a bad record in a later
object stops the build after earlier objects were committed (a re-run skips those)."""

from __future__ import annotations

import functools
import io
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import ray

from jobs import build
from lab.rehearsal import SYNTHETIC_CONFIG, SYNTHETIC_STAGES, S3Requests, synthetic_lines
from pipeline.builder import driver as build_driver
from pipeline.builder.driver import run_build
from pipeline.builder.sources import corpus_objects
from pipeline.config import DriverOptions
from pipeline.corpus.reader import CorpusObject, CorpusStream, ReadStats
from pipeline.corpus.schema import CorpusError
from pipeline.store.backends.local import LocalStore
from pipeline.store.backends.s3 import S3Store
from pipeline.store.backends.uri import open_store
from pipeline.store.catalogue.manifest import list_conversations
from tests.support.paths import REPO


def _bad(line: str) -> str:
    """The record with its second turn's speaker not one of the speakers."""
    rec = json.loads(line)
    rec["turns"][1]["speaker"] = "Eve"
    return json.dumps(rec) + "\n"


def _put_parts(s3_server, prefix: str, parts: list[str]) -> str:
    client = s3_server.client()
    for i, text in enumerate(parts):
        client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/part-{i}.jsonl",
                          Body=text.encode())
    return s3_server.uri(prefix)


@pytest.fixture
def quiet_tmp(tmp_path, monkeypatch):
    """The temporary folder every `tempfile` call of this process uses; it must stay empty."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def test_s3_corpus_is_streamed_and_never_written_to_disk(ray_local, s3_env, tmp_path, quiet_tmp,
                                                        monkeypatch):
    """A folder of three JSONL objects: every record arrives through a GetObject stream (one
    per object: small objects are read once, checked and built from memory), nothing goes to
    the temporary folder, no object is downloaded, and every conversation is built."""
    uri = _put_parts(s3_env, "stream/corpus", [synthetic_lines(0, 5), synthetic_lines(5, 9),
                                               synthetic_lines(9, 12)])
    opened = []
    real_open = S3Store.open

    def spy_open(self, key):
        stream = real_open(self, key)
        opened.append((key, type(stream).__name__))
        return stream

    def no_download(*_args, **_kwargs):
        raise AssertionError("the corpus must be streamed, not downloaded")

    monkeypatch.setattr(S3Store, "open", spy_open)
    monkeypatch.setattr(S3Store, "download", no_download)
    monkeypatch.setattr(S3Store, "get", no_download)
    store = LocalStore(tmp_path / "store")
    summary = run_build(uri, store, SYNTHETIC_CONFIG, DriverOptions(progress=False),
                        stages=SYNTHETIC_STAGES)
    assert summary.built == 12 and not summary.failed
    assert opened == [(f"part-{i}.jsonl", "BufferedReader") for i in range(3)]
    assert list(quiet_tmp.iterdir()) == []
    assert len(list_conversations(store)) == 12


def test_large_object_is_streamed_twice_in_fail_mode_and_once_in_skip_mode(s3_env):
    """An object over the hold size is never read whole: checked in one streamed pass, built
    in a second (fail mode), or read in a single pass that skips as it goes (skip mode)."""
    uri = _put_parts(s3_env, "twice/corpus", [synthetic_lines(0, 50) + "[1]\n"])
    folder = S3Store(s3_env.bucket, "twice/corpus", endpoint_url=s3_env.endpoint)
    requests = S3Requests(folder)
    objects = corpus_objects(uri)
    objects = [CorpusObject(o.name, functools.partial(folder.open, o.name), o.size)
               for o in objects]
    with pytest.raises(CorpusError, match=r"part-0\.jsonl, record 51: record must be a JSON "
                                          r"object, got list"):
        next(iter(CorpusStream(objects, "fail", hold_bytes=1000)))
    assert requests("GetObject", "") == 1  # the check failed: nothing was yielded
    stream = CorpusStream(objects, "skip", ReadStats(), hold_bytes=1000)
    assert len(list(stream)) == 50 and stream.stats.records_skipped == 1
    assert requests("GetObject", "") == 2  # one more: a single pass
    fine = CorpusStream([CorpusObject(
        "ok.jsonl", lambda: io.BytesIO(synthetic_lines(0, 30).encode()), lambda: 10**9)],
        "fail", hold_bytes=1000)
    assert len(list(fine)) == 30


def test_bad_record_in_s3_corpus_fails_before_ray_and_writes_nothing(s3_env, tmp_path, capsys,
                                                                     quiet_tmp, monkeypatch):
    """jobs.build on an S3 corpus whose first object's third record is bad: exit 2 with one
    line naming object, record and field, Ray never started, no store, nothing on disk."""
    lines = synthetic_lines(0, 3).splitlines(keepends=True)
    uri = _put_parts(s3_env, "badfirst/corpus", ["".join(lines[:2]) + _bad(lines[2]),
                                                 synthetic_lines(3, 6)])
    calls = []
    monkeypatch.setattr(build_driver, "init_ray", lambda *a: calls.append(a))
    ray_was_up = ray.is_initialized()
    store = tmp_path / "store"
    rc = build.main(["--corpus", uri, "--store", str(store), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: part-0.jsonl, record 3 (conversation 'bench-0000002'): "
                             "field 'turns[1].speaker': 'Eve' is not one of speakers"), err
    assert not calls and not store.exists() and (ray_was_up or not ray.is_initialized())
    assert list(quiet_tmp.iterdir()) == []


def test_first_conversations_are_built_before_the_last_object_is_opened(ray_local, s3_env,
                                                                        tmp_path):
    """Four S3 objects: by the time the driver opens the last one, conversations of the first
    are already committed (the corpus is not read ahead of the build)."""
    uri = _put_parts(s3_env, "early/corpus", [synthetic_lines(i * 40, i * 40 + 40)
                                              for i in range(4)])
    store = LocalStore(tmp_path / "store")
    committed_at_open = []

    def opener(obj: CorpusObject):
        def open_():
            committed_at_open.append(len(list_conversations(store)))
            return obj.open()
        return CorpusObject(obj.name, open_, obj.size)

    corpus = CorpusStream([opener(o) for o in corpus_objects(uri)], where=uri)
    summary = run_build(corpus, store, SYNTHETIC_CONFIG,
                        DriverOptions(max_in_flight=4, progress=False),
                        stages=SYNTHETIC_STAGES)
    assert summary.built == 160
    assert committed_at_open[0] == 0 and committed_at_open[-1] > 0, committed_at_open


def test_bad_record_in_a_later_object_stops_after_committing_the_earlier(ray_local, s3_env,
                                                                          tmp_path):
    """Fail mode, a bad record in the second object: the first object's conversations are
    built and committed, none of the second's, and the error names the object and record; a
    re-run with the object fixed builds only the rest."""
    lines = synthetic_lines(10, 20).splitlines(keepends=True)
    bad = "".join(lines[:4]) + _bad(lines[4]) + "".join(lines[5:])
    uri = _put_parts(s3_env, "badlater/corpus", [synthetic_lines(0, 10), bad])
    store = LocalStore(tmp_path / "store")
    with pytest.raises(CorpusError, match=r"^part-1\.jsonl, record 5 \(conversation "
                                          r"'bench-0000014'\): field 'turns\[1\]\.speaker'"):
        run_build(uri, store, SYNTHETIC_CONFIG, DriverOptions(progress=False),
                  stages=SYNTHETIC_STAGES)
    assert list_conversations(store) == [f"bench-{i:07d}" for i in range(10)]
    _put_parts(s3_env, "badlater/corpus", [synthetic_lines(0, 10), synthetic_lines(10, 20)])
    summary = run_build(uri, store, SYNTHETIC_CONFIG, DriverOptions(progress=False),
                        stages=SYNTHETIC_STAGES)
    assert (summary.built, summary.skipped) == (10, 10)


def test_skips_in_a_later_object_reach_stderr_and_the_report(ray_local, tmp_path, capsys,
                                                             monkeypatch):
    """Skip mode, a bad record in the second of two objects (read after Ray started): the
    build goes on, the skip is printed and the store's report is rewritten with it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text(synthetic_lines(0, 3))
    lines = synthetic_lines(3, 6).splitlines(keepends=True)
    (corpus / "b.jsonl").write_text(lines[0] + _bad(lines[1]) + lines[2])
    monkeypatch.setattr(build_driver, "run_build",
                        functools.partial(run_build, stages=SYNTHETIC_STAGES))
    store = tmp_path / "store"
    rc = build.main(["--corpus", str(corpus), "--store", str(store), "--on-bad-record", "skip",
                     "--no-progress", "--model", "synthetic"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "built 5 conversations" in captured.out and "bad records skipped 1" in captured.out
    assert "skipped: b.jsonl, record 2 (conversation 'bench-0000004')" in captured.err
    reports = LocalStore(store).list("reports/")
    assert len(reports) == 1
    rows = [json.loads(ln) for ln in (store / reports[0]).read_text().splitlines()]
    assert [(r["file"], r["record"]) for r in rows] == [("b.jsonl", 2)]
    assert len(list_conversations(open_store(str(store)))) == 5



def test_bench_large_counts_no_get_of_cache_objects_in_the_commit(s3_server, tmp_path):
    """`jobs.bench.scale --large` on a small corpus against the test's S3 (its own process, so
    that its Ray workers get the credentials): the corpus is streamed from S3, the driver's
    RSS is read at both marks, and the build into an S3 store makes one HEAD per cache object
    and no GET (counted on the driver's S3 client)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AWS_") and k not in ("RAY_ADDRESS", "EPICACHE_S3_ENDPOINT")}
    env |= s3_server.env()
    out = subprocess.run([sys.executable, "-m", "jobs.bench.scale", "--large",
                          "--conversations", "120", "--s3-prefix", s3_server.uri("benchlarge"),
                          "--s3-endpoint", s3_server.endpoint, "--max-in-flight", "8",
                          "--no-progress"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("corpus: 120 conversations in 1 JSONL objects")
    assert "large build: 120 conversations, 240 episodes, 360 tasks" in lines[1]
    assert re.search(r"at conversation 12: \d+ MiB; at 120: \d+ MiB; growth [+-]", lines[3])
    assert "120 conversations, 240 episodes committed; the driver's requests for cache " \
           "objects: 0 GetObject, 240 HeadObject" in lines[4]
    assert lines[5] == "commit GETs per episode: 0"
