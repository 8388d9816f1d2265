"""Stage 3 of an append: one episode's stored cache, read back, goes on through the new turns.

The cache after an episode's last block is exactly what block prefill continues from: it keeps
each entry's original position (the scorers read it), the tokens seen and the next position
(`pipeline.store.objects.cache_format`), and it is read through the read path's one way in
(`pipeline.store.objects.cache_read`). So the new turns are block-prefilled into it under the
same budgets, scorer and patch, and the episode's focus now includes the new turns the plan
gave it. Every cache kind goes on this way (original or compact positions, tri-state, merging,
DapQ, the baselines, the full cache); what differs from a rebuild of the whole history is listed
in docs/building.md. The new version goes under a key of its own; the commit replaces the
manifest.
"""

from __future__ import annotations

import dataclasses

from pipeline.builder.cluster import ClusterResult
from pipeline.builder.episode import (
    build_episodes,
    cache_fields,
    episode_scorer,
    index_fields,
    store_cache,
    store_dtype,
)
from pipeline.builder.growth import AppendPlan
from pipeline.builder.repair import RepairPlan, repair_episodes
from pipeline.config import BuildConfig, ModelFingerprints
from pipeline.corpus.render import render_conversation
from pipeline.kv import models, prompts
from pipeline.kv.cache import EpisodicCache
from pipeline.kv.prefill import block_prefill
from pipeline.store.backends.base import Store
from pipeline.store.catalogue.manifest import ManifestRecord
from pipeline.store.objects.cache_format import CacheCorruptError
from pipeline.store.objects.cache_read import read_cache


def read_stored_cache(store: Store, record: ManifestRecord, model) -> EpisodicCache:
    """An episode's cache object, checked against its record (length and SHA-256 by the read
    path, then the tokens seen), in the model's dtype and on its device."""
    weight = next(model.parameters())
    cache = read_cache(store, record.ref, dtype=weight.dtype, device=weight.device).cache
    if cache.tokens_seen != record.tokens:
        raise CacheCorruptError(f"cache object {record.object_key} has seen {cache.tokens_seen} "
                                f"tokens, its manifest says {record.tokens}")
    return cache


def append_episode(plan: AppendPlan, episode: int, budgets: list[int] | None,
                   config: BuildConfig, store: Store) -> ManifestRecord:
    """The episode's stored cache with the new turns block-prefilled into it, stored as a new
    object, and its manifest record (the stored one, brought up to date)."""
    before = dataclasses.replace(plan.previous[episode], **index_fields(plan.turn_index))
    if plan.new_tokens == 0:  # the record grew past the cut: the caches hold all they can
        return before
    lm = models.load_llm(config.model)
    conv = plan.conversation
    ids = prompts.context_ids(lm.tokenizer, render_conversation(conv).text)
    members = plan.members(episode)
    scorer = episode_scorer(lm.tokenizer, conv, before.medoid_text, members, config)
    cache = read_stored_cache(store, before, lm.model)
    cache, stats = block_prefill(lm.model, ids[before.tokens:], scorer, budgets, config.prefill,
                                 original_element_size=store_dtype(config)[1], cache=cache)
    files = ModelFingerprints(lm.fingerprint, plan.encoder_fingerprint)
    stored = store_cache(cache, conv.conversation_id, episode, config, files, store)
    return dataclasses.replace(
        before, centroid=list(plan.centroids[episode]), n_windows=plan.n_windows[episode],
        window_embeddings=plan.window_embeddings(episode),
        layer_budgets=budgets, model_fingerprint=files.model, encoder_fingerprint=files.encoder,
        cluster_seconds=plan.seconds, cache_turns=len(conv.turns), member_turn_ids=list(members),
        appends=(before.appends or 0) + 1, **cache_fields(stored, cache, stats, config)
        | {"merged_entries": (before.merged_entries or 0) + stats.merged_entries})


def prefill_episodes(planned: AppendPlan | RepairPlan | ClusterResult, episodes: tuple[int, ...],
                     budgets: list[int] | None, config: BuildConfig,
                     store: Store) -> list[ManifestRecord]:
    """Stage 3 any way, for the episodes of one task (`pipeline.builder.plan.task_groups`):
    the append the plan says (each episode from its own stored cache), damaged episodes'
    repair, or the episodes' build."""
    if isinstance(planned, AppendPlan):
        return [append_episode(planned, e, budgets, config, store) for e in episodes]
    if isinstance(planned, RepairPlan):
        return repair_episodes(planned, episodes, budgets, config, store)
    return build_episodes(planned, episodes, budgets, config, store)
