"""Stage 3 of a build: one episode's cache, block-prefilled, stored, and its manifest record."""

from __future__ import annotations

import datetime as dt
import os
import socket

import numpy as np
import torch

from pipeline.build.cluster import ClusterResult, is_episodic
from pipeline.build.config import BuildConfig, ModelFingerprints
from pipeline.corpus.render import render_conversation
from pipeline.corpus.schema import Conversation
from pipeline.episodes import Episode, member_turn_ids
from pipeline.kv import models, prompts
from pipeline.kv.layout import token_layout
from pipeline.kv.prefill import block_prefill
from pipeline.kv.scorers import Scorer, build_scorer, episodic_scorer
from pipeline.store import cache_format
from pipeline.store.base import Store, cache_key
from pipeline.store.manifest import ManifestRecord


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
                  config: BuildConfig, store: Store) -> ManifestRecord:
    """Block-prefill one episode's cache, store it, and return its manifest record."""
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
    files = ModelFingerprints(lm.fingerprint, clustered.encoder_fingerprint)
    header = {"model_id": config.model, "config_hash": config.hash,
              "model_fingerprint": files.model, "encoder_fingerprint": files.encoder,
              "conversation_id": conv.conversation_id, "episode": episode}
    data = cache_format.serialize(cache, header, dtype)
    key = cache_key(conv.conversation_id, files.bound_hash(config.hash), episode)
    store.put(key, data)  # checked at the commit (`check_stored`), not read back here
    checksum = cache_format.sha256(data)
    return ManifestRecord(
        conversation_id=conv.conversation_id, episode=episode,
        episodes_requested=episodes.requested if is_episodic(config) else 1,
        episodes_built=len(episodes.episodes), episode_note=episodes.note,
        object_key=key, sha256=checksum, object_bytes=len(data),
        kv_bytes=cache.nbytes(element_size),
        original_entries=stats.original_entries, original_bytes=stats.original_bytes,
        quantized_entries=stats.quantized_entries, quantized_bytes=stats.quantized_bytes,
        evicted_entries=stats.evicted_entries, evicted_bytes=stats.evicted_bytes,
        merged_entries=stats.merged_entries,
        layer_byte_budgets=stats.byte_budgets or None,
        oq_ratios=stats.oq_ratios or None,
        centroid=ep.centroid.astype(np.float32).tolist(), medoid_text=ep.patch_text,
        medoid_turn_ids=list(ep.medoid_turn_ids), n_windows=len(ep.windows),
        layer_budgets=budgets, entries_per_layer=stats.final_entries,
        peak_entries_per_layer=stats.peak_entries, tokens=stats.tokens,
        scorer=config.scorer, model_id=config.model, encoder_id=config.encoder,
        model_fingerprint=files.model, encoder_fingerprint=files.encoder,
        config_hash=config.hash, config_json=config.to_json(),
        cluster_seconds=clustered.seconds, build_seconds=stats.seconds,
        worker=f"{socket.gethostname()}:{os.getpid()}",
        built_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    )
