"""Validation of the project's JSONL schema: one record in, one `Conversation` out.

Every malformed field raises a `CorpusError` naming the record and the field. A bad question is
a fault of that question only: with a `faults` list (skip mode) it is dropped and noted there,
and its conversation is kept. `CorpusLimits` bounds one record, so a single bad record cannot
exhaust the driver's memory or the model's context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pipeline.corpus.schema import (
    Conversation,
    CorpusError,
    Question,
    Turn,
    UnsafeIdError,
    check_safe_id,
)


@dataclass(frozen=True)
class CorpusLimits:
    """Bounds on one record, so a single bad record cannot exhaust the driver's memory or
    the model's context: a JSONL line over `max_record_bytes` is never held whole, and a
    `.json` file (read whole) may not exceed it either; a turn's text or caption may hold at
    most `max_turn_chars` characters."""
    max_record_bytes: int = 16 * 2**20
    max_turn_chars: int = 100_000

    def __post_init__(self) -> None:
        if self.max_record_bytes < 1 or self.max_turn_chars < 1:
            raise ValueError("--max-record-bytes and --max-turn-chars must be at least 1")

    def check_chars(self, rec: "RecordFields", path: str, value: str | None) -> None:
        if value is not None and len(value) > self.max_turn_chars:
            raise rec.fail(path, f"is {len(value):,} characters, over the limit of "
                                 f"{self.max_turn_chars:,} (--max-turn-chars)")


DEFAULT_LIMITS = CorpusLimits()
_TURN_KEYS = {"turn_id", "speaker", "text", "session", "timestamp", "caption"}
_QUESTION_KEYS = {"question", "answer", "evidence", "category"}
_CONVERSATION_KEYS = {"conversation_id", "speakers", "turns", "questions"}


class RecordFields:
    """Field access that raises a `CorpusError` naming where the record came from."""

    def __init__(self, where: str, conversation_id: str | None = None):
        self.where = where
        self.conversation_id = conversation_id

    def fail(self, path: str, message: str) -> CorpusError:
        return CorpusError(f"{self.where}: field '{path}': {message}", self.conversation_id)

    def get(self, obj: dict, key: str, path: str, kind: type | tuple, *, required: bool = True,
            nonempty: bool = False) -> Any:
        if key not in obj or obj[key] is None:
            if required:
                raise self.fail(path, "is missing")
            return None
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            names = (kind.__name__ if isinstance(kind, type)
                     else " or ".join(k.__name__ for k in kind))
            raise self.fail(path, f"must be {names}, got {type(value).__name__}")
        if nonempty and not (value.strip() if isinstance(value, str) else value):
            raise self.fail(path, "must not be empty")  # whitespace is empty too
        if isinstance(value, str) and not value.isascii():
            try:  # a JSON escape like \ud800 decodes to text no tokenizer or file can take
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise self.fail(path, f"is not valid text (unpaired surrogate "
                                      f"{value[e.start]!a} at character {e.start + 1})") from None
        return value


# A question's fault: (its index, the error). A list of them is given in skip mode.
QuestionFaults = list[tuple[int, CorpusError]]


def parse_questions(items: list, parse_one: Callable[[int, Any], Question],
                     faults: QuestionFaults | None) -> tuple[Question, ...]:
    """Each question through `parse_one(index, item)`. A bad question raises when `faults` is
    None (fail mode); else it is dropped and noted, so one bad question does not cost its
    conversation (questions are never used to build a cache)."""
    questions = []
    for i, item in enumerate(items):
        try:
            questions.append(parse_one(i, item))
        except CorpusError as e:
            if faults is None:
                raise
            faults.append((i, e))
    return tuple(questions)


_TRAILING_PUNCTUATION = ".,;:!?"


def resolve_turn_id(raw: Any, known: set[str]) -> str | None:
    """The turn id `raw` names: itself when it is one; else the id left once whitespace and
    trailing punctuation are stripped (a public corpus writes 'D5:3.'), which is unambiguous
    as only an exact turn id is accepted; None when it names no turn."""
    text = str(raw)
    if text in known:
        return text
    stripped = text.strip().rstrip(_TRAILING_PUNCTUATION).rstrip()
    return stripped if stripped and stripped in known else None


def parse_record(obj: Any, where: str, limits: CorpusLimits = DEFAULT_LIMITS,
                 faults: QuestionFaults | None = None) -> Conversation:
    """Validate one JSONL record and build its `Conversation`; bad questions raise, or with
    `faults` given are dropped and noted there."""
    rec = RecordFields(where)
    if not isinstance(obj, dict):
        raise CorpusError(f"{where}: record must be a JSON object, got {type(obj).__name__}")
    cid = rec.get(obj, "conversation_id", "conversation_id", str, nonempty=True)
    try:
        check_safe_id(cid)
    except UnsafeIdError as e:
        raise CorpusError(f"{where}: field 'conversation_id': {e}") from None
    rec.where, rec.conversation_id = f"{where} (conversation {cid!r})", cid
    speakers = rec.get(obj, "speakers", "speakers", list, nonempty=True)
    for i, s in enumerate(speakers):
        if not isinstance(s, str) or not s.strip():
            raise rec.fail(f"speakers[{i}]", "must be a non-empty string")

    turns, seen = [], set()
    for i, t in enumerate(rec.get(obj, "turns", "turns", list, nonempty=True)):
        p = f"turns[{i}]"
        if not isinstance(t, dict):
            raise rec.fail(p, "must be an object")
        turn_id = rec.get(t, "turn_id", f"{p}.turn_id", (str, int))
        turn_id = str(turn_id)
        if turn_id in seen:
            raise rec.fail(f"{p}.turn_id", f"duplicate turn id {turn_id!r}")
        seen.add(turn_id)
        speaker = rec.get(t, "speaker", f"{p}.speaker", str, nonempty=True)
        if speaker not in speakers:
            raise rec.fail(f"{p}.speaker", f"{speaker!r} is not one of speakers {speakers}")
        text = rec.get(t, "text", f"{p}.text", str)
        caption = rec.get(t, "caption", f"{p}.caption", str, required=False)
        limits.check_chars(rec, f"{p}.text", text)
        limits.check_chars(rec, f"{p}.caption", caption)
        if not text.strip() and not caption:
            raise rec.fail(f"{p}.text", "must not be empty (unless the turn has a caption)")
        session = rec.get(t, "session", f"{p}.session", int)
        if turns and session < turns[-1].session:
            raise rec.fail(f"{p}.session", "sessions must not decrease along the turns")
        timestamp = rec.get(t, "timestamp", f"{p}.timestamp", str)
        meta = {k: v for k, v in t.items() if k not in _TURN_KEYS}
        turns.append(Turn(turn_id, speaker, text, session, timestamp, caption, meta))

    def question(i: int, q: Any) -> Question:
        p = f"questions[{i}]"
        if not isinstance(q, dict):
            raise rec.fail(p, "must be an object")
        text = rec.get(q, "question", f"{p}.question", str, nonempty=True)
        answer = rec.get(q, "answer", f"{p}.answer", (str, int, float))
        evidence = []
        for j, e in enumerate(rec.get(q, "evidence", f"{p}.evidence", list, required=False) or []):
            turn_id = resolve_turn_id(e, seen)
            if turn_id is None:
                raise rec.fail(f"{p}.evidence[{j}]",
                               f"turn id {e!r} is not a turn of this conversation")
            evidence.append(turn_id)
        category = rec.get(q, "category", f"{p}.category", int, required=False)
        meta = {k: v for k, v in q.items() if k not in _QUESTION_KEYS}
        return Question(text, str(answer), tuple(evidence), category, meta)

    questions = parse_questions(
        rec.get(obj, "questions", "questions", list, required=False) or [], question, faults)
    meta = {k: v for k, v in obj.items() if k not in _CONVERSATION_KEYS}
    return Conversation(cid, tuple(speakers), tuple(turns), questions, meta)
