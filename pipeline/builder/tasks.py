"""The build's stages as Ray tasks, and the `Stages` the driver schedules.

Models are loaded once per worker process (`pipeline.kv.models` caches them), so a worker that
builds many episodes loads its model once.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, replace
from typing import Any

import ray

from pipeline.builder.append import prefill_episodes
from pipeline.builder.growth import AppendPlan, Recluster
from pipeline.builder.plan import (
    Plan,
    kept_records,
    plan_conversation,
    prefilled_episodes,
    task_groups,
)
from pipeline.builder.profile import build_basis
from pipeline.builder.repair import Damage, RepairPlan
from pipeline.config import BuildConfig, GrowthConfig, ModelFingerprints
from pipeline.corpus.schema import Conversation
from pipeline.kv import models
from pipeline.store.backends.base import Store
from pipeline.store.catalogue.manifest import ManifestRecord


@dataclass(frozen=True)
class WorkerStamp:
    """Where a task ran (the Ray node, host:pid) and how many models it loaded (`loads`: the
    process's loads since `before`, taken as the task started). A worker should load each model
    once over a build; counting per task keeps the loads of earlier jobs on a reused worker
    (another build, a test before) out of this build's count."""
    node_id: str
    worker: str
    pid: int
    loads: int

    @classmethod
    def here(cls, before: int) -> "WorkerStamp":
        return cls(ray.get_runtime_context().get_node_id(),
                   f"{socket.gethostname()}:{os.getpid()}", os.getpid(),
                   models.load_count() - before)

    def on(self, record: ManifestRecord) -> ManifestRecord:
        """The record as built here: its node and worker set."""
        return replace(record, node_id=self.node_id, worker=self.worker)


@dataclass(frozen=True)
class Planned:
    """What the driver learns of stage 1 (the plan itself goes to the episode tasks by
    reference): how many episodes the conversation has, which of them get a task, and whether
    they append, repair or build."""
    episodes: int
    tasks: tuple[tuple[int, ...], ...]  # the episodes of each task (`task_groups`)
    appended: bool = False
    reclustered: Recluster | None = None  # why a grown or damaged conversation is rebuilt
    new_tokens: int = 0  # appended: the tokens after those the caches had seen
    repaired: tuple[int, ...] | None = None  # a repair: the episodes rebuilt
    kept: tuple[ManifestRecord, ...] = ()  # a repair: the records of the others, committed again

    @classmethod
    def of(cls, planned: Plan, config: BuildConfig) -> Planned:
        """What the driver needs of a plan: its episodes split as the in-process build splits
        them (`task_groups`, `kept_records`)."""
        tasks, kept = task_groups(planned, config), kept_records(planned)
        if isinstance(planned, AppendPlan):
            return cls(planned.n_episodes, tasks, appended=True, new_tokens=planned.new_tokens)
        if isinstance(planned, RepairPlan):
            return cls(planned.n_episodes, tasks, repaired=prefilled_episodes(planned), kept=kept)
        return cls(planned.n_episodes, tasks, reclustered=planned.reclustered)


@ray.remote
def cluster_task(conv: Conversation, config: BuildConfig,
                 previous: list[ManifestRecord] | None, growth: GrowthConfig, store: Store,
                 damage: Damage | None = None) -> tuple[Planned, Plan]:
    """(what the driver needs, the clustering or the append's or repair's plan, the
    conversation's turn index stored); called with num_returns=2 so the driver fetches the
    first only and the episode tasks get the second by reference. `previous`: the stored
    version of a conversation that grew, or whose objects are damaged (`damage`)."""
    planned = plan_conversation(conv, config, previous, growth, store, damage)
    return Planned.of(planned, config), planned


@ray.remote
def budgets_task(store: Store, config: BuildConfig
                 ) -> tuple[list[int] | None, ModelFingerprints, WorkerStamp]:
    """Stage 2 (`build_basis`): the layer budgets, and the fingerprints of the model files the
    build runs with."""
    before = models.load_count()
    budgets, files = build_basis(store, config)
    return budgets, files, WorkerStamp.here(before)


# max_calls=0: the worker process is reused, so its model stays loaded (Ray's default for GPU
# tasks is one call per process, which would reload the model for every episode).
@ray.remote(max_calls=0)
def episode_task(planned: Plan, episodes: tuple[int, ...], budgets: list[int] | None,
                 config: BuildConfig, store: Store) -> tuple[list[ManifestRecord], WorkerStamp]:
    """Stage 3 (`prefill_episodes`): a task's episodes (one, or a conversation's all when
    they are built in one pass) built, appended to or repaired, and stored."""
    before = models.load_count()
    records = prefill_episodes(planned, episodes, budgets, config, store)
    stamp = WorkerStamp.here(before)  # after the build: its model load counted
    return [stamp.on(record) for record in records], stamp


@dataclass(frozen=True)
class Stages:
    """The Ray remote functions the driver schedules, with the signatures of the tasks above;
    `jobs.bench.scale` swaps in synthetic ones to rehearse the scheduler without a model."""
    cluster: Any = cluster_task
    budgets: Any = budgets_task
    episode: Any = episode_task


MODEL_STAGES = Stages()
