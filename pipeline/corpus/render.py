"""Rendering: the text the model reads, and the character span of every turn in it.

A header naming the speakers, a date line per session, one `<speaker> said, "<text>"` line per
turn; patched prompts render their windows the same way. `cut_at_session` fits a conversation
to a token limit at a session boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pipeline.corpus.schema import Conversation, Turn


def render_turn(turn: Turn) -> str:
    """One line per turn, as the LoCoMo evaluation renders it (photo captions included)."""
    line = f'{turn.speaker} said, "{turn.text}"'
    if turn.caption:
        line += f" and shared {turn.caption}."
    return line


def render_session_header(turn: Turn) -> str:
    return f"DATE: {turn.timestamp}\nCONVERSATION:" if turn.timestamp else "CONVERSATION:"


def render_header(conv: Conversation) -> str:
    names = " and ".join(conv.speakers)
    return f"Below is a conversation between {names} over multiple sessions."


@dataclass(frozen=True)
class Rendered:
    """The rendered text and the character span of every turn (for token-level bookkeeping)."""
    text: str
    turn_spans: tuple[tuple[int, int], ...]


def render_turns(conv: Conversation, turns: list[Turn] | tuple[Turn, ...] | None = None,
                 header: bool = True) -> Rendered:
    """Render `turns` (default: all): a header naming the speakers, a date line per session,
    one line per turn. Patched prompts render their windows the same way, without the header."""
    turns = conv.turns if turns is None else turns
    lines: list[str] = [render_header(conv)] if header else []
    spans: list[tuple[int, int]] = []
    pos, session = 0, None  # pos: where the next line starts (lines are joined with "\n")

    def add(line: str) -> int:
        nonlocal pos
        start = pos
        lines.append(line)
        pos += len(line) + 1
        return start

    if header:
        pos = len(lines[0]) + 1
    for t in turns:
        if t.session != session:
            session = t.session
            if lines:
                add("")
            add(render_session_header(t))
        line = render_turn(t)
        start = add(line)
        spans.append((start, start + len(line)))
    return Rendered("\n".join(lines), tuple(spans))


def render_conversation(conv: Conversation) -> Rendered:
    return render_turns(conv)


def cut_at_session(conv: Conversation, max_tokens: int,
                   count_tokens: Callable[[str], int]) -> Conversation:
    """The longest prefix of whole sessions whose rendering fits `max_tokens` (at least the
    first session); questions whose evidence falls outside are dropped. `meta["cut"]` says
    what was kept."""
    sessions = sorted({t.session for t in conv.turns})
    kept: list[Turn] = []
    for n in sessions:
        candidate = kept + [t for t in conv.turns if t.session == n]
        if kept and count_tokens(render_turns(conv, candidate).text) > max_tokens:
            break
        kept = candidate
    if len(kept) == len(conv.turns):
        return conv
    ids = {t.turn_id for t in kept}
    questions = tuple(q for q in conv.questions if all(e in ids for e in q.evidence))
    cut = {"sessions": len({t.session for t in kept}), "of_sessions": len(sessions),
           "questions_dropped": len(conv.questions) - len(questions), "max_tokens": max_tokens}
    return Conversation(conv.conversation_id, conv.speakers, tuple(kept), questions,
                        conv.meta | {"cut": cut})
