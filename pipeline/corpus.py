"""Conversations as data: the project's JSONL schema, the LoCoMo reader, validation, rendering.

A corpus is read lazily, one conversation at a time, so a corpus of millions of conversations
never sits in memory. Every malformed record is reported with its file, its record number and
the offending field; `on_bad_record="skip"` reports it (a `Skip`) and goes on instead of failing.
A bad question is a fault of that question only: skip mode drops it and keeps the conversation.
A corpus is a list of objects (`CorpusObject`: local files, or S3 objects read as streams);
`check_corpus` reads a whole corpus this way before any heavy work starts, and `CorpusStream`
(the build's reader) checks each object just before its conversations are handed out.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, Callable, Iterable, Iterator, Literal, TextIO

OnBadRecord = Literal["fail", "skip"]

# Ids become object keys: keep them to a conservative alphabet so they cannot escape the store.
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class CorpusError(ValueError):
    """A record that does not follow the schema; the message names file, record and field.
    `conversation_id` is set when the record's id was known, for the skip report."""

    def __init__(self, message: str, conversation_id: str | None = None):
        super().__init__(message)
        self.conversation_id = conversation_id


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

    def check_chars(self, rec: "_Record", path: str, value: str | None) -> None:
        if value is not None and len(value) > self.max_turn_chars:
            raise rec.fail(path, f"is {len(value):,} characters, over the limit of "
                                 f"{self.max_turn_chars:,} (--max-turn-chars)")


DEFAULT_LIMITS = CorpusLimits()


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
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
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


