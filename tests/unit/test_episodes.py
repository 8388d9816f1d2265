"""Episode clustering (windows, K-Means, medoids, patched prompts), with a small
deterministic bag-of-words encoder standing in for the sentence encoder (routing is in
test_routers.py)."""

from __future__ import annotations

import dataclasses
import math
import re
import zlib

import numpy as np
import pytest

from pipeline.corpus.render import render_turn
from pipeline.corpus.schema import Conversation, Turn
from pipeline.corpus.synthetic import make_conversation
from pipeline.episodes import EpisodeConfig, build_episodes, segment, window_texts

DIM = 32


class BagOfWordsEncoder:
    """`encode(texts, normalize_embeddings=..., show_progress_bar=...)` like sentence-transformers:
    each lower-cased word hashed (crc32) into one of 32 dimensions."""

    def __init__(self):
        self.calls = 0

    def encode(self, texts, normalize_embeddings=True, show_progress_bar=False):
        self.calls += 1
        out = np.zeros((len(texts), DIM), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in re.findall(r"[a-z']+", text.lower()):
                out[i, zlib.crc32(word.encode()) % DIM] += 1.0
        if normalize_embeddings:
            norms = np.linalg.norm(out, axis=1, keepdims=True)
            out = out / np.where(norms > 0, norms, 1.0)
        return out


@pytest.fixture(scope="module")
def conversation() -> Conversation:
    return make_conversation("synth-episodes", 4000, seed=3)


def test_clustering_is_deterministic(conversation):
    """The same conversation, encoder and seed give the same episodes twice."""
    a = build_episodes(conversation, BagOfWordsEncoder(), EpisodeConfig(seed=0))
    b = build_episodes(conversation, BagOfWordsEncoder(), EpisodeConfig(seed=0))
    assert len(a.episodes) == len(b.episodes) == 4
    for x, y in zip(a.episodes, b.episodes):
        assert (x.windows, x.medoid_windows, x.medoid_turn_ids, x.patch_text) == \
               (y.windows, y.medoid_windows, y.medoid_turn_ids, y.patch_text)
        np.testing.assert_array_equal(x.centroid, y.centroid)


def _partition(result) -> list[tuple[int, ...]]:
    return sorted(e.windows for e in result.episodes)


def test_clustering_depends_on_the_seed_and_the_input(conversation):
    """Not a constant: another seed gives another K-Means partition of the same windows (the
    seed reaches K-Means), and another conversation gives other episodes."""
    base = build_episodes(conversation, BagOfWordsEncoder(), EpisodeConfig(seed=0))
    reseeded = build_episodes(conversation, BagOfWordsEncoder(), EpisodeConfig(seed=1))
    assert reseeded.n_windows == base.n_windows and len(reseeded.episodes) == 4
    assert _partition(reseeded) != _partition(base)
    other = build_episodes(make_conversation("synth-episodes", 4000, seed=4), BagOfWordsEncoder(),
                           EpisodeConfig(seed=0))
    assert {e.patch_text for e in other.episodes}.isdisjoint(e.patch_text for e in base.episodes)
    assert not any(np.allclose(a.centroid, b.centroid)
                   for a in other.episodes for b in base.episodes)


def test_windows_partition_the_conversation(conversation):
    """Every window (of `window` consecutive turns) belongs to exactly one episode."""
    config = EpisodeConfig(window=4, episodes=4)
    result = build_episodes(conversation, BagOfWordsEncoder(), config)
    assert result.n_windows == math.ceil(len(conversation.turns) / 4)
    assert result.requested == 4 and result.note == ""
    members = sorted(w for e in result.episodes for w in e.windows)
    assert members == list(range(result.n_windows))
    assert [e.index for e in result.episodes] == list(range(len(result.episodes)))


@pytest.mark.parametrize("medoids", [1, 2, 4, 50])
def test_medoids_are_nearest_members_and_patch_renders_them(conversation, medoids):
    """Medoid windows are members of their own episode, at most `medoids` of them, the members
    nearest the centroid (nearest first); the patched prompt contains every medoid turn, and
    the centroid is unit-norm."""
    encoder = BagOfWordsEncoder()
    config = EpisodeConfig(window=3, episodes=4, medoids=medoids)
    result = build_episodes(conversation, encoder, config)
    windows = segment(conversation.turns, config.window)
    vec = encoder.encode(window_texts(conversation, windows))  # the space the clustering used
    assert vec.shape[0] == result.n_windows
    for ep in result.episodes:
        assert set(ep.medoid_windows) <= set(ep.windows)
        assert 1 <= len(ep.medoid_windows) == min(medoids, len(ep.windows))
        assert np.linalg.norm(ep.centroid) == pytest.approx(1.0, abs=1e-5)
        sims = {w: float(vec[w] @ ep.centroid) for w in ep.windows}
        medoid_sims = [sims[w] for w in ep.medoid_windows]
        assert medoid_sims == sorted(medoid_sims, reverse=True)
        others = [s for w, s in sims.items() if w not in ep.medoid_windows]
        if others:
            assert min(medoid_sims) >= max(others) - 1e-6
        # the patched prompt: the medoid windows' turns, rendered like the conversation
        expected_ids = [t.turn_id for w in sorted(ep.medoid_windows) for t in windows[w]]
        assert list(ep.medoid_turn_ids) == expected_ids
        for w in ep.medoid_windows:
            for turn in windows[w]:
                assert render_turn(turn) in ep.patch_text


def test_short_conversation_gets_fewer_episodes_with_a_note(conversation):
    """3 turns, 4 episodes requested: one window of 4 turns, so one episode and a note saying
    why; with windows of 1 turn, at most 3 episodes."""
    short = dataclasses.replace(conversation, turns=conversation.turns[:3], questions=())
    result = build_episodes(short, BagOfWordsEncoder(), EpisodeConfig(window=4, episodes=4))
    assert len(result.episodes) == 1 and result.n_windows == 1
    assert result.note and "1 of 4" in result.note
    ep = result.episodes[0]
    assert ep.windows == ep.medoid_windows == (0,)
    assert all(render_turn(t) in ep.patch_text for t in short.turns)

    result = build_episodes(short, BagOfWordsEncoder(), EpisodeConfig(window=1, episodes=4))
    assert 1 <= len(result.episodes) <= 3 and result.note


def test_identical_windows_give_one_episode():
    """Windows that embed identically cannot make several clusters: one episode, a note."""
    turns = tuple(Turn(f"D1:{i + 1}", "A" if i % 2 == 0 else "B", "same words again", 1, "")
                  for i in range(12))
    conv = Conversation("same", ("A", "B"), turns)
    result = build_episodes(conv, BagOfWordsEncoder(), EpisodeConfig(window=2, episodes=4))
    assert len(result.episodes) == 1 and result.note
    assert result.episodes[0].windows == tuple(range(6))
