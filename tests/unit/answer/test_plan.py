"""The one plan step of a question (`pipeline.answer.plan.QuestionPlanner`), shared by the
library's `Answerer` and the Serve router: the manifest kept (read once, again when its object
changed), the tools made and checked when it is read (a refused manifest is not kept), the
question routed and topped up, and the first question over a manifest as read said so."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pipeline.answer.lookup import ConversationNotFound, ModelMismatchError
from pipeline.answer.plan import QuestionPlanner, QuestionTools
from pipeline.config import TopUpConfig
from pipeline.store.backends.local import LocalStore
from tests.support.stores import put_conversation

OFF = TopUpConfig(enabled=False)


class Tools:
    """Tools that embed every question on the first axis, counting the manifests they are
    made for; `refuse` makes them refuse a conversation as a model check would."""

    def __init__(self, refuse: bool = False):
        self.made, self.refuse = 0, refuse

    def __call__(self, records) -> QuestionTools:
        if self.refuse:
            raise ModelMismatchError(f"conversation {records[0].conversation_id!r}: other files")
        self.made += 1
        return QuestionTools(lambda q: np.array([1.0, 0.0], dtype=np.float32), len)


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
