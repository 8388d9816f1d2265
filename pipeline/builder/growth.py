"""A grown conversation: its new turns appended to the stored episodes, or a re-clustering.

A record that extends what its manifest covers (`pipeline.corpus.history`) need not be rebuilt
from its first token: each episode's stored cache is exactly what block prefill would go on from.
The plan cuts the new turns into windows (from the append point: the last window built is not
re-opened), gives each window to the episode whose centroid is nearest, and moves that
centroid to the running mean of its windows, so routing sees the new content. The episodes'
patched prompts (their medoids) stay as clustered.

When the episodes no longer describe the conversation, it is re-clustered and rebuilt instead
(`GrowthConfig`): it has grown past `max_growth` times the turns it was clustered on, most new
windows are far from every centroid, it had fewer episodes than requested and now has the
windows for more, or its stored version lacks what an append goes on from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from pipeline.config import BuildConfig, GrowthConfig
from pipeline.corpus.render import render_conversation
from pipeline.corpus.schema import Conversation
from pipeline.episodes import embed_windows, segment, unit
from pipeline.kv import models, prompts
from pipeline.store.catalogue.manifest import ManifestRecord
from pipeline.store.objects.turn_index import StoredIndex


@dataclass(frozen=True)
class AppendPlan:
    """How a grown conversation's new turns join its stored episodes (one per record)."""
    conversation: Conversation  # as built now: cut to `max_context_tokens` when that is set
    previous: tuple[ManifestRecord, ...]  # the stored version, by episode
    new_tokens: int  # tokens after those the caches have seen
    centroids: tuple[tuple[float, ...], ...]  # per episode, the running mean (unit norm)
    n_windows: tuple[int, ...]  # per episode, its windows now
    new_members: tuple[tuple[str, ...], ...]  # per episode, the new turns it was given
    seconds: float = 0.0
    # per episode, the unit embeddings of the new windows it was given (the window routers)
    new_window_embeddings: tuple[tuple[tuple[float, ...], ...], ...] = ()
    encoder_fingerprint: str = ""
    turn_index: StoredIndex | None = None  # the grown conversation's, stored

    @property
    def n_episodes(self) -> int:
        return len(self.previous)

    def window_embeddings(self, episode: int) -> list[list[float]] | None:
        """The episode's window embeddings: those it had, then the new windows'; None when
        its manifest predates them."""
        before = self.previous[episode].window_embeddings
        if before is None:
            return None
        new = self.new_window_embeddings[episode] if self.new_window_embeddings else ()
        return [list(row) for row in before] + [list(row) for row in new]

    def members(self, episode: int) -> tuple[str, ...]:
        """The episode's turns: those it held, then the new ones given to it."""
        before = self.previous[episode].member_turn_ids or []
        return tuple(before) + self.new_members[episode]


@dataclass(frozen=True)
class Recluster:
    """Why a grown conversation is re-clustered and rebuilt: `reason` is the summary's short
    name for it, `detail` the logged sentence."""
    reason: str
    detail: str


_APPEND_STATE = ("cache_turns", "member_turn_ids", "clustered_turns")


def plan_append(conv: Conversation, previous: list[ManifestRecord], config: BuildConfig,
                growth: GrowthConfig, episodic: bool) -> AppendPlan | Recluster:
    """The append of `conv` (the grown record, as built) onto its stored version `previous`, or
    why it is re-clustered instead. `episodic`: the configuration clusters (EpiCache); a
    baseline's single episode takes every new window."""
    if not growth.append:
        return Recluster("appending off", "appending is off (--no-append)")
    previous = sorted(previous, key=lambda r: r.episode)
    first = previous[0]
    if any(getattr(r, name) is None for r in previous for name in _APPEND_STATE):
        return Recluster("built before appends", "its manifest predates appends")
    old_turns = first.cache_turns
    tokenizer = models.load_tokenizer(config.model)
    old = dataclasses.replace(conv, turns=conv.turns[:old_turns])
    old_ids = prompts.context_ids(tokenizer, render_conversation(old).text)
    ids = prompts.context_ids(tokenizer, render_conversation(conv).text)
    if (len(conv.turns) < old_turns or old_ids.shape[0] != first.tokens
            or not bool((ids[:old_ids.shape[0]] == old_ids).all())):
        return Recluster("tokens changed", "the history no longer renders to the tokens its "
                                           "caches hold")
    window = config.episodes.window
    new_windows = segment(conv.turns[old_turns:], window)
    total_windows = sum(r.n_windows for r in previous) + len(new_windows)
    if episodic and first.episodes_built < first.episodes_requested \
            and total_windows > first.episodes_built:
        return Recluster("more episodes", f"it had {first.episodes_built} of "
                         f"{first.episodes_requested} episodes and now has {total_windows} windows")
    if len(conv.turns) > growth.max_growth * first.clustered_turns:
        return Recluster("grown past max-growth",
                         f"{len(conv.turns)} turns, more than {growth.max_growth:g}x the "
                         f"{first.clustered_turns} it was clustered on")
    centroids = np.array([r.centroid for r in previous], dtype=np.float64)
    counts = np.array([r.n_windows for r in previous], dtype=np.float64)
    nearest = np.zeros(len(new_windows), dtype=int)
    if new_windows:
        encoder = models.load_encoder(config.encoder)
        embeddings = embed_windows(encoder, conv, new_windows)
        similarity = embeddings @ unit(centroids).T
        if episodic:
            nearest = similarity.argmax(axis=1)
            far = float((similarity.max(axis=1) < growth.far_similarity).mean())
            if far > growth.far_share:
                return Recluster("far windows", f"{far:.0%} of its new windows are below cosine "
                                 f"{growth.far_similarity:g} to every episode's centroid")
        for e in range(len(previous)):
            mine = embeddings[nearest == e]
            if len(mine):  # the running mean of the episode's window embeddings
                centroids[e] = unit(centroids[e] * counts[e] + mine.sum(axis=0))
    new_members = tuple(tuple(t.turn_id for i in np.flatnonzero(nearest == e)
                              for t in new_windows[i]) for e in range(len(previous)))
    new_embeddings = tuple(tuple(tuple(float(x) for x in row) for row in
                                 embeddings[nearest == e].astype(np.float32))
                           if new_windows else () for e in range(len(previous)))
    added = np.bincount(nearest, minlength=len(previous)) if new_windows else \
        np.zeros(len(previous), dtype=int)
    return AppendPlan(
        conversation=conv, previous=tuple(previous),
        new_tokens=int(ids.shape[0] - old_ids.shape[0]),
        centroids=tuple(tuple(float(x) for x in c) for c in centroids.astype(np.float32)),
        n_windows=tuple(int(n) for n in counts + added), new_members=new_members,
        new_window_embeddings=new_embeddings,
        encoder_fingerprint=models.encoder_fingerprint(config.encoder))
