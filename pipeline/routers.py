"""Routing strategies: which episode's cache answers a question.

Every router scores each episode for a question embedding from one `RouteIndex` (the episodes'
centroids and their windows' embeddings, all unit-norm in the encoder's space); the question
goes to the best-scoring episode, and with a "two" rule to the best two when their scores are
close. The routers need no training: they differ only in which of the stored embeddings they
compare the question with.

- `centroid`: the nearest centroid (the paper's rule).
- `window`: the episode of the nearest window (a centroid averages an episode's topics away).

Each is registered by name in `pipeline.config.registry.ROUTERS` (one line: a new router is its
class here and that line); `router(name)` makes it, and `ROUTERS` lists them all.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pipeline.config import registry


def unit(x: np.ndarray) -> np.ndarray:
    """`x` scaled to unit norm along its last axis (zero rows left zero)."""
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(norm > 0, norm, 1.0)


@dataclass(frozen=True)
class RouteIndex:
    """What a router compares a question with."""
    centroids: np.ndarray  # [episodes, dim] unit
    windows: np.ndarray  # [windows, dim] unit
    window_episode: np.ndarray  # [windows] the episode of each window

    @classmethod
    def of_episodes(cls, centroids: list, windows: list | None) -> RouteIndex:
        """From each episode's centroid and its windows' embeddings (a clustering's, or a
        manifest's columns); `windows` None: no window embeddings (only the centroid router
        can route)."""
        centroids = unit(np.asarray(centroids, dtype=np.float64))
        if windows is None:
            return cls(centroids, np.zeros((0, centroids.shape[1])), np.zeros(0, dtype=np.int64))
        owner = np.concatenate([np.full(len(w), e, dtype=np.int64) for e, w in enumerate(windows)])
        rows = [np.asarray(w, dtype=np.float64).reshape(-1, centroids.shape[1]) for w in windows]
        return cls(centroids, unit(np.concatenate(rows)), owner)

    @property
    def has_windows(self) -> bool:
        return len(self.windows) > 0

    @property
    def n_episodes(self) -> int:
        return len(self.centroids)

    def per_episode_max(self, similarities: np.ndarray) -> np.ndarray:
        """[episodes] the best of each episode's window similarities."""
        best = np.full(self.n_episodes, -np.inf)
        np.maximum.at(best, self.window_episode, similarities)
        return best


class Router(Protocol):
    """Scores each episode of an index for a question embedding (higher: the better episode)."""

    def scores(self, question: np.ndarray, index: RouteIndex) -> np.ndarray: ...


@dataclass(frozen=True)
class CentroidRouter:
    def scores(self, question: np.ndarray, index: RouteIndex) -> np.ndarray:
        return index.centroids @ unit(np.asarray(question, dtype=np.float64))


@dataclass(frozen=True)
class WindowRouter:
    def scores(self, question: np.ndarray, index: RouteIndex) -> np.ndarray:
        return index.per_episode_max(index.windows @ unit(np.asarray(question, dtype=np.float64)))


def router(name: str) -> Router:
    """The registered router called `name` (ValueError naming the known ones)."""
    return registry.ROUTERS.load(name)()


class Routers(Mapping):
    """Every registered router by name (`pipeline.config.registry.ROUTERS`), each made when it
    is looked up: what a caller iterates over, or finds a router in by name."""

    def __getitem__(self, name: str) -> Router:
        if name not in registry.ROUTERS:
            raise KeyError(name)
        return router(name)

    def __iter__(self) -> Iterator[str]:
        return iter(registry.ROUTERS)

    def __len__(self) -> int:
        return len(registry.ROUTERS)


ROUTERS = Routers()


def ranked(scores: np.ndarray) -> list[int]:
    """Episodes best first (ties: the lower index)."""
    return [int(i) for i in np.argsort(-np.asarray(scores), kind="stable")]


def chosen(scores: np.ndarray, two_below: float | None = None) -> tuple[int, ...]:
    """The episodes a question reads: the best, and the second too when `two_below` is set and
    the two scores are closer than it (the router is unsure)."""
    order = ranked(scores)
    if two_below and len(order) > 1 and scores[order[0]] - scores[order[1]] < two_below:
        return tuple(order[:2])
    return (order[0],)
