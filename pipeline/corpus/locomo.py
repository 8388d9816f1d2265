"""The LoCoMo reader: a published sample (see shared/data/locomo/README.md) as a `Conversation`.

LoCoMo files are read as published: evidence entries that name no turn are kept aside in the
question's `meta["unknown_evidence"]`, not a fault.
"""

from __future__ import annotations

import re
from typing import Any

from pipeline.corpus.records import (
    DEFAULT_LIMITS,
    CorpusLimits,
    QuestionFaults,
    RecordFields,
    parse_questions,
    resolve_turn_id,
)
from pipeline.corpus.schema import Conversation, CorpusError, Question, Turn, check_safe_id

# ASCII digits, at most 9: int() of a longer run raises ValueError, not a CorpusError
_SESSION_KEY = re.compile(r"^session_([0-9]{1,9})$")


def parse_locomo(obj: Any, conversation_id: str, where: str, limits: CorpusLimits = DEFAULT_LIMITS,
                 faults: QuestionFaults | None = None) -> Conversation:
    """Build a `Conversation` from one LoCoMo sample (see shared/data/locomo/README.md); bad
    questions raise, or with `faults` given are dropped and noted there."""
    rec = RecordFields(where, conversation_id)
    if not isinstance(obj, dict):
        raise CorpusError(f"{where}: a LoCoMo sample must be a JSON object", conversation_id)
    conv = obj.get("conversation", obj)  # the original locomo10.json nests the sessions
    if not isinstance(conv, dict):
        raise rec.fail("conversation", "must be an object")
    speakers = [rec.get(conv, "speaker_a", "speaker_a", str, nonempty=True),
                rec.get(conv, "speaker_b", "speaker_b", str, nonempty=True)]
    sessions = _session_keys(conv, rec)
    turns, where_of = [], {}
    for n, key in sorted(sessions.items()):
        date = conv.get(f"{key}_date_time", "")
        for i, t in enumerate(rec.get(conv, key, key, list)):
            p = f"{key}[{i}]"
            if not isinstance(t, dict):
                raise rec.fail(p, "must be an object")
            turn = Turn(turn_id=str(rec.get(t, "dia_id", f"{p}.dia_id", str, nonempty=True)),
                        speaker=rec.get(t, "speaker", f"{p}.speaker", str, nonempty=True),
                        text=rec.get(t, "text", f"{p}.text", str),
                        session=n, timestamp=str(date),
                        caption=rec.get(t, "blip_caption", f"{p}.blip_caption", str,
                                        required=False) or None)
            if turn.speaker not in speakers:
                raise rec.fail(f"{p}.speaker", f"{turn.speaker!r} is neither speaker_a nor "
                                               f"speaker_b ({speakers[0]!r}, {speakers[1]!r})")
            if turn.turn_id in where_of:
                raise rec.fail(f"{p}.dia_id", f"duplicate id {turn.turn_id!r} (also "
                                              f"{where_of[turn.turn_id]})")
            where_of[turn.turn_id] = p
            limits.check_chars(rec, f"{p}.text", turn.text)
            limits.check_chars(rec, f"{p}.blip_caption", turn.caption)
            turns.append(turn)
    known = set(where_of)

    def question(i: int, q: Any) -> Question:
        p = f"qa[{i}]"
        if not isinstance(q, dict):
            raise rec.fail(p, "must be an object")
        answer = q.get("answer", q.get("adversarial_answer"))
        if answer is None:
            raise rec.fail(f"{p}.answer", "is missing")
        text = rec.get(q, "question", f"{p}.question", str, nonempty=True)
        # LoCoMo has a few evidence entries like "D8:6; D9:17" and some that name no turn: those
        # are kept aside in meta (the LoCoMo files are used as published), not a fault.
        evidence = rec.get(q, "evidence", f"{p}.evidence", list, required=False) or []
        raw = [e.strip() for item in evidence for e in re.split(r"[;,]", str(item)) if e.strip()]
        resolved = [resolve_turn_id(e, known) for e in raw]
        unknown = [e for e, r in zip(raw, resolved) if r is None]
        return Question(question=text, answer=str(answer),
                        evidence=tuple(r for r in resolved if r is not None),
                        category=rec.get(q, "category", f"{p}.category", int, required=False),
                        meta={"unknown_evidence": unknown} if unknown else {})

    qa = obj.get("qa", conv.get("qa", [])) or []
    if not isinstance(qa, list):
        raise rec.fail("qa", f"must be list, got {type(qa).__name__}")
    return Conversation(check_safe_id(conversation_id), tuple(speakers), tuple(turns),
                        parse_questions(qa, question, faults), {"source": "locomo"})


def _session_keys(conv: dict, rec: RecordFields) -> dict[int, str]:
    """{session number: its key}, the number parsed (`session_01` is session 1); two keys of
    one number are an error naming both, not one session read twice and the other dropped."""
    sessions: dict[int, str] = {}
    for key in conv:
        m = _SESSION_KEY.match(key)
        if m is None:
            continue
        n = int(m.group(1))
        if n in sessions:
            raise rec.fail(key, f"is session {n} again (also {sessions[n]!r})")
        sessions[n] = key
    if not sessions:
        raise rec.fail("session_1", "is missing (no sessions in this sample)")
    return sessions


def locomo_id(sample: Any, default: str) -> str:
    sample_id = sample.get("sample_id") if isinstance(sample, dict) else None
    base = str(sample_id or default)
    return base if base.startswith("locomo") else f"locomo-{base}"
