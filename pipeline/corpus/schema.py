"""Conversations as data: turns, questions and the conversation, and the ids they may carry.

Ids become storage keys, so `check_safe_id` keeps them to a conservative alphabet; a record that
breaks the schema is a `CorpusError` whose message names file, record and field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Ids become object keys: keep them to a conservative alphabet so they cannot escape the store.
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class CorpusError(ValueError):
    """A record that does not follow the schema; the message names file, record and field.
    `conversation_id` is set when the record's id was known, for the skip report."""

    def __init__(self, message: str, conversation_id: str | None = None):
        super().__init__(message)
        self.conversation_id = conversation_id


class UnsafeIdError(CorpusError):
    """An id that could escape the store (path separators, '..', control characters...)."""


def check_safe_id(value: Any, what: str = "conversation_id") -> str:
    """Return `value` if it is safe to use inside an object key, else raise `UnsafeIdError`."""
    if not isinstance(value, str) or not value:
        raise UnsafeIdError(f"{what} must be a non-empty string, got {value!r}")
    reasons = []
    if "/" in value or "\\" in value:
        reasons.append("contains a path separator")
    if ".." in value:
        reasons.append("contains '..'")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        reasons.append("contains control characters")
    if not reasons and not _SAFE_ID.match(value):
        reasons.append("must be 1-128 characters of letters, digits, '.', '_' or '-', "
                       "starting with a letter or digit")
    if reasons:
        shown = value if len(value) <= 80 else value[:80] + "..."  # echoed to whoever sent it
        raise UnsafeIdError(f"unsafe {what} {shown!r}: {'; '.join(reasons)} "
                            "(ids become storage keys and may not escape the store)")
    return value


@dataclass(frozen=True)
class Turn:
    turn_id: str
    speaker: str
    text: str
    session: int
    timestamp: str
    caption: str | None = None  # caption of a shared photo (LoCoMo's blip_caption)
    meta: dict = field(default_factory=dict, compare=False)  # extra fields, e.g. a topic label


@dataclass(frozen=True)
class Question:
    question: str
    answer: str
    evidence: tuple[str, ...] = ()
    category: int | None = None
    meta: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Conversation:
    conversation_id: str
    speakers: tuple[str, ...]
    turns: tuple[Turn, ...]
    questions: tuple[Question, ...] = ()
    meta: dict = field(default_factory=dict, compare=False)

    def turn_index(self) -> dict[str, int]:
        return {t.turn_id: i for i, t in enumerate(self.turns)}

    def to_record(self) -> dict:
        """The JSONL record of this conversation (the inverse of `parse_record`)."""
        def turn(t: Turn) -> dict:
            rec = {"turn_id": t.turn_id, "speaker": t.speaker, "text": t.text,
                   "session": t.session, "timestamp": t.timestamp}
            if t.caption:
                rec["caption"] = t.caption
            return rec | t.meta

        def question(q: Question) -> dict:
            rec = {"question": q.question, "answer": q.answer, "evidence": list(q.evidence)}
            if q.category is not None:
                rec["category"] = q.category
            return rec | q.meta

        return {"conversation_id": self.conversation_id, "speakers": list(self.speakers),
                "turns": [turn(t) for t in self.turns],
                "questions": [question(q) for q in self.questions]} | self.meta
