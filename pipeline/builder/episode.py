"""Stage 3 of a build: episodes' caches prefilled (a block prefill each, or all of them in one
pass: `PrefillConfig.one_pass`), stored, and their manifest records."""

from __future__ import annotations

import datetime as dt
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from pipeline.builder.cluster import ClusterResult, is_episodic
from pipeline.config import BuildConfig, ModelFingerprints
from pipeline.config.build import STORE_ELEMENT_BYTES
from pipeline.corpus.render import render_conversation
from pipeline.corpus.schema import Conversation
from pipeline.kv import methods, models, prompts
from pipeline.kv.cache import EpisodicCache
from pipeline.kv.layout import token_layout
from pipeline.kv.methods.base import Method, MethodInputs, Scorer
from pipeline.kv.one_pass import one_pass_prefill
from pipeline.kv.prefill import PrefillStats, block_prefill
from pipeline.store.backends.base import Store, cache_key
from pipeline.store.catalogue.manifest import ManifestRecord
from pipeline.store.objects import cache_format
from pipeline.store.objects.turn_index import StoredIndex


def build_method(config: BuildConfig) -> Method:
    """The configured method with its parameters: those of its own section of the build
    configuration (hashed into the build), or its defaults (`Method.from_config`)."""
    return methods.method_class(config.scorer).from_config(config)


def episode_scorer(tokenizer, conv: Conversation, patch_text: str, members: tuple[str, ...],
                   config: BuildConfig) -> Scorer:
    """The method of one episode's build, bound to its patch text and, for a method built per
    episode, the conversation's token layout and the episode's own turns (`members`)."""
    inputs = MethodInputs(lambda text: prompts.patch_ids(tokenizer, text), patch_text)
    if is_episodic(config):
        layout = token_layout(tokenizer, conv)
        inputs = replace(inputs, line_ids=layout.line_ids, member=layout.turn_mask(members))
    return build_method(config).bind(inputs)


def store_dtype(config: BuildConfig) -> tuple[torch.dtype, int]:
    """The dtype the caches are stored in and its bytes per number (tri-state and a code's
    budget in bytes read a budget of M entries as the bytes of M entries at this size)."""
    return getattr(torch, config.store_dtype), STORE_ELEMENT_BYTES[config.store_dtype]


@dataclass(frozen=True)
class StoredCache:
    """A cache object written to the store: what its manifest record says of it."""
    key: str
    sha256: str
    size: int


def store_cache(cache: EpisodicCache, conversation_id: str, episode: int, config: BuildConfig,
                files: ModelFingerprints, store: Store) -> StoredCache:
    """Serialize an episode's cache and put it under a key of its own content (a new version
    never replaces the one being served). Checked at the commit (`check_stored`), not read
    back here."""
    header = {"model_id": config.model, "config_hash": config.hash,
              "model_fingerprint": files.model, "encoder_fingerprint": files.encoder,
              "conversation_id": conversation_id, "episode": episode}
    data = cache_format.serialize(cache, header, store_dtype(config)[0], config.code)
    checksum = cache_format.sha256(data)
    key = cache_key(conversation_id, files.bound_hash(config.hash), episode, checksum)
    store.put(key, data)
    return StoredCache(key, checksum, len(data))


def cache_fields(stored: StoredCache, cache: EpisodicCache, stats: PrefillStats,
                 config: BuildConfig) -> dict:
    """The manifest fields that describe a stored cache and the prefill that made it."""
    return dict(
        object_key=stored.key, sha256=stored.sha256, object_bytes=stored.size,
        kv_bytes=cache.nbytes(store_dtype(config)[1]),
        original_entries=stats.original_entries, original_bytes=stats.original_bytes,
        quantized_entries=stats.quantized_entries, quantized_bytes=stats.quantized_bytes,
        evicted_entries=stats.evicted_entries, evicted_bytes=stats.evicted_bytes,
        merged_entries=stats.merged_entries,
        layer_byte_budgets=stats.byte_budgets or None, oq_ratios=stats.oq_ratios or None,
        entries_per_layer=stats.final_entries, peak_entries_per_layer=stats.peak_entries,
        tokens=cache.tokens_seen, build_seconds=stats.seconds,
        positions_note=config.prefill.positions_note,
        worker=f"{socket.gethostname()}:{os.getpid()}",
        built_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))


def index_fields(stored: StoredIndex | None) -> dict:
    """The manifest fields naming the conversation's turn index (none: not written)."""
    return {} if stored is None else stored.fields()


@dataclass(frozen=True)
class Prefilled:
    """An episode's cache, prefilled and stored: the object, the cache and its stats, and the
    model files it was built with."""
    stored: StoredCache
    cache: EpisodicCache
    stats: PrefillStats
    files: ModelFingerprints


