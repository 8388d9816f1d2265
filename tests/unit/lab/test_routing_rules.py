"""`jobs.bench.routing`'s rules, scored from reads made once: each rule picks the read it
names, and its retention and lead are the scorecard's over those reads."""

from __future__ import annotations

import numpy as np
import pytest

from lab.routing_rules import BEST, DEFAULT, EVIDENCE, rule_picks, rule_records, rule_summary
from pipeline.routers import ROUTERS


def record(answer: float, evidence: float, topup: tuple[str, ...] = ()) -> dict:
    """A scorecard-shaped record: one evidence turn "t1" probed, the answer NLL."""
    return {"answer_nll": answer, "evidence_nll": evidence, "evidence_nlls": [evidence],
            "evidence_probed": ["t1"], "topup_turn_ids": list(topup)}


def reads(answers: list[float], holds: list[int], window: list[float], centroid: list[float],
          default_pick: tuple[int, ...] = (0,), default: dict | None = None) -> dict:
    by_episode = [record(a, a + 1.0) for a in answers]
    return {"by_episode": by_episode, "default": default or by_episode[default_pick[0]],
            "default_pick": default_pick, "holds": holds,
            "scores": {"window": np.array(window), "centroid": np.array(centroid)}}


def test_each_rule_picks_the_episode_it_names():
    read = reads(answers=[3.0, 2.0, 4.0], holds=[1, 0, 1], window=[0.2, 0.9, 0.5],
                 centroid=[0.7, 0.1, 0.3], default_pick=(1, 2))
    picks = rule_picks(read)
    assert picks[DEFAULT] == (1, 2)  # the route the product read, two episodes included
    assert picks["window"] == (1,) and picks["centroid"] == (0,)
    assert picks[EVIDENCE] == (2,)  # the evidence held (a tie) then the window router's order
    assert picks[BEST] == (1,)
    assert set(picks) == {DEFAULT, EVIDENCE, BEST, *ROUTERS}


def test_the_evidence_oracle_prefers_more_evidence_over_the_router():
    picks = rule_picks(reads(answers=[1.0, 1.0], holds=[1, 2], window=[0.9, 0.1],
                             centroid=[0.9, 0.1]))
    assert picks[EVIDENCE] == (1,)


def test_records_carry_each_rules_read_and_route_hit():
    joined = record(2.5, 3.5)
    read = reads(answers=[3.0, 2.0], holds=[0, 1], window=[0.9, 0.1], centroid=[0.1, 0.9],
                 default_pick=(0, 1), default=joined)
    records = {r["method"]: r for r in rule_records("c", [read])}
    assert records[DEFAULT]["answer_nll"] == 2.5 and records[DEFAULT]["route_hit"]
    assert records["window"]["answer_nll"] == 3.0 and not records["window"]["route_hit"]
    assert records["centroid"]["answer_nll"] == 2.0 and records["centroid"]["route_hit"]
    assert all(r["conversation_id"] == "c" and r["question_index"] == 0 and r["budget"] is None
               for r in records.values())


def references(n: int) -> list[dict]:
    """No history and the full history: answers at 5 and 1 nats, the evidence at 6 and 2."""
    return [record(nll, nll + 1.0) | {"conversation_id": "c", "method": method, "budget": None,
                                      "question_index": i}
            for method, nll in (("none", 5.0), ("full", 1.0)) for i in range(n)]


def test_the_summary_scores_each_rule_against_the_default_route():
    """No history answers at 5 nats, the full history at 1: an episode read at 3 retains 50%,
    at 2 75%. The window router reads the worse episode, the evidence oracle the better one."""
    n = 6
    rows = [reads(answers=[3.0, 2.0], holds=[0, 1], window=[0.9, 0.1], centroid=[0.1, 0.9])
            for _ in range(n)]
    table = {row["rule"]: row for row in rule_summary(references(n) + rule_records("c", rows))}
    assert table[DEFAULT]["answer"] == pytest.approx(50.0)
    assert table[DEFAULT]["answer_lead"] == "+0.0 [+0.0, +0.0]"
    assert table[EVIDENCE]["answer"] == pytest.approx(75.0)
    assert table[EVIDENCE]["answer_lead"] == "+25.0 [+25.0, +25.0]"
    assert table[EVIDENCE]["hit"] == 1.0 and table["window"]["hit"] == 0.0
    # copy-free: the evidence turn lies outside every top-up, read 1 nat above the answer
    assert table[BEST]["copy_free"] == pytest.approx(100 * (6.0 - 3.0) / (6.0 - 2.0))
