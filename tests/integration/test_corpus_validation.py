"""Bad input, caught before any heavy work: `jobs.build` / `jobs.evaluate` validate the whole
corpus first (a malformed one fails in seconds, before Ray starts, writing nothing), an empty
corpus is an error, bytes that are not UTF-8, JSON nested too deeply and oversize records or
turns are errors naming file and record (and skippable), skip mode reports what it skipped (on
stderr and in skipped.jsonl), and a bad question costs only that question."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
import ray

from jobs import build
from jobs import evaluate as evaluate_job
from lab.rehearsal import SYNTHETIC_CONFIG, SYNTHETIC_STAGES
from pipeline.builder import driver as build_driver
from pipeline.builder.driver import run_build
from pipeline.config import DriverOptions
from pipeline.corpus.reader import ReadStats, check_corpus, iter_corpus, read_corpus
from pipeline.corpus.records import CorpusLimits
from pipeline.corpus.schema import CorpusError
from pipeline.store.backends.local import LocalStore


def record(cid: str, *, text: str = "Hello there.", evidence: list | None = None,
           question: str = "Who said hello?") -> dict:
    """A valid record of two sessions; the question's evidence defaults to the first turn."""
    return {"conversation_id": cid, "speakers": ["Ann", "Bob"],
            "turns": [{"turn_id": "D1:1", "speaker": "Ann", "text": text, "session": 1,
                       "timestamp": "1 May 2023"},
                      {"turn_id": "D1:2", "speaker": "Bob", "text": "Hi Ann.", "session": 1,
                       "timestamp": "1 May 2023"},
                      {"turn_id": "D2:1", "speaker": "Ann", "text": "Bye.", "session": 2,
                       "timestamp": "2 May 2023"}],
            "questions": [{"question": "What did Bob say?", "answer": "Hi Ann.",
                           "evidence": ["D1:2"], "category": 4},
                          {"question": question, "answer": "Ann",
                           "evidence": ["D1:1"] if evidence is None else evidence}]}


def write_jsonl_bytes(path: Path, lines: list[bytes | dict | str]) -> Path:
    """Each line as given: raw bytes, a dict (JSON) or text; one per line."""
    with path.open("wb") as f:
        for line in lines:
            data = line if isinstance(line, bytes) else \
                (json.dumps(line) if isinstance(line, dict) else line).encode("utf-8")
            f.write(data + b"\n")
    return path


DEEP = b"[" * 100_000 + b"]" * 100_000


def _schema_error(r: dict) -> None:
    r["turns"][1]["speaker"] = "Eve"


