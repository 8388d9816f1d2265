"""Build episodic caches for every conversation of a corpus, on Ray.

    python -m jobs.build --corpus PATH|s3://... --store DIR|s3://bucket/prefix [--budget 1024 ...]
    ray job submit --working-dir . -- python -m jobs.build --corpus s3://... --store s3://...

Stages per conversation: a clustering task (CPU), then one block-prefill task per episode
(GPU when the cluster has one), then the manifest commit (the driver writes it once every
episode is stored): the manifest is the only commit point. The layer sensitivity profile is
measured once per model (or read from the store). The driver keeps at most `--max-in-flight`
tasks submitted (`ray.wait`) and streams the corpus, so its memory does not grow with the
corpus. Conversations whose manifest already carries this configuration's hash are skipped.
Committed rows are also appended, in batches, to the store's manifest table
(`pipeline.manifest_table`), which the driver keeps equal to the manifests.
Alone it starts a local Ray; under `ray job submit` (RAY_ADDRESS set) it joins the cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import IO, Any

import ray
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from jobs.cli import make_parser
from jobs.environment import init_ray
from pipeline import builder, models
from pipeline.calibrate import CalibrationConfig
from pipeline.config import BuildConfig
from pipeline.corpus import (DEFAULT_LIMITS, SKIP_REPORT, Conversation, CorpusError,
                             CorpusLimits, CorpusObject, CorpusStream, ReadStats,
                             add_corpus_options, limits_from_args, local_objects)
from pipeline.manifest import list_conversations
from pipeline.episodes import EpisodeConfig
from pipeline.compress import MergeConfig, TriStateConfig
from pipeline.manifest_table import IndexWriter
from pipeline.positions import POSITION_MODES
from pipeline.prefill import PrefillConfig
from pipeline.scorers import SCORERS, ScoringConfig
from pipeline.store import (S3Store, S3_ENDPOINT_ENV, Store, StoreError, open_store,
                            parse_s3_uri)

log = logging.getLogger("jobs.build")


# ---------------------------------------------------------------------------------------------
# The tasks
# ---------------------------------------------------------------------------------------------

def worker_stamp() -> dict:
    """Where a task ran and how many models its process has loaded so far."""
    node = ray.get_runtime_context().get_node_id()
    return {"node_id": node, "worker": f"{socket.gethostname()}:{os.getpid()}",
            "_loads": (node, os.getpid(), models.load_count())}


@ray.remote
def cluster_task(conv: Conversation, config: BuildConfig) -> tuple[int, builder.ClusterResult]:
    """(episode count, clustering); called with num_returns=2 so the driver fetches the count
    only and the episode tasks get the clustering by reference."""
    clustered = builder.cluster_conversation(conv, config)
    return len(clustered.episodes.episodes), clustered


@ray.remote
def budgets_task(store: Store, config: BuildConfig) -> tuple[list[int] | None, dict]:
    lm = models.load_llm(config.model)
    return builder.layer_budgets(store, config, lm.config.num_hidden_layers), worker_stamp()


# max_calls=0: the worker process is reused, so its model stays loaded (Ray's default for GPU
# tasks is one call per process, which would reload the model for every episode).
@ray.remote(max_calls=0)
def episode_task(clustered: builder.ClusterResult, episode: int, budgets: list[int] | None,
                 config: BuildConfig, store: Store) -> dict:
    return builder.build_episode(clustered, episode, budgets, config, store) | worker_stamp()


@dataclass(frozen=True)
class Stages:
    """The Ray remote functions the driver schedules, with the signatures of the tasks above;
    `jobs.bench_scale` swaps in synthetic ones to rehearse the scheduler without a model."""
    cluster: Any = cluster_task
    budgets: Any = budgets_task
    episode: Any = episode_task


MODEL_STAGES = Stages()


# ---------------------------------------------------------------------------------------------
# The corpus: a local path, or s3:// objects streamed through the store layer
# ---------------------------------------------------------------------------------------------

def corpus_objects(uri: str, endpoint_url: str | None = None) -> list[CorpusObject]:
    """The objects of a corpus: a local file or folder, `s3://bucket/key.jsonl` (one object)
    or `s3://bucket/folder` (the .jsonl/.json objects directly under it, in key order). Only
    the listing happens here; records are streamed from S3 (GetObject) as the build reads
    them, never copied to the driver's disk."""
    if not uri.startswith("s3://"):
        return local_objects(uri)
    bucket, key = parse_s3_uri(uri)
    if not key:
        raise CorpusError(f"{uri}: give an object (.jsonl/.json) or a folder inside the bucket")
    endpoint_url = endpoint_url or os.environ.get(S3_ENDPOINT_ENV) or None
    parent, _, name = key.rpartition("/")
    if name.endswith((".jsonl", ".json")):
        folder = S3Store(bucket, parent, endpoint_url=endpoint_url)
        size = folder.info(name).size  # a missing object fails here, in one line
        return [_s3_object(folder, name, size)]
    folder = S3Store(bucket, key, endpoint_url=endpoint_url)
    names = [k for k in folder.list() if "/" not in k and k.endswith((".jsonl", ".json"))]
    if not names:
        raise CorpusError(f"{uri}: no such object, and no .jsonl or .json objects under it")
    return [_s3_object(folder, n) for n in names]


