"""The scale rehearsal's stand-ins: synthetic stages, corpora and caches, with no model.

The driver, Ray, the store and the manifests are real; clustering picks fixed episodes and each
episode task writes a tiny random cache in the real safetensors format. `jobs.bench.scale`
measures the machinery with them, and the tests rehearse failures with them (a record may ask
for `"rehearse_failure": "raise"` or `"crash"`).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import json
import os
import socket
import time
import zlib
from pathlib import Path

import numpy as np
import ray
import torch
from safetensors.torch import save as st_save

from pipeline.builder.cluster import ClusterResult
from pipeline.builder.growth import AppendPlan
from pipeline.builder.repair import Damage, RepairPlan
from pipeline.builder.tasks import Planned, Stages, WorkerStamp
from pipeline.config import BuildConfig, GrowthConfig, ModelFingerprints
from pipeline.corpus.schema import Conversation
from pipeline.episodes import Episode, EpisodeConfig, EpisodeSet
from pipeline.kv import models
from pipeline.store.backends.base import Store, cache_key
from pipeline.store.backends.s3 import S3Store
from pipeline.store.catalogue.manifest import ManifestRecord
from pipeline.store.objects import cache_format

LAYERS, KV_HEADS, HEAD_DIM, DIM = 2, 2, 8, 8
SYNTHETIC_FILES = ModelFingerprints("synthetic-model", "synthetic-encoder")  # no files to read


def _seed(*parts) -> int:
    """A seed that is the same in every process (str hashes are salted per process)."""
    return zlib.crc32("/".join(map(str, parts)).encode())


def _rng(*parts) -> np.random.Generator:
    return np.random.default_rng(_seed(*parts))


def synthetic_cluster(conv: Conversation, config: BuildConfig) -> ClusterResult:
    """`config.episodes.episodes` episodes with random unit centroids (no encoder)."""
    rng = _rng(conv.conversation_id, "cluster")
    episodes = []
    for i in range(config.episodes.episodes):
        centroid = rng.standard_normal(DIM).astype(np.float32)
        episodes.append(Episode(index=i, centroid=centroid / np.linalg.norm(centroid),
                                windows=(i,), medoid_windows=(i,), medoid_turn_ids=(),
                                patch_text=f"synthetic episode {i}"))
    members = tuple(() for _ in episodes)
    return ClusterResult(conv, EpisodeSet(tuple(episodes), config.episodes.episodes,
                                          config.episodes.episodes), 0.0,
                         SYNTHETIC_FILES.encoder, members,
                         dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))


def synthetic_plan(conv: Conversation, config: BuildConfig, previous: list[ManifestRecord] | None,
                   growth: GrowthConfig, damage: Damage | None = None
                   ) -> ClusterResult | AppendPlan | RepairPlan:
    """A damaged conversation's repair, a grown conversation's append (its new turns count as
    its new tokens), else `synthetic_cluster`."""
    if previous and damage is not None:
        previous = sorted(previous, key=lambda r: r.episode)
        return RepairPlan(conv, tuple(previous), damage.episodes, previous[0].turn_index)
    if not previous or not growth.append:
        return synthetic_cluster(conv, config)
    previous = sorted(previous, key=lambda r: r.episode)
    return AppendPlan(conversation=conv, previous=tuple(previous),
                      new_tokens=len(conv.turns) - previous[0].tokens,
                      centroids=tuple(tuple(r.centroid) for r in previous),
                      n_windows=tuple(r.n_windows for r in previous),
                      new_members=tuple(() for _ in previous),
                      encoder_fingerprint=SYNTHETIC_FILES.encoder)


def synthetic_cache(conversation_id: str, episode: int, entries: int, config: BuildConfig,
                    turns: int = 0) -> bytes:
    """A tiny random cache in the real format (`pipeline.store.objects.cache_format` reads it back);
    each length of the conversation (`turns`) gets other content."""
    gen = torch.Generator().manual_seed(_seed(conversation_id, episode, turns))
    tensors = {}
    for i in range(LAYERS):
        n = entries * KV_HEADS
        tensors[f"layers.{i}.keys"] = torch.randn(n, HEAD_DIM, generator=gen).half()
        tensors[f"layers.{i}.values"] = torch.randn(n, HEAD_DIM, generator=gen).half()
        tensors[f"layers.{i}.lengths"] = torch.full((KV_HEADS,), entries, dtype=torch.int32)
        tensors[f"layers.{i}.positions"] = torch.arange(entries).repeat(KV_HEADS)
    header = {"format": cache_format.FORMAT, "model_id": config.model, "config_hash": config.hash,
              "model_fingerprint": SYNTHETIC_FILES.model,
              "encoder_fingerprint": SYNTHETIC_FILES.encoder, "conversation_id": conversation_id,
              "episode": episode, "tokens_seen": entries,
              "num_layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "float16"}
    return st_save(tensors, metadata={"header": json.dumps(header)})


def synthetic_episode(clustered: ClusterResult | AppendPlan | RepairPlan, episode: int,
                      budgets: list[int] | None, config: BuildConfig,
                      store: Store) -> ManifestRecord:
    """Write one tiny cache and return its manifest record, like `build_episode` (or, for an
    append or a repair, like `append_episode` or `repair_episodes`: a new object, the stored
    record brought up to date)."""
    start = time.perf_counter()
    conv = clustered.conversation
    failure = conv.meta.get("rehearse_failure")
    if failure == "crash":  # the worker process dies: Ray retries, then gives up
        os._exit(1)
    if failure == "raise" and episode == clustered.n_episodes - 1:
        raise RuntimeError(f"rehearsed failure of {conv.conversation_id} episode {episode}")
    entries = min(budgets or [16])
    data = synthetic_cache(conv.conversation_id, episode, entries, config, len(conv.turns))
    checksum = cache_format.sha256(data)
    key = cache_key(conv.conversation_id, SYNTHETIC_FILES.bound_hash(config.hash), episode,
                    checksum)
    store.put(key, data)
    if isinstance(clustered, RepairPlan):  # the same bytes as built: the damaged key, mended
        return dataclasses.replace(clustered.previous[episode], object_key=key, sha256=checksum,
                                   object_bytes=len(data),
                                   build_seconds=time.perf_counter() - start)
    if isinstance(clustered, AppendPlan):
        before = clustered.previous[episode]
        return dataclasses.replace(
            before, object_key=key, sha256=checksum, object_bytes=len(data),
            tokens=len(conv.turns), cache_turns=len(conv.turns),
            appends=(before.appends or 0) + 1, build_seconds=time.perf_counter() - start)
    ep = clustered.episodes.episodes[episode]
    return ManifestRecord(
        conversation_id=conv.conversation_id, episode=episode,
        episodes_requested=clustered.episodes.requested,
        episodes_built=len(clustered.episodes.episodes), episode_note="",
        object_key=key, sha256=checksum, object_bytes=len(data),
        kv_bytes=2 * LAYERS * KV_HEADS * entries * HEAD_DIM * 2,
        centroid=ep.centroid.tolist(), medoid_text=ep.patch_text, medoid_turn_ids=[],
        n_windows=1, layer_budgets=budgets, entries_per_layer=[float(entries)] * LAYERS,
        peak_entries_per_layer=[float(entries)] * LAYERS, tokens=len(conv.turns),
        scorer=config.scorer, model_id=config.model, encoder_id=config.encoder,
        model_fingerprint=SYNTHETIC_FILES.model, encoder_fingerprint=SYNTHETIC_FILES.encoder,
        config_hash=config.hash, config_json=config.to_json(), cluster_seconds=0.0,
        build_seconds=time.perf_counter() - start, cache_turns=len(conv.turns),
        member_turn_ids=[], clustered_turns=len(conv.turns), clustered_at=clustered.clustered_at,
        appends=0, worker=f"{socket.gethostname()}:{os.getpid()}",
        built_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    )


@ray.remote
def synthetic_cluster_task(conv: Conversation, config: BuildConfig,
                           previous: list[ManifestRecord] | None, growth: GrowthConfig,
                           store: Store, damage: Damage | None = None
                           ) -> tuple[Planned, ClusterResult | AppendPlan | RepairPlan]:
    planned = synthetic_plan(conv, config, previous, growth, damage)  # no turn index: no encoder
    return Planned.of(planned, config), planned


@ray.remote
def synthetic_budgets_task(store: Store, config: BuildConfig
                           ) -> tuple[list[int] | None, ModelFingerprints, WorkerStamp]:
    return [config.budget or 16] * LAYERS, SYNTHETIC_FILES, WorkerStamp.here(models.load_count())


@ray.remote(max_calls=0)
def synthetic_episode_task(clustered: ClusterResult | AppendPlan, episodes: tuple[int, ...],
                           budgets: list[int] | None,
                           config: BuildConfig,
                           store: Store) -> tuple[list[ManifestRecord], WorkerStamp]:
    before = models.load_count()  # none: the synthetic build loads no model
    records = [synthetic_episode(clustered, e, budgets, config, store) for e in episodes]
    stamp = WorkerStamp.here(before)
    return [stamp.on(record) for record in records], stamp


SYNTHETIC_STAGES = Stages(cluster=synthetic_cluster_task, budgets=synthetic_budgets_task,
                          episode=synthetic_episode_task)
SYNTHETIC_CONFIG = BuildConfig(model="synthetic", encoder="synthetic", budget=16,
                               episodes=EpisodeConfig(episodes=2))


def synthetic_lines(start: int, stop: int, fail_every: int = 0,
                    failures: dict[int, str] | None = None) -> str:
    """JSONL of tiny conversations `start`..`stop`-1 (two turns each); every `fail_every`-th
    asks for a raised failure, and `failures` maps record indices to "raise" or "crash"."""
    failures = dict(failures or {})
    lines = []
    for i in range(start, stop):
        rec = {"conversation_id": f"bench-{i:07d}", "speakers": ["Ann", "Bob"],
               "turns": [{"turn_id": "1", "speaker": "Ann", "text": f"hello {i}",
                          "session": 1, "timestamp": "1 May 2024"},
                         {"turn_id": "2", "speaker": "Bob", "text": "hi", "session": 1,
                          "timestamp": "1 May 2024"}]}
        if i in failures:
            rec["rehearse_failure"] = failures[i]
        elif fail_every and (i + 1) % fail_every == 0:
            rec["rehearse_failure"] = "raise"
        lines.append(json.dumps(rec) + "\n")
    return "".join(lines)


def write_synthetic_corpus(path: Path, n: int, fail_every: int = 0,
                           failures: dict[int, str] | None = None) -> None:
    """n tiny conversations in one JSONL file (see `synthetic_lines`)."""
    path.write_text(synthetic_lines(0, n, fail_every, failures))


def put_synthetic_corpus(folder: Store, n: int, per_object: int = 1000) -> int:
    """n tiny conversations as JSONL objects of `per_object` each (part-00000.jsonl, ...),
    the layout a large corpus should have; returns the bytes written."""
    written = 0
    for part, start in enumerate(range(0, n, per_object)):
        data = synthetic_lines(start, min(n, start + per_object)).encode()
        folder.put(f"part-{part:05d}.jsonl", data)
        written += len(data)
    return written


class S3Requests:
    """Counts the S3 requests a store's client makes, by operation and by what the key is
    (caches/, manifests/, ...), through botocore's event hooks: nothing is stubbed."""

    def __init__(self, store: S3Store):
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        store.client.meta.events.register("before-parameter-build.s3", self._count)

    def _count(self, event_name: str, params: dict, **_) -> None:
        parts = params.get("Key", "").split("/")
        folder = next((f for f in ("caches", "manifests", "profiles", "reports") if f in parts), "")
        self.counts[event_name.rsplit(".", 1)[-1], folder] += 1

    def __call__(self, operation: str, folder: str) -> int:
        return self.counts[operation, folder]