def prefill_caches(model: torch.nn.Module, ids: torch.Tensor, scorers: list[Scorer],
                   budgets: list[int] | None,
                   config: BuildConfig) -> list[tuple[EpisodicCache, PrefillStats]]:
    """Each scorer's cache of the conversation `ids`: all from one pass when the build asks for
    it (`PrefillConfig.one_pass`), else a block prefill each."""
    element_size = store_dtype(config)[1]
    if config.prefill.one_pass:
        return one_pass_prefill(model, ids, scorers, budgets, config.prefill,
                                original_element_size=element_size)
    return [block_prefill(model, ids, scorer, budgets, config.prefill,
                          original_element_size=element_size) for scorer in scorers]


def prefill_and_store(conv: Conversation, scorers: Mapping[int, Scorer],
                      budgets: list[int] | None, config: BuildConfig, store: Store,
                      encoder_fingerprint: str) -> dict[int, Prefilled]:
    """Prefill the whole conversation under each episode's scorer (by episode) and store the
    caches: a build's episodes, or damaged ones' repair."""
    lm = models.load_llm(config.model)
    ids = prompts.context_ids(lm.tokenizer, render_conversation(conv).text)
    built = prefill_caches(lm.model, ids, list(scorers.values()), budgets, config)
    files = ModelFingerprints(lm.fingerprint, encoder_fingerprint)
    return {episode: Prefilled(store_cache(cache, conv.conversation_id, episode, config, files,
                                           store), cache, stats, files)
            for episode, (cache, stats) in zip(scorers, built)}


@dataclass(frozen=True)
class BuiltEpisode:
    """An episode's build: its manifest record, and the cache it stored with its prefill's
    stats (the evaluation measures them; a Ray task returns only the record)."""
    record: ManifestRecord
    cache: EpisodicCache
    stats: PrefillStats


def build_episode_caches(clustered: ClusterResult, episodes: tuple[int, ...],
                         budgets: list[int] | None, config: BuildConfig, store: Store,
                         patch_text: str | None = None) -> list[BuiltEpisode]:
    """Prefill the episodes' caches (in one pass when the build says so), store them, and make
    their manifest records. `patch_text` replaces the episodes' medoid text as the method's
    patch (the evaluation's question bound)."""
    lm = models.load_llm(config.model)
    conv, clustering = clustered.conversation, clustered.episodes
    scorers = {e: episode_scorer(lm.tokenizer, conv,
                                 patch_text or clustering.episodes[e].patch_text,
                                 clustered.members[e], config) for e in episodes}
    built = prefill_and_store(conv, scorers, budgets, config, store,
                              clustered.encoder_fingerprint)
    return [BuiltEpisode(episode_record(clustered, e, budgets, config, built[e]), built[e].cache,
                         built[e].stats) for e in episodes]


def episode_record(clustered: ClusterResult, episode: int, budgets: list[int] | None,
                   config: BuildConfig, built: Prefilled) -> ManifestRecord:
    """The manifest record of a clustering's episode as prefilled and stored."""
    conv, episodes = clustered.conversation, clustered.episodes
    ep = episodes.episodes[episode]
    members = clustered.members[episode]
    return ManifestRecord(
        conversation_id=conv.conversation_id, episode=episode,
        episodes_requested=episodes.requested if is_episodic(config) else 1,
        episodes_built=len(episodes.episodes), episode_note=episodes.note,
        centroid=ep.centroid.astype(np.float32).tolist(), medoid_text=ep.patch_text,
        window_embeddings=None if ep.window_embeddings is None else ep.window_embeddings.tolist(),
        medoid_turn_ids=list(ep.medoid_turn_ids), n_windows=len(ep.windows),
        layer_budgets=budgets, scorer=config.scorer, model_id=config.model,
        encoder_id=config.encoder, model_fingerprint=built.files.model,
        encoder_fingerprint=built.files.encoder, config_hash=config.hash,
        config_json=config.to_json(), cluster_seconds=clustered.seconds,
        cache_turns=len(conv.turns), member_turn_ids=list(members),
        clustered_turns=len(conv.turns), clustered_at=clustered.clustered_at, appends=0,
        **index_fields(clustered.turn_index),
        **cache_fields(built.stored, built.cache, built.stats, config))


def build_episode_cache(clustered: ClusterResult, episode: int, budgets: list[int] | None,
                        config: BuildConfig, store: Store,
                        patch_text: str | None = None) -> BuiltEpisode:
    """One episode's cache (`build_episode_caches`)."""
    return build_episode_caches(clustered, (episode,), budgets, config, store, patch_text)[0]


def build_episodes(clustered: ClusterResult, episodes: tuple[int, ...],
                   budgets: list[int] | None, config: BuildConfig,
                   store: Store) -> list[ManifestRecord]:
    """Prefill the episodes' caches, store them, and return their manifest records."""
    return [built.record for built in
            build_episode_caches(clustered, episodes, budgets, config, store)]
