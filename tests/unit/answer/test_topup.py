"""The question-time top-up (pipeline.answer.topup): which turns a question reads after its
cache, how they are rendered, and what happens when the conversation's turn index is unusable."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipeline.answer.topup import TopUp, TopUps, held_turns, render_topup, select_topup
from pipeline.config import TopUpConfig
from pipeline.store.backends.memory import MemoryStore
from pipeline.store.catalogue.manifest import ManifestRecord
from pipeline.store.objects.turn_index import IndexedTurn, TurnIndex, store_turn_index

ON = TopUpConfig(enabled=True, turns=3, max_tokens=1000)


def _index(n: int = 6, dim: int = 4) -> TurnIndex:
    """Turn i's embedding is unit vector i % dim; sessions of two turns."""
    turns = tuple(IndexedTurn(f"D{i // 2 + 1}:{i % 2 + 1}", i // 2 + 1, f"DATE: day {i // 2 + 1}",
                              f'A said, "turn {i}"') for i in range(n))
    return TurnIndex("conv", "enc", "fp", turns, np.eye(dim, dtype=np.float16)[np.arange(n) % dim])


def words(text: str) -> int:
    return len(text.split())


def test_the_nearest_turns_the_episodes_lack_are_read_in_conversation_order():
    index = _index()
    question = np.array([0.1, 0.9, 0.0, 0.5], np.float32)  # nearest: turn 1 and 5 (dim 1), then 3
    topup = select_topup(index, question, held=set(), config=ON, count_tokens=words)
    assert topup.status == "used" and topup.turn_ids == ("D1:2", "D2:2", "D3:2")
    assert topup.text == render_topup([index.turns[i] for i in (1, 3, 5)])
    assert topup.text.startswith("\n\nDATE: day 1\nA said, \"turn 1\"\n\nDATE: day 2")
    held = select_topup(index, question, held={"D1:2", "D3:2"}, config=ON, count_tokens=words)
    assert held.turn_ids == ("D2:2",)  # of the 3 nearest, the one the episodes do not hold


def test_a_question_whose_nearest_turns_are_all_held_reads_no_top_up():
    index = _index()
    question = np.array([0, 1, 0, 0], np.float32)
    topup = select_topup(index, question, held={"D1:2", "D3:2", "D1:1"},
                         config=dataclasses.replace(ON, turns=2), count_tokens=words)
    assert topup == TopUp(status="none")


def test_the_top_up_stays_within_its_tokens():
    index = _index()
    question = np.array([0.1, 0.9, 0.0, 0.5], np.float32)
    one_turn = words(render_topup([index.turns[1]]))
    topup = select_topup(index, question, set(), dataclasses.replace(ON, max_tokens=one_turn),
                         count_tokens=words)
    assert topup.turn_ids == ("D1:2",) and topup.tokens == one_turn <= one_turn


def test_nearer_than_held_reads_only_the_turns_nearer_than_the_episodes_own():
    index = _index()
    question = np.array([0.1, 0.9, 0.0, 0.5], np.float32)  # turn 1, 5 (0.9), 3 (0.5), 0, 4 (0.1)
    nearer = dataclasses.replace(ON, skip_held=True, nearer_than_held=True)
    assert select_topup(index, question, {"D2:2"}, nearer, words).turn_ids == ("D1:2", "D3:2")
    assert select_topup(index, question, {"D1:2"}, nearer, words) == TopUp(status="none")
    assert select_topup(index, question, set(), nearer, words).turn_ids == ("D1:2", "D2:2", "D3:2")


def test_a_top_up_read_once_hides_its_turns_spans_where_the_index_has_them():
    """`read_once` gives the top-up's turns' token spans to hide from the cache read, in the
    top-up's order; an index built before spans hides nothing and says so."""
    index = _index()
    spanned = dataclasses.replace(index, turns=tuple(
        dataclasses.replace(t, span=(10 * i, 10 * i + 7)) for i, t in enumerate(index.turns)))
    question = np.array([0.1, 0.9, 0.0, 0.5], np.float32)  # turns 1, 3 and 5
    once = dataclasses.replace(ON, read_once=True)
    plain = select_topup(spanned, question, set(), ON, words)
    topup = select_topup(spanned, question, set(), once, words)
    assert topup == dataclasses.replace(plain, hidden_spans=((10, 17), (30, 37), (50, 57)))
    assert plain.hidden_spans == ()
    unspanned = select_topup(index, question, set(), once, words)
    assert unspanned.hidden_spans == () and unspanned.turn_ids == plain.turn_ids
    assert "no token spans" in unspanned.note and "jobs.build --force" in unspanned.note


def test_off_reads_nothing():
    assert select_topup(_index(), np.ones(4, np.float32), set(), TopUpConfig(enabled=False),
                        words) == TopUp()


def test_config_is_checked():
    with pytest.raises(ValueError, match="needs skip_held"):
        TopUpConfig(nearer_than_held=True)
    with pytest.raises(ValueError, match="turns"):
        TopUpConfig(turns=0)
    with pytest.raises(ValueError, match="max_tokens"):
        TopUpConfig(max_tokens=0)


