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

from pipeline.build.cluster import ClusterResult, cluster_conversation
from pipeline.build.config import BuildConfig, ModelFingerprints
from pipeline.build.episode import build_episode
from pipeline.build.profile import layer_budgets
from pipeline.corpus.schema import Conversation
from pipeline.kv import models
from pipeline.store.base import Store
from pipeline.store.manifest import ManifestRecord


@dataclass(frozen=True)
class WorkerStamp:
    """Where a task ran (the Ray node, host:pid) and how many models its process has loaded so
    far (a worker should load each model once)."""
    node_id: str
    worker: str
    pid: int
    loads: int

    @classmethod
    def here(cls) -> "WorkerStamp":
        return cls(ray.get_runtime_context().get_node_id(),
                   f"{socket.gethostname()}:{os.getpid()}", os.getpid(), models.load_count())

    def on(self, record: ManifestRecord) -> ManifestRecord:
        """The record as built here: its node and worker set."""
        return replace(record, node_id=self.node_id, worker=self.worker)


@ray.remote
def cluster_task(conv: Conversation, config: BuildConfig) -> tuple[int, ClusterResult]:
    """(episode count, clustering); called with num_returns=2 so the driver fetches the count
    only and the episode tasks get the clustering by reference."""
    clustered = cluster_conversation(conv, config)
    return len(clustered.episodes.episodes), clustered


@ray.remote
def budgets_task(store: Store, config: BuildConfig
                 ) -> tuple[list[int] | None, ModelFingerprints, WorkerStamp]:
    """The layer budgets, and the fingerprints of the model files the build runs with."""
    lm = models.load_llm(config.model)
    files = ModelFingerprints(lm.fingerprint, models.encoder_fingerprint(config.encoder))
    return layer_budgets(store, config, lm.config.num_hidden_layers), files, WorkerStamp.here()


# max_calls=0: the worker process is reused, so its model stays loaded (Ray's default for GPU
# tasks is one call per process, which would reload the model for every episode).
@ray.remote(max_calls=0)
def episode_task(clustered: ClusterResult, episode: int, budgets: list[int] | None,
                 config: BuildConfig, store: Store) -> tuple[ManifestRecord, WorkerStamp]:
    record = build_episode(clustered, episode, budgets, config, store)
    stamp = WorkerStamp.here()  # after the build: its model load counted
    return stamp.on(record), stamp


@dataclass(frozen=True)
class Stages:
    """The Ray remote functions the driver schedules, with the signatures of the tasks above;
    `jobs.bench.scale` swaps in synthetic ones to rehearse the scheduler without a model."""
    cluster: Any = cluster_task
    budgets: Any = budgets_task
    episode: Any = episode_task


MODEL_STAGES = Stages()
