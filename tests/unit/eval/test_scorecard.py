"""The scorecard's figures (pipeline.eval.scorecard): measures a copy cannot win, intervals,
paired differences and each measure's signal, on hand-made records."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pipeline.eval.page import scorecard_table
from pipeline.eval.scorecard import (
    CEILING,
    RAG,
    copy_free_turns,
    group_scorecard,
    nll_triple,
    retention_of_means,
    scorecard,
)


def _record(method, budget, q, answer, turns, topup=(), conv="c1", **more):
    """One question's record: `turns` maps evidence turn -> evidence-recall NLL."""
    return {"conversation_id": conv, "question_index": q, "method": method, "budget": budget,
            "answer_nll": answer, "evidence_probed": list(turns),
            "evidence_nlls": list(turns.values()),
            "evidence_nll": float(np.mean(list(turns.values()))),
            "topup_turn_ids": list(topup), "topup_tokens": 10 * len(topup),
            "kept_entries": 100.0 if budget else 7000.0,
            "decode_entries": (100.0 if budget else 7000.0) + 10 * len(topup), **more}


def test_retention_of_means_skips_what_is_undefined():
    method = np.array([2.0, 3.0, np.nan])
    low, high = np.array([4.0, 4.0, 9.0]), np.array([1.0, 2.0, 0.0])
    # means over the two defined questions: low 4, high 1.5, method 2.5 -> 1.5 / 2.5
    assert retention_of_means(method, low, high) == pytest.approx(0.6)
    assert math.isnan(retention_of_means(np.array([1.0]), np.array([1.0]), np.array([2.0])))


def test_copy_free_evidence_reads_only_the_turns_the_top_up_does_not_hold():
    none = _record("none", None, 0, 4.0, {"a": 4.0, "b": 5.0})
    full = _record("full", None, 0, 3.0, {"a": 1.0, "b": 2.0})
    topped = _record("rag", None, 0, 3.5, {"a": 0.5, "b": 4.5}, topup=("a",))
    assert copy_free_turns(topped) == ["b"]
    assert nll_triple(topped, none, full, "copy_free") == (4.5, 5.0, 2.0)
    assert nll_triple(topped, none, full, "evidence") == (2.5, 4.5, 1.5)  # the copy counts here
    assert nll_triple(topped, none, full, "answer") == (3.5, 4.0, 3.0)
    every = _record("rag", None, 0, 3.5, {"a": 0.5}, topup=("a",))
    assert all(math.isnan(x) for x in nll_triple(every, none, full, "copy_free"))
    # beside a row whose top-up holds "b": no turn is left to compare the two on
    other = _record("rag", None, 0, 3.5, {"a": 0.5, "b": 0.5}, topup=("b",))
    assert copy_free_turns(topped, other) == []


def test_two_rows_are_compared_on_copy_free_over_the_turns_neither_top_up_holds():
    """The default (no top-up) recalls the easy turn "a" fully and the hard turn "b" at 20%; a
    row whose top-up holds "a" recalls "b" as well as the default. Each row's own copy-free
    figure reads its own turns (60% and 20%), but the lead compares them on "b" alone: 0, not
    the 40 points the easy turn the row's top-up took away would give."""
    records = []
    for q in range(20):
        low, high = 5.0 + 0.01 * q, 3.0 + 0.01 * q
        hard = low - 0.2 * (low - high)
        records += [_record("none", None, q, low, {"a": low, "b": low}),
                    _record("full", None, q, high, {"a": high, "b": high}),
                    _record("epicache", 512, q, hard, {"a": high, "b": hard}),
                    _record("wide+topup.enabled=true", 512, q, hard, {"a": high, "b": hard},
                            topup=("a",))]
    rows = {r["method"]: r for r in group_scorecard(records, "epicache")["rows"]}
    assert rows["epicache"]["copy_free"]["value"] == pytest.approx(0.6)
    assert rows["wide+topup.enabled=true"]["copy_free"]["value"] == pytest.approx(0.2)
    lead = rows["wide+topup.enabled=true"]["default_minus_row"]
    assert lead["copy_free"]["value"] == pytest.approx(0.0, abs=1e-9)
    assert lead["answer"]["value"] == pytest.approx(0.0, abs=1e-9)


