"""The one plan step of a question (`pipeline.answer.plan.QuestionPlanner`), shared by the
library's `Answerer` and the Serve router: the manifest kept (read once, again when its object
changed), the tools made and checked when it is read (a refused manifest is not kept), the
question routed and topped up, and the first question over a manifest as read said so. The kept
manifests are bounded in bytes (least recently used evicted), hold their embeddings once as
numpy arrays, and concurrent first questions read a manifest once."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pipeline.answer.lookup import ConversationNotFound, ModelMismatchError
from pipeline.answer.plan import QuestionPlanner, QuestionTools
from pipeline.config import TopUpConfig
from pipeline.store.backends.local import LocalStore
from pipeline.store.catalogue.manifest import read_manifest
from tests.support.stores import put_conversation

OFF = TopUpConfig(enabled=False)


class Tools:
    """Tools that embed every question on the first axis, counting the manifests they are
    made for; `refuse` makes them refuse a conversation as a model check would."""

    def __init__(self, refuse: bool = False, dim: int = 2):
        self.made, self.refuse, self.dim = 0, refuse, dim

    def __call__(self, records) -> QuestionTools:
        if self.refuse:
            raise ModelMismatchError(f"conversation {records[0].conversation_id!r}: other files")
        self.made += 1
        axis = np.eye(self.dim, dtype=np.float32)[0]
        return QuestionTools(lambda q: axis, len)


def test_a_manifest_is_read_once_and_questions_are_routed_over_it(tmp_path):
    store = LocalStore(tmp_path)
    put_conversation(store, "c1", episodes=2)
    tools = Tools()
    planner = QuestionPlanner(store, tools, topup=OFF)
    first = planner.plan("c1", "Who?")
    again = planner.plan("c1", "Where?")
    assert tools.made == 1 and planner.loaded == 1
    assert first.first and not again.first
    assert [r.episode for r in first.read] and first.records == again.records
    assert first.topup.status == "off" and set(first.timings_ms) == {"manifest", "embed",
                                                                     "route", "topup"}
    with pytest.raises(ConversationNotFound):
        planner.plan("c2", "Who?")


def test_a_changed_manifest_is_read_again_when_checked(tmp_path):
    store = LocalStore(tmp_path)
    put_conversation(store, "c1", episodes=2)
    tools = Tools()
    planner = QuestionPlanner(store, tools, topup=OFF, manifest_ttl_s=0)
    assert len(planner.plan("c1", "Who?").records) == 2
    assert not planner.plan("c1", "Who?").first  # unchanged: kept
    time.sleep(0.01)
    put_conversation(store, "c1", episodes=3)
    grown = planner.plan("c1", "Who?")
    assert len(grown.records) == 3 and grown.first and tools.made == 2


def test_a_refused_conversation_is_not_kept(tmp_path):
    store = LocalStore(tmp_path)
    put_conversation(store, "c1")
    planner = QuestionPlanner(store, Tools(refuse=True), topup=OFF)
    with pytest.raises(ModelMismatchError):
        planner.plan("c1", "Who?")
    assert planner.loaded == 0


def test_a_conversation_without_a_turn_index_is_answered_without_a_top_up(tmp_path):
    store = LocalStore(tmp_path)
    put_conversation(store, "c1")
    plan = QuestionPlanner(store, Tools(), topup=TopUpConfig(enabled=True)).plan("c1", "Who?")
    assert plan.topup.status == "unavailable" and "before turn indexes" in plan.topup.note


# ---------------------------------------------------------------------------------------------
# A service that runs for months: the kept manifests are bounded, compact, and read once
# ---------------------------------------------------------------------------------------------

def test_kept_manifests_stay_within_their_byte_bound_least_recently_used_evicted(tmp_path):
    """Ten conversations through a bound that holds about three: the bytes kept never pass
    it, the least recently asked go first, and an evicted one is read again when asked."""
    from lab.synthetic_manifests import SyntheticManifests, conversation_id

    store = SyntheticManifests(10, episodes=2, windows=5, dim=16)
    tools = Tools(dim=16)
    probe = QuestionPlanner(store, tools, topup=OFF)
    one = probe.conversation(conversation_id(0)).nbytes
    bound = 3 * one + one // 2
    planner = QuestionPlanner(store, tools, topup=OFF, manifest_cache_bytes=bound)
    store.reads = 0
    for i in range(10):
        planner.plan(conversation_id(i), "Who?")
        stats = planner.manifest_stats()
        assert stats["bytes"] <= bound and stats["max_bytes"] == bound
    assert planner.loaded == 3 and store.reads == 10
    assert planner.manifest_stats()["evictions"] == 7
    planner.plan(conversation_id(9), "Where?")  # kept: not read again
    assert store.reads == 10
    again = planner.plan(conversation_id(0), "Where?")  # evicted: read again, a first question
    assert store.reads == 11 and again.first and planner.loaded == 3


def test_a_kept_manifest_holds_its_embeddings_once_as_read_only_numpy_views():
    from lab.synthetic_manifests import SyntheticManifests, conversation_id

    store = SyntheticManifests(1, episodes=3, windows=4, dim=8)
    conv = QuestionPlanner(store, Tools(dim=8), topup=OFF).conversation(conversation_id(0))
    read = read_manifest(store, conversation_id(0))
    assert isinstance(read[0].window_embeddings, list)  # as the manifest is read
    for e, (kept, original) in enumerate(zip(conv.records, read)):
        assert isinstance(kept.centroid, np.ndarray) and kept.window_embeddings.shape == (4, 8)
        assert np.shares_memory(kept.centroid, conv.index.centroids)
        assert np.shares_memory(kept.window_embeddings, conv.index.windows)
        assert not kept.window_embeddings.flags.writeable
        np.testing.assert_allclose(kept.window_embeddings, original.window_embeddings, atol=1e-6)
        np.testing.assert_allclose(kept.centroid, original.centroid, atol=1e-6)
        assert (kept.episode, kept.object_key) == (original.episode, original.object_key)
    assert conv.nbytes >= conv.index.windows.nbytes + conv.index.centroids.nbytes


def test_a_manifest_without_window_embeddings_is_kept_as_read(tmp_path):
    store = LocalStore(tmp_path)
    put_conversation(store, "c1", episodes=2)
    conv = QuestionPlanner(store, Tools(), topup=OFF).conversation("c1")
    assert all(r.window_embeddings is None for r in conv.records)
    assert not conv.index.has_windows and conv.records[1].centroid.tolist() == [1.0, 0.0]


class SlowReads(LocalStore):
    """A folder store whose manifest reads take `delay` seconds, counted."""

    def __init__(self, root, delay: float):
        super().__init__(root)
        self.delay, self.manifest_reads = delay, 0
        self._count = threading.Lock()

    def get(self, key: str) -> bytes:
        if key.startswith("manifests/"):
            with self._count:
                self.manifest_reads += 1
            time.sleep(self.delay)
        return super().get(key)


@pytest.mark.parametrize("ttl", [math.inf, 0.0])
def test_concurrent_first_questions_read_a_manifest_once(tmp_path, ttl):
    """Eight first questions about one conversation at once: one manifest read and one tools
    check, the others wait for it; one of them is the first question. With a ttl of 0 (every
    question checks the store) an unchanged manifest is not read again either."""
    store = SlowReads(tmp_path, delay=0.3)
    put_conversation(store, "c1", episodes=2)
    tools = Tools()
    planner = QuestionPlanner(store, tools, topup=OFF, manifest_ttl_s=ttl)
    barrier = threading.Barrier(8)

    def ask(_):
        barrier.wait()
        return planner.plan("c1", "Who?")

    with ThreadPoolExecutor(8) as pool:
        plans = list(pool.map(ask, range(8)))
    assert store.manifest_reads == 1 and tools.made == 1
    assert sum(p.first for p in plans) == 1
    assert all(p.records is plans[0].records for p in plans)


def test_a_changed_manifest_is_read_once_by_concurrent_questions(tmp_path):
    store = SlowReads(tmp_path, delay=0.3)
    put_conversation(store, "c1", episodes=2)
    planner = QuestionPlanner(store, Tools(), topup=OFF, manifest_ttl_s=0)
    planner.plan("c1", "Who?")
    time.sleep(0.01)
    put_conversation(store, "c1", episodes=3)
    store.manifest_reads = 0
    with ThreadPoolExecutor(6) as pool:
        plans = list(pool.map(lambda _: planner.plan("c1", "Who?"), range(6)))
    assert store.manifest_reads == 1 and {len(p.records) for p in plans} == {3}
    assert planner.loaded == 1


def test_the_routers_manifest_bound_defaults_to_the_planners():
    from pipeline.answer.plan import DEFAULT_MANIFEST_CACHE_BYTES
    from pipeline.serve.settings import ServeSettings

    assert ServeSettings(store="s").manifest_cache_bytes == DEFAULT_MANIFEST_CACHE_BYTES
    with pytest.raises(ValueError, match="manifest_cache_bytes"):
        ServeSettings(store="s", manifest_cache_bytes=-1)