def _parse_questions(items: list, parse_one: Callable[[int, Any], Question],
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
    rec = _Record(where)
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
                raise rec.fail(f"{p}.evidence[{j}]", f"turn id {e!r} is not a turn of this conversation")
            evidence.append(turn_id)
        category = rec.get(q, "category", f"{p}.category", int, required=False)
        meta = {k: v for k, v in q.items() if k not in _QUESTION_KEYS}
        return Question(text, str(answer), tuple(evidence), category, meta)

    questions = _parse_questions(
        rec.get(obj, "questions", "questions", list, required=False) or [], question, faults)
    meta = {k: v for k, v in obj.items() if k not in _CONVERSATION_KEYS}
    return Conversation(cid, tuple(speakers), tuple(turns), questions, meta)


# ---------------------------------------------------------------------------------------------
# LoCoMo
# ---------------------------------------------------------------------------------------------

_SESSION_KEY = re.compile(r"^session_(\d+)$")


def parse_locomo(obj: Any, conversation_id: str, where: str, limits: CorpusLimits = DEFAULT_LIMITS,
                 faults: QuestionFaults | None = None) -> Conversation:
    """Build a `Conversation` from one LoCoMo sample (see shared/data/locomo/README.md); bad
    questions raise, or with `faults` given are dropped and noted there."""
    rec = _Record(where, conversation_id)
    if not isinstance(obj, dict):
        raise CorpusError(f"{where}: a LoCoMo sample must be a JSON object", conversation_id)
    conv = obj.get("conversation", obj)  # the original locomo10.json nests the sessions
    if not isinstance(conv, dict):
        raise rec.fail("conversation", "must be an object")
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
            turn = Turn(turn_id=str(rec.get(t, "dia_id", f"{p}.dia_id", str, nonempty=True)),
                        speaker=rec.get(t, "speaker", f"{p}.speaker", str, nonempty=True),
                        text=rec.get(t, "text", f"{p}.text", str),
                        session=n, timestamp=str(date),
                        caption=t.get("blip_caption") or None)
            limits.check_chars(rec, f"{p}.text", turn.text)
            limits.check_chars(rec, f"{p}.blip_caption", turn.caption)
            turns.append(turn)
    known = {t.turn_id for t in turns}

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
        raw = [e.strip() for item in q.get("evidence", []) or []
               for e in re.split(r"[;,]", str(item)) if e.strip()]
        resolved = [resolve_turn_id(e, known) for e in raw]
        unknown = [e for e, r in zip(raw, resolved) if r is None]
        return Question(question=text, answer=str(answer),
                        evidence=tuple(r for r in resolved if r is not None),
                        category=q.get("category"),
                        meta={"unknown_evidence": unknown} if unknown else {})

    qa = obj.get("qa", conv.get("qa", [])) or []
    if not isinstance(qa, list):
        raise rec.fail("qa", f"must be list, got {type(qa).__name__}")
    return Conversation(check_safe_id(conversation_id), tuple(speakers), tuple(turns),
                        _parse_questions(qa, question, faults), {"source": "locomo"})


# ---------------------------------------------------------------------------------------------
# Reading a corpus: a JSONL file, a LoCoMo file, or a folder of either
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Skip:
    """What a skip-mode read left out: a whole record (`question` None) or one question of a
    kept conversation. `record` is the JSONL line number or the sample's position in a LoCoMo
    list (None: the whole file); `reason` is the error, which names file, record and field."""
    file: str
    record: int | None
    conversation_id: str | None
    question: int | None
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        return f"{'dropped question' if self.question is not None else 'skipped'}: {self.reason}"


@dataclass
class ReadStats:
    """What a read saw. Only the first `keep` skips are held (a corpus may have millions of
    bad records); `sink` is told of every one as it happens (e.g. to write a report)."""
    read: int = 0
    records_skipped: int = 0
    questions_dropped: int = 0
    skipped: list[Skip] = field(default_factory=list)
    keep: int = 1000
    sink: Callable[[Skip], None] | None = None

    def add(self, skip: Skip) -> None:
        if skip.question is None:
            self.records_skipped += 1
        else:
            self.questions_dropped += 1
        if len(self.skipped) < self.keep:
            self.skipped.append(skip)
        if self.sink is not None:
            self.sink(skip)

    @property
    def total_skipped(self) -> int:
        return self.records_skipped + self.questions_dropped


@dataclass(frozen=True)
class CorpusObject:
    """One file or object of a corpus: the name its records are reported under, and how to
    read it (a fresh binary stream each call: a local file, or an S3 GetObject body read as it
    is consumed) and its size (called only when needed: an S3 HEAD)."""
    name: str
    open: Callable[[], BinaryIO]
    size: Callable[[], int]

    @property
    def jsonl(self) -> bool:
        return self.name.endswith(".jsonl")


def _file_object(file: Path) -> CorpusObject:
    return CorpusObject(file.name, lambda: file.open("rb"), lambda: file.stat().st_size)


def _corpus_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json"))
        if not files:
            raise CorpusError(f"{path}: folder holds no .jsonl or .json files")
        return files
    if not path.exists():
        raise CorpusError(f"{path}: no such file or folder")
    return [path]


def local_objects(path: str | Path) -> list[CorpusObject]:
    """The objects of a local corpus: a file, or a folder's .jsonl/.json files in name order."""
    return [_file_object(f) for f in _corpus_files(Path(path))]


@dataclass(frozen=True)
class _Source:
    """Where a record came from: the file, and its line (JSONL) or position (LoCoMo list)."""
    file: str
    record: int | None = None

    def __str__(self) -> str:
        return self.file if self.record is None else f"{self.file}, record {self.record}"


NEWLINE = b"\n"


def _jsonl_lines(f: BinaryIO, max_bytes: int) -> Iterator[tuple[int, bytes | int]]:
    """(line number, the line's bytes) per line; a line over `max_bytes` gives its size
    instead, read through in chunks so it is never held whole (memory stays bounded)."""
    lineno = 0
    while line := f.readline(max_bytes + 1):
        lineno += 1
        if line.endswith(NEWLINE) or len(line) <= max_bytes:
            yield lineno, line
            continue
        size = len(line)
        while not line.endswith(NEWLINE) and (line := f.readline(1 << 20)):
            size += len(line)
        yield lineno, size - line.endswith(NEWLINE)


def _decode_json(data: bytes, where: _Source, line_of: Callable[[int], str]) -> Any:
    """Parse one record's bytes; every way it can fail (not UTF-8, not JSON, nested past
    Python's recursion limit, an integer too long to convert) is a `CorpusError` naming it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{where}: not UTF-8 (byte 0x{data[e.start]:02x} at {line_of(e.start)})") \
            from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CorpusError(f"{where}: not valid JSON ({e.msg}, {line_of(e.pos)})") from None
    except RecursionError:
        raise CorpusError(f"{where}: JSON nested too deeply (over about "
                          f"{sys.getrecursionlimit()} levels)") from None
    except ValueError as e:  # e.g. an integer over Python's digit limit
        raise CorpusError(f"{where}: not valid JSON ({e})") from None


def _records(obj: CorpusObject, limits: CorpusLimits) -> Iterator[tuple[_Source, Any]]:
    """(source, item) for each record of an object, lazily; item is ("jsonl", obj),
    ("locomo", obj, default id) or the `CorpusError` met reading it. JSONL is streamed as bytes
    and decoded line by line, so a bad line costs that line only and memory stays bounded
    whatever the object's size; a .json (LoCoMo) object is parsed whole (they are small)."""
    name = obj.name
    if obj.jsonl:
        with obj.open() as f:
            for lineno, line in _jsonl_lines(f, limits.max_record_bytes):
                where = _Source(name, lineno)
                if isinstance(line, int):
                    yield where, CorpusError(
                        f"{where}: the record is {line:,} bytes, over the limit of "
                        f"{limits.max_record_bytes:,} (--max-record-bytes)")
                    continue
                if not line.strip():
                    continue
                try:
                    yield where, ("jsonl", _decode_json(line, where, lambda i: f"column {i + 1}"))
                except CorpusError as e:
                    yield where, e
        return
    where = _Source(name)
    size = obj.size()
    if size > limits.max_record_bytes:  # a .json file is parsed whole
        yield where, CorpusError(f"{where}: the file is {size:,} bytes, over the limit of "
                                 f"{limits.max_record_bytes:,} (--max-record-bytes; a .json file "
                                 "is read whole: give a large corpus as JSONL)")
        return
    with obj.open() as f:
        data = f.read(limits.max_record_bytes + 1)
    try:
        parsed = _decode_json(data, where, lambda i: f"line {data.count(NEWLINE, 0, i) + 1}")
    except CorpusError as e:
        yield where, e
        return
    stem = Path(name).stem
    if isinstance(parsed, list):  # locomo10.json: a list of samples
        for i, sample in enumerate(parsed, 1):
            yield _Source(name, i), ("locomo", sample, f"{stem}-{i}")
    else:
        yield where, ("locomo", parsed, stem)


def _locomo_id(sample: Any, default: str) -> str:
    sample_id = sample.get("sample_id") if isinstance(sample, dict) else None
    base = str(sample_id or default)
    return base if base.startswith("locomo") else f"locomo-{base}"


def _conversations(obj: CorpusObject, skip: bool, stats: ReadStats, limits: CorpusLimits,
                   seen_ids: set[str], new_ids: set[str]) -> Iterator[Conversation]:
    """The conversations of one object; an id in `seen_ids` or `new_ids` is a duplicate, and
    each id read is added to `new_ids` (a check pass gives a set of its own, so that the build
    pass of the same object does not find its ids taken)."""
    for src, item in _records(obj, limits):
        faults: QuestionFaults | None = [] if skip else None
        where = str(src)
        try:
            if isinstance(item, Exception):
                raise item
            if item[0] == "jsonl":
                conv = parse_record(item[1], where, limits, faults)
            else:
                cid = _locomo_id(item[1], item[2])
                try:
                    conv = parse_locomo(item[1], cid, where, limits, faults)
                except UnsafeIdError as e:
                    raise CorpusError(f"{where}: {e}", cid) from None
            cid = conv.conversation_id
            if cid in new_ids or cid in seen_ids:
                raise CorpusError(f"{where}: field 'conversation_id': duplicate id {cid!r}", cid)
        except CorpusError as e:
            if not skip:
                raise
            stats.add(Skip(src.file, src.record, e.conversation_id, None, str(e)))
            continue
        for index, error in faults or ():
            stats.add(Skip(src.file, src.record, conv.conversation_id, index, str(error)))
        new_ids.add(conv.conversation_id)
        stats.read += 1
        yield conv


def _check_mode(on_bad_record: str) -> bool:
    if on_bad_record not in ("fail", "skip"):
        raise ValueError(f"on_bad_record must be 'fail' or 'skip', got {on_bad_record!r}")
    return on_bad_record == "skip"


def iter_corpus(path: str | Path | list[CorpusObject], on_bad_record: OnBadRecord = "fail",
                stats: ReadStats | None = None,
                limits: CorpusLimits = DEFAULT_LIMITS) -> Iterator[Conversation]:
    """Yield the conversations of a corpus (a local path, or its objects); a bad record raises
    or is skipped, a bad question raises or is dropped (its conversation kept); each skip is
    added to `stats`. One pass, no validation ahead: see `CorpusStream` for that."""
    skip = _check_mode(on_bad_record)
    stats = stats if stats is not None else ReadStats()
    objects = path if isinstance(path, list) else local_objects(path)
    seen_ids: set[str] = set()
    for obj in objects:
        yield from _conversations(obj, skip, stats, limits, seen_ids, seen_ids)


# An object up to this size is read once into the driver's memory and its conversations parsed
# (checked) once, then built from that parse; a larger one is streamed twice (check, then
# build), or once in skip mode.
HOLD_BYTES = 64 * 2**20


class CorpusStream:
    """The conversations of a corpus, object by object, each object checked whole before any
    of its conversations is yielded: a bad record (fail mode) stops the read before anything
    of its object is built, naming object, record and field. Nothing is written to disk and
    memory stays bounded: an object of at most `hold_bytes` is read once, and its conversations
    are parsed (and so checked) once and built from that parse; a larger one is streamed twice (or once in skip mode, where a bad record is
    reported and left out as the build meets it). A bad record in a later object therefore
    stops the build after earlier objects were built; their commits are kept, and the same
    command re-run skips them. Skips go to `stats` (its sink writes the report) once each."""

    def __init__(self, objects: list[CorpusObject], on_bad_record: OnBadRecord = "fail",
                 stats: ReadStats | None = None, limits: CorpusLimits = DEFAULT_LIMITS,
                 hold_bytes: int = HOLD_BYTES, where: str = "corpus"):
        self.skip = _check_mode(on_bad_record)
        self.objects, self.limits, self.hold_bytes, self.where = objects, limits, hold_bytes, where
        self.stats = stats if stats is not None else ReadStats()
        self.objects_started = 0  # objects whose reading has begun
        self._seen: set[str] = set()
        self._it = self._read()
        self._primed: list[Conversation] = []

    def _held(self, obj: CorpusObject) -> CorpusObject | None:
        """The object read once into memory when it is small enough, else None."""
        if obj.size() > self.hold_bytes:
            return None
        with obj.open() as f:
            data = f.read()
        return CorpusObject(obj.name, lambda: io.BytesIO(data), lambda: len(data))

    def _read(self) -> Iterator[Conversation]:
        for obj in self.objects:
            self.objects_started += 1
            held = self._held(obj)
            if held is not None:  # checked whole and parsed once, then built from the parse
                yield from list(_conversations(held, self.skip, self.stats, self.limits,
                                               self._seen, self._seen))
            elif self.skip:  # one streamed pass: skips are met as they come
                yield from _conversations(obj, True, self.stats, self.limits, self._seen,
                                          self._seen)
            else:  # fail mode, too large to hold: a checking pass, then a building pass
                for _ in _conversations(obj, False, self.stats, self.limits, self._seen, set()):
                    pass
                yield from _conversations(obj, False, ReadStats(keep=0), self.limits,
                                          self._seen, self._seen)

    def prime(self) -> None:
        """Read up to the first conversation (checking the objects before it, and its own),
        so that a bad or empty corpus fails before anything starts; raises `CorpusError`."""
        if not self._primed:
            self._primed = [next(self._it, None)]
        if self._primed[0] is None:
            s = self.stats
            raise CorpusError(f"{self.where}: every record was skipped ({s.records_skipped:,} "
                              "bad records): no conversation left" if s.records_skipped else
                              f"{self.where}: the corpus is empty (no records)")

    def __iter__(self) -> Iterator[Conversation]:
        for conv in self._primed:
            if conv is not None:
                yield conv
        self._primed = []
        yield from self._it


def read_corpus(path: str | Path, on_bad_record: OnBadRecord = "fail",
                limits: CorpusLimits = DEFAULT_LIMITS) -> tuple[list[Conversation], ReadStats]:
    stats = ReadStats()
    return list(iter_corpus(path, on_bad_record, stats, limits)), stats


SKIP_REPORT = "skipped.jsonl"


def check_corpus(path: str | Path, on_bad_record: OnBadRecord = "fail",
                 limits: CorpusLimits = DEFAULT_LIMITS, report: IO[str] | None = None,
                 out: TextIO | None = None, shown: int = 20) -> ReadStats:
    """Read and validate the whole corpus, streaming (no conversation is held), before any
    heavy work, so a bad corpus fails in seconds rather than after Ray and the model start.
    Each skip goes to `report` (one JSON object a line: the full `skipped.jsonl`) and the
    first `shown` to `out` (stderr). A corpus that yields no conversation raises."""
    out = out if out is not None else sys.stderr
    sink = (lambda s: report.write(json.dumps(s.as_dict()) + "\n")) if report is not None else None
    stats = ReadStats(keep=shown, sink=sink)
    for _ in iter_corpus(path, on_bad_record, stats, limits):
        pass
    for s in stats.skipped:
        print(s.line(), file=out)
    if stats.total_skipped > len(stats.skipped):
        print(f"... and {stats.total_skipped - len(stats.skipped):,} more (all in {SKIP_REPORT})",
              file=out)
    if stats.read == 0:
        raise CorpusError(f"{path}: every record was skipped ({stats.records_skipped:,} bad "
                          "records): no conversation left" if stats.records_skipped else
                          f"{path}: the corpus is empty (no records)")
    return stats


def add_corpus_options(p: argparse.ArgumentParser) -> None:
    """The corpus options `jobs.build` and `jobs.evaluate` share."""
    p.add_argument("--on-bad-record", default="fail", choices=["fail", "skip"],
                   help="a malformed record (or question) stops the run, or is skipped (a "
                        "question: dropped, its conversation kept) and listed in skipped.jsonl")
    p.add_argument("--max-record-bytes", type=int, default=DEFAULT_LIMITS.max_record_bytes,
                   help="largest JSONL line (or .json file) accepted, in bytes")
    p.add_argument("--max-turn-chars", type=int, default=DEFAULT_LIMITS.max_turn_chars,
                   help="longest turn text (or caption) accepted, in characters")


def limits_from_args(a: argparse.Namespace) -> CorpusLimits:
    return CorpusLimits(max_record_bytes=a.max_record_bytes, max_turn_chars=a.max_turn_chars)


def select_conversations(conversations: Iterable[Conversation], ids: str,
                         where: str) -> list[Conversation]:
    """The conversations named in `ids` (comma-separated; `26` also names `locomo-26`), in
    corpus order; a name that matches none is a `CorpusError` naming the corpus `where`."""
    wanted = [w.strip() for w in ids.split(",") if w.strip()]
    chosen = set(wanted) | {f"locomo-{w}" for w in wanted}
    picked = [c for c in conversations if c.conversation_id in chosen]
    found = {c.conversation_id for c in picked}
    missing = [w for w in wanted if w not in found and f"locomo-{w}" not in found]
    if missing:
        raise CorpusError(f"{where}: no conversation with id {', '.join(missing)}")
    return picked


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