def _run(n: int = 40, seed: int = 0, gap: float = 1.0) -> list[dict]:
    """n questions over two conversations: the default sits 60% of the way from no history to
    the full history on both measures, a baseline 30%, with noise; rag and the ceiling read the
    evidence turn "a" in their top-ups."""
    rng = np.random.default_rng(seed)
    records = []
    for q in range(n):
        conv = "c1" if q < n // 2 else "c2"
        low = 5.0 + rng.normal(0, 0.3)
        high = low - gap
        def at(share):
            return low - share * gap + rng.normal(0, 0.05)
        records += [
            _record("none", None, q, low, {"a": low, "b": low}, conv=conv),
            _record("full", None, q, high, {"a": high, "b": high}, conv=conv),
            _record("epicache", 512, q, at(0.6), {"a": at(0.6), "b": at(0.6)}, conv=conv,
                    route_hit=q % 2 == 0),
            _record("snapkv+topup.enabled=true", 512, q, at(0.3), {"a": high, "b": at(0.3)},
                    topup=("a",), conv=conv),
            _record(RAG, None, q, at(0.2), {"a": high, "b": low}, topup=("a",), conv=conv),
            _record(CEILING, None, q, at(1.0), {"a": high, "b": high}, topup=("a",), conv=conv)]
    return records


def test_the_scorecard_gives_each_row_its_retention_interval_and_the_defaults_lead():
    card = group_scorecard(_run(), "epicache")
    rows = {r["method"]: r for r in card["rows"]}
    assert set(rows) == {"full", "epicache", "snapkv+topup.enabled=true", RAG, CEILING}
    default, baseline = rows["epicache"], rows["snapkv+topup.enabled=true"]
    for measure, want in (("answer", 0.6), ("copy_free", 0.6)):
        figure = default[measure]
        assert figure["value"] == pytest.approx(want, abs=0.03)
        assert figure["lo"] < figure["value"] < figure["hi"]
    assert baseline["copy_free"]["value"] == pytest.approx(0.3, abs=0.03)
    assert baseline["evidence"]["value"] > baseline["copy_free"]["value"] + 0.2  # the copy
    lead = baseline["default_minus_row"]["answer"]
    assert lead["value"] == pytest.approx(0.3, abs=0.04) and lead["lo"] > 0
    assert "default_minus_row" not in default
    # over retrieval: (rag - m) / (rag - ceiling) on the answer NLLs: (0.6 - 0.2) / 0.8
    assert default["over_retrieval"]["value"] == pytest.approx(0.5, abs=0.04)
    assert rows[CEILING]["over_retrieval"]["value"] == pytest.approx(1.0)
    assert default["decode_entries"] == 100.0 and baseline["decode_entries"] == 110.0
    assert default["route_hit"] == pytest.approx(0.5)
    assert card["signal"]["answer"]["value"] == pytest.approx(1.0)
    assert card["signal"]["answer"]["full_better"] == 1.0 and not card["signal"]["answer"]["low"]
    assert set(card["signal_by_conversation"]) == {"c1", "c2"}


def test_a_measure_with_a_small_gap_is_marked_low_signal_and_groups_are_separate():
    card = group_scorecard(_run(gap=0.1), "epicache")
    assert card["signal"]["answer"]["low"]
    groups = scorecard(_run(), "epicache", {"tuning": ["c1"], "untouched": ["c2"]})
    assert groups["tuning"]["questions"] == groups["untouched"]["questions"] == 20
    assert set(groups["tuning"]["signal_by_conversation"]) == {"c1"}
    # the same seed: the intervals are reproducible
    twice = [json.dumps(group_scorecard(_run(), "epicache"), sort_keys=True) for _ in range(2)]
    assert twice[0] == twice[1]  # NaN-safe


def _on_a_curve(seed: int, cost: str, rows: list[tuple[float, int, float, str]]) -> list[dict]:
    """30 questions with their two references, and each (retention, budget, cost, method) row
    answering at about that retention, its `cost` field as given."""
    rng = np.random.default_rng(seed)
    records = []
    for q in range(30):
        low = 5.0 + rng.normal(0, 0.3)
        records += [_record("none", None, q, low, {"a": low}),
                    _record("full", None, q, low - 1.0, {"a": low - 1.0})]
        records += [_record(method, budget, q, low - share + rng.normal(0, 0.02), {"a": low},
                            **{cost: value}) for share, budget, value, method in rows]
    return records


