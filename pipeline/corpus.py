"""Conversations as data: the project's JSONL schema, the LoCoMo reader, validation, rendering.

A corpus is read lazily, one conversation at a time, so a corpus of millions of conversations
never sits in memory. Every malformed record is reported with its file, its record number and
the offending field; `on_bad_record="skip"` counts it and goes on instead of failing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

OnBadRecord = Literal["fail", "skip"]

# Ids become object keys: keep them to a conservative alphabet so they cannot escape the store.
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class CorpusError(ValueError):
    """A record that does not follow the schema; the message names file, record and field."""


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
        raise UnsafeIdError(f"unsafe {what} {value!r}: {'; '.join(reasons)} "
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


# ---------------------------------------------------------------------------------------------
# Validation of the project's JSONL schema
# ---------------------------------------------------------------------------------------------

_TURN_KEYS = {"turn_id", "speaker", "text", "session", "timestamp", "caption"}
_QUESTION_KEYS = {"question", "answer", "evidence", "category"}
_CONVERSATION_KEYS = {"conversation_id", "speakers", "turns", "questions"}


class _Record:
    """Field access that raises a `CorpusError` naming where the record came from."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, path: str, message: str) -> CorpusError:
        return CorpusError(f"{self.where}: field '{path}': {message}")

    def get(self, obj: dict, key: str, path: str, kind: type | tuple, *, required: bool = True,
            nonempty: bool = False) -> Any:
        if key not in obj or obj[key] is None:
            if required:
                raise self.fail(path, "is missing")
            return None
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise self.fail(path, f"must be {names}, got {type(value).__name__}")
        if nonempty and not value:
            raise self.fail(path, "must not be empty")
        return value


def parse_record(obj: Any, where: str) -> Conversation:
    """Validate one JSONL record and build its `Conversation`."""
    rec = _Record(where)
    if not isinstance(obj, dict):
        raise CorpusError(f"{where}: record must be a JSON object, got {type(obj).__name__}")
    cid = rec.get(obj, "conversation_id", "conversation_id", str, nonempty=True)
    try:
        check_safe_id(cid)
    except UnsafeIdError as e:
        raise CorpusError(f"{where}: field 'conversation_id': {e}") from None
    rec.where = f"{where} (conversation {cid!r})"
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
        if not text.strip() and not caption:
            raise rec.fail(f"{p}.text", "must not be empty (unless the turn has a caption)")
        session = rec.get(t, "session", f"{p}.session", int)
        if turns and session < turns[-1].session:
            raise rec.fail(f"{p}.session", "sessions must not decrease along the turns")
        timestamp = rec.get(t, "timestamp", f"{p}.timestamp", str)
        meta = {k: v for k, v in t.items() if k not in _TURN_KEYS}
        turns.append(Turn(turn_id, speaker, text, session, timestamp, caption, meta))

    questions = []
    for i, q in enumerate(rec.get(obj, "questions", "questions", list, required=False) or []):
        p = f"questions[{i}]"
        if not isinstance(q, dict):
            raise rec.fail(p, "must be an object")
        question = rec.get(q, "question", f"{p}.question", str, nonempty=True)
        answer = rec.get(q, "answer", f"{p}.answer", (str, int, float))
        evidence = rec.get(q, "evidence", f"{p}.evidence", list, required=False) or []
        for j, e in enumerate(evidence):
            if str(e) not in seen:
                raise rec.fail(f"{p}.evidence[{j}]", f"turn id {e!r} is not a turn of this conversation")
        category = rec.get(q, "category", f"{p}.category", int, required=False)
        meta = {k: v for k, v in q.items() if k not in _QUESTION_KEYS}
        questions.append(Question(question, str(answer), tuple(str(e) for e in evidence),
                                  category, meta))

    meta = {k: v for k, v in obj.items() if k not in _CONVERSATION_KEYS}
    return Conversation(cid, tuple(speakers), tuple(turns), tuple(questions), meta)


# ---------------------------------------------------------------------------------------------
# LoCoMo
# ---------------------------------------------------------------------------------------------

_SESSION_KEY = re.compile(r"^session_(\d+)$")


