"""The synthetic corpus: deterministic, sized as asked, topic-labelled, with answerable facts."""

from __future__ import annotations

import re
import string
from collections import Counter

import pytest

from jobs.make_corpus import main as make_corpus_main
from pipeline.corpus.reader import read_corpus
from pipeline.corpus.render import render_conversation
from pipeline.corpus.schema import check_safe_id
from pipeline.corpus.synthetic import (
    _TOPIC_LIST,
    TOPICS,
    estimate_tokens,
    make_conversation,
    make_corpus,
)


def tokens_of(conv) -> int:
    return estimate_tokens(render_conversation(conv).text)


def test_estimate_tokens_is_about_four_chars_per_token():
    assert estimate_tokens("") == 0
    assert estimate_tokens("abcd") == 1
    assert estimate_tokens("abcde") == 2
    assert estimate_tokens("x" * 4000) == 1000


def test_topics_are_many_and_well_formed():
    assert len(TOPICS) >= 10 and len(set(TOPICS)) == len(TOPICS)
    fields = string.Formatter()
    for topic in _TOPIC_LIST:
        assert len(topic.chatter) >= 15, topic.name
        for template in topic.openers + topic.chatter:  # every slot has a vocabulary
            for _, slot, _, _ in fields.parse(template):
                assert slot is None or slot in topic.words or slot in ("other", "when"), \
                    (topic.name, template)
        for spec in topic.facts:
            assert "{value}" in spec.statement and "{speaker}" in spec.question
            keyed = spec.keys != ("",)
            assert ("{key}" in spec.statement) == keyed == ("{key}" in spec.question)


def test_same_seed_same_conversation_different_seed_different():
    a = make_conversation("synth-0000", 3000, seed=7)
    b = make_conversation("synth-0000", 3000, seed=7)
    c = make_conversation("synth-0000", 3000, seed=8)
    assert a.to_record() == b.to_record()
    assert a.to_record() != c.to_record()
    assert make_corpus(3, 1000, seed=1) == make_corpus(3, 1000, seed=1)
    assert [x.to_record() for x in make_corpus(3, 1000, seed=1)] != \
        [x.to_record() for x in make_corpus(3, 1000, seed=2)]


def test_corpus_conversations_differ_and_do_not_depend_on_corpus_size():
    small, large = make_corpus(2, 1000, seed=3), make_corpus(4, 1000, seed=3)
    assert [c.conversation_id for c in large] == ["synth-0000", "synth-0001", "synth-0002",
                                                   "synth-0003"]
    assert large[:2] == small
    texts = {render_conversation(c).text.split("\n", 1)[1] for c in large}
    assert len(texts) == 4


@pytest.mark.parametrize("target", [300, 1000, 8000, 100_000])
def test_length_is_within_ten_percent_above_target(target):
    for seed in range(3):
        conv = make_conversation(f"synth-{seed:04d}", target, seed)
        assert target <= tokens_of(conv) <= target * 1.10, (target, seed, tokens_of(conv))


def test_sessions_turn_ids_and_dates():
    conv = make_conversation("synth-0000", 8000, seed=0)
    sessions = [t.session for t in conv.turns]
    assert sessions[0] == 1 and sessions == sorted(sessions)
    assert len(set(t.turn_id for t in conv.turns)) == len(conv.turns)
    stamps = {}
    for t in conv.turns:
        n = int(t.turn_id.split(":")[1])
        assert t.turn_id == f"D{t.session}:{n}"
        stamps.setdefault(t.session, t.timestamp)
        assert t.timestamp == stamps[t.session]
        assert re.fullmatch(r"\d{1,2}:\d\d [ap]m on \d{1,2} [A-Z][a-z]+, \d{4}", t.timestamp)
    assert len(set(stamps.values())) == len(stamps)  # one date per session, never repeated
    assert set(t.speaker for t in conv.turns) == set(conv.speakers) and len(conv.speakers) == 2


@pytest.mark.parametrize("target,n_topics", [(1000, 4), (2000, 4), (8000, 4), (8000, 2),
                                             (8000, 6), (30_000, 12)])
