"""The build as one job, as `jobs.build` and the demo run it: the corpus checked before anything
starts, the store opened, and every skipped record reported; and the build's outcome.

The corpus is read up to its first conversation (its first object checked whole) before the
store is opened (a local one would be created) and before Ray and the model start: a bad or
empty corpus fails in well under a second and writes nothing, since this module imports
neither torch nor Ray (`pipeline.builder.driver.run_job` runs the build once `open_job` has
checked its input). Later objects are checked each before its own conversations are scheduled.
Skips (even where every record is skipped) go to `<store>/reports/<UTC time>-<pid>/skipped.jsonl`
(a folder per run: no run overwrites another's report) and the first 20 to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO

from pipeline.builder.sources import corpus_objects
from pipeline.corpus.reader import SKIP_REPORT, CorpusStream, OnBadRecord, ReadStats
from pipeline.corpus.records import DEFAULT_LIMITS, CorpusLimits
from pipeline.corpus.schema import CorpusError
from pipeline.store.backends.base import Store, StoreOptions
from pipeline.store.backends.uri import open_store

SKIPS_SHOWN = 20  # skips printed to stderr; all of them are in the report


@dataclass
class Summary:
    """What a build did: the figures of its summary line."""
    built: int = 0
    appended: int = 0  # grown conversations whose new turns were appended to the stored caches
    # conversations whose damaged objects were rebuilt alone (`pipeline.builder.repair`), and
    # the episode caches and turn indexes among them
    repaired_conversations: int = 0
    repaired_episodes: int = 0
    repaired_indexes: int = 0
    skipped: int = 0
    rebuilt: Counter[str] = field(default_factory=Counter)  # of `built`, built before: why again
    failed: dict[str, str] = field(default_factory=dict)
    episodes: int = 0
    tokens: int = 0
    bytes: int = 0
    # (node, pid) -> the models that worker loaded in this build (not those of earlier jobs)
    loads: dict[tuple[str, int], int] = field(default_factory=dict)
    bad_records: int = 0
    questions_dropped: int = 0  # bad questions dropped from kept conversations (skip mode)
    tasks: int = 0  # tasks submitted
    peak_in_flight: int = 0  # most tasks submitted and not yet collected at any time
    seconds: float = 0.0
    wait_seconds: float = 0.0  # of which the driver waited in ray.wait with nothing to do

    def repaired(self, episodes: int, turn_index: bool) -> None:
        """Count a conversation whose damaged objects were rebuilt."""
        self.repaired_conversations += 1
        self.repaired_episodes += episodes
        self.repaired_indexes += turn_index

    @property
    def nodes(self) -> set[str]:
        return {node for node, _ in self.loads}

    def line(self, seconds: float | None = None, store: str = "") -> str:
        seconds = self.seconds if seconds is None else seconds
        return (f"built {self.built} conversations, appended to {self.appended} "
                f"({_n(self.episodes, 'episode cache')}, {self.tokens:,} tokens prefilled, "
                f"{self.bytes / 2**20:.1f} MiB) in {seconds:.1f}s; "
                f"{self._rebuilt()}{self._repaired()}skipped {self.skipped} up to date; "
                f"failed {len(self.failed)}; "
                f"bad records skipped {self.bad_records}; questions dropped "
                f"{self.questions_dropped}; model loads {sum(self.loads.values())} "
                f"in {_n(len(self.loads), 'worker')} on {_n(len(self.nodes), 'node')}; "
                f"store {store}")

    def _rebuilt(self) -> str:
        """E.g. "of which rebuilt 2 (edited 1, grown 1); " when conversations were built again."""
        if not self.rebuilt:
            return ""
        why = ", ".join(f"{reason} {n}" for reason, n in sorted(self.rebuilt.items()))
        return f"of which rebuilt {sum(self.rebuilt.values())} ({why}); "


    def _repaired(self) -> str:
        """E.g. "repaired 1 (1 episode cache, 0 turn indexes; 1 conversation); " when a
        conversation's damaged objects were rebuilt."""
        if not self.repaired_conversations:
            return ""
        return (f"repaired {self.repaired_episodes + self.repaired_indexes} "
                f"({_n(self.repaired_episodes, 'episode cache')}, "
                f"{_n(self.repaired_indexes, 'turn index', 'turn indexes')}; "
                f"{_n(self.repaired_conversations, 'conversation')}); ")


def _n(count: int, noun: str, plural: str | None = None) -> str:
    if count != 1:
        return f"{count} {plural or noun + 's'}"
    return f"{count} {noun}"


class BuildError(RuntimeError):
    """A failure that stops the whole build (not one conversation)."""


def configure_logging(level: str = "INFO") -> None:
    """Warnings from everything, and the build's own progress lines at `level`."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jobs.build").setLevel(level)  # the driver's logger


@dataclass(frozen=True)
class BuildJob:
    """What a build reads and where it writes: the corpus (a path or s3:// URI) and its reading
    rules, the store (a folder or s3:// URI) and how to reach it (the corpus, when in S3, is
    reached alike), and the Ray cluster."""
    corpus: str
    store: str
    on_bad_record: OnBadRecord = "fail"
    limits: CorpusLimits = DEFAULT_LIMITS
    store_options: StoreOptions = StoreOptions()
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


@dataclass(frozen=True)
class OpenedJob:
    """A job whose corpus is primed (its first object checked) and whose store is open."""
    job: BuildJob
    corpus: CorpusStream
    store: Store


@contextmanager
def open_job(job: BuildJob, err: IO[str] | None = None) -> Iterator[OpenedJob]:
    """Check the corpus up to its first conversation, open the store and report the skips so
    far; the build runs inside the block, and skips met later are reported on leaving it. A
    bad corpus raises `CorpusError`, a store that cannot be opened `StoreError`. Skips are
    printed to `err` (stderr)."""
    err = err if err is not None else sys.stderr
    with tempfile.TemporaryFile("w+", encoding="utf-8") as report:
        def to_report(skip) -> None:
            report.write(json.dumps(skip.as_dict()) + "\n")

        stats = ReadStats(keep=SKIPS_SHOWN, sink=to_report)
        corpus = CorpusStream(corpus_objects(job.corpus, job.store_options), job.on_bad_record,
                              stats, job.limits, where=job.corpus)
        unusable = None
        try:
            corpus.prime()
        except CorpusError as e:
            if not stats.total_skipped:  # nothing skipped, nothing to report: nothing written
                raise
            unusable = e  # every record skipped: reported below, as any skips are, then raised
        shown = print_skips(stats, 0, err)
        store = open_store(job.store, job.store_options)
        key = skip_report_key()
        if put_skip_report(store, report, key):
            print(f"skip report: {store.uri}/{key}", file=err)
        if unusable is not None:
            raise unusable
        reported = stats.total_skipped
        try:
            yield OpenedJob(job, corpus, store)
        finally:  # skips met in later objects: the report is rewritten whole
            if stats.total_skipped > reported:
                print_skips(stats, shown, err)
                put_skip_report(store, report, key)
                print(f"skip report: {store.uri}/{key}", file=err)


def print_outcome(summary: Summary, seconds: float, store: Store) -> None:
    """The build's one summary line (stdout), then each failed conversation (stderr)."""
    print(summary.line(seconds, store.uri))
    for cid, error in summary.failed.items():
        print(f"failed {cid}: {error}", file=sys.stderr)
