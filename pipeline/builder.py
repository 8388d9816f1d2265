"""The build of one conversation, stage by stage, as plain functions a Ray task can call.

cluster_conversation -> (calibration profile -> layer budgets) -> build_episode per episode ->
commit_manifest. Models are loaded once per process (`pipeline.models` caches them), so a
worker that builds many episodes loads its model once.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass

import numpy as np
import torch

from pipeline import cache_io, models, prompts
from pipeline.config import BuildConfig
from pipeline.corpus import Conversation, cut_at_session, render_conversation
from pipeline.episodes import Episode, EpisodeConfig, EpisodeSet, build_episodes, member_turn_ids
from pipeline.layout import token_layout
from pipeline.manifest import ManifestError, read_manifest, write_manifest
from pipeline.positions import check_fits
from pipeline.prefill import block_prefill
from pipeline.scorers import EpiCacheScorer, Scorer, build_scorer, episodic_scorer
from pipeline.store import ObjectNotFound, Store, cache_key, profile_key

log = logging.getLogger(__name__)


def is_episodic(config: BuildConfig) -> bool:
    return config.scorer == EpiCacheScorer.name


# ---------------------------------------------------------------------------------------------
# Stage 1: episodes
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ClusterResult:
    conversation: Conversation  # as built: cut to `max_context_tokens` when that is set
    episodes: EpisodeSet
    seconds: float


def fit_context(conv: Conversation, config: BuildConfig) -> Conversation:
    """The conversation as built: cut at a session boundary to `max_context_tokens` when set;
    refused (`ContextTooLongError`) when it does not fit the model's positions, unless the
    cache keeps compact positions."""
    tokenizer = models.load_tokenizer(config.model)
    count = lambda text: len(prompts.context_ids(tokenizer, text))  # noqa: E731
    if config.max_context_tokens is not None:
        conv = cut_at_session(conv, config.max_context_tokens, count)
    limit = models.max_positions(config.model)
    if config.prefill.positions == "original" and limit is not None:
        check_fits(conv.conversation_id, count(render_conversation(conv).text), limit)
    return conv


def cluster_conversation(conv: Conversation, config: BuildConfig, fit: bool = True) -> ClusterResult:
    """Episodes of the conversation as built (`fit_context`; `fit=False` keeps it whole, for
    benchmarks that time lengths past the model's positions on purpose)."""
    start = time.perf_counter()
    conv = fit_context(conv, config) if fit else conv
    episode_config = config.episodes if is_episodic(config) else EpisodeConfig(
        window=config.episodes.window, episodes=1, medoids=config.episodes.medoids,
        seed=config.episodes.seed)
    episodes = build_episodes(conv, models.load_encoder(config.encoder), episode_config)
    return ClusterResult(conv, episodes, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# Stage 2: layer sensitivity profile (once per model) and layer budgets
# ---------------------------------------------------------------------------------------------

def calibration_text(config: BuildConfig) -> str:
    """A long, model-independent text: a synthetic multi-topic conversation (no dataset shipped)."""
    from pipeline.synthetic import make_conversation

    conv = make_conversation("calibration", target_tokens=int(config.calibration.tokens * 1.5),
                             seed=config.calibration.seed)
    return render_conversation(conv).text


def layer_profile(store: Store, config: BuildConfig) -> list[float]:
    """The model's per-layer profile for the configured allocator (Key similarity for
    "sensitivity", cumulative-attention variance for "variance"): read from the store, or
    measured once on the calibration text and stored."""
    cal = config.calibration
    allocator = config.allocator_strategy()
    described = cal.as_dict() if allocator.name == "sensitivity" else \
        cal.as_dict() | {"profile": allocator.name}  # sensitivity keeps its historical key
    cal_hash = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:12]
    key = profile_key(models.model_key(config.model), cal_hash)
    if store.exists(key):
        return json.loads(store.get(key))["similarity"]
    lm = models.load_llm(config.model)
    ids = prompts.context_ids(lm.tokenizer, calibration_text(config))[:cal.tokens]
    start = time.perf_counter()
    sims = allocator.measure(lm.model, ids, cal).tolist()
    # "similarity" holds the profile whatever the allocator (the key name predates D2O)
    store.put(key, json.dumps({"model_id": config.model, "calibration": cal.as_dict(),
                               "allocator": allocator.name, "similarity": sims,
                               "seconds": time.perf_counter() - start}, indent=1).encode())
    return sims


def layer_budgets(store: Store, config: BuildConfig, n_layers: int) -> list[int] | None:
    if config.budget is None:
        return None
    if config.allocator == "sensitivity" and config.alpha == 0:
        return [config.budget] * n_layers
    return config.allocator_strategy().allocate(layer_profile(store, config), config.budget)


# ---------------------------------------------------------------------------------------------
# Stage 3: one episode's cache
# ---------------------------------------------------------------------------------------------

def episode_scorer(tokenizer, conv: Conversation, ep: Episode, config: BuildConfig) -> Scorer:
    """The scorer of one episode's build: EpiCache's, shaped by `config.scoring` (it may read
    the conversation's token layout and the episode's own turns), or the configured baseline."""
    encode = lambda text: prompts.patch_ids(tokenizer, text)  # noqa: E731
    if not is_episodic(config):
        return build_scorer(config.scorer, encode, ep.patch_text)
    layout = token_layout(tokenizer, conv)
    members = layout.turn_mask(member_turn_ids(conv, ep, config.episodes.window))
    return episodic_scorer(encode(ep.patch_text), config.scoring, layout.line_ids, members)


def build_episode(clustered: ClusterResult, episode: int, budgets: list[int] | None,
                  config: BuildConfig, store: Store) -> dict:
    """Block-prefill one episode's cache, store it, and return its manifest row."""
    lm = models.load_llm(config.model)
    conv, episodes = clustered.conversation, clustered.episodes
    ep = episodes.episodes[episode]
    ids = prompts.context_ids(lm.tokenizer, render_conversation(conv).text)
    scorer = episode_scorer(lm.tokenizer, conv, ep, config)
    dtype = getattr(torch, config.store_dtype)
    element_size = torch.empty(0, dtype=dtype).element_size()
    # Tri-state: the budget of M entries reads as the bytes of M Original entries per KV head.
    cache, stats = block_prefill(lm.model, ids, scorer, budgets, config.prefill,
                                 original_element_size=element_size)
    header = {"model_id": config.model, "config_hash": config.hash,
              "conversation_id": conv.conversation_id, "episode": episode}
    data = cache_io.serialize(cache, header, dtype)
    key = cache_key(conv.conversation_id, config.hash, episode)
    store.put(key, data)  # checked at the commit (`check_stored`), not read back here
    checksum = cache_io.sha256(data)
    return {
        "conversation_id": conv.conversation_id, "episode": episode,
        "episodes_requested": episodes.requested if is_episodic(config) else 1,
        "episodes_built": len(episodes.episodes), "episode_note": episodes.note,
        "object_key": key, "sha256": checksum, "object_bytes": len(data),
        "kv_bytes": cache.nbytes(element_size),
        "original_entries": stats.original_entries, "original_bytes": stats.original_bytes,
        "quantized_entries": stats.quantized_entries, "quantized_bytes": stats.quantized_bytes,
        "evicted_entries": stats.evicted_entries, "evicted_bytes": stats.evicted_bytes,
        "merged_entries": stats.merged_entries,
        "layer_byte_budgets": stats.byte_budgets or None,
        "oq_ratios": stats.oq_ratios or None,
        "centroid": ep.centroid.astype(np.float32).tolist(), "medoid_text": ep.patch_text,
        "medoid_turn_ids": list(ep.medoid_turn_ids), "n_windows": len(ep.windows),
        "layer_budgets": budgets, "entries_per_layer": stats.final_entries,
        "peak_entries_per_layer": stats.peak_entries, "tokens": stats.tokens,
        "scorer": config.scorer, "model_id": config.model, "encoder_id": config.encoder,
        "config_hash": config.hash, "config_json": config.to_json(),
        "cluster_seconds": clustered.seconds, "build_seconds": stats.seconds,
        "worker": f"{socket.gethostname()}:{os.getpid()}",
        "built_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------------------------------
# Stage 4: commit
# ---------------------------------------------------------------------------------------------

def is_built(store: Store, conversation_id: str, config: BuildConfig) -> bool:
    """Whether the conversation's manifest carries this configuration; a corrupt manifest is
    not a build (rebuilding replaces it), so it is logged and the conversation rebuilt."""
    try:
        rows = read_manifest(store, conversation_id)
    except ManifestError as e:
        log.warning("%s; rebuilding the conversation", e)
        return False
    return bool(rows) and all(r["config_hash"] == config.hash for r in rows)


def check_stored(store: Store, key: str, size: int) -> None:
    """The object is in the store with the size written: one HEAD, no download. Its content
    is trusted to the write (a local store renames a complete file into place; S3 checks the
    upload's checksum), the SHA-256 the worker computed of what it wrote goes in the manifest,
    and every reader verifies it (a full re-read is `jobs.gc --verify`)."""
    try:
        stored = store.info(key).size
    except ObjectNotFound:
        raise cache_io.CacheCorruptError(f"cache object {key} is missing from the store") from None
    if stored != size:
        raise cache_io.CacheCorruptError(f"cache object {key} holds {stored} bytes, "
                                         f"{size} were written")


def commit_manifest(store: Store, conversation_id: str, rows: list[dict]) -> None:
    """Write the manifest last, once every object it names is in the store at its size."""
    for row in rows:
        check_stored(store, row["object_key"], row["object_bytes"])
    write_manifest(store, conversation_id, rows)


def build_conversation(conv: Conversation, config: BuildConfig, store: Store) -> list[dict]:
    """The whole build of one conversation in this process (the Ray job fans the same steps out)."""
    clustered = cluster_conversation(conv, config)
    lm = models.load_llm(config.model)
    budgets = layer_budgets(store, config, lm.config.num_hidden_layers)
    rows = [build_episode(clustered, e, budgets, config, store)
            for e in range(len(clustered.episodes.episodes))]
    commit_manifest(store, conv.conversation_id, rows)
    return rows
