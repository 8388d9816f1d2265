"""Reading a corpus: a JSONL file, a LoCoMo file, or a folder of either, one record at a time.

A corpus is read lazily, so millions of conversations never sit in memory. A corpus is a list of
objects (`CorpusObject`: local files, or S3 objects read as streams); `check_corpus` reads a
whole corpus before any heavy work starts, and `CorpusStream` (the build's reader) checks each
object just before its conversations are handed out. With `on_bad_record="skip"` a malformed
record is reported (a `Skip`) and the read goes on instead of failing.
"""

from __future__ import annotations

import io
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, Callable, Iterable, Iterator, Literal, TextIO

from pipeline.corpus.locomo import locomo_id, parse_locomo
from pipeline.corpus.records import DEFAULT_LIMITS, CorpusLimits, QuestionFaults, parse_record
from pipeline.corpus.schema import Conversation, CorpusError, UnsafeIdError

OnBadRecord = Literal["fail", "skip"]
SKIP_REPORT = "skipped.jsonl"  # where a skip-mode run lists every skip, one JSON object a line


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
    def opened() -> BinaryIO:
        try:
            return file.open("rb")
        except OSError as e:  # unreadable (permissions), or gone since it was listed
            raise CorpusError(f"{file}: cannot be read ({e.strerror or e})") from None
    return CorpusObject(file.name, opened, lambda: file.stat().st_size)


def _corpus_files(path: Path) -> list[Path]:
    """The corpus files: `path`, or its folder's .jsonl/.json files; a listing that fails or an
    entry that is a folder is a `CorpusError` naming it (one line, not a traceback)."""
    try:
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json"))
            if not files:
                raise CorpusError(f"{path}: folder holds no .jsonl or .json files")
        elif not path.exists():
            raise CorpusError(f"{path}: no such file or folder")
        else:
            files = [path]
    except OSError as e:
        raise CorpusError(f"{path}: cannot be listed ({e.strerror or e})") from None
    for f in files:
        if f.is_dir():
            raise CorpusError(f"{f}: a folder named like a corpus file")
    return files


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
        raise CorpusError(
            f"{where}: not UTF-8 (byte 0x{data[e.start]:02x} at {line_of(e.start)})") from None
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
        yield where, CorpusError(f"{e}; {FORMAT_RULE}") if _looks_like_jsonl(data) else e
        return
    if isinstance(parsed, dict) and "turns" in parsed and "conversation" not in parsed:
        yield where, CorpusError(f"{where}: holds one record of the project's JSONL (a 'turns' "
                                 f"field), not a LoCoMo sample; {FORMAT_RULE}")
        return
    stem = Path(name).stem
    if isinstance(parsed, list):  # locomo10.json: a list of samples
        for i, sample in enumerate(parsed, 1):
            yield _Source(name, i), ("locomo", sample, f"{stem}-{i}")
    else:
        yield where, ("locomo", parsed, stem)


FORMAT_RULE = ("the format is chosen by the name: a .jsonl file is the project's JSONL (one "
               "record a line), any other file one JSON document (LoCoMo's) and was read as "
               "one: give JSONL a .jsonl name (stdin too: save it to a .jsonl file)")


def _looks_like_jsonl(data: bytes) -> bool:
    """Whether a document that failed to parse whole is JSON objects one a line (JSONL)."""
    lines = [line for line in data.splitlines() if line.strip()]
    try:
        return len(lines) > 1 and isinstance(json.loads(lines[0]), dict)
    except (ValueError, RecursionError):
        return False


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
                cid = locomo_id(item[1], item[2])
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
    are parsed (and so checked) once and built from that parse; a larger one is streamed twice (or
    once in skip mode, where a bad record is reported and left out as the build meets it). A bad
    record in a later object therefore stops the build after earlier objects were built; their
    commits are kept, and the same command re-run skips them. Skips go to `stats` (its sink writes
    the report) once each."""

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
                              f"bad records, each in {SKIP_REPORT}): no conversation left"
                              if s.records_skipped else
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
                          f"records, each in {SKIP_REPORT}): no conversation left"
                          if stats.records_skipped else
                          f"{path}: the corpus is empty (no records)")
    return stats


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


def write_jsonl(conversations: Iterable[Conversation], path: str | Path) -> None:
    """Write the corpus whole or not at all: into a temporary file beside `path`, renamed over
    it once complete, so a full disk or an interruption leaves no half-written corpus (an
    earlier file stays as it was). A path that exists and is not a regular file (/dev/stdout, a
    pipe, a device) is written in place: renaming over it would replace the device. An error
    is the `OSError` of the write."""
    path = Path(path)
    if path.exists() and not path.is_file():
        with path.open("w", encoding="utf-8") as f:
            _write_records(conversations, f)
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # the umask's permissions, as `open`
    try:
        with tmp.open("w", encoding="utf-8") as f:
            _write_records(conversations, f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_records(conversations: Iterable[Conversation], f: TextIO) -> None:
    f.writelines(json.dumps(conv.to_record(), ensure_ascii=False) + "\n" for conv in conversations)
