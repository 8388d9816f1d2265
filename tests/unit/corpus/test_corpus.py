"""Reading corpora: JSONL validation errors that name file, record and field; skipping bad
records; unsafe ids; the LoCoMo reader on a small fixture (and on the real files when
present); rendering."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.corpus.reader import iter_corpus, read_corpus, select_conversations, write_jsonl
from pipeline.corpus.render import render_conversation, render_turn
from pipeline.corpus.schema import CorpusError, UnsafeIdError, check_safe_id
from tests.support.paths import REPO, SHARED

# The LoCoMo-format parsing tests read a small fixture written for the project (tests/data/locomo);
# the real LoCoMo lives beside the repository (../shared/data/locomo, or $LOCOMO_DIR), not in it,
# and its tests are skipped with the reason on a clone without it.
FIXTURE = REPO / "tests" / "data" / "locomo"
LOCOMO = Path(os.environ.get("LOCOMO_DIR") or SHARED / "data" / "locomo")
needs_locomo = pytest.mark.skipif(not (LOCOMO / "30.json").is_file(),
                                  reason=f"real LoCoMo data not found at {LOCOMO} "
                                         f"(set LOCOMO_DIR to run these tests)")


def good_record(cid: str = "conv-1") -> dict:
    return {
        "conversation_id": cid,
        "speakers": ["Ann", "Bob"],
        "turns": [
            {"turn_id": "t1", "speaker": "Ann", "text": "Hi Bob.", "session": 1,
             "timestamp": "1 May 2023"},
            {"turn_id": "t2", "speaker": "Bob", "text": "Hello Ann.", "session": 1,
             "timestamp": "1 May 2023", "caption": "a cat on a sofa"},
            {"turn_id": "t3", "speaker": "Ann", "text": "Bye.", "session": 2,
             "timestamp": "2 May 2023"},
        ],
        "questions": [{"question": "Who said hi?", "answer": "Ann", "evidence": ["t1"],
                       "category": 4}],
    }


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                            for line in lines),
                    encoding="utf-8")
    return path


def test_good_jsonl_reads_and_round_trips(tmp_path):
    """A valid file reads; write_jsonl of what was read reads back the same."""
    path = write_lines(tmp_path / "c.jsonl", [good_record("a"), good_record("b")])
    convs, stats = read_corpus(path)
    assert [c.conversation_id for c in convs] == ["a", "b"] and stats.read == 2
    assert convs[0].turns[1].caption == "a cat on a sofa"
    assert convs[0].questions[0].evidence == ("t1",)
    write_jsonl(convs, tmp_path / "again.jsonl")
    again, _ = read_corpus(tmp_path / "again.jsonl")
    assert [c.to_record() for c in again] == [c.to_record() for c in convs]


def _missing_turns(r):
    del r["turns"]


def _bad_speaker(r):
    r["turns"][1]["speaker"] = "Carol"


def _bad_session_type(r):
    r["turns"][2]["session"] = "two"


def _bad_evidence(r):
    r["questions"][0]["evidence"] = ["t1", "t9"]


BAD = [
    (_missing_turns, "turns", "is missing"),
    (_bad_speaker, "turns[1].speaker", "'Carol' is not one of speakers"),
    (_bad_session_type, "turns[2].session", "must be int, got str"),
    (_bad_evidence, "questions[0].evidence[1]", "'t9' is not a turn"),
]


@pytest.mark.parametrize("mutate,field,why", BAD, ids=[b[1] for b in BAD])
def test_validation_error_names_file_record_and_field(tmp_path, mutate, field, why):
    """The third record is bad: the error names the file, 'record 3' and the field path."""
    bad = good_record("c")
    mutate(bad)
    path = write_lines(tmp_path / "corpus.jsonl", [good_record("a"), good_record("b"), bad])
    with pytest.raises(CorpusError) as info:
        read_corpus(path)
    message = str(info.value)
    assert "corpus.jsonl" in message and "record 3" in message
    assert f"field '{field}'" in message and why in message


def test_invalid_json_line_is_reported(tmp_path):
    path = write_lines(tmp_path / "broken.jsonl", [good_record("a"), '{"conversation_id": "b",'])
    with pytest.raises(CorpusError, match=r"broken\.jsonl, record 2: not valid JSON"):
        read_corpus(path)


def test_record_numbers_are_line_numbers(tmp_path):
    """Blank lines are skipped but still counted, so 'record N' is the line to look at."""
    bad = good_record("b")
    _bad_speaker(bad)
    path = write_lines(tmp_path / "c.jsonl", [good_record("a"), "", bad])
    with pytest.raises(CorpusError, match="record 3"):
        read_corpus(path)


def test_skip_mode_skips_and_counts(tmp_path):
    """on_bad_record='skip': every bad record (schema error, bad JSON, duplicate id) is skipped
    and listed in ReadStats.skipped with where it was; a bad question drops only itself; good
    ones are read."""
    records = [good_record("a")]
    for i, (mutate, _, _) in enumerate(BAD):
        r = good_record(f"bad-{i}")
        mutate(r)
        records.append(r)
    records += ["not json at all", good_record("a"), good_record("z")]
    path = write_lines(tmp_path / "mixed.jsonl", records)
    convs, stats = read_corpus(path, on_bad_record="skip")
    # the record with bad evidence (bad-3) loses that question only: it is kept
    assert [c.conversation_id for c in convs] == ["a", "bad-3", "z"]
    assert (stats.read == 3 and stats.records_skipped == len(BAD) + 1
            and stats.questions_dropped == 1)
    wheres = [f"{s.file}, record {s.record}" for s in stats.skipped if s.question is None]
    assert wheres == [f"mixed.jsonl, record {n}" for n in range(2, len(records)) if n != 5]
    assert [(s.record, s.conversation_id, s.question) for s in stats.skipped
            if s.question is not None] == [(5, "bad-3", 0)]
    assert "duplicate id" in stats.skipped[-1].reason
    with pytest.raises(ValueError, match="on_bad_record"):
        list(iter_corpus(path, on_bad_record="ignore"))


@pytest.mark.parametrize("cid,why", [
    ("../x", "'..'"),
    ("a/b", "path separator"),
    ("a\\b", "path separator"),
    ("x\x00y", "control characters"),
    ("", "non-empty"),
    (".hidden", "starting with a letter or digit"),
    ("a b", "letters, digits"),
])
def test_unsafe_ids_are_rejected_with_the_reason(cid, why):
    """Each unsafe id raises UnsafeIdError (a CorpusError) whose message says why."""
    with pytest.raises(UnsafeIdError) as info:
        check_safe_id(cid)
    assert why in str(info.value)
    assert isinstance(info.value, CorpusError)


def test_unsafe_id_in_a_record_fails_the_record(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", [good_record("../escape")])
    with pytest.raises(CorpusError, match=r"record 1: field 'conversation_id'.*'\.\.'"):
        read_corpus(path)


def test_safe_ids_pass():
    for cid in ("conv-1", "locomo-30", "A.b_c-9", "x" * 128):
        assert check_safe_id(cid) == cid
    with pytest.raises(UnsafeIdError):
        check_safe_id("x" * 129)
    with pytest.raises(UnsafeIdError):
        check_safe_id(42)


# --------------------------------------------------------------------------------------------
# LoCoMo
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mini():
    """The hand-written LoCoMo-format sample (tests/data/locomo/mini.json)."""
    convs, stats = read_corpus(FIXTURE / "mini.json")
    assert stats.read == 1 and not stats.skipped
    return convs[0]


def test_locomo_fixture_turns_sessions_and_captions(mini):
    """Speakers, turns in session order with their session's date, blip_caption kept as the
    caption and rendered ' and shared <caption>.', other keys (img_url, events) ignored."""
    assert mini.conversation_id == "locomo-mini" and mini.speakers == ("Maya", "Tomas")
    assert mini.meta == {"source": "locomo"}
    assert [t.turn_id for t in mini.turns] == ["D1:1", "D1:2", "D1:3", "D2:1", "D2:2", "D2:3",
                                               "D3:1", "D3:2"]
    assert [t.session for t in mini.turns] == [1, 1, 1, 2, 2, 2, 3, 3]
    assert {t.session: t.timestamp for t in mini.turns} == {
        1: "1:56 pm on 8 May, 2023", 2: "10:37 am on 27 June, 2023", 3: "7:10 pm on 3 August, 2023"}
    captions = {t.turn_id: t.caption for t in mini.turns if t.caption}
    assert captions == {"D1:2": "a photo of a brown dog running on a beach",
                        "D3:2": "a photography of a blue ceramic vase on a table"}
    turn = mini.turns[1]
    assert render_turn(turn) == ('Tomas said, "Congratulations! Mine loves the beach, look." '
                                 'and shared a photo of a brown dog running on a beach.')
    assert render_turn(mini.turns[0]) == \
        'Maya said, "Hi Tomas! I finally adopted a dog last weekend."'


def test_locomo_fixture_questions_and_odd_evidence(mini):
    """'D2:1; D3:2' names two turns; an id naming no turn is dropped from the evidence and kept
    in meta; empty evidence stays empty; an int answer becomes a string; a category-5 item
    takes its adversarial_answer."""
    got = [(q.answer, q.evidence, q.category, q.meta) for q in mini.questions]
    assert got == [
        ("Biscuit", ("D2:2",), 4, {}),
        ("a blue vase", ("D2:1", "D3:2"), 1, {}),
        ("the weekend before 8 May 2023", ("D1:1",), 2, {"unknown_evidence": ["D9:9"]}),
        ("2023", ("D1:1",), 2, {}),
        ("Likely yes", (), 3, {}),
        ("Not mentioned in the conversation", ("D1:2",), 5, {}),
    ]
    assert mini.questions[0].question == "What is the name of Maya's dog?"


def test_locomo10_layout_list_of_nested_samples():
    """The original locomo10.json layout: a list of samples, sessions under 'conversation',
    'qa' beside it, the id from sample_id."""
    convs, stats = read_corpus(FIXTURE / "nested.json")
    assert stats.read == 1 and len(convs) == 1
    conv = convs[0]
    assert conv.conversation_id == "locomo-conv-7" and conv.speakers == ("Lena", "Omar")
    assert [(t.turn_id, t.session) for t in conv.turns] == [("D1:1", 1), ("D1:2", 1), ("D2:1", 2)]
    assert [(q.answer, q.evidence) for q in conv.questions] == [("14 May", ("D1:1", "D2:1"))]


def test_locomo_fixture_folder_reads_every_sample():
    """A folder of LoCoMo files (other files, like its README, ignored) reads each sample once."""
    convs, stats = read_corpus(FIXTURE)
    assert sorted(c.conversation_id for c in convs) == ["locomo-conv-7", "locomo-mini"]
    assert stats.read == 2 and not stats.skipped


@pytest.mark.parametrize("mutate,field,why", [
    (lambda s: s.pop("speaker_b"), "speaker_b", "is missing"),
    (lambda s: s["session_2"][1].pop("dia_id"), r"session_2\[1\]\.dia_id", "is missing"),
    (lambda s: s["qa"][5].pop("adversarial_answer"), r"qa\[5\]\.answer", "is missing"),
], ids=["speaker_b", "dia_id", "answer"])
def test_locomo_errors_name_file_and_field(tmp_path, mutate, field, why):
    """A broken LoCoMo sample fails naming the file and the field."""
    sample = json.loads((FIXTURE / "mini.json").read_text(encoding="utf-8"))
    mutate(sample)
    (tmp_path / "x.json").write_text(json.dumps(sample))
    with pytest.raises(CorpusError, match=rf"x\.json.*field '{field}': {why}"):
        read_corpus(tmp_path / "x.json")


def test_rendering_spans_point_at_turn_lines(mini):
    """The rendered text names both speakers, has a DATE line per session, and each turn span
    is exactly its rendered line."""
    _check_rendering(mini)


def _check_rendering(conv):
    rendered = render_conversation(conv)
    assert rendered.text.startswith(f"Below is a conversation between {conv.speakers[0]} and "
                                    f"{conv.speakers[1]}")
    n_sessions = len({t.session for t in conv.turns})
    assert rendered.text.count("DATE: ") == n_sessions
    for t in conv.turns:
        assert f"DATE: {t.timestamp}\nCONVERSATION:" in rendered.text
    assert len(rendered.turn_spans) == len(conv.turns)
    for turn, (start, end) in zip(conv.turns, rendered.turn_spans):
        assert rendered.text[start:end] == render_turn(turn)


# The real LoCoMo files, when present.

@pytest.fixture(scope="module")
def locomo30():
    convs, stats = read_corpus(LOCOMO / "30.json")
    assert stats.read == 1 and not stats.skipped
    return convs[0]


@needs_locomo
def test_locomo_reader(locomo30):
    """Conversation 30: two speakers, > 300 turns in session order, > 100 questions whose
    evidence names real turns; a captioned turn renders ' and shared <caption>.'"""
    conv = locomo30
    assert conv.conversation_id == "locomo-30" and len(conv.speakers) == 2
    assert len(conv.turns) > 300 and len(conv.questions) > 100
    sessions = [t.session for t in conv.turns]
    assert sessions == sorted(sessions) and sessions[0] == 1
    for t in conv.turns:
        assert t.turn_id.startswith(f"D{t.session}:") and t.speaker in conv.speakers
    known = {t.turn_id for t in conv.turns}
    assert all(e in known for q in conv.questions for e in q.evidence)
    captioned = [t for t in conv.turns if t.caption]
    assert captioned
    line = render_turn(captioned[0])
    assert " and shared " in line and line.endswith(f" and shared {captioned[0].caption}.")
    assert render_turn(conv.turns[0]) == f'{conv.turns[0].speaker} said, "{conv.turns[0].text}"'


@needs_locomo
def test_real_rendering_spans_point_at_turn_lines(locomo30):
    """The fixture's rendering check, on a real conversation (31 sessions, captions)."""
    _check_rendering(locomo30)


