"""The store on every backend: a local folder, a real S3 server (SeaweedFS on 127.0.0.1) and
memory.

The same contract tests run against each; then what only S3 has (multipart uploads, retries,
credentials that never leak, one clear line for each way of not reaching a bucket); garbage
collection of orphans on each; and the same build with the real SmolLM2 and MiniLM into S3
and into a folder, giving equivalent manifests that answer the same questions.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import uuid

import pytest

from jobs import build, gc
from lab.rehearsal import SYNTHETIC_CONFIG, synthetic_cache
from pipeline.answer.answerer import Answerer
from pipeline.builder.driver import run_build
from pipeline.config import DriverOptions, TopUpConfig
from pipeline.corpus.reader import read_corpus, write_jsonl
from pipeline.corpus.synthetic import make_corpus
from pipeline.store.backends.base import ObjectNotFound, StoreError, cache_key
from pipeline.store.backends.local import LocalStore
from pipeline.store.backends.s3 import S3Store
from pipeline.store.backends.uri import open_store
from pipeline.store.catalogue.manifest import (
    ManifestRecord,
    list_conversations,
    read_manifest,
    write_manifest,
)
from pipeline.store.objects import cache_format
from pipeline.store.objects.cache_read import read_cache
from tests.support.paths import REPO
from tests.support.stores import store  # noqa: F401  (a folder, a prefix in SeaweedFS, memory)

# ---------------------------------------------------------------------------------------------
# The contract, on every backend
# ---------------------------------------------------------------------------------------------

def test_put_get_exists_list_delete(store):
    store.put("caches/a/h/episode-0.safetensors", b"zero")
    store.put("caches/a/h/episode-1.safetensors", b"one")
    store.put("manifests/a.parquet", b"m")
    assert store.get("caches/a/h/episode-1.safetensors") == b"one"
    assert store.exists("manifests/a.parquet") and not store.exists("manifests/b.parquet")
    assert store.list("caches/") == ["caches/a/h/episode-0.safetensors",
                                     "caches/a/h/episode-1.safetensors"]
    assert store.list() == sorted(store.list()) and len(store.list()) == 3
    store.put("manifests/a.parquet", b"replaced, and longer than before")
    assert store.get("manifests/a.parquet") == b"replaced, and longer than before"
    store.delete("manifests/a.parquet")
    store.delete("manifests/a.parquet")  # deleting twice is fine
    assert not store.exists("manifests/a.parquet")
    assert store.list("manifests/") == []


def test_missing_object(store):
    with pytest.raises(ObjectNotFound):
        store.get("manifests/none.parquet")
    with pytest.raises(KeyError):  # ObjectNotFound is also a KeyError
        store.get("manifests/none.parquet")
    with pytest.raises(ObjectNotFound):
        store.info("manifests/none.parquet")
    with pytest.raises(ObjectNotFound):
        store.open("manifests/none.parquet")
    assert not store.exists("manifests/none.parquet")


@pytest.mark.parametrize("key", ["..", "a/../b", "/abs/key", "", "a//b", "a b", "caches/x\x00y"])
def test_unsafe_keys_are_refused(store, key):
    for call in (lambda: store.put(key, b"x"), lambda: store.get(key),
                 lambda: store.exists(key)):
        with pytest.raises(StoreError, match="unsafe object key"):
            call()


def test_info_and_download(store, tmp_path):
    data = os.urandom(3000)
    before = time.time()
    store.put("caches/c/h/episode-0.safetensors", data)
    info = store.info("caches/c/h/episode-0.safetensors")
    assert info.size == 3000 and abs(info.modified - before) < 120
    store.download("caches/c/h/episode-0.safetensors", tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == data


def test_open_streams_lines_and_chunks(store):
    lines = [f'{{"conversation_id": "c{i}"}}\n'.encode() for i in range(20000)]
    store.put("corpus/big.jsonl", b"".join(lines))
    with store.open("corpus/big.jsonl") as f:
        assert next(iter(f)) == lines[0]
        assert f.read(5) == lines[1][:5]
        rest = f.read()
    assert rest == b"".join(lines[1:])[5:]
    with store.open("corpus/big.jsonl") as f:
        assert sum(1 for _ in f) == 20000
    for call in (lambda: store.open("a/../b"),):
        with pytest.raises(StoreError, match="unsafe object key"):
            call()


def test_manifest_round_trip_and_checksum_verified_on_read(store):
    """Rows come back with every column (node_id included); a cache object that changed after
    its manifest was written fails its recorded checksum when read."""
    data = synthetic_cache("conv-1", 0, 8, SYNTHETIC_CONFIG)
    key = cache_key("conv-1", SYNTHETIC_CONFIG.hash, 0)
    store.put(key, data)
    row = ManifestRecord.from_row({
        "conversation_id": "conv-1", "episode": 0, "object_key": key,
        "sha256": cache_format.sha256(data), "object_bytes": len(data), "centroid": [1.0, 0.0],
        "config_hash": SYNTHETIC_CONFIG.hash, "node_id": "ab" * 28, "worker": "host:1"})
    write_manifest(store, "conv-1", [row])
    [back] = read_manifest(store, "conv-1")
    assert back == row and back.node_id == "ab" * 28
    assert list_conversations(store) == ["conv-1"]
    cache, header = cache_format.deserialize(store.get(key), back.sha256, key)
    assert header["conversation_id"] == "conv-1" and cache.tokens_seen == 8
    assert read_cache(store, back).cache.tokens_seen == 8  # by Store.open, hashed beside the parse
    tampered = bytearray(data)
    tampered[-5] ^= 0xFF
    store.put(key, bytes(tampered))
    with pytest.raises(cache_format.CacheCorruptError, match="checksum"):
        cache_format.deserialize(store.get(key), back.sha256, key)
    with pytest.raises(cache_format.CacheCorruptError, match=f"{key} failed its checksum"):
        read_cache(store, back)


# ---------------------------------------------------------------------------------------------
# S3 only
# ---------------------------------------------------------------------------------------------

def test_s3_store_pickles_without_credentials(s3_env):
    """Ray ships the store to workers: the pickle and the repr carry the bucket, prefix and
    endpoint, never a credential; the copy makes its own client from its own chain."""
    store = open_store(s3_env.uri("pickle"))
    store.put("a.bin", b"x")
    blob = pickle.dumps(store)
    for secret in (s3_env.secret_key, s3_env.access_key):
        assert secret.encode() not in blob and secret not in repr(store)
    copy = pickle.loads(blob)
    assert copy.get("a.bin") == b"x" and copy.uri == store.uri == f"s3://{s3_env.bucket}/pickle"


def test_large_objects_go_up_in_multipart_parts(s3_env):
    store = S3Store(s3_env.bucket, "multipart", endpoint_url=s3_env.endpoint,
                    multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20)
    data = os.urandom(12 * 2**20)
    store.put("big.bin", data)
    head = s3_env.client().head_object(Bucket=s3_env.bucket, Key="multipart/big.bin")
    assert head["ETag"].strip('"').endswith("-3")  # the S3 ETag of a 3-part upload
    assert store.get("big.bin") == data
    small = S3Store(s3_env.bucket, "multipart", endpoint_url=s3_env.endpoint)
    small.put("small.bin", b"x" * 1000)
    assert "-" not in s3_env.client().head_object(Bucket=s3_env.bucket,
                                                  Key="multipart/small.bin")["ETag"]


def test_transient_errors_are_retried_with_backoff(s3_env):
    """A connection that fails is retried by botocore (adaptive mode by default) up to the
    attempt bound, with backoff, then ends in one clear StoreError."""
    from tests.support.s3_server import free_ports

    [port] = free_ports(1)  # nothing listens there
    store = S3Store(s3_env.bucket, "x", endpoint_url=f"http://127.0.0.1:{port}", max_attempts=3,
                    check=False)
    assert store.client.meta.config.retries == {"mode": "adaptive", "total_max_attempts": 3}
    sends = []
    store.client.meta.events.register("before-send.s3", lambda **kw: sends.append(time.monotonic()))
    with pytest.raises(StoreError,
                       match=r"cannot reach S3 at http://127\.0\.0\.1:\d+ .* after 3 attempts"):
        store.put("k", b"v")
    assert len(sends) == 3


def test_bucket_errors_are_one_clear_error(s3_env, monkeypatch):
    """Missing bucket, wrong credentials, no credentials, unreachable: a StoreError each, with a
    message that says which, and never the secret."""
    cases = {}
    with pytest.raises(StoreError) as e:
        open_store(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/p")
    cases["missing"] = str(e.value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + s3_env.secret_key[::-1])
    with pytest.raises(StoreError) as e:
        open_store(s3_env.uri("p"))
    cases["denied"] = str(e.value)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreError) as e:
        open_store(s3_env.uri("p"))
    cases["no credentials"] = str(e.value)
    assert "does not exist" in cases["missing"]
    assert "access denied" in cases["denied"] and "credentials" in cases["denied"]
    assert "no usable AWS credentials" in cases["no credentials"]
    for message in cases.values():
        assert "\n" not in message and s3_env.secret_key not in message
        assert s3_env.secret_key[::-1] not in message
    with pytest.raises(StoreError, match="invalid S3 URI"):
        open_store("s3://Bad_Bucket/x")
    with pytest.raises(StoreError, match="unsupported store URI"):
        open_store("gs://bucket/x")


@pytest.mark.parametrize("case", ["unreachable", "missing bucket", "wrong credentials",
                                  "missing corpus object"])
def test_build_command_fails_with_one_error_line(s3_server, tmp_path, case):
    """`python -m jobs.build` against S3 that cannot be used: exit code 2 and a single line on
    stderr starting with 'error:', naming the problem, without the secret."""
    from tests.support.s3_server import free_ports

    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(make_corpus(1, 300, seed=1), corpus)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AWS_") and k not in ("RAY_ADDRESS", "EPICACHE_S3_ENDPOINT")}
    env |= s3_server.env() | {"AWS_MAX_ATTEMPTS": "2"}
    store, endpoint, corpus_arg = s3_server.uri("cli"), s3_server.endpoint, str(corpus)
    expect = {"unreachable": "cannot reach S3", "missing bucket": "does not exist",
              "wrong credentials": "access denied", "missing corpus object": "no object"}[case]
    if case == "unreachable":
        endpoint = f"http://127.0.0.1:{free_ports(1)[0]}"
    elif case == "missing bucket":
        store = "s3://no-such-bucket-here/cli"
    elif case == "wrong credentials":
        env["AWS_SECRET_ACCESS_KEY"] = "wrong-" + s3_server.secret_key[::-1]
    else:
        corpus_arg = s3_server.uri("nothing/here/corpus.jsonl")
    out = subprocess.run([sys.executable, "-m", "jobs.build", "--corpus", corpus_arg, "--store",
                          store, "--s3-endpoint", endpoint, "--no-progress"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], out.stderr
    assert out.stdout == ""
    for secret in (s3_server.secret_key, s3_server.secret_key[::-1]):
        assert secret not in out.stderr


# ---------------------------------------------------------------------------------------------
# Garbage collection, on every backend
# ---------------------------------------------------------------------------------------------

def _committed_and_orphan(store) -> tuple[str, str]:
    kept, orphan = (cache_key("conv-1", "abcd", e) for e in (0, 1))
    for key in (kept, orphan):
        store.put(key, b"cache bytes")
    row = ManifestRecord.from_row({"conversation_id": "conv-1", "episode": 0, "object_key": kept,
                                   "config_hash": "abcd",
                                   "sha256": cache_format.sha256(b"cache bytes")})
    write_manifest(store, "conv-1", [row])
    return kept, orphan


def test_gc_lists_then_deletes_orphans_and_unfinished_writes(store, capsys, s3_server):
    """An object no manifest names and an unfinished write (a stale temporary file, or an
    incomplete multipart upload) are listed, left in place without --delete, and removed with
    it; committed objects, manifests and recent writes are never touched."""
    kept, orphan = _committed_and_orphan(store)
    partial = 1  # a stale temporary file, or a fresh multipart upload (young, as the orphan)
    if isinstance(store, LocalStore):
        tmp = store.root / "caches" / "conv-1" / ".tmp-stale"
        tmp.write_bytes(b"half a write")
        os.utime(tmp, (time.time() - 7200, time.time() - 7200))
    elif isinstance(store, S3Store):
        s3_server.client().create_multipart_upload(Bucket=store.bucket,
                                                   Key=f"{store.prefix}/caches/conv-2/x")
    else:  # in memory a write is whole or absent: there is no unfinished one to plant
        partial = 0
    uri = ["--store", store.uri]

    assert gc.main(uri + ["--min-age-seconds", "0"]) == 0
    out = capsys.readouterr().out
    assert f"orphan  {orphan}" in out and kept not in out and "--delete removes them" in out
    assert out.count("partial ") == partial
    assert store.exists(orphan)

    assert gc.main(uri) == 0  # the default age (an hour) leaves the fresh orphan alone
    out = capsys.readouterr().out
    assert not out.startswith("orphan") and f"orphan  {orphan}" not in out
    young = 2 if isinstance(store, S3Store) else 1  # the fresh multipart upload too
    assert "found 0 orphan objects" in out and f"{young} younger than 3600s left alone" in out

    assert gc.main(uri + ["--min-age-seconds", "0", "--delete"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("orphan") and "removed " in out
    assert not store.exists(orphan) and store.exists(kept)
    assert read_manifest(store, "conv-1")[0].object_key == kept
    assert store.list_partial() == []
    assert gc.main(uri + ["--min-age-seconds", "0"]) == 0
    assert "found 0 orphan objects" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# The same build into S3 and into a folder (real SmolLM2 and MiniLM)
# ---------------------------------------------------------------------------------------------

ARGS = ["--budget", "64", "--block", "128", "--medoids", "1", "--episodes", "2",
        "--calibration-tokens", "512", "--calibration-window", "128", "--no-progress"]


@pytest.fixture(scope="module")
def twin_builds(s3_server, ray_local, tmp_path_factory):
    """A conversation (two episodes) built twice with the default models: into a local folder
    (this session's Ray) and, by `python -m jobs.build` reading the corpus from S3, into S3."""
    root = tmp_path_factory.mktemp("twins")
    corpus = root / "corpus.jsonl"
    write_jsonl(make_corpus(1, 600, seed=13), corpus)
    s3_server.client().upload_file(str(corpus), s3_server.bucket, "twins/input/corpus.jsonl")
    local_dir = root / "local-store"
    config = build.config_from_args(build.parse_args(["--corpus", "-", "--store", "-", *ARGS]))
    summary = run_build(str(corpus), str(local_dir), config, DriverOptions(progress=False))
    assert summary.built == 1 and not summary.failed
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AWS_") and k not in ("RAY_ADDRESS", "EPICACHE_S3_ENDPOINT")}
    env |= {k: v for k, v in s3_server.env().items() if k != "EPICACHE_S3_ENDPOINT"}
    s3_uri = s3_server.uri("twins/store")
    out = subprocess.run([sys.executable, "-m", "jobs.build", "--corpus",
                          s3_server.uri("twins/input/corpus.jsonl"), "--store", s3_uri,
                          "--s3-endpoint", s3_server.endpoint, *ARGS], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "built 1 conversations" in out.stdout and s3_server.secret_key not in out.stderr
    return corpus, local_dir, s3_uri, config


@pytest.mark.e2e
def test_same_build_into_s3_and_a_folder_gives_equivalent_manifests(twin_builds, s3_env):
    corpus, local_dir, s3_uri, config = twin_builds
    local, s3 = LocalStore(local_dir), open_store(s3_uri)
    ids = sorted(c.conversation_id for c in read_corpus(corpus)[0])
    assert list_conversations(local) == list_conversations(s3) == ids
    assert s3.list("profiles/") == local.list("profiles/")
    same = ("episode", "episodes_built", "object_key", "object_bytes", "kv_bytes", "tokens",
            "medoid_turn_ids", "layer_budgets", "entries_per_layer", "config_hash", "model_id")
    for cid in ids:
        a, b = read_manifest(local, cid), read_manifest(s3, cid)
        assert len(a) == len(b) == 2
        for ra, rb in zip(a, b):
            assert ra.config_hash == config.hash
            assert {k: getattr(ra, k) for k in same} == {k: getattr(rb, k) for k in same}
            assert ra.centroid == pytest.approx(rb.centroid, abs=1e-5)
            assert ra.sha256 == rb.sha256  # CPU builds are deterministic: same bytes
            assert s3.get(rb.object_key) == local.get(ra.object_key)
            assert rb.node_id and ra.node_id


@pytest.mark.e2e
def test_answers_read_caches_back_from_both_backends(twin_builds, s3_env):
    corpus, local_dir, s3_uri, _ = twin_builds
    conv = read_corpus(corpus)[0][0]
    question = conv.questions[0].question
    stores = (LocalStore(local_dir), open_store(s3_uri))
    answers = [Answerer(store).answer(conv.conversation_id, question, max_new_tokens=8)
               for store in stores]  # topped up (the default): the turn index read back too
    assert answers[0].answer == answers[1].answer and answers[0].topup == answers[1].topup
    assert answers[0].topup["status"] in ("used", "none")
    assert answers[0].episode == answers[1].episode
    assert not answers[0].cache_hit and not answers[1].cache_hit
    plain = [Answerer(store, topup=TopUpConfig(enabled=False)).answer(
        conv.conversation_id, question, max_new_tokens=8) for store in stores]
    assert plain[0].answer and plain[0].answer == plain[1].answer