# name -> (third line of the corpus, extra options, what the error must say)
MALFORMED = {
    "schema": (lambda: record("c", text="ok") | {"speakers": ["Ann"]}, [],
               "field 'turns[1].speaker'"),
    "not-utf8": (lambda: b'{"conversation_id": "c\xff"}', [], "not UTF-8 (byte 0xff"),
    "deep-nesting": (lambda: DEEP, [], "nested too deeply"),
    "huge-integer": (lambda: b'{"conversation_id": ' + b"9" * 5000 + b"}", [], "not valid JSON"),
    "record-too-big": (lambda: record("c", text="x" * 2000), ["--max-record-bytes", "1000"],
                       "over the limit of 1,000 (--max-record-bytes)"),
    "turn-too-long": (lambda: record("c", text="x" * 51), ["--max-turn-chars", "50"],
                      "field 'turns[0].text': is 51 characters, over the limit of 50"),
    "bad-question": (lambda: record("c", evidence=["D9:9"]), [],
                     "field 'questions[1].evidence[0]': turn id 'D9:9' is not a turn"),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_corpus_fails_before_ray_and_writes_nothing(tmp_path, capsys, monkeypatch, kind):
    """jobs.build on a corpus whose third line is bad: exit 2 with one line naming the file,
    the record and the fault, in seconds, with Ray never initialised and no store folder."""
    line, options, why = MALFORMED[kind]
    corpus = write_jsonl_bytes(tmp_path / "corpus.jsonl", [record("a"), record("b"), line()])
    store = tmp_path / "store"
    ray_was_up = ray.is_initialized()  # a whole-suite run may have the session's Ray up
    calls = []
    monkeypatch.setattr(build_driver, "init_ray", lambda *a: calls.append(a))
    start = time.perf_counter()
    rc = build.main(["--corpus", str(corpus), "--store", str(store), "--no-progress", *options])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: corpus.jsonl, record 3"), err
    assert why in lines[0] and "Traceback" not in err
    assert not calls and not store.exists()
    assert ray_was_up or not ray.is_initialized()
    assert elapsed < 5, elapsed


def test_question_fault_in_fail_mode_names_conversation_and_question(tmp_path):
    """Fail mode: an empty question stops the read, naming conversation and question index."""
    corpus = write_jsonl_bytes(tmp_path / "c.jsonl", [record("a"), record("b", question="  ")])
    with pytest.raises(CorpusError, match=r"c\.jsonl, record 2 \(conversation 'b'\): field "
                                          r"'questions\[1\]\.question': must not be empty"):
        read_corpus(corpus)


def test_evaluate_validates_before_ray_and_writes_nothing(tmp_path, capsys):
    """jobs.evaluate on a non-UTF-8 corpus: exit 2 naming file and line; no --out folder."""
    corpus = write_jsonl_bytes(tmp_path / "c.jsonl", [record("a"), b'{"x": "\xfe"}'])
    out = tmp_path / "eval-out"
    ray_was_up = ray.is_initialized()
    rc = evaluate_job.main(["--corpus", str(corpus), "--out", str(out), "--methods", "full",
                            "--budgets", "64"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: c.jsonl, record 2: not UTF-8 (byte 0xfe" in err, err
    assert not out.exists() and (ray_was_up or not ray.is_initialized())


@pytest.mark.parametrize("content,why", [
    (b"", "the corpus is empty (no records)"),
    (b"\n  \n\n", "the corpus is empty (no records)"),
])
def test_empty_corpus_is_exit_2(tmp_path, capsys, content, why):
    """No records, or only blank lines: exit 2, no store."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(content)
    store = tmp_path / "store"
    rc = build.main(["--corpus", str(corpus), "--store", str(store), "--on-bad-record", "skip",
                     "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and why in err.splitlines()[-1] and err.splitlines()[-1].startswith("error: ")
    assert not store.exists()


ALL_BAD = ["[1]", record("a") | {"speakers": ["Ann"]}, {}]
ALL_BAD_REASONS = ["c.jsonl, record 1: record must be a JSON object, got list",
                   "c.jsonl, record 2 (conversation 'a'): field 'turns[1].speaker'",
                   "c.jsonl, record 3: field 'conversation_id': is missing"]


def assert_reasons_then_error(err: str) -> None:
    """Each skip on stderr (record and field), then the report's path, then the error."""
    lines = err.strip().splitlines()
    assert [ln.startswith(f"skipped: {why}") for ln, why in zip(lines, ALL_BAD_REASONS)] == \
        [True] * 3, err
    assert lines[3].startswith("skip report: ") and lines[3].endswith("skipped.jsonl"), err
    assert lines[4].startswith("error: ") and len(lines) == 5, err
    assert "every record was skipped (3 bad records, each in skipped.jsonl)" in lines[4]


def assert_report(path: Path) -> None:
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [(r["record"], r["conversation_id"]) for r in rows] == [(1, None), (2, "a"), (3, None)]
    assert all(r["reason"].startswith(why) for r, why in zip(rows, ALL_BAD_REASONS))


def test_build_where_every_record_is_skipped_reports_why(tmp_path, capsys, monkeypatch):
    """Skip mode, every record bad: the reasons on stderr and in the store's skipped.jsonl (the
    store holds that report only), exit 2, and Ray never started."""
    corpus = write_jsonl_bytes(tmp_path / "c.jsonl", ALL_BAD)
    calls = []
    monkeypatch.setattr(build_driver, "init_ray", lambda *a: calls.append(a))
    store = tmp_path / "store"
    rc = build.main(["--corpus", str(corpus), "--store", str(store), "--on-bad-record", "skip",
                     "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and not calls
    assert_reasons_then_error(err)
    [key] = LocalStore(store).list()
    assert key.startswith("reports/") and f"skip report: {store.resolve()}/{key}" in err
    assert_report(store / key)


def test_evaluate_where_every_record_is_skipped_reports_why(tmp_path, capsys):
    corpus = write_jsonl_bytes(tmp_path / "c.jsonl", ALL_BAD)
    out = tmp_path / "eval-out"
    ray_was_up = ray.is_initialized()
    rc = evaluate_job.main(["--corpus", str(corpus), "--out", str(out), "--methods", "full",
                            "--budgets", "64", "--on-bad-record", "skip"])
    err = capsys.readouterr().err
    assert rc == 2 and (ray_was_up or not ray.is_initialized())
    assert_reasons_then_error(err)
    assert sorted(p.name for p in out.iterdir()) == ["skipped.jsonl"]
    assert_report(out / "skipped.jsonl")


def test_non_utf8_and_deep_nesting_are_skippable(tmp_path):
    """Skip mode: a non-UTF-8 line and a 100,000-level line are skipped with their line
    numbers, and every other line of the file is still read."""
    corpus = write_jsonl_bytes(tmp_path / "c.jsonl", [
        record("a"), b'{"conversation_id": "\xff\xfe"}', record("b"), DEEP, record("c")])
    stats = ReadStats()
    convs = list(iter_corpus(corpus, "skip", stats))
    assert [c.conversation_id for c in convs] == ["a", "b", "c"]
    assert [(s.file, s.record) for s in stats.skipped] == [("c.jsonl", 2), ("c.jsonl", 4)]
    assert "not UTF-8 (byte 0xff at column 22)" in stats.skipped[0].reason
    assert "nested too deeply" in stats.skipped[1].reason
    with pytest.raises(CorpusError, match=r"c\.jsonl, record 2: not UTF-8"):
        read_corpus(corpus)


def test_json_file_faults_name_the_line_and_skip_the_file(tmp_path):
    """A .json (LoCoMo) file is parsed whole: bad bytes name their line; nesting too deep
    and a file over --max-record-bytes are errors; skip mode skips that file only."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.json").write_bytes(b'{\n "speaker_a": "Ann",\n "speaker_b": "B\xffb"\n}')
    (folder / "b.json").write_bytes(DEEP)
    (folder / "c.jsonl").write_text(json.dumps(record("ok")) + "\n")
    with pytest.raises(CorpusError, match=r"a\.json: not UTF-8 \(byte 0xff at line 3\)"):
        read_corpus(folder)
    convs, stats = read_corpus(folder, "skip")
    assert [c.conversation_id for c in convs] == ["ok"]
    assert [(s.file, s.record) for s in stats.skipped] == [("a.json", None), ("b.json", None)]
    with pytest.raises(CorpusError, match=r"b\.json: JSON nested too deeply"):
        read_corpus(folder / "b.json")
    size = (folder / "a.json").stat().st_size
    with pytest.raises(CorpusError, match=rf"a\.json: the file is {size} bytes, over the limit"):
        read_corpus(folder / "a.json", limits=CorpusLimits(max_record_bytes=size - 1))


def test_record_size_limit_is_exact_and_bounded(tmp_path):
    """A line of exactly --max-record-bytes reads; one byte more is skipped without losing the
    lines after it (the oversize line is read through in chunks, line numbers stay right)."""
    fits = json.dumps(record("fits"))
    limit = len(fits.encode())
    over = json.dumps(record("over", text="Hello there!!"))  # 1 byte longer
    huge = json.dumps(record("huge", text="y" * 3_000_000))
    corpus = write_jsonl_bytes(tmp_path / "c.jsonl", [fits, over, huge, record("last")])
    stats = ReadStats()
    convs = list(iter_corpus(corpus, "skip", stats, CorpusLimits(max_record_bytes=limit)))
    assert [c.conversation_id for c in convs] == ["fits", "last"]
    assert [s.record for s in stats.skipped] == [2, 3]
    assert (f"the record is {limit + 1:,} bytes, over the limit of {limit:,}"
            in stats.skipped[0].reason)
    assert f"the record is {len(huge):,} bytes" in stats.skipped[1].reason


def test_bad_question_is_dropped_and_its_conversation_kept(tmp_path):
    """Skip mode: a question whose evidence names no turn, and one with an empty text, are
    dropped and reported with conversation and question index; the conversations are kept
    with their other questions."""
    corpus = write_jsonl_bytes(tmp_path / "c.jsonl", [
        record("a", evidence=["D7:1"]), record("b", question=""), record("c")])
    convs, stats = read_corpus(corpus, "skip")
    assert [c.conversation_id for c in convs] == ["a", "b", "c"]
    assert [len(c.questions) for c in convs] == [1, 1, 2]
    assert (stats.read, stats.records_skipped, stats.questions_dropped) == (3, 0, 2)
    assert [(s.record, s.conversation_id, s.question) for s in stats.skipped] == \
        [(1, "a", 1), (2, "b", 1)]
    assert ("field 'questions[1].evidence[0]': turn id 'D7:1' is not a turn"
            in stats.skipped[0].reason)
    assert "field 'questions[1].question': must not be empty" in stats.skipped[1].reason


def test_evidence_with_trailing_punctuation_resolves_unambiguously(tmp_path):
    """'D1:2.' (as a public corpus writes it) names turn D1:2; a turn id that itself ends in a
    dot is taken as it is, never stripped."""
    rec = record("a", evidence=["D1:1.", " D2:1;"])
    rec["turns"][1]["turn_id"] = "D1:2."
    rec["questions"][0]["evidence"] = ["D1:2."]
    convs, _ = read_corpus(write_jsonl_bytes(tmp_path / "c.jsonl", [rec]))
    assert convs[0].questions[0].evidence == ("D1:2.",)
    assert convs[0].questions[1].evidence == ("D1:1", "D2:1")


def _skip_corpus(path: Path) -> tuple[Path, int, int]:
    """25 bad records and 3 bad questions among good records: (path, records, questions)."""
    lines: list = [record("good-0")]
    for i in range(25):
        bad = record(f"bad-{i}")
        _schema_error(bad)
        lines.append(bad)
    lines += [record("q-0", evidence=["D9:1"]), record("q-1", question=""),
              record("q-2", evidence=["D1:1", "nope"]), b"\xff"]
    return write_jsonl_bytes(path, lines), 26, 3


def test_skip_report_on_stderr_and_in_the_store(tmp_path, capsys, monkeypatch):
    """jobs.build --on-bad-record skip: the first 20 skips on stderr and '... and N more', and
    all of them in <store>/reports/<run>/skipped.jsonl (file, record, conversation id, question
    index, reason), written before Ray starts (stopped there: the build itself is tested
    below with the real scheduler)."""
    corpus, n_records, n_questions = _skip_corpus(tmp_path / "corpus.jsonl")

    class Stop(Exception):
        pass

    def stop(*_):
        raise Stop

    monkeypatch.setattr(build_driver, "init_ray", stop)
    store = tmp_path / "store"
    with pytest.raises(Stop):
        build.main(["--corpus", str(corpus), "--store", str(store), "--on-bad-record", "skip",
                    "--no-progress"])
    err = capsys.readouterr().err.splitlines()
    shown = [ln for ln in err if ln.startswith(("skipped: ", "dropped question: "))]
    assert len(shown) == 20 and shown[0].startswith(
        "skipped: corpus.jsonl, record 2 (conversation 'bad-0'): field 'turns[1].speaker'")
    assert f"... and {n_records + n_questions - 20} more (all in skipped.jsonl)" in err
    reports = list(LocalStore(store).list("reports/"))
    assert len(reports) == 1 and reports[0].endswith("/skipped.jsonl")
    assert f"skip report: {store.resolve()}/{reports[0]}" in err
    rows = [json.loads(ln) for ln in (store / reports[0]).read_text().splitlines()]
    assert len(rows) == n_records + n_questions
    assert rows[0] == {"file": "corpus.jsonl", "record": 2, "conversation_id": "bad-0",
                       "question": None, "reason": rows[0]["reason"]}
    assert "'Eve' is not one of speakers" in rows[0]["reason"]
    assert [(r["record"], r["conversation_id"], r["question"]) for r in rows[25:]] == \
        [(27, "q-0", 1), (28, "q-1", 1), (29, "q-2", 1), (30, None, None)]
    assert "not UTF-8" in rows[-1]["reason"]


def test_skip_mode_build_counts_and_keeps_conversations_with_a_dropped_question(ray_local,
                                                                               tmp_path):
    """The driver's own (second) read skips the same records: the summary counts them, and a
    conversation that lost a question is still built."""
    corpus, n_records, n_questions = _skip_corpus(tmp_path / "corpus.jsonl")
    stats = check_corpus(corpus, "skip", out=io.StringIO())
    assert (stats.read, stats.records_skipped, stats.questions_dropped) == \
        (4, n_records, n_questions)
    store = LocalStore(tmp_path / "store")
    summary = run_build(str(corpus), store, SYNTHETIC_CONFIG, DriverOptions(progress=False),
                        on_bad_record="skip", stages=SYNTHETIC_STAGES)
    assert (summary.built, summary.bad_records, summary.questions_dropped) == \
        (4, n_records, n_questions)
    assert not summary.failed
    assert f"bad records skipped {n_records}; questions dropped {n_questions}" in summary.line()
    assert sorted(k.split("/")[1] for k in store.list("manifests/")) == \
        ["good-0.parquet", "q-0.parquet", "q-1.parquet", "q-2.parquet"]


def test_unpaired_surrogate_escape_is_not_text(tmp_path):
    """A JSON escape that decodes to an unpaired surrogate (valid JSON, not valid text: no
    tokenizer or file could take it) fails its record naming the field, before any build."""
    rec = record("a")
    rec["turns"][2]["text"] = "caf\u00e9 \ud800"
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps(rec) + "\n" + json.dumps(record("b")) + "\n")  # ASCII escapes
    with pytest.raises(CorpusError, match=r"record 1 \(conversation 'a'\): field 'turns\[2\]\.text'"
                                          r": is not valid text \(unpaired surrogate '\\ud800' at "
                                          r"character 6\)"):
        read_corpus(corpus)
    convs, stats = read_corpus(corpus, "skip")
    assert [c.conversation_id for c in convs] == ["b"] and stats.records_skipped == 1