def _records(store, index: TurnIndex | None) -> list[ManifestRecord]:
    fields = {} if index is None else store_turn_index(index, store).fields()
    base = {f.name: None for f in dataclasses.fields(ManifestRecord)}
    return [ManifestRecord(**base | {"conversation_id": "conv", "episode": e,
                                     "member_turn_ids": [f"D{e + 1}:1", f"D{e + 1}:2"],
                                     "encoder_fingerprint": "fp", **fields}) for e in range(3)]


def test_top_ups_fetch_the_index_once_and_answer_from_the_episode_alone_without_it(caplog):
    store = MemoryStore("topup-test")
    try:
        records = _records(store, _index())
        topups = TopUps(store, ON)
        question = np.array([0.1, 0.9, 0.0, 0.5], np.float32)
        first = topups.for_question(records, records[:1], question, words)
        assert first.turn_ids == ("D1:2", "D2:2", "D3:2")  # the nearest, whatever is held
        skipping = TopUps(store, dataclasses.replace(ON, skip_held=True))
        assert skipping.for_question(records, records[:1], question, words).turn_ids == \
            ("D2:2", "D3:2")  # episode 0 holds D1:*
        fetched = topups.fetched_bytes
        assert fetched == records[0].turn_index_bytes
        topups.for_question(records, records[1:2], question, words)
        assert topups.fetched_bytes == fetched  # kept, not fetched again

        corrupt = TopUps(store, ON)
        data = bytearray(store.get(records[0].turn_index_key))
        data[-1] ^= 0xFF
        store.put(records[0].turn_index_key, bytes(data))
        got = corrupt.for_question(records, records[:1], question, words)
        assert got.status == "unavailable" and "checksum" in got.note and "jobs.build" in got.note
        store.delete(records[0].turn_index_key)
        got = TopUps(store, ON).for_question(records, records[:1], question, words)
        assert got.status == "unavailable" and "missing" in got.note
        assert "answering from the episode alone" in caplog.text

        old = _records(store, None)  # built before turn indexes
        got = TopUps(store, ON).for_question(old, old[:1], question, words)
        assert got.status == "unavailable" and "before turn indexes" in got.note
    finally:
        store.drop()


def test_top_ups_keep_their_indexes_within_a_bound_in_bytes():
    """The indexes kept are the most recently used within `keep_bytes` (the newest always): an
    index pushed out is fetched again at its conversation's next question."""
    store = MemoryStore("topup-bytes-test")
    try:
        conversations = []
        for name, n in (("a", 6), ("b", 6), ("c", 40)):
            index = dataclasses.replace(_index(n), conversation_id=name)
            stored = store_turn_index(index, store)
            base = {f.name: None for f in dataclasses.fields(ManifestRecord)}
            conversations.append([ManifestRecord(**base | {
                "conversation_id": name, "episode": 0, "member_turn_ids": [],
                "encoder_fingerprint": "fp", **stored.fields()})])
        small, large = (c[0].turn_index_bytes for c in conversations[1:])
        topups = TopUps(store, ON, keep_bytes=2 * small)
        question = np.array([0.1, 0.9, 0.0, 0.5], np.float32)

        def ask(records):
            assert topups.for_question(records, records, question, words).status == "used"

        a, b, c = conversations
        ask(a), ask(b), ask(a)  # both fit: a is read once
        assert topups.fetched_bytes == 2 * small and topups.held_bytes == 2 * small
        ask(c)  # over the bound: only the newest is kept, however large
        assert large > 2 * small and topups.held_bytes == large
        ask(b)  # pushed out: fetched again; c pushed out in turn
        assert topups.fetched_bytes == 3 * small + large and topups.held_bytes == small
    finally:
        store.drop()


def test_held_turns_of_records_without_members_is_empty():
    assert held_turns([None, ("a",), ["b"]]) == {"a", "b"}


def test_a_top_up_sized_by_its_tokens_alone_reads_the_nearest_turns_that_fit():
    """turns=None: every turn, nearest first, as many as `max_tokens` holds (retrieval at a
    row's decode-time entries): the same turns as a cap on their number that is never
    reached, and more than the default's 8 when the tokens allow."""
    index = _index(40, dim=40)
    question = np.linspace(1.0, 0.0, 40).astype(np.float32)  # turn 0 nearest, then 1, 2, ...
    budget = words(render_topup(list(index.turns[:12])))
    wide = select_topup(index, question, set(), dataclasses.replace(ON, turns=None,
                                                                     max_tokens=budget), words)
    assert wide.turn_ids == tuple(t.turn_id for t in index.turns[:12])
    assert wide == select_topup(index, question, set(),
                                dataclasses.replace(ON, turns=40, max_tokens=budget), words)
    assert wide.tokens == budget
    with pytest.raises(ValueError, match="turns must be >= 1"):
        TopUpConfig(turns=0)