def parse_locomo(obj: Any, conversation_id: str, where: str) -> Conversation:
    """Build a `Conversation` from one LoCoMo sample (see shared/data/locomo/README.md)."""
    rec = _Record(where)
    if not isinstance(obj, dict):
        raise CorpusError(f"{where}: a LoCoMo sample must be a JSON object")
    conv = obj.get("conversation", obj)  # the original locomo10.json nests the sessions
    speakers = [rec.get(conv, "speaker_a", "speaker_a", str, nonempty=True),
                rec.get(conv, "speaker_b", "speaker_b", str, nonempty=True)]
    sessions = sorted(int(m.group(1)) for k in conv if (m := _SESSION_KEY.match(k)))
    if not sessions:
        raise rec.fail("session_1", "is missing (no sessions in this sample)")
    turns = []
    for n in sessions:
        date = conv.get(f"session_{n}_date_time", "")
        for i, t in enumerate(rec.get(conv, f"session_{n}", f"session_{n}", list)):
            p = f"session_{n}[{i}]"
            if not isinstance(t, dict):
                raise rec.fail(p, "must be an object")
            turns.append(Turn(
                turn_id=str(rec.get(t, "dia_id", f"{p}.dia_id", str, nonempty=True)),
                speaker=rec.get(t, "speaker", f"{p}.speaker", str, nonempty=True),
                text=rec.get(t, "text", f"{p}.text", str),
                session=n, timestamp=str(date),
                caption=t.get("blip_caption") or None))
    known = {t.turn_id for t in turns}
    questions = []
    for i, q in enumerate(obj.get("qa", conv.get("qa", [])) or []):
        p = f"qa[{i}]"
        answer = q.get("answer", q.get("adversarial_answer"))
        if answer is None:
            raise rec.fail(f"{p}.answer", "is missing")
        # LoCoMo has a few evidence entries like "D8:6; D9:17" and some that name no turn.
        evidence = [e.strip() for raw in q.get("evidence", []) or []
                    for e in re.split(r"[;,]", str(raw)) if e.strip()]
        questions.append(Question(
            question=rec.get(q, "question", f"{p}.question", str, nonempty=True),
            answer=str(answer),
            evidence=tuple(e for e in evidence if e in known),
            category=q.get("category"),
            meta={"unknown_evidence": [e for e in evidence if e not in known]}
            if any(e not in known for e in evidence) else {}))
    return Conversation(check_safe_id(conversation_id), tuple(speakers), tuple(turns),
                        tuple(questions), {"source": "locomo"})


# ---------------------------------------------------------------------------------------------
# Reading a corpus: a JSONL file, a LoCoMo file, or a folder of either
# ---------------------------------------------------------------------------------------------

@dataclass
class ReadStats:
    """What a read saw; `skipped` lists (where, error) for every record skipped."""
    read: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _corpus_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json"))
        if not files:
            raise CorpusError(f"{path}: folder holds no .jsonl or .json files")
        return files
    if not path.exists():
        raise CorpusError(f"{path}: no such file or folder")
    return [path]


def _records(file: Path) -> Iterator[tuple[str, Any]]:
    """(where, item) for each record of a file, lazily; item is ("jsonl", obj),
    ("locomo", obj, default id) or the `CorpusError` met reading it."""
    if file.suffix == ".jsonl":
        with file.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    where = f"{file.name}, record {lineno}"
                    try:
                        yield where, ("jsonl", json.loads(line))
                    except json.JSONDecodeError as e:
                        yield where, CorpusError(f"{where}: not valid JSON ({e.msg}, column {e.colno})")
        return
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        yield file.name, CorpusError(f"{file.name}: not valid JSON ({e.msg}, line {e.lineno})")
        return
    if isinstance(data, list):  # locomo10.json: a list of samples
        for i, sample in enumerate(data, 1):
            yield f"{file.name}, record {i}", ("locomo", sample, f"{file.stem}-{i}")
    else:
        yield file.name, ("locomo", data, file.stem)


def _locomo_id(sample: Any, default: str) -> str:
    sample_id = sample.get("sample_id") if isinstance(sample, dict) else None
    base = str(sample_id or default)
    return base if base.startswith("locomo") else f"locomo-{base}"


def iter_corpus(path: str | Path, on_bad_record: OnBadRecord = "fail",
                stats: ReadStats | None = None) -> Iterator[Conversation]:
    """Yield the conversations of a corpus; bad records raise or are skipped and counted."""
    if on_bad_record not in ("fail", "skip"):
        raise ValueError(f"on_bad_record must be 'fail' or 'skip', got {on_bad_record!r}")
    stats = stats if stats is not None else ReadStats()
    seen_ids: set[str] = set()
    for file in _corpus_files(Path(path)):
        for where, item in _records(file):
            try:
                if isinstance(item, Exception):
                    raise item
                if item[0] == "jsonl":
                    conv = parse_record(item[1], where)
                else:
                    try:
                        conv = parse_locomo(item[1], _locomo_id(item[1], item[2]), where)
                    except UnsafeIdError as e:
                        raise CorpusError(f"{where}: {e}") from None
                if conv.conversation_id in seen_ids:
                    raise CorpusError(f"{where}: field 'conversation_id': duplicate id "
                                      f"{conv.conversation_id!r}")
            except CorpusError as e:
                if on_bad_record == "fail":
                    raise
                stats.skipped.append((where, str(e)))
                continue
            seen_ids.add(conv.conversation_id)
            stats.read += 1
            yield conv


def read_corpus(path: str | Path, on_bad_record: OnBadRecord = "fail") -> tuple[list[Conversation], ReadStats]:
    stats = ReadStats()
    return list(iter_corpus(path, on_bad_record, stats)), stats


def write_jsonl(conversations: list[Conversation], path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for conv in conversations:
            f.write(json.dumps(conv.to_record(), ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------
# Rendering: the text the model reads
# ---------------------------------------------------------------------------------------------

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