def test_a_row_reading_more_entries_is_compared_with_the_default_at_its_entries():
    """A variant of the default that reads 150 entries at budget 512, where the default reads
    100 at 512 (60% retention) and 200 at 1024 (80%): the fair comparison is the default's
    curve at 150 (70%), not its 512 row; a row outside the curve gets none."""
    records = _on_a_curve(1, "decode_entries", [
        (0.6, 512, 100.0, "epicache"), (0.8, 1024, 200.0, "epicache"),
        (0.75, 512, 150.0, "wider"), (0.9, 1024, 400.0, "wider")])
    rows = {(r["method"], r["budget"]): r for r in group_scorecard(records, "epicache")["rows"]}
    wider = rows[("wider", 512)]
    assert wider["default_minus_row"]["answer"]["value"] == pytest.approx(-0.15, abs=0.02)
    fair = wider["default_minus_row_at_its_entries"]["answer"]
    assert fair["value"] == pytest.approx(-0.05, abs=0.02) and fair["lo"] < fair["value"]
    assert rows[("wider", 1024)]["default_minus_row_at_its_entries"] == {}  # past the curve
    assert "default_minus_row_at_its_entries" not in rows[("epicache", 1024)]


def test_a_row_storing_fewer_bytes_is_compared_with_the_default_at_its_bytes():
    """A low-bit code of the default at budget 512: the same entries as the default there (no
    equal-entries figure), a quarter of its bytes. The default stores 1 MiB at 128 (40%
    retention), 2 at 256 (60%), 4 at 512 (80%); the code keeps 75% at 1 MiB, so at equal bytes
    it leads the default by 35 points, at equal entries it trails by 5. The default at 128
    stores its own curve's bytes: no equal-bytes figure of its own."""
    mib = 2.0 ** 20
    records = _on_a_curve(2, "stored_cache_bytes", [
        (0.4, 128, mib, "epicache"), (0.6, 256, 2 * mib, "epicache"),
        (0.8, 512, 4 * mib, "epicache"), (0.75, 512, mib, "epicache+code.bits=4")])
    card = group_scorecard(records, "epicache")
    rows = {(r["method"], r["budget"]): r for r in card["rows"]}
    coded = rows[("epicache+code.bits=4", 512)]
    assert coded["default_minus_row"]["answer"]["value"] == pytest.approx(0.05, abs=0.02)
    assert "default_minus_row_at_its_entries" not in coded
    fair = coded["default_minus_row_at_its_bytes"]["answer"]
    assert fair["value"] == pytest.approx(-0.35, abs=0.02) and fair["hi"] < 0
    assert "default_minus_row_at_its_bytes" not in rows[("epicache", 128)]
    assert "equal bytes: -35." in scorecard_table(card, "epicache")


def _costed(n: int = 24) -> list[dict]:
    """Two conversations; the default reads a top-up and stores 4 MiB of caches a conversation
    built from 3 prefills of it, rag at the default's entries (budget 512) reads more turns,
    holding the evidence turn "a" on the even questions only, and the ceiling is 0.1 nats
    better than rag alone on answers (a low gap)."""
    rng = np.random.default_rng(3)
    records = []
    for q in range(n):
        conv = "c1" if q < n // 2 else "c2"
        low = 5.0 + rng.normal(0, 0.3)
        common = {"conv": conv, "category": 1 + q % 2, "evidence": ["a"],
                  "conversation_tokens": 1000, "turn_index_bytes": 2 ** 20}
        held = ("a",) if q % 2 == 0 else ("x",)
        records += [
            _record("none", None, q, low, {"a": low}, **common),
            _record("full", None, q, low - 1.0, {"a": low - 1.0}, **common),
            _record("epicache", 512, q, low - 0.6 - (0.4 if q % 2 else 0), {"a": low - 0.6},
                    topup=("y",), stored_cache_bytes=4 * 2 ** 20, build_tokens=3000,
                    fetched_bytes=2 ** 20 + 2 ** 20, **common),
            _record(RAG, 512, q, low - 0.8, {"a": low - 0.8}, topup=held + ("z",), **common),
            _record(RAG, None, q, low - 0.5, {"a": low - 0.5}, topup=("y",), **common),
            _record(CEILING, None, q, low - 0.6, {"a": low - 0.6}, topup=("y",), **common)]
    return records


