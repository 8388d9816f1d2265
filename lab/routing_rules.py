"""Routing rules scored from reads already made (`jobs.bench.routing`): every question read over
each episode's cache alone and over the default route's pick, so a rule's pick is one of those
reads and every rule is scored on the same measurements, against the scorecard's references.

A question's reads are a dict: `by_episode` (its scorecard-shaped record over each episode
alone), `default` (its record over the default route's pick, `default_pick`), `scores` (each
router's score of each episode) and `holds` (the evidence turns each episode's windows hold).
"""

from __future__ import annotations

import numpy as np

from pipeline.config import RoutingConfig
from pipeline.eval.scorecard import (
    HEADLINE,
    Rows,
    bootstrap_retention,
    paired_difference,
    resamples,
)
from pipeline.routers import ROUTERS, chosen

DEFAULT, EVIDENCE, BEST = "default", "evidence", "best episode"


def rule_picks(read: dict) -> dict[str, tuple[int, ...]]:
    """The episodes each rule reads for one question."""
    window = read["scores"][RoutingConfig().router]
    answers = [r["answer_nll"] for r in read["by_episode"]]
    episodes = range(len(read["holds"]))
    return {DEFAULT: tuple(read["default_pick"]),
            **{name: chosen(s) for name, s in read["scores"].items()},
            EVIDENCE: (max(episodes, key=lambda e: (read["holds"][e], window[e])),),
            BEST: (min(episodes, key=lambda e: answers[e]),)}


def rule_records(conversation_id: str, reads: list[dict]) -> list[dict]:
    """Scorecard-shaped records, one per rule and question (the rule in `method`)."""
    records = []
    for i, read in enumerate(reads):
        for rule, pick in rule_picks(read).items():
            record = read["default"] if rule == DEFAULT else read["by_episode"][pick[0]]
            records.append(record | {"conversation_id": conversation_id, "method": rule,
                                     "budget": None, "question_index": i,
                                     "route_hit": any(read["holds"][k] for k in pick)})
    return records


def rule_summary(records: list[dict]) -> list[dict]:
    """Per rule: its route hit, and on each headline measure its retention (%) and its paired
    lead over the default route (points, 90% interval)."""
    rows = Rows.of(records)
    keys = rows.keys()
    index = resamples(len(keys))
    table = []
    for rule in [DEFAULT, *ROUTERS, EVIDENCE, BEST]:
        row = {"rule": rule, "hit": float(np.nanmean(rows.values((rule, None), keys,
                                                                  "route_hit")))}
        for measure in HEADLINE:
            own = rows.arrays((rule, None), keys, measure)
            lead = paired_difference(own, rows.arrays((DEFAULT, None), keys, measure), index)
            row |= {measure: 100 * bootstrap_retention(own, index)["value"],
                    f"{measure}_lead": f"{100 * lead['value']:+.1f} [{100 * lead['lo']:+.1f}, "
                                       f"{100 * lead['hi']:+.1f}]"}
        table.append(row)
    return table
