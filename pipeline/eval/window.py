"""The oracle window: the full-attention reference of a question in a conversation longer than
the model's positions.

Whole, a LoCoMo conversation runs to 20-26K tokens, and an 8K model has no full cache of it to
compare with. What it can read whole is a window of the conversation: the reference of a
question is then the full cache of the window of whole sessions (at most `max_tokens` rendered
tokens) that holds its evidence, the best a full-attention model with this window does when told
where to look. The windows are few and shared: from each session, the longest run of sessions
that fits (`cut_at_session` of the conversation from there); a question reads, among those
holding every evidence turn, the one whose sessions are centred nearest its evidence's (the
earliest on a tie), so evidence is read with context on both sides where there is some.

A question whose evidence spans more sessions than one window holds (a fact spread over
months) reads **its evidence sessions** instead (`sessions_window`): the sessions holding its
evidence, in order, with nothing between them; where they do not fit, each keeps the turns
nearest its evidence turns (the same number of turns on each side of each, as many as fit).
It is a reference of another kind (the conversation between those sessions is gone), so its
questions are reported apart (`Windows.kinds`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.corpus.render import cut_at_session, render_conversation
from pipeline.corpus.schema import Conversation, Question

SESSION_RUN, EVIDENCE_SESSIONS = "window", "sessions"  # the two kinds of reference
# the scorecard's cut, and its oracle window whole: the model's 8,192 positions hold the
# full-history reference of either
CUT_TOKENS = 7600


@dataclass(frozen=True)
class Windows:
    """A conversation's oracle windows (each a conversation: a run of whole sessions, or a
    question's evidence sessions) and the one each question reads (`of_question`, in the
    order of the questions given; None: no window holds its evidence)."""
    windows: tuple[Conversation, ...]
    of_question: tuple[int | None, ...]

    def kind(self, question: int) -> str | None:
        """The kind of reference question i reads: a run of sessions or its evidence sessions."""
        w = self.of_question[question]
        return None if w is None else self.windows[w].meta["window"].get("kind", SESSION_RUN)


def window_from(conv: Conversation, first_session: int, max_tokens: int,
                count_tokens: Callable[[str], int]) -> Conversation:
    """The longest run of whole sessions from `first_session` that fits `max_tokens`."""
    turns = tuple(t for t in conv.turns if t.session >= first_session)
    tail = Conversation(conv.conversation_id, conv.speakers, turns, (), {})
    cut = cut_at_session(tail, max_tokens, count_tokens)
    return Conversation(conv.conversation_id, conv.speakers, cut.turns, (),
                        {"window": {"first_session": first_session,
                                    "last_session": cut.turns[-1].session,
                                    "max_tokens": max_tokens}})


def sessions_window(conv: Conversation, question: Question, max_tokens: int,
                    count_tokens: Callable[[str], int]) -> Conversation:
    """The sessions holding `question`'s evidence, in order and whole where they fit
    `max_tokens`; else within each the turns at most r turns from an evidence turn, for the
    largest r that fits (at least the evidence turns themselves)."""
    evidence = set(question.evidence)
    sessions = sorted({t.session for t in conv.turns if t.turn_id in evidence})
    turns = [t for t in conv.turns if t.session in sessions]
    # each turn's distance (in turns, within its session) to the nearest evidence turn
    distance = {}
    for s in sessions:
        own = [t for t in turns if t.session == s]
        marks = [i for i, t in enumerate(own) if t.turn_id in evidence]
        distance |= {t.turn_id: min(abs(i - m) for m in marks) for i, t in enumerate(own)}

    def within(radius: int) -> Conversation:
        return Conversation(conv.conversation_id, conv.speakers,
                            tuple(t for t in turns if distance[t.turn_id] <= radius), (),
                            {"window": {"kind": EVIDENCE_SESSIONS, "sessions": sessions,
                                        "radius": radius, "max_tokens": max_tokens}})

    def fits(window: Conversation) -> bool:
        return count_tokens(render_conversation(window).text) <= max_tokens

    low, high = 0, max(distance.values())
    if fits(within(high)):
        return within(high)
    while low < high - 1:  # the largest radius that fits: within(low) fits or is the floor
        middle = (low + high) // 2
        low, high = (middle, high) if fits(within(middle)) else (low, middle)
    return within(low)


def evidence_windows(conv: Conversation, questions: list[Question] | tuple[Question, ...],
                     max_tokens: int, count_tokens: Callable[[str], int]) -> Windows:
    """The windows `questions` read (only those some question reads), and each one's."""
    sessions = sorted({t.session for t in conv.turns})
    session_of = {t.turn_id: t.session for t in conv.turns}
    candidates: list[Conversation] = []
    spans: list[tuple[int, int]] = []  # each candidate's first and last session
    for first in sessions:
        window = window_from(conv, first, max_tokens, count_tokens)
        last = window.turns[-1].session
        if spans and spans[-1][1] == last:
            continue  # inside the previous window: it adds nothing that one lacks
        candidates.append(window)
        spans.append((first, last))
    used: dict[int, int] = {}  # candidate -> index among the windows read, in first-read order
    chosen: list[int | None] = []
    for q in questions:
        lo = min(session_of[t] for t in q.evidence)
        hi = max(session_of[t] for t in q.evidence)
        holding = [(abs(first + last - lo - hi), i) for i, (first, last) in enumerate(spans)
                   if first <= lo and hi <= last]
        if not holding:  # spread past one window: its evidence sessions
            holding = [(0, len(candidates))]
            candidates.append(sessions_window(conv, q, max_tokens, count_tokens))
        chosen.append(used.setdefault(min(holding)[1], len(used)))
    return Windows(tuple(candidates[i] for i in used), tuple(chosen))
