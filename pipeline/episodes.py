"""Conversation clustering into episodes (EpiCache stage 1, §3.1 and A.3).

The turns are cut into windows of `window` consecutive utterances, each window is embedded with
a sentence encoder (normalised), and K-Means (k-means++ seeding, fixed seed) groups them into
episodes. An episode keeps its centroid (for routing questions) and its medoid windows: the
`medoids` windows nearest the centroid, whose rendering is the episode's patched prompt.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from sklearn.cluster import KMeans

from pipeline.config import EpisodeConfig
from pipeline.corpus.render import render_turns
from pipeline.corpus.schema import Conversation, Turn
from pipeline.routers import RouteIndex, unit


@dataclass(frozen=True)
class Episode:
    index: int
    centroid: np.ndarray  # unit-norm, in the encoder's space
    windows: tuple[int, ...]  # member window indices
    medoid_windows: tuple[int, ...]  # nearest the centroid first
    medoid_turn_ids: tuple[str, ...]
    patch_text: str
    # [member windows, dim] unit-norm, in `windows`' order: what the window routers compare
    window_embeddings: np.ndarray | None = None


@dataclass(frozen=True)
class EpisodeSet:
    episodes: tuple[Episode, ...]
    requested: int
    n_windows: int
    note: str = ""  # why fewer episodes than requested, if so

    def route_index(self) -> RouteIndex:
        """What the routers compare a question with: the centroids and the windows."""
        return RouteIndex.of_episodes([ep.centroid for ep in self.episodes],
                                      [ep.window_embeddings for ep in self.episodes])


def segment(turns: tuple[Turn, ...] | list[Turn], window: int) -> list[list[Turn]]:
    return [list(turns[i:i + window]) for i in range(0, len(turns), window)]


def window_texts(conv: Conversation, windows: list[list[Turn]]) -> list[str]:
    return [render_turns(conv, w, header=False).text for w in windows]


def cluster_embeddings(embeddings: np.ndarray, n_clusters: int, seed: int,
                       n_init: int = 10) -> np.ndarray:
    """K-Means labels (k-means++ seeding, fixed seed)."""
    with warnings.catch_warnings():  # "fewer distinct points than clusters": handled by the caller
        warnings.simplefilter("ignore")
        km = KMeans(n_clusters=n_clusters, init="k-means++", n_init=n_init, random_state=seed)
        return km.fit_predict(embeddings)


def embed_texts(encoder, texts: list[str]) -> np.ndarray:
    """[texts, dim] unit-norm embeddings in the encoder's space, as the encoder returns them:
    the one way text enters that space, so the centroids, the windows, the questions (routing,
    the evaluation) and the top-up's turns never drift apart."""
    return encoder.encode(texts, normalize_embeddings=True, show_progress_bar=False)


def embed_windows(encoder, conv: Conversation, windows: list[list[Turn]]) -> np.ndarray:
    """[windows, dim] unit-norm embeddings of the windows' renderings (float64)."""
    texts = window_texts(conv, windows)
    return unit(np.asarray(embed_texts(encoder, texts), dtype=np.float64))


def build_episodes(conv: Conversation, encoder,
                   config: EpisodeConfig = EpisodeConfig()) -> EpisodeSet:
    """Cluster a conversation into at most `config.episodes` episodes. Short conversations get
    fewer (one per window at most); the note says why."""
    windows = segment(conv.turns, config.window)
    embeddings = embed_windows(encoder, conv, windows)
    distinct = len(np.unique(embeddings.round(6), axis=0))
    k = min(config.episodes, len(windows), distinct)
    labels = cluster_embeddings(embeddings, k, config.seed, config.n_init) if k > 1 \
        else np.zeros(len(windows), dtype=int)
    episodes = []
    for label in sorted(set(labels.tolist())):
        members = np.flatnonzero(labels == label)
        centroid = unit(embeddings[members].mean(axis=0))
        nearest = members[np.argsort(-(embeddings[members] @ centroid), kind="stable")]
        medoids = tuple(int(i) for i in nearest[:config.medoids])
        patch_turns = [t for i in sorted(medoids) for t in windows[i]]
        episodes.append(Episode(
            index=len(episodes), centroid=centroid.astype(np.float32),
            windows=tuple(int(i) for i in members), medoid_windows=medoids,
            medoid_turn_ids=tuple(t.turn_id for t in patch_turns),
            patch_text=render_turns(conv, patch_turns, header=False).text,
            window_embeddings=embeddings[members].astype(np.float32)))
    note = ""
    if len(episodes) < config.episodes:
        note = (f"{len(episodes)} of {config.episodes} episodes: the conversation has "
                f"{len(windows)} windows of {config.window} turns ({distinct} distinct)")
    return EpisodeSet(tuple(episodes), config.episodes, len(windows), note)


def member_turn_ids(conv: Conversation, episode: Episode, window: int) -> tuple[str, ...]:
    """The turn ids of every window of an episode (what a question routed to it is about)."""
    windows = segment(conv.turns, window)
    return tuple(t.turn_id for i in episode.windows for t in windows[i])
