"""Stage 1 of a build: the conversation as built (cut to fit) and its episodes."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pipeline.build.config import BuildConfig
from pipeline.corpus.render import cut_at_session, render_conversation
from pipeline.corpus.schema import Conversation
from pipeline.episodes import EpisodeConfig, EpisodeSet, build_episodes
from pipeline.kv import models, prompts
from pipeline.kv.positions import check_fits
from pipeline.kv.scorers import EpiCacheScorer


def is_episodic(config: BuildConfig) -> bool:
    return config.scorer == EpiCacheScorer.name


@dataclass(frozen=True)
class ClusterResult:
    conversation: Conversation  # as built: cut to `max_context_tokens` when that is set
    episodes: EpisodeSet
    seconds: float
    encoder_fingerprint: str  # of the encoder files whose space the centroids are in


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
    encoder = models.load_encoder(config.encoder)
    fingerprint = models.encoder_fingerprint(config.encoder)  # the files just loaded (cached)
    episodes = build_episodes(conv, encoder, episode_config)
    return ClusterResult(conv, episodes, time.perf_counter() - start, fingerprint)
