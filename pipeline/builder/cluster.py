"""Stage 1 of a build: the conversation as built (cut to fit) and its episodes (what else stage
1 may plan instead, an append or a repair, is `pipeline.builder.plan`)."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass

from pipeline.builder.growth import Recluster
from pipeline.config import BuildConfig
from pipeline.corpus.render import cut_at_session, render_conversation
from pipeline.corpus.schema import Conversation
from pipeline.episodes import EpisodeConfig, EpisodeSet, build_episodes, member_turn_ids
from pipeline.kv import methods, models, prompts
from pipeline.kv.positions import check_fits
from pipeline.store.objects.turn_index import StoredIndex


def is_episodic(config: BuildConfig) -> bool:
    """Whether the configured method builds one cache per episode (`Registered.per_episode`);
    the others build one per conversation, from one episode of all its windows."""
    return methods.registered(config.scorer).per_episode


@dataclass(frozen=True)
class ClusterResult:
    conversation: Conversation  # as built: cut to `max_context_tokens` when that is set
    episodes: EpisodeSet
    seconds: float
    encoder_fingerprint: str  # of the encoder files whose space the centroids are in
    members: tuple[tuple[str, ...], ...] = ()  # per episode, the turns of its windows
    clustered_at: str = ""  # ISO time
    reclustered: Recluster | None = None  # why a grown conversation was not appended to
    turn_index: StoredIndex | None = None  # the conversation's, stored (`plan_conversation`)

    @property
    def n_episodes(self) -> int:
        return len(self.episodes.episodes)


def fit_context(conv: Conversation, config: BuildConfig) -> Conversation:
    """The conversation as built: cut at a session boundary to `max_context_tokens` when set;
    refused (`ContextTooLongError`) when it does not fit the model's positions, unless the
    cache keeps compact positions."""
    tokenizer = models.load_tokenizer(config.model)
    count = lambda text: len(prompts.context_ids(tokenizer, text))  # noqa: E731
    if config.max_context_tokens is not None:
        conv = cut_at_session(conv, config.max_context_tokens, count)
    limit = models.max_positions(config.model)
    if config.prefill.position_mode == "original" and limit is not None:
        check_fits(conv.conversation_id, count(render_conversation(conv).text), limit,
                   cannot_compact=config.prefill.cannot_compact)
    return conv


def cluster_conversation(conv: Conversation, config: BuildConfig,
                         fit: bool = True) -> ClusterResult:
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
    members = tuple(member_turn_ids(conv, ep, episode_config.window) for ep in episodes.episodes)
    return ClusterResult(conv, episodes, time.perf_counter() - start, fingerprint, members,
                         dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
