"""The routers (pipeline.routers) and the routing of manifest records (pipeline.answer.lookup)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.answer.lookup import route_index, route_records
from pipeline.config import ROUTER_NAMES, RoutingConfig
from pipeline.routers import ROUTERS, RouteIndex, chosen, unit


def test_every_router_is_named_in_the_configuration():
    assert tuple(ROUTERS) == ROUTER_NAMES
    with pytest.raises(ValueError, match="router must be one of"):
        RoutingConfig("nearest")


def _index() -> RouteIndex:
    """Episode 0: three far-apart windows (its centroid between them); episode 1: one window."""
    windows = [[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], [[0.8, 0.6, 0.0]]]
    centroids = [unit(np.mean(w, axis=0)) for w in windows]
    return RouteIndex.of_episodes(centroids, windows)


def test_the_window_router_finds_the_episode_of_a_topic_its_centroid_averages_away():
    index, question = _index(), np.array([0.95, 0.05, 0.0])
    assert ROUTERS["centroid"].scores(question, index).argmax() == 1
    assert ROUTERS["window"].scores(question, index).argmax() == 0


def test_an_unsure_router_reads_two_episodes_a_sure_one_reads_one():
    assert chosen(np.array([0.50, 0.49, 0.1]), 0.02) == (0, 1)
    assert chosen(np.array([0.50, 0.40, 0.1]), 0.02) == (0,)
    assert chosen(np.array([0.49, 0.50, 0.1]), 0.0) == (1,)  # 0: one episode always


class _Record:
    def __init__(self, episode, centroid, windows):
        self.episode, self.centroid, self.window_embeddings = episode, centroid, windows


def test_manifest_records_are_routed_by_window_and_by_centroid_when_they_predate_windows():
    windows = [[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], [[0.8, 0.6, 0.0]]]
    records = [_Record(e, list(unit(np.mean(w, axis=0))), w) for e, w in enumerate(windows)]
    question = np.array([0.95, 0.05, 0.0])
    read, score = route_records(question, records, RoutingConfig("window", 0.0))
    assert [r.episode for r in read] == [0] and score == pytest.approx(0.9986, abs=1e-3)
    old = [_Record(r.episode, r.centroid, None) for r in records]
    assert not route_index(old).has_windows
    assert [r.episode for r in route_records(question, old, RoutingConfig("window", 0.0))[0]] == [1]
    both = route_records(question, records, RoutingConfig("centroid", 1.0))[0]
    assert [r.episode for r in both] == [1, 0]


def test_the_centroid_router_compares_directions_not_lengths():
    """A long centroid pointing away loses to a short one pointing at the question; the
    scores are the cosine similarities."""
    centroids = np.array([[10.0, 0.0, 0.0], [0.0, 0.6, 0.8], [0.0, -1.0, 0.0]])
    index = RouteIndex.of_episodes(list(centroids), None)
    question = np.array([0.5, 0.5, 0.7])
    scores = ROUTERS["centroid"].scores(question, index)
    assert scores.argmax() == 1 and scores[1] == pytest.approx(
        question @ centroids[1] / np.linalg.norm(question) / np.linalg.norm(centroids[1]))
    assert ROUTERS["centroid"].scores(np.array([1.0, 0.1, 0.0]), index).argmax() == 0
    assert ROUTERS["centroid"].scores(np.array([0.0, -3.0, 0.1]), index).argmax() == 2