def test_topics_and_planted_facts(target, n_topics):
    for seed in range(3):
        conv = make_conversation(f"synth-{seed:04d}", target, seed, n_topics=n_topics)
        topics = Counter(t.meta["topic"] for t in conv.turns)
        assert len(topics) == n_topics and set(topics) <= set(TOPICS)
        assert sorted(conv.meta["topics"]) == sorted(topics)

        turns = {t.turn_id: t for t in conv.turns}
        assert len({q.question for q in conv.questions}) == len(conv.questions)
        for q in conv.questions:
            assert q.category == 4 and len(q.evidence) == 1
            fact_turn = turns[q.evidence[0]]
            assert q.answer in fact_turn.text
            assert q.meta["topic"] == fact_turn.meta["topic"]
            assert fact_turn.speaker in q.question  # questions name who stated the fact

        per_topic = Counter(q.meta["topic"] for q in conv.questions)
        if target >= 1500:
            assert all(per_topic[name] >= 2 for name in topics), per_topic
        assert len(conv.questions) >= tokens_of(conv) / 600  # about one per 300-500 tokens


def test_topics_come_in_stretches_and_recur():
    conv = make_conversation("synth-0000", 20_000, seed=5)
    labels = [t.meta["topic"] for t in conv.turns]
    runs = [labels[0]] + [b for a, b in zip(labels, labels[1:]) if a != b]
    assert len(labels) / len(runs) >= 8  # stretches of many turns, not topic salad
    assert all(n >= 2 for n in Counter(runs).values())  # every topic comes back
    sessions_per_topic = {name: {t.session for t in conv.turns if t.meta["topic"] == name}
                          for name in set(labels)}
    assert all(len(s) >= 2 for s in sessions_per_topic.values())


def test_long_conversation_is_rich():
    """A 100K-token conversation keeps planting questions and rarely repeats a turn verbatim.
    (Its generation time is not asserted: a wall-clock bound belongs in a benchmark, not in a
    test run on a shared machine.)"""
    conv = make_conversation("synth-0000", 100_000, seed=0)
    assert len(conv.questions) >= 100_000 / 600
    # Finite templates do repeat over ~3000 turns, but rarely verbatim.
    assert len({t.text for t in conv.turns}) > 0.75 * len(conv.turns)
    shorter = make_conversation("synth-0000", 8000, seed=0)
    assert len({t.text for t in shorter.turns}) > 0.9 * len(shorter.turns)


def test_explicit_speakers_and_bad_arguments():
    conv = make_conversation("synth-0000", 1000, 0, speakers=("Ann", "Ben"))
    assert conv.speakers == ("Ann", "Ben")
    with pytest.raises(ValueError):
        make_conversation("../escape", 1000, 0)
    with pytest.raises(ValueError):
        make_conversation("synth-0000", 1000, 0, n_topics=len(TOPICS) + 1)
    with pytest.raises(ValueError):
        make_conversation("synth-0000", 0, 0)
    with pytest.raises(ValueError):
        make_conversation("synth-0000", 1000, 0, speakers=("Ann", "Ann"))


def test_make_corpus_job_round_trips(tmp_path, capsys):
    out = tmp_path / "corpus.jsonl"
    assert make_corpus_main(["--out", str(out), "--conversations", "3", "--target-tokens",
                             "1500", "--seed", "11", "--topics", "3"]) == 0
    printed = capsys.readouterr().out
    assert "3 conversations" in printed and str(out) in printed and "questions" in printed

    read, stats = read_corpus(out)
    expected = make_corpus(3, 1500, seed=11, n_topics=3)
    assert stats.read == 3 and not stats.skipped
    assert read == expected
    assert [c.to_record() for c in read] == [c.to_record() for c in expected]  # meta included
    for conv in read:
        assert check_safe_id(conv.conversation_id) == conv.conversation_id
        assert all("topic" in t.meta for t in conv.turns)


def test_make_corpus_job_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        make_corpus_main(["--out", str(tmp_path / "x.jsonl"), "--conversations", "0",
                          "--target-tokens", "100"])