def _s3_object(folder: S3Store, name: str, size: int | None = None) -> CorpusObject:
    return CorpusObject(name, lambda: folder.open(name),
                        (lambda: size) if size is not None else (lambda: folder.info(name).size))


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------

@dataclass
class Summary:
    built: int = 0
    skipped: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    episodes: int = 0
    tokens: int = 0
    bytes: int = 0
    loads: dict[tuple[str, int], int] = field(default_factory=dict)  # (node, pid) -> model loads
    bad_records: int = 0
    questions_dropped: int = 0  # bad questions dropped from kept conversations (skip mode)
    tasks: int = 0  # tasks submitted
    peak_in_flight: int = 0  # most tasks submitted and not yet collected at any time
    seconds: float = 0.0
    wait_seconds: float = 0.0  # of which the driver waited in ray.wait with nothing to do

    @property
    def nodes(self) -> set[str]:
        return {node for node, _ in self.loads}

    def line(self, seconds: float | None = None, store: str = "") -> str:
        seconds = self.seconds if seconds is None else seconds
        return (f"built {self.built} conversations ({self.episodes} episode caches, "
                f"{self.tokens:,} tokens, {self.bytes / 2**20:.1f} MiB) in {seconds:.1f}s; "
                f"skipped {self.skipped} up to date; failed {len(self.failed)}; "
                f"bad records skipped {self.bad_records}; questions dropped "
                f"{self.questions_dropped}; model loads {sum(self.loads.values())} "
                f"in {_n(len(self.loads), 'worker')} on {_n(len(self.nodes), 'node')}; "
                f"store {store}")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


class BuildError(RuntimeError):
    """A failure that stops the whole build (not one conversation)."""


