"""LoCoMo samples are checked as the project's JSONL is: a turn's speaker is one of the two, a
`dia_id` is one turn's, and session keys are read by number (`session_01` is session 1)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.corpus.locomo import parse_locomo
from pipeline.corpus.schema import CorpusError

SAMPLE = {"conversation": {
    "speaker_a": "Ann", "speaker_b": "Bo",
    "session_1": [{"dia_id": "D1:1", "speaker": "Ann", "text": "Hi Bo."},
                  {"dia_id": "D1:2", "speaker": "Bo", "text": "Hi Ann."}],
    "session_1_date_time": "1 May", "session_2_date_time": "2 May",
    "session_2": [{"dia_id": "D2:1", "speaker": "Ann", "text": "Back again."}]},
    "qa": [{"question": "Who?", "answer": "Bo", "evidence": ["D1:2"], "category": 1}]}


def _parse(sample: dict):
    return parse_locomo(sample, "locomo-t", "t.json")


def test_the_sample_reads():
    conv = _parse(SAMPLE)
    assert [t.session for t in conv.turns] == [1, 1, 2]


def test_a_speaker_not_among_the_two_is_named():
    bad = copy.deepcopy(SAMPLE)
    bad["conversation"]["session_2"][0]["speaker"] = "Cy"
    with pytest.raises(CorpusError, match=r"session_2\[0\]\.speaker': 'Cy' is neither"):
        _parse(bad)


def test_a_duplicate_dia_id_names_both_turns():
    bad = copy.deepcopy(SAMPLE)
    bad["conversation"]["session_2"][0]["dia_id"] = "D1:1"
    with pytest.raises(CorpusError, match=r"duplicate id 'D1:1' \(also session_1\[0\]\)"):
        _parse(bad)


def test_a_zero_padded_session_key_is_its_number_and_two_keys_of_one_number_are_refused():
    padded = copy.deepcopy(SAMPLE)
    conv = padded["conversation"]
    conv["session_02"] = conv.pop("session_2")
    conv["session_02_date_time"] = conv.pop("session_2_date_time")
    turns = _parse(padded).turns
    assert [(t.turn_id, t.session, t.timestamp) for t in turns][-1] == ("D2:1", 2, "2 May")
    conv["session_2"] = [{"dia_id": "D2:9", "speaker": "Bo", "text": "Twice?"}]
    with pytest.raises(CorpusError, match=r"is session 2 again"):
        _parse(padded)


@given(st.permutations(["session_1", "session_2", "session_3"]), st.sampled_from(["", "0", "00"]))
def test_sessions_are_read_in_number_order_whatever_the_key_order_and_padding(order, pad):
    conv = {"speaker_a": "Ann", "speaker_b": "Bo"}
    for key in order:
        n = key.split("_")[1]
        conv[f"session_{pad}{n}"] = [{"dia_id": f"D{n}:1", "speaker": "Ann", "text": n}]
    assert [t.session for t in _parse({"conversation": conv}).turns] == [1, 2, 3]
