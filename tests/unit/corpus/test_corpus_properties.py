"""Property-based: the corpus reader, given random or mutated records (JSONL lines and LoCoMo
.json files, as bytes), raises only `CorpusError` in fail mode and never raises in skip mode,
where every record it does not return is reported as a skip."""

from __future__ import annotations

import copy
import io
import json

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipeline.corpus.reader import CorpusObject, ReadStats, iter_corpus
from pipeline.corpus.records import CorpusLimits
from pipeline.corpus.schema import CorpusError

LIMITS = CorpusLimits(max_record_bytes=4096, max_turn_chars=200)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# JSON values, with text that may hold lone surrogates (valid JSON escapes, not valid text)
TEXT = st.text(st.characters(exclude_categories=()), max_size=12)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(TEXT, kids, max_size=4), max_leaves=16)

RECORD = {"conversation_id": "c-1", "speakers": ["Ann", "Bob"],
          "turns": [{"turn_id": "D1:1", "speaker": "Ann", "text": "Hi.", "session": 1,
                     "timestamp": "1 May"},
                    {"turn_id": 2, "speaker": "Bob", "text": "", "caption": "a photo",
                     "session": 2, "timestamp": "2 May"}],
          "questions": [{"question": "Who?", "answer": "Ann", "evidence": ["D1:1."],
                         "category": 1}]}
LOCOMO = {"sample_id": "7", "conversation": {
    "speaker_a": "Ann", "speaker_b": "Bob", "session_1_date_time": "1 May",
    "session_1": [{"speaker": "Ann", "dia_id": "D1:1", "text": "Hi."},
                  {"speaker": "Bob", "dia_id": "D1:2", "text": "Hey.", "blip_caption": "a dog"}]},
    "qa": [{"question": "Who?", "answer": "Ann", "evidence": ["D1:1; D1:2"], "category": 2},
           {"question": "What?", "adversarial_answer": "x", "evidence": ["D9:9"]}]}


def _paths(value, path=()):
    """Every path into a JSON value (dict keys and list indexes), the root first."""
    yield path
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from _paths(child, (*path, key))


@st.composite
def mutated(draw, valid):
    """`valid` with a few of its parts replaced by random JSON values or removed."""
    value = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(value))))
        if not path:
            return draw(JSON)
        parent = value
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()):
            parent[path[-1]] = draw(JSON)
        elif isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
    return value


def _object(name: str, data: bytes) -> CorpusObject:
    return CorpusObject(name, lambda: io.BytesIO(data), lambda: len(data))


def _read_both_ways(objects: list[CorpusObject]) -> None:
    """Fail mode raises `CorpusError` or returns; skip mode returns, having reported every
    record it left out."""
    try:
        list(iter_corpus(objects, "fail", limits=LIMITS))
    except CorpusError:
        pass
    stats = ReadStats()
    read = list(iter_corpus(objects, "skip", stats, LIMITS))
    assert stats.read == len(read)
    assert all(isinstance(s.reason, str) and s.reason for s in stats.skipped)


def _jsonl(lines: list) -> bytes:
    return b"".join((ln if isinstance(ln, bytes) else json.dumps(ln).encode()) + b"\n"
                    for ln in lines)


@FAST
@given(st.lists(mutated(RECORD) | JSON | st.binary(max_size=64), min_size=1, max_size=4))
def test_jsonl_records_raise_only_corpus_errors(lines):
    _read_both_ways([_object("c.jsonl", _jsonl(lines))])


@FAST
@given(mutated(LOCOMO) | st.lists(mutated(LOCOMO), max_size=2) | JSON)
@example({"conversation": {"speaker_a": "A", "speaker_b": "B", "session_" + "9" * 5000: []}})
@example(dict(LOCOMO, qa=[{"question": "Who?", "answer": "A", "evidence": 5}]))
def test_locomo_samples_raise_only_corpus_errors(sample):
    _read_both_ways([_object("locomo.json", json.dumps(sample).encode())])


@FAST
@given(st.binary(max_size=300), st.sampled_from(["c.jsonl", "c.json"]))
def test_random_bytes_raise_only_corpus_errors(data, name):
    _read_both_ways([_object(name, data)])


@FAST
@given(st.data())
def test_mutated_valid_records_that_pass_are_well_typed(data):
    """What passes validation is usable: text where text is expected (a caption or an
    evidence id of another type is a fault, not a value handed on)."""
    kind = data.draw(st.sampled_from(["jsonl", "locomo"]))
    if kind == "jsonl":
        obj = _object("c.jsonl", _jsonl([data.draw(mutated(RECORD))]))
    else:
        obj = _object("l.json", json.dumps(data.draw(mutated(LOCOMO))).encode())
    for conv in iter_corpus([obj], "skip", ReadStats(), LIMITS):
        for turn in conv.turns:
            assert isinstance(turn.text, str) and isinstance(turn.speaker, str)
            assert turn.caption is None or isinstance(turn.caption, str)
        for q in conv.questions:
            assert isinstance(q.question, str) and all(isinstance(e, str) for e in q.evidence)
            assert q.category is None or isinstance(q.category, int)
