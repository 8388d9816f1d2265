"""The build as one job, as `jobs.build` and the demo run it: the corpus checked before anything
starts, the store opened, Ray joined, the driver run, and every skipped record reported.

The corpus is read up to its first conversation (its first object checked whole) before the
store is opened (a local one would be created) and before Ray and the model start: a bad or
empty corpus fails in seconds and writes nothing. Later objects are checked each before its own
conversations are scheduled. Skips (even where every record is skipped) go to `<store>/reports/<UTC time>-<pid>/skipped.jsonl` (a
folder per run: no run overwrites another's report) and the first 20 to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO

from pipeline.build.config import BuildConfig, DriverOptions
from pipeline.build.driver import Summary, run_build
from pipeline.build.sources import corpus_objects
from pipeline.corpus.reader import SKIP_REPORT, CorpusStream, OnBadRecord, ReadStats
from pipeline.corpus.records import DEFAULT_LIMITS, CorpusLimits
from pipeline.corpus.schema import CorpusError
from pipeline.ray_runtime import init_ray
from pipeline.store.base import Store
from pipeline.store.uri import open_store

SKIPS_SHOWN = 20  # skips printed to stderr; all of them are in the report


def configure_logging(level: str = "INFO") -> None:
    """Warnings from everything, and the build's own progress lines at `level`."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jobs.build").setLevel(level)  # the driver's logger


@dataclass(frozen=True)
class BuildJob:
    """What a build reads and where it writes: the corpus (a path or s3:// URI) and its reading
    rules, the store (a folder or s3:// URI), and the S3 endpoint and region and Ray cluster."""
    corpus: str
    store: str
    on_bad_record: OnBadRecord = "fail"
    limits: CorpusLimits = DEFAULT_LIMITS
    s3_endpoint: str | None = None
    s3_region: str | None = None
    ray_address: str | None = None


def skip_report_key() -> str:
    """A folder of its own per run (`reports/<UTC time>-<pid>/skipped.jsonl`): a re-run never
    overwrites an earlier report, and manifests/ holds manifests only."""
    return f"reports/{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}/{SKIP_REPORT}"


def put_skip_report(store: Store, report: IO[str], key: str) -> bool:
    """Upload the run's skip report (spooled as the corpus is read) whole to `key`; False when
    nothing was skipped."""
    if report.tell() == 0:
        return False
    report.seek(0)
    store.put(key, report.read().encode("utf-8"))
    report.seek(0, os.SEEK_END)
    return True


def print_skips(stats: ReadStats, shown: int, out: IO[str]) -> int:
    """Print the skips held in `stats` from the `shown`-th on, and how many more are only in
    the report; returns how many are printed so far (the next call's `shown`)."""
    for s in stats.skipped[shown:]:
        print(s.line(), file=out)
    shown = max(shown, len(stats.skipped))
    if stats.total_skipped > shown:
        print(f"... and {stats.total_skipped - shown:,} more (all in {SKIP_REPORT})", file=out)
    return shown


def run_job(job: BuildJob, config: BuildConfig, options: DriverOptions = DriverOptions(),
            err: IO[str] | None = None) -> tuple[Summary, Store]:
    """Run the build; returns its summary and the store. A bad corpus raises `CorpusError`, a
    store that cannot be opened `StoreError`, a failure of the whole build `BuildError`; one
    conversation's failure is in the summary. Skips are printed to `err` (stderr)."""
    err = err if err is not None else sys.stderr
    with tempfile.TemporaryFile("w+", encoding="utf-8") as report:
        def to_report(skip) -> None:
            report.write(json.dumps(skip.as_dict()) + "\n")

        stats = ReadStats(keep=SKIPS_SHOWN, sink=to_report)
        corpus = CorpusStream(corpus_objects(job.corpus, job.s3_endpoint), job.on_bad_record,
                              stats, job.limits, where=job.corpus)
        unusable = None
        try:
            corpus.prime()
        except CorpusError as e:
            if not stats.total_skipped:  # nothing skipped, nothing to report: nothing written
                raise
            unusable = e  # every record skipped: reported below, as any skips are, then raised
        shown = print_skips(stats, 0, err)
        store = open_store(job.store, endpoint_url=job.s3_endpoint, region=job.s3_region)
        key = skip_report_key()
        if put_skip_report(store, report, key):
            print(f"skip report: {store.uri}/{key}", file=err)
        if unusable is not None:
            raise unusable
        init_ray(job.ray_address)
        reported = stats.total_skipped
        try:
            summary = run_build(corpus, store, config, options)
        finally:  # skips met in later objects: the report is rewritten whole
            if stats.total_skipped > reported:
                print_skips(stats, shown, err)
                put_skip_report(store, report, key)
                print(f"skip report: {store.uri}/{key}", file=err)
    return summary, store


def print_outcome(summary: Summary, seconds: float, store: Store) -> None:
    """The build's one summary line (stdout), then each failed conversation (stderr)."""
    print(summary.line(seconds, store.uri))
    for cid, error in summary.failed.items():
        print(f"failed {cid}: {error}", file=sys.stderr)
