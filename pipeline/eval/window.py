"""The oracle window: the full-attention reference of a question in a conversation longer than
the model's positions.

Whole, a LoCoMo conversation runs to 20-26K tokens, and an 8K model has no full cache of it to
compare with. What it can read whole is a window of the conversation: the reference of a
question is then the full cache of the window of whole sessions (at most `max_tokens` rendered
tokens) that holds its evidence, the best a full-attention model with this window does when told
where to look. The windows are few and shared: from each session, the longest run of sessions
that fits (`cut_at_session` of the conversation from there); a question reads, among those
holding every evidence turn, the one whose sessions are centred nearest its evidence's (the
earliest on a tie), so evidence is read with context on both sides where there is some. A
question whose evidence spans more than one window can hold has no reference and is left out
of the evaluation (counted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.corpus.render import cut_at_session
from pipeline.corpus.schema import Conversation, Question


@dataclass(frozen=True)
class Windows:
    """A conversation's oracle windows (each a conversation of whole sessions) and the one each
    question reads (`of_question`, in the order of the questions given; None: no window holds
    its evidence)."""
    windows: tuple[Conversation, ...]
    of_question: tuple[int | None, ...]


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
        chosen.append(used.setdefault(min(holding)[1], len(used)) if holding else None)
    return Windows(tuple(candidates[i] for i in used), tuple(chosen))