@needs_locomo
def test_locomo_folder_reads_ten_conversations():
    """All ten real files parse; the odd evidence of 26.json ('D8:6; D9:17') names two turns."""
    convs, stats = read_corpus(LOCOMO)
    assert len(convs) == 10 and stats.read == 10 and not stats.skipped
    assert len({c.conversation_id for c in convs}) == 10
    [c26] = [c for c in convs if c.conversation_id == "locomo-26"]
    assert any({"D8:6", "D9:17"} <= set(q.evidence) for q in c26.questions)


def test_missing_path_is_a_corpus_error(tmp_path):
    with pytest.raises(CorpusError, match="no such file"):
        read_corpus(tmp_path / "nope.jsonl")


def test_select_conversations_by_id_or_locomo_number(tmp_path):
    """`--conversations 30,x`: a bare LoCoMo number names locomo-<n>; corpus order is kept; an
    id that names nothing is an error naming the corpus and the id."""
    path = write_lines(tmp_path / "c.jsonl",
                       [good_record(c) for c in ("locomo-26", "x", "locomo-30", "y")])
    convs, _ = read_corpus(path)
    picked = select_conversations(convs, " 30, x ,", "c.jsonl")
    assert [c.conversation_id for c in picked] == ["x", "locomo-30"]
    with pytest.raises(CorpusError, match="c.jsonl: no conversation with id 41, z"):
        select_conversations(convs, "26,41,z", "c.jsonl")


def test_an_unsafe_id_is_echoed_back_at_most_80_characters():
    """The message goes back to whoever sent the id (a 400 over HTTP): not at any length."""
    with pytest.raises(UnsafeIdError) as info:
        check_safe_id("../" + "x" * 100_000)
    assert "contains '..'" in str(info.value) and len(str(info.value)) < 250
