"""The Ray driver of a build: the corpus streamed through the stages under a bound on tasks.

The stages are those of `pipeline.builder.conversation.build_conversation`, the same functions
in the same order, fanned out: the build's basis once (a budgets task), then per conversation
the skip check (`stored_version`, in the driver), a planning task (CPU: `plan_conversation`),
one task per planned episode, or per conversation built in one pass (GPU when the cluster has
one: `prefill_episodes`), then the commit
(`commit_build`: the driver's commit thread writes the manifest once every episode is stored).
A conversation whose record grew since its build is planned instead of clustered
(`pipeline.builder.growth`), and its episode tasks append the new turns to the stored caches.
The driver keeps at most `max_in_flight` tasks submitted (`ray.wait`) and streams the corpus,
so its memory does not grow with the corpus. Conversations whose manifest already carries this
configuration's hash and the fingerprints of the model files the budgets task found, and whose
objects are all in the store at their recorded sizes, are skipped; one whose objects are not
has those repaired (`pipeline.builder.repair`). Committed rows are also appended, in batches,
to the store's manifest table (`pipeline.store.catalogue.table_sync.IndexWriter`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from pipeline.builder.conversation import StoredVersion, commit_build, stored_version
from pipeline.builder.job import BuildError, OpenedJob, Summary
from pipeline.builder.repair import Damage
from pipeline.builder.sources import corpus_objects
from pipeline.builder.tasks import MODEL_STAGES, Planned, Stages, WorkerStamp
from pipeline.config import BuildConfig, DriverOptions, ModelFingerprints
from pipeline.corpus.reader import CorpusStream, ReadStats
from pipeline.corpus.records import DEFAULT_LIMITS, CorpusLimits
from pipeline.corpus.schema import Conversation, CorpusError
from pipeline.ray_runtime import init_ray
from pipeline.store.backends.base import Store
from pipeline.store.backends.uri import open_store
from pipeline.store.catalogue.manifest import ManifestRecord, list_conversations
from pipeline.store.catalogue.table_sync import IndexWriter
from pipeline.telemetry import build_metrics

log = logging.getLogger("jobs.build")  # its lines carry the name of the command users run


@dataclass
class _Conversation:
    """What the driver holds for one conversation in flight (and only while in flight)."""
    clustered: Any = None  # ObjectRef of its ClusterResult, shared by its episode tasks
    outstanding: int = 0  # its tasks submitted or queued
    records: list[ManifestRecord] = field(default_factory=list)
    error: str | None = None
    source: Conversation | None = None  # the record read: its turns are marked in the manifest
    rebuilt: str | None = None  # why a conversation built before is built again
    appended: bool = False  # its episode tasks append to the stored caches
    damage: Damage | None = None  # what its stored objects lack (repaired, or rebuilt whole)
    repaired: tuple[int, ...] | None = None  # repaired: the episodes rebuilt, the others kept
    new_tokens: int = 0  # appended: the tokens each episode task prefills


def _describe(exc: BaseException) -> str:
    """One line for a task failure: the task's own exception when there is one."""
    cause = getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else None
    err = cause if isinstance(cause, BaseException) else exc
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