@dataclass
class _Conversation:
    """What the driver holds for one conversation in flight (and only while in flight)."""
    clustered: Any = None  # ObjectRef of its ClusterResult, shared by its episode tasks
    outstanding: int = 0  # its tasks submitted or queued
    rows: list[dict] = field(default_factory=list)
    error: str | None = None


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
                 *, force: bool, max_in_flight: int, resources: dict, max_retries: int,
                 bar: tqdm, index: IndexWriter | None = None):
        self.corpus, self.conversations = corpus, iter(corpus)
        self.store, self.config, self.stages = store, config, stages
        self.force, self.max_in_flight, self.bar = force, max(1, max_in_flight), bar
        self.resources, self.max_retries = resources, max_retries
        self.index = index  # the manifest table: told before and after each commit
        self.summary = Summary()
        self.in_flight: dict[ray.ObjectRef, tuple[str, str, int]] = {}  # ref -> (kind, id, ep)
        self.pending: deque[tuple[str, int]] = deque()  # episodes waiting for a slot
        self.convs: dict[str, _Conversation] = {}
        self.more = True
        self.corpus_error: CorpusError | None = None
        self.budgets: list[int] | None = None
        self.built_before: set[str] = set()  # ids with a manifest when the build started
        self.committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="commit")
        self.commits: deque[Future] = deque()
        self.batch = max(1, self.max_in_flight // 4)
        self.start = self._postfix_at = time.perf_counter()

    def run(self) -> Summary:
        ref = self.stages.budgets.options(**self.resources).remote(self.store, self.config)
        try:
            self.budgets, stamp = ray.get(ref)
        except Exception as exc:  # nothing can be built without the budgets
            raise BuildError(f"layer budgets (model {self.config.model!r}): {_describe(exc)}") \
                from None
        self._loads(stamp["_loads"])
        log.info("layer budgets: %s", self.budgets)
        if not self.force:  # one listing instead of a manifest read per conversation
            self.built_before = set(list_conversations(self.store))
        self.episode_fn = self.stages.episode.options(**self.resources)
        self.cluster_fn = self.stages.cluster.options(num_cpus=1, max_retries=self.max_retries,
                                                      num_returns=2)
        self.config_ref, self.store_ref = ray.put(self.config), ray.put(self.store)
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

    def submit(self, ref: ray.ObjectRef, kind: str, cid: str, episode: int = -1) -> None:
        self.in_flight[ref] = (kind, cid, episode)
        self.summary.tasks += 1
        self.summary.peak_in_flight = max(self.summary.peak_in_flight, len(self.in_flight))

    def fill(self) -> None:
        """Submit queued episodes first (they finish conversations), then new conversations."""
        while len(self.in_flight) < self.max_in_flight:
            if self.pending:
                cid, e = self.pending.popleft()
                conv = self.convs[cid]
                if conv.error is not None:  # a sibling failed: do not spend work on it
                    conv.outstanding -= 1
                    self.finish(cid)
                    continue
                self.submit(self.episode_fn.remote(conv.clustered, e, self.budgets_ref,
                                                   self.config_ref, self.store_ref),
                            "episode", cid, e)
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
            if cid in self.built_before and builder.is_built(self.store, cid, self.config):
                self.summary.skipped += 1
                self.bar.update(1)
                continue
            count_ref, clustered_ref = self.cluster_fn.remote(conv, self.config_ref)
            self.convs[cid] = _Conversation(clustered=clustered_ref, outstanding=1)
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
        kind, cid, e = self.in_flight.pop(ref)
        conv = self.convs[cid]
        conv.outstanding -= 1
        if isinstance(result, Exception):
            what = "clustering" if kind == "cluster" else f"episode {e}"
            conv.error = conv.error or f"{what}: {_describe(result)}"
            log.error("conversation %s: %s", cid, conv.error)
            result = None
        if kind == "cluster" and result is not None:
            if result == 0:
                conv.error = "clustering produced no episodes"
            conv.outstanding += result
            self.pending.extend((cid, i) for i in range(result))
        elif kind == "episode" and result is not None:
            self._loads(result.pop("_loads"))
            conv.rows.append(result)
            s = self.summary
            s.episodes += 1
            s.tokens += result["tokens"]
            s.bytes += result["object_bytes"]
            log.debug("built %s episode %d on node %s by %s: %d tokens in %.1fs", cid, e,
                      result["node_id"][:12], result["worker"], result["tokens"],
                      result["build_seconds"])
            self._postfix()
        self.finish(cid)

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
                builder.commit_manifest(self.store, cid, conv.rows)
                self.summary.built += 1
                log.info("committed %s: %d episodes", cid, len(conv.rows))
            except Exception as exc:  # a commit that fails marks the conversation failed
                conv.error = f"manifest commit: {type(exc).__name__}: {exc}"
            else:
                if self.index is not None:
                    self.index.add(cid, conv.rows)
        if conv.error is not None:
            self.summary.failed[cid] = conv.error
            log.error("conversation %s failed: %s", cid, conv.error)
        self.bar.update(1)
        self._postfix()

    def _loads(self, stamp: tuple[str, int, int]) -> None:
        node, pid, loads = stamp
        self.summary.loads[(node, pid)] = max(loads, self.summary.loads.get((node, pid), 0))

    def _postfix(self) -> None:
        now = time.perf_counter()
        if self.bar.disable or now - self._postfix_at < self.POSTFIX_S:
            return
        self._postfix_at, s = now, self.summary
        rate = s.tokens / max(now - self.start, 1e-9)
        self.bar.set_postfix_str(f"episodes={s.episodes} tok/s={rate:,.0f} "
                                 f"failed={len(s.failed)} objects={self.corpus.objects_started}/"
                                 f"{len(self.corpus.objects)}", refresh=False)


def run_build(corpus: str | CorpusStream, store: str | Store, config: BuildConfig, *,
              force: bool = False, on_bad_record: str = "fail", max_in_flight: int = 16,
              num_cpus: float = 1, num_gpus: float = 0, max_retries: int = 2,
              progress: bool = True, stages: Stages = MODEL_STAGES,
              limits: CorpusLimits = DEFAULT_LIMITS, index_flush_rows: int = 10_000) -> Summary:
    """Drive the whole build on the connected Ray; returns the summary (the caller decides the
    exit code). `corpus` is a local path or an s3:// URI (read with `on_bad_record` and
    `limits`), or a `CorpusStream` `main` has already opened and primed; `store` a Store or
    its URI. The corpus is streamed object by object, each object checked before its
    conversations are scheduled; a bad record (fail mode) raises `CorpusError` and stops the
    build (conversations already committed are kept). Committed rows go to the store's
    manifest table every `index_flush_rows` rows (or minute) and at the end."""
    store = open_store(store) if isinstance(store, str) else store
    if isinstance(corpus, str):
        endpoint = store.endpoint_url if isinstance(store, S3Store) else None
        corpus = CorpusStream(corpus_objects(corpus, endpoint), on_bad_record, ReadStats(),
                              limits, where=corpus)
    resources = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_retries": max_retries}
    # log lines go above the bar, not through it; no total: counting an S3 corpus's records
    # would mean reading it all first (the postfix says how many of its objects are started)
    redirect = logging_redirect_tqdm() if progress else contextlib.nullcontext()
    with IndexWriter(store, index_flush_rows) as index, redirect, tqdm(
            unit="conv", desc="build", disable=not progress, dynamic_ncols=True,
            file=sys.stderr) as bar:
        summary = _Driver(corpus, store, config, stages, force=force,
                          max_in_flight=max_in_flight, resources=resources,
                          max_retries=max_retries, bar=bar, index=index).run()
    stats = corpus.stats
    summary.bad_records, summary.questions_dropped = stats.records_skipped, stats.questions_dropped
    return summary


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.build", __doc__)
    p.add_argument("--corpus", required=True,
                   help="JSONL file, LoCoMo .json, or a folder of them; local or s3://bucket/key")
    p.add_argument("--store", required=True, help="store folder (or file://), or s3://bucket/prefix")
    p.add_argument("--s3-endpoint", default=None,
                   help=f"S3-compatible endpoint URL (default: ${S3_ENDPOINT_ENV}, else AWS)")
    p.add_argument("--s3-region", default=None, help="S3 region (default: the AWS chain)")
    p.add_argument("--model", default=models.DEFAULT_LLM,
                   help="LLM: packaged name or local HF folder")
    p.add_argument("--encoder", default=models.DEFAULT_ENCODER, help="sentence encoder")
    p.add_argument("--scorer", default="epicache", choices=sorted(set(SCORERS) - {"question"}),
                   metavar="SCORER",
                   help="how entries are scored for eviction, one of %(choices)s (the README's "
                        "'Scorers'); epicache builds one cache per episode, the others one per "
                        "conversation")
    p.add_argument("--budget", type=int, default=1024,
                   help="mean entries kept per layer and KV head (--tristate: the bytes of that "
                        "many Original entries)")
    p.add_argument("--full", action="store_true", help="no eviction: store the full cache")
    p.add_argument("--block", type=int, default=512, help="block-prefill block size (tokens)")
    p.add_argument("--selection", default="headwise", choices=["headwise", "perhead"],
                   help="top-k across a layer's heads (AdaKV) or per head")
    p.add_argument("--alpha", type=float, default=BuildConfig.alpha,
                   help="sensitivity-aware layer allocation sharpness (0: uniform budgets)")
    scoring = ScoringConfig()
    p.add_argument("--paper", action="store_true",
                   help="EpiCache scored as the paper describes it (max patch attention, token by "
                        "token, whole patch); add --alpha 1 for its layer budgets")
    p.add_argument("--focus", type=float, default=scoring.focus,
                   help="weight the episode's own turns' scores by 1 + FOCUS (0: off)")
    p.add_argument("--patch-tokens", type=int, default=scoring.patch_tokens or 0,
                   help="cap on the patched prompt's tokens (0: the whole medoid text)")
    p.add_argument("--episodes", type=int, default=4,
                   help="episodes (K-Means clusters) per conversation")
    p.add_argument("--medoids", type=int, default=4, help="medoid windows in an episode's patch")
    p.add_argument("--window", type=int, default=4, help="utterances per clustering window")
    p.add_argument("--seed", type=int, default=0, help="K-Means seed")
    p.add_argument("--max-context-tokens", type=int, default=None,
                   help="cut each conversation at a session boundary to fit this many tokens "
                        "(default: whole)")
    p.add_argument("--positions", default="original", choices=list(POSITION_MODES),
                   help="original: entries keep their token positions, so a conversation must "
                        "fit the model's positions; compact: kept entries are re-rotated to "
                        "positions 0, 1, 2, ... after every eviction, for histories of any length")
    p.add_argument("--store-dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                   help="dtype of the stored keys and values")
    p.add_argument("--calibration-tokens", type=int, default=4096,
                   help="calibration text length (layer profiles, with --alpha > 0 or "
                        "--allocator variance)")
    p.add_argument("--calibration-window", type=int, default=1024,
                   help="calibration: the simulated budget (sink + recent tokens)")
    add_corpus_options(p)
    t = TriStateConfig()
    p.add_argument("--tristate", action="store_true",
                   help="ARKV tri-state compression: --budget M = the bytes of M Original tokens "
                        "per layer and KV head; entries Original, Quantized (int8) or Evicted")
    p.add_argument("--fp8", action="store_true", help="tri-state: fp8 e4m3 codes instead of int8")
    p.add_argument("--tri-window", type=int, default=t.window, help="tri-state protected window")
    p.add_argument("--tri-gamma", type=float, default=t.gamma, help="heavy-hitter gamma")
    p.add_argument("--tri-original-scale", type=float, default=t.original_scale,
                   help="scales the OQ ratio (share of a layer's bytes spent on Original entries)")
    p.add_argument("--tri-slack", type=float, default=t.slack, help="tri-state slack factor")
    p.add_argument("--dapq", action="store_true",
                   help="DapQ: patch queries at the decode positions (after the conversation)")
    p.add_argument("--merge", action="store_true", help="D2O: merge evicted entries into kept ones")
    p.add_argument("--merge-beta", type=float, default=MergeConfig().beta, help="D2O EMA beta")
    p.add_argument("--allocator", default="sensitivity", choices=["sensitivity", "variance"],
                   help="layer budgets: EpiCache sensitivity or D2O attention variance")
    p.add_argument("--variance-temperature", type=float, default=1.0,
                   help="D2O inverse-variance softmax temperature (--allocator variance)")
    p.add_argument("--force", action="store_true", help="rebuild conversations already built")
    p.add_argument("--max-in-flight", type=int, default=16, help="tasks submitted at most")
    p.add_argument("--cpus-per-task", type=float, default=1, help="Ray CPUs per task")
    p.add_argument("--gpus-per-task", type=float, default=None,
                   help="Ray GPUs per task (default: 1 when the cluster has GPUs now, else 0; "
                        "give 1 on an autoscaling cluster whose GPU workers start at zero)")
    p.add_argument("--max-retries", type=int, default=2, help="Ray retries per task on worker death")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS, set by `ray job submit`; "
                        "else a local Ray is started)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="the driver's log level")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (e.g. in a job's log)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def config_from_args(a: argparse.Namespace) -> BuildConfig:
    return BuildConfig(
        model=a.model, encoder=a.encoder, scorer=a.scorer,
        budget=None if a.full else a.budget, alpha=a.alpha, store_dtype=a.store_dtype,
        allocator=a.allocator, variance_temperature=a.variance_temperature,
        max_context_tokens=a.max_context_tokens,
        episodes=EpisodeConfig(window=a.window, episodes=a.episodes, medoids=a.medoids, seed=a.seed),
        scoring=ScoringConfig.paper() if a.paper else replace(
            ScoringConfig(), focus=a.focus, patch_tokens=a.patch_tokens or None),
        prefill=PrefillConfig(
            block=a.block, selection=a.selection, decode_positions=a.dapq, positions=a.positions,
            tristate=TriStateConfig(enabled=a.tristate or a.fp8, fp8=a.fp8, window=a.tri_window,
                                    gamma=a.tri_gamma, original_scale=a.tri_original_scale,
                                    slack=a.tri_slack) if (a.tristate or a.fp8) else TriStateConfig(),
            merge=MergeConfig(enabled=True, beta=a.merge_beta) if a.merge else MergeConfig()),
        calibration=CalibrationConfig(tokens=a.calibration_tokens, window=a.calibration_window,
                                      sink=min(128, a.calibration_window // 4)))


def skip_report_key() -> str:
    """A folder of its own per run (`reports/<UTC time>-<pid>/skipped.jsonl`): a re-run never
    overwrites an earlier report, and manifests/ holds manifests only."""
    return f"reports/{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}/{SKIP_REPORT}"


def put_skip_report(store: Store, report: IO[str], key: str | None = None) -> str | None:
    """Upload the run's skip report (spooled as the corpus is read) to the store under `key`
    (default: a new `skip_report_key()`); None when nothing was skipped."""
    if report.tell() == 0:
        return None
    report.seek(0)
    key = key or skip_report_key()
    store.put(key, report.read().encode("utf-8"))
    report.seek(0, os.SEEK_END)
    return key


def print_skips(stats: ReadStats, shown: int, out: IO[str]) -> int:
    """Print the skips held in `stats` from the `shown`-th on, and how many more are only in
    the report; returns how many are printed so far (the next call's `shown`)."""
    for s in stats.skipped[shown:]:
        print(s.line(), file=out)
    shown = max(shown, len(stats.skipped))
    if stats.total_skipped > shown:
        print(f"... and {stats.total_skipped - shown:,} more (all in {SKIP_REPORT})", file=out)
    return shown


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(a.log_level)
    start = time.perf_counter()
    try:
        config = config_from_args(a)
        limits = limits_from_args(a)
        if a.max_in_flight < 1 or a.max_retries < 0:
            raise ValueError("--max-in-flight must be at least 1 and --max-retries at least 0")
        with tempfile.TemporaryFile("w+", encoding="utf-8") as report:
            def to_report(skip) -> None:
                report.write(json.dumps(skip.as_dict()) + "\n")

            stats = ReadStats(keep=20, sink=to_report)
            corpus = CorpusStream(corpus_objects(a.corpus, a.s3_endpoint), a.on_bad_record,
                                  stats, limits, where=a.corpus)
            # The corpus is read up to its first conversation (its first object is checked
            # whole) before the store is opened (a local one would be created) and before Ray
            # and the model start: a bad or empty corpus fails in seconds and writes nothing.
            # Later objects are checked each before its own conversations are scheduled.
            corpus.prime()
            shown = print_skips(stats, 0, sys.stderr)
            store = open_store(a.store, endpoint_url=a.s3_endpoint, region=a.s3_region)
            key = skip_report_key()
            if put_skip_report(store, report, key) is not None:
                print(f"skip report: {store.uri}/{key}", file=sys.stderr)
            init_ray(a.ray_address)
            gpus = a.gpus_per_task if a.gpus_per_task is not None else \
                (1 if ray.cluster_resources().get("GPU", 0) > 0 else 0)
            reported = stats.total_skipped
            try:
                summary = run_build(corpus, store, config, force=a.force,
                                    max_in_flight=a.max_in_flight, num_cpus=a.cpus_per_task,
                                    num_gpus=gpus, max_retries=a.max_retries,
                                    progress=not a.no_progress)
            finally:  # skips met in later objects: the report is rewritten whole
                if stats.total_skipped > reported:
                    print_skips(stats, shown, sys.stderr)
                    put_skip_report(store, report, key)
                    print(f"skip report: {store.uri}/{key}", file=sys.stderr)
    except (ValueError, CorpusError, StoreError, models.ModelNotFoundError, BuildError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):  # stop the tasks (and a local Ray) before the line
            ray.shutdown()
        print("interrupted: committed conversations are kept; run the same command again to "
              "build the rest", file=sys.stderr)
        return 130
    print(summary.line(time.perf_counter() - start, store.uri))
    for cid, err in summary.failed.items():
        print(f"failed {cid}: {err}", file=sys.stderr)
    return 1 if summary.failed else 0


if __name__ == "__main__":
    # Run through the importable module, so Ray ships the tasks by reference, not by value.
    from jobs.build import main as _main

    raise SystemExit(_main())
