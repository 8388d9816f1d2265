"""The oracle window: each question's full-history reference in a conversation longer than the
model (`pipeline.eval.window`)."""

from __future__ import annotations

from pipeline.corpus.render import render_conversation
from pipeline.corpus.schema import Conversation, Question, Turn
from pipeline.corpus.synthetic import make_corpus
from pipeline.eval.window import EVIDENCE_SESSIONS, SESSION_RUN, evidence_windows, sessions_window


def chars(text: str) -> int:
    return len(text) // 4  # a stand-in tokenizer: the windows' logic, not the model's


def sessions_of(conv: Conversation) -> list[int]:
    return [t.session for t in conv.turns]


def test_every_window_fits_and_holds_the_evidence_of_the_questions_reading_it():
    conv = make_corpus(1, 4000, seed=5)[0]
    assert len(set(sessions_of(conv))) >= 4
    limit = chars(render_conversation(conv).text) // 2
    found = evidence_windows(conv, conv.questions, limit, chars)
    assert found.windows and len(found.of_question) == len(conv.questions)
    for window in found.windows:
        assert chars(render_conversation(window).text) <= limit or \
            len(set(sessions_of(window))) == 1  # a first session is kept whole
        first, last = window.meta["window"]["first_session"], window.meta["window"]["last_session"]
        assert sessions_of(window) == [s for s in sessions_of(conv) if first <= s <= last]
    for q, w in zip(conv.questions, found.of_question):
        assert w is not None
        held = {t.turn_id for t in found.windows[w].turns}
        assert set(q.evidence) <= held
    assert sorted(set(found.of_question)) == list(range(len(found.windows)))  # each one read


def _conversation(sessions: int, turns_per_session: int = 3) -> Conversation:
    turns = tuple(Turn(f"D{s}:{i}", "A" if i % 2 else "B", f"session {s} turn {i} " + "x" * 80, s,
                       f"day {s}") for s in range(1, sessions + 1)
                  for i in range(1, turns_per_session + 1))
    return Conversation("c", ("A", "B"), turns)


def test_a_question_reads_the_window_centred_on_its_evidence_or_its_evidence_sessions():
    conv = _conversation(9)
    per_session = chars(render_conversation(_conversation(1)).text)
    limit = 3 * per_session + 10  # about three sessions a window
    middle = Question("q", "a", ("D5:2",))
    spread = Question("q", "a", ("D1:1", "D9:1"))
    early = Question("q", "a", ("D1:3",))
    found = evidence_windows(conv, [middle, spread, early], limit, chars)
    window = found.windows[found.of_question[0]].meta["window"]
    assert (window["first_session"] + window["last_session"]) / 2 == 5  # centred on session 5
    assert found.windows[found.of_question[2]].meta["window"]["first_session"] == 1
    assert [found.kind(i) for i in range(3)] == [SESSION_RUN, EVIDENCE_SESSIONS, SESSION_RUN]
    # spread past one window: sessions 1 and 9 whole, in order, nothing between them
    sessions = found.windows[found.of_question[1]]
    assert sessions_of(sessions) == [1, 1, 1, 9, 9, 9]
    assert len(found.windows) == 3  # only the windows read


def test_evidence_sessions_too_long_for_the_window_keep_the_turns_nearest_the_evidence():
    conv = _conversation(4, turns_per_session=9)
    question = Question("q", "a", ("D1:5", "D4:1"))
    whole = chars(render_conversation(sessions_window(conv, question, 10 ** 6, chars)).text)
    window = sessions_window(conv, question, whole // 2, chars)
    kept = [t.turn_id for t in window.turns]
    assert chars(render_conversation(window).text) <= whole // 2
    assert {"D1:5", "D4:1"} <= set(kept) and {t.session for t in window.turns} == {1, 4}
    radius = window.meta["window"]["radius"]
    assert radius >= 1 and kept == [t.turn_id for t in conv.turns if t.session == 1 and
                                    abs(int(t.turn_id.split(":")[1]) - 5) <= radius or
                                    t.session == 4 and int(t.turn_id.split(":")[1]) - 1 <= radius]
    # one more turn each side would not fit
    wider = [t for t in conv.turns if t.session == 1 and
             abs(int(t.turn_id.split(":")[1]) - 5) <= radius + 1 or
             t.session == 4 and int(t.turn_id.split(":")[1]) - 1 <= radius + 1]
    assert chars(render_conversation(Conversation("c", ("A", "B"), tuple(wider))).text) > \
        whole // 2
    tiny = sessions_window(conv, question, 1, chars)  # nothing fits: the evidence turns alone
    assert [t.turn_id for t in tiny.turns] == ["D1:5", "D4:1"]