def test_each_row_carries_its_costs_beside_its_answers():
    card = group_scorecard(_costed(), "epicache")
    rows = {(r["method"], r["budget"]): r for r in card["rows"]}
    default = rows[("epicache", 512)]
    # its caches and the turn index, once a conversation (not once a question)
    assert default["stored_bytes"] == 5 * 2 ** 20
    assert default["fetched_bytes"] == 2 * 2 ** 20
    assert default["build_tokens"] == 3000 and default["build_prefills"] == pytest.approx(3.0)
    assert default["question_prefill"] == 10
    assert rows[("full", None)]["question_prefill"] == 0  # no top-up: nothing at question time
    # the answer lead in nats: rag at 512 is 0.8 nats better than no history, the default
    # 0.6 on the even questions and 1.0 on the odd: on average as good
    nats = rows[(RAG, 512)]["default_minus_row_nats"]
    assert nats["value"] == pytest.approx(0.0, abs=0.01) and nats["lo"] < 0 < nats["hi"]


def test_over_retrieval_is_flagged_where_its_gap_is_too_small_to_judge_by():
    card = group_scorecard(_costed(), "epicache")
    assert card["retrieval_signal"]["value"] == pytest.approx(0.1, abs=0.01)
    assert card["retrieval_signal"]["low"]
    rows = {(r["method"], r["budget"]): r for r in card["rows"]}
    assert rows[("epicache", 512)]["over_retrieval"]["low"]
    assert not group_scorecard(_run(), "epicache")["retrieval_signal"]["low"]


def test_leads_by_category_and_by_whether_retrievals_turns_hold_the_evidence():
    """The default answers the odd questions (category 2, where rag's turns miss the evidence)
    0.4 nats better than the even ones: against rag at its budget it leads there and trails
    on the others."""
    card = group_scorecard(_costed(), "epicache")
    lines = {(line["method"], line["budget"], line["by"], line["group"]): line
             for line in card["breakdown"]}
    miss = lines[(RAG, 512, "retrieval", "none")]["default_minus_row"]
    hold = lines[(RAG, 512, "retrieval", "all")]["default_minus_row"]
    assert miss["value"] == pytest.approx(0.2, abs=0.02) and miss["lo"] > 0
    assert hold["value"] == pytest.approx(-0.2, abs=0.02) and hold["hi"] < 0
    assert lines[(RAG, 512, "category", "temporal")]["default_minus_row"]["value"] == \
        pytest.approx(miss["value"])
    # a row without a budget is grouped by rag's own top-up (which never holds "a"), and has
    # no lead: the default runs at no budget there
    assert {g for m, b, by, g in lines if (m, by) == (CEILING, "retrieval")} == {"none"}
    assert "default_minus_row" not in lines[(CEILING, None, "category", "multi-hop")]


def test_the_best_row_at_each_budget_is_named_with_its_lead_over_the_next():
    card = group_scorecard(_costed(), "epicache")
    [answers] = [b for b in card["best"] if b["measure"] == "answer"]
    # epicache and rag@512 both reach 0.8 of the gap on average, rag alone 0.5
    assert {answers["best"]["method"], answers["next"]["method"]} == {"epicache", RAG}
    assert answers["budget"] == 512 and answers["lead"]["lo"] < 0 < answers["lead"]["hi"]


def test_intervals_are_given_per_conversation_too():
    card = group_scorecard(_costed(), "epicache")
    lines = {line["conversation_id"]: line for line in card["per_conversation"]}
    assert set(lines) == {"c1", "c2"} and lines["c1"]["questions"] == 12
    lead = lines["c1"]["leads"]["rag@-"]
    assert lead["lo"] <= lead["value"] <= lead["hi"]
    assert set(lines["c1"]["leads"]) == {"rag@512", "rag@-", f"{CEILING}@-"}


def test_a_row_without_a_budget_competes_only_where_it_reads_no_more_than_the_default():
    """A wide retrieval row answers best of all but reads 10x the default's entries: it is not
    the best row at the default's budget; a narrow one that answers better is."""
    records = _costed()
    for r in [r for r in records if (r["method"], r["budget"]) == (RAG, None)]:
        wide = dict(r, method="rag+topup.max_tokens=2000", decode_entries=2000.0,
                    answer_nll=r["answer_nll"] - 2.0)
        narrow = dict(r, method="rag+topup.max_tokens=90", decode_entries=90.0,
                      answer_nll=r["answer_nll"] - 1.0)
        records += [wide, narrow]
    [answers] = [b for b in group_scorecard(records, "epicache")["best"]
                 if b["measure"] == "answer"]
    assert answers["best"]["method"] == "rag+topup.max_tokens=90"
    assert answers["best"]["budget"] is None and answers["lead"]["lo"] > 0