class _Driver:
    """Streams conversations through the stages with at most `max_in_flight` tasks submitted.

    Its loop is built for a rate of hundreds of tasks a second: the remote functions'
    `.options()` are made once, the configuration, store and budgets go to the object store
    once (tasks get them by reference, not pickled per task), one `ray.wait` collects a batch
    of finished tasks (up to a quarter of the bound, or what is done within `WAIT_S`) and one
    `ray.get` fetches the batch, a conversation is looked up in the store (`is_built`) only
    when the manifest listing made at the start names it, and manifests are committed by a
    thread of their own (`finish`)."""

    WAIT_S = 0.02  # how long a wait may hold finished tasks to collect them in one batch
    POSTFIX_S = 0.5  # the progress bar's postfix is refreshed at most this often

    def __init__(self, corpus: CorpusStream, store: Store, config: BuildConfig, stages: Stages,
                 options: DriverOptions, gpus: float, *, bar: tqdm,
                 index: IndexWriter | None = None):
        self.corpus, self.conversations = corpus, iter(corpus)
        self.store, self.config, self.stages = store, config, stages
        self.force, self.max_in_flight, self.bar = options.force, options.max_in_flight, bar
        self.verify = options.verify
        self.max_retries, self.growth = options.max_retries, options.growth
        self.resources = {"num_cpus": options.cpus_per_task, "num_gpus": gpus,
                          "max_retries": options.max_retries}
        self.index = index  # the manifest table: told before and after each commit
        self.summary = Summary()
        self.metrics = build_metrics()  # the summary's counts, exported through Ray as they come
        # ref -> (kind, id, the task's episodes)
        self.in_flight: dict[ray.ObjectRef, tuple[str, str, tuple[int, ...]]] = {}
        self.pending: deque[tuple[str, tuple[int, ...]]] = deque()  # tasks waiting for a slot
        self.convs: dict[str, _Conversation] = {}
        self.more = True
        self.corpus_error: CorpusError | None = None
        self.budgets: list[int] | None = None
        self.files: ModelFingerprints | None = None  # the model files the build runs with
        self.built_before: set[str] = set()  # ids with a manifest when the build started
        self.committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="commit")
        self.commits: deque[Future] = deque()
        self.batch = max(1, self.max_in_flight // 4)
        self.start = self._postfix_at = time.perf_counter()

    def run(self) -> Summary:
        ref = self.stages.budgets.options(**self.resources).remote(self.store, self.config)
        try:
            self.budgets, self.files, stamp = ray.get(ref)
        except Exception as exc:  # nothing can be built without the budgets
            raise BuildError(f"layer budgets (model {self.config.model!r}): {_describe(exc)}") \
                from None
        self._loads(stamp)
        log.info("layer budgets: %s; model files %s, encoder files %s", self.budgets,
                 self.files.model, self.files.encoder)
        if not self.force:  # one listing instead of a manifest read per conversation
            self.built_before = set(list_conversations(self.store))
        # SPREAD: an episode task is long and its worker holds a model, so the tasks go round
        # the nodes; Ray's default would queue them where the clustering ran (data locality).
        self.episode_fn = self.stages.episode.options(**self.resources,
                                                      scheduling_strategy="SPREAD")
        self.cluster_fn = self.stages.cluster.options(num_cpus=1, max_retries=self.max_retries,
                                                      num_returns=2)
        self.config_ref, self.store_ref = ray.put(self.config), ray.put(self.store)
        self.growth_ref = ray.put(self.growth)
        self.budgets_ref = ray.put(self.budgets)
        try:
            while True:
                self.fill()
                if not self.in_flight:
                    break
                refs = list(self.in_flight)
                waited = time.perf_counter()
                ready, _ = ray.wait(refs, num_returns=min(self.batch, len(refs)),
                                    timeout=self.WAIT_S)
                if not ready:
                    ready, _ = ray.wait(refs, num_returns=1)
                self.summary.wait_seconds += time.perf_counter() - waited
                self.collect_all(ready)
            while self.commits:
                self.commits.popleft().result()
        finally:  # the commits handed over are finished (also on an interrupt)
            self.committer.shutdown(wait=True)
        self.summary.seconds = time.perf_counter() - self.start
        if self.corpus_error is not None:
            raise self.corpus_error
        return self.summary

    def submit(self, ref: ray.ObjectRef, kind: str, cid: str,
               episodes: tuple[int, ...] = ()) -> None:
        self.in_flight[ref] = (kind, cid, episodes)
        self.summary.tasks += 1
        self.summary.peak_in_flight = max(self.summary.peak_in_flight, len(self.in_flight))

    def fill(self) -> None:
        """Submit queued episode tasks first (they finish conversations), then new
        conversations."""
        while len(self.in_flight) < self.max_in_flight:
            if self.pending:
                cid, episodes = self.pending.popleft()
                conv = self.convs[cid]
                if conv.error is not None:  # a sibling failed: do not spend work on it
                    conv.outstanding -= 1
                    self.finish(cid)
                    continue
                self.submit(self.episode_fn.remote(conv.clustered, episodes, self.budgets_ref,
                                                   self.config_ref, self.store_ref),
                            "episode", cid, episodes)
            elif self.more:
                self.more = self.admit()
            else:
                break

    def admit(self) -> bool:
        """Submit the next conversation that needs building; False when the corpus is done, or
        when a bad record stopped it (the tasks in flight finish and commit, then it raises)."""
        try:
            return self._admit()
        except CorpusError as e:
            self.corpus_error = e
            return False

    def _admit(self) -> bool:
        for conv in self.conversations:
            cid = conv.conversation_id
            version = StoredVersion(None, None)  # no manifest when the build began: built whole
            if cid in self.built_before:
                version = stored_version(self.store, cid, self.config, self.files, conv,
                                         self.verify)
                if version.reason is None:
                    self.summary.skipped += 1
                    self.metrics.conversation("skipped")
                    self.bar.update(1)
                    continue
                if version.damage is not None:
                    log.warning("repairing %s: %s", cid, version.damage.describe())
                elif version.reason != "grown":
                    log.info("rebuilding %s: %s", cid, version.reason)
            count_ref, clustered_ref = self.cluster_fn.remote(
                conv, self.config_ref, version.planned_from, self.growth_ref, self.store,
                version.damage)
            self.convs[cid] = _Conversation(clustered=clustered_ref, outstanding=1, source=conv,
                                            rebuilt=version.reason, damage=version.damage)
            self.submit(count_ref, "cluster", cid)
            return True
        return False

    def collect_all(self, ready: list[ray.ObjectRef]) -> None:
        """Fetch the finished tasks' results in one call (one by one only when one failed)."""
        try:
            results: list[Any] = ray.get(ready)
        except Exception:  # Ray already retried worker deaths (max_retries)
            results = []
            for ref in ready:
                try:
                    results.append(ray.get(ref))
                except Exception as exc:
                    results.append(exc)
        for ref, result in zip(ready, results):
            self.collect(ref, result)

    def collect(self, ref: ray.ObjectRef, result: Any) -> None:
        kind, cid, episodes = self.in_flight.pop(ref)
        conv = self.convs[cid]
        conv.outstanding -= 1
        if isinstance(result, Exception):
            what = "clustering" if kind == "cluster" else \
                f"episode{'s' if len(episodes) > 1 else ''} {', '.join(map(str, episodes))}"
            conv.error = conv.error or f"{what}: {_describe(result)}"
            log.error("conversation %s: %s", cid, conv.error)
            result = None
        if kind == "cluster" and result is not None:
            self._planned(cid, conv, result)
        elif kind == "episode" and result is not None:
            records, stamp = result
            self._loads(stamp)
            for i, record in enumerate(records):
                self._built(cid, conv, record, stamp, first=i == 0)
            self._postfix()
        self.finish(cid)

    def _built(self, cid: str, conv: _Conversation, record: ManifestRecord, stamp: WorkerStamp,
               first: bool) -> None:
        """An episode's record is back: counted, and kept for the commit. The tokens
        prefilled are counted once per task (one pass runs the conversation once for all)."""
        conv.records.append(record)
        s = self.summary
        s.episodes += 1
        prefilled = conv.new_tokens if conv.appended else record.tokens if first else 0
        s.tokens += prefilled
        self.metrics.episode(prefilled)
        if not (conv.appended and conv.new_tokens == 0):  # else the stored object is kept
            s.bytes += record.object_bytes
        log.debug("built %s episode %d on node %s by %s: %d tokens in %.1fs", cid,
                  record.episode, stamp.node_id[:12], stamp.worker, record.tokens,
                  record.build_seconds)

    def _planned(self, cid: str, conv: _Conversation, planned: Planned) -> None:
        """Stage 1 is done: queue the conversation's episode tasks."""
        if planned.episodes == 0:
            conv.error = "clustering produced no episodes"
        conv.appended, conv.new_tokens = planned.appended, planned.new_tokens
        conv.repaired = planned.repaired
        conv.records.extend(planned.kept)
        if planned.reclustered is not None:
            why = planned.reclustered
            conv.rebuilt = why.reason if conv.rebuilt == "damaged" else f"grown, {why.reason}"
            log.info("rebuilding %s: %s, re-clustered: %s", cid, conv.rebuilt, why.detail)
        conv.outstanding += len(planned.tasks)
        self.pending.extend((cid, episodes) for episodes in planned.tasks)

    def finish(self, cid: str) -> None:
        """Hand a conversation whose tasks are all done to the commit thread, which runs
        `maybe_finish` (a manifest write costs the loop milliseconds: PUTs and HEADs on S3, an
        fsync on a local store). One thread: commits and their bookkeeping stay in order and
        single-threaded. At most `max_in_flight` commits wait; a commit's own exception is
        re-raised here."""
        if self.convs[cid].outstanding > 0:
            return
        while self.commits and (self.commits[0].done() or
                                len(self.commits) >= self.max_in_flight):
            self.commits.popleft().result()
        self.commits.append(self.committer.submit(self.maybe_finish, cid))

    def maybe_finish(self, cid: str) -> None:
        conv = self.convs[cid]
        if conv.outstanding > 0:
            return
        del self.convs[cid]  # drops the clustering reference: Ray frees the object
        if conv.error is None:
            try:
                if self.index is not None:
                    self.index.begin(cid)
                conv.records = commit_build(self.store, conv.source, conv.records, self.files)
                if conv.appended:
                    self.summary.appended += 1
                elif conv.repaired is not None:
                    self.summary.repaired(len(conv.repaired), conv.damage.turn_index)
                else:
                    self.summary.built += 1
                    if conv.rebuilt is not None:
                        self.summary.rebuilt[conv.rebuilt] += 1
                log.info("committed %s: %d episodes%s", cid, len(conv.records),
                         f", {conv.new_tokens} tokens appended" if conv.appended else
                         f", {len(conv.repaired)} repaired" if conv.repaired is not None else "")
            except Exception as exc:  # a commit that fails marks the conversation failed
                conv.error = f"manifest commit: {type(exc).__name__}: {exc}"
            else:
                if self.index is not None:
                    self.index.add(cid, conv.records)
        self.metrics.conversation("failed" if conv.error is not None else
                                  "appended" if conv.appended else
                                  "repaired" if conv.repaired is not None else "built")
        if conv.error is not None:
            self.summary.failed[cid] = conv.error
            log.error("conversation %s failed: %s", cid, conv.error)
        self.bar.update(1)
        self._postfix()

    def _loads(self, stamp: WorkerStamp) -> None:
        node, pid, loads = stamp.node_id, stamp.pid, stamp.loads
        self.summary.loads[(node, pid)] = self.summary.loads.get((node, pid), 0) + loads

    def _postfix(self) -> None:
        now = time.perf_counter()
        if self.bar.disable or now - self._postfix_at < self.POSTFIX_S:
            return
        self._postfix_at, s = now, self.summary
        rate = s.tokens / max(now - self.start, 1e-9)
        self.bar.set_postfix_str(f"episodes={s.episodes} tok/s={rate:,.0f} "
                                 f"failed={len(s.failed)} objects={self.corpus.objects_started}/"
                                 f"{len(self.corpus.objects)}", refresh=False)


def run_build(corpus: str | CorpusStream, store: str | Store, config: BuildConfig,
              options: DriverOptions = DriverOptions(), *, on_bad_record: str = "fail",
              limits: CorpusLimits = DEFAULT_LIMITS, stages: Stages = MODEL_STAGES) -> Summary:
    """Drive the whole build on the connected Ray; returns the summary (the caller decides the
    exit code). `corpus` is a local path or an s3:// URI (read with `on_bad_record` and
    `limits`), or a `CorpusStream` already opened and primed (`pipeline.builder.job`); `store` a
    Store or its URI. The corpus is streamed object by object, each object checked before its
    conversations are scheduled; a bad record (fail mode) raises `CorpusError` and stops the
    build (conversations already committed are kept). Committed rows go to the store's
    manifest table every `options.index_flush_rows` rows (or minute) and at the end."""
    store = open_store(store) if isinstance(store, str) else store
    if isinstance(corpus, str):
        corpus = CorpusStream(corpus_objects(corpus, store.options), on_bad_record, ReadStats(),
                              limits, where=corpus)
    gpus = options.gpus_per_task
    if gpus is None:
        gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
    # log lines go above the bar, not through it; no total: counting an S3 corpus's records
    # would mean reading it all first (the postfix says how many of its objects are started)
    progress = options.progress
    redirect = logging_redirect_tqdm() if progress else contextlib.nullcontext()
    with IndexWriter(store, options.index_flush_rows) as index, redirect, tqdm(
            unit="conv", desc="build", disable=not progress, dynamic_ncols=True,
            file=sys.stderr) as bar:
        summary = _Driver(corpus, store, config, stages, options, gpus, bar=bar,
                          index=index).run()
    stats = corpus.stats
    summary.bad_records, summary.questions_dropped = stats.records_skipped, stats.questions_dropped
    return summary


def run_job(opened: OpenedJob, config: BuildConfig,
            options: DriverOptions = DriverOptions()) -> Summary:
    """Run a build whose corpus and store `pipeline.builder.job.open_job` has checked: Ray joined
    (or started), then `run_build`. On Ctrl-C the tasks (and a local Ray) are stopped before
    the interrupt goes on."""
    init_ray(opened.job.ray_address)
    try:
        return run_build(opened.corpus, opened.store, config, options)
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):
            ray.shutdown()
        raise
