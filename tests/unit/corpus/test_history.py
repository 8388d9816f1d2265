"""What a build covered of a record, and how a later record differs from it."""

from __future__ import annotations

import dataclasses

from pipeline.corpus.history import history_change, turns_digest
from pipeline.corpus.synthetic import make_corpus

TURNS = make_corpus(1, 400, seed=5)[0].turns


def test_the_digest_reads_what_the_model_reads_and_nothing_else():
    assert turns_digest(TURNS) == turns_digest(list(TURNS))
    assert len(turns_digest(TURNS)) == 16
    tagged = [dataclasses.replace(t, meta={"topic": "x"}) for t in TURNS]
    assert turns_digest(tagged) == turns_digest(TURNS)  # meta is not read by the build
    for change in ({"text": TURNS[0].text + "!"}, {"speaker": "Someone"}, {"session": 99},
                   {"timestamp": "never"}, {"caption": "a photo"}, {"turn_id": "other"}):
        assert turns_digest([dataclasses.replace(TURNS[0], **change), *TURNS[1:]]) != \
            turns_digest(TURNS), change


def test_a_record_is_unchanged_grown_or_edited():
    covered = len(TURNS) - 3
    digest = turns_digest(TURNS[:covered])
    assert history_change(TURNS[:covered], covered, digest) == "unchanged"
    assert history_change(TURNS, covered, digest) == "grown"
    edited = [*TURNS[:2], dataclasses.replace(TURNS[2], text="changed"), *TURNS[3:]]
    assert history_change(edited, covered, digest) == "edited"
    assert history_change(TURNS[:covered - 1], covered, digest) == "edited"  # a turn deleted
    assert history_change(TURNS[1:], covered, digest) == "edited"  # the first one deleted
