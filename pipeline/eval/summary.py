"""Gathering cell records: retention per question, and summaries per method, budget and group.

Retention = (NLL_none - NLL_method) / (NLL_none - NLL_full); the headline figure is the
retention of the mean NLLs over many questions (one question is noise).
"""

from __future__ import annotations

import numpy as np

from pipeline.eval.metrics import retention
from pipeline.eval.scorecard import evidence_third


def with_retention(records: list[dict]) -> list[dict]:
    """Add per-question retention, from the `full` and `none` records of the same question."""
    refs = {(r["conversation_id"], r["question_index"], r["method"]): r for r in records
            if r["method"] in ("full", "none")}
    out = []
    for r in records:
        full = refs.get((r["conversation_id"], r["question_index"], "full"))
        none = refs.get((r["conversation_id"], r["question_index"], "none"))
        value = float("nan")
        if full is not None and none is not None:
            value = retention(none["evidence_nll"], r["evidence_nll"], full["evidence_nll"])
        out.append(r | {"retention": value})
    return out


def summarise_by(records: list[dict], key: str) -> list[dict]:
    """Retention of the mean NLLs per (method, budget, group), the groups being the values of
    `key` ("route_hit", or "evidence_third": the evidence's relative position in thirds). The
    references are the full and no-history NLLs of the same questions."""
    def group_of(r):
        return evidence_third(r.get("evidence_position")) if key == "evidence_third" else r.get(key)

    refs = {(r["conversation_id"], r["question_index"], r["method"]): r["evidence_nll"]
            for r in records if r["method"] in ("full", "none")}
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if group_of(r) is not None:
            groups.setdefault((r["method"], r["budget"], group_of(r)), []).append(r)
    out = []
    for (method, budget, group), g in groups.items():
        keys = [(r["conversation_id"], r["question_index"]) for r in g]
        full = nan_mean(refs.get(k + ("full",)) for k in keys)
        none = nan_mean(refs.get(k + ("none",)) for k in keys)
        out.append({"method": method, "budget": budget, "group": group, "questions": len(g),
                    "retention_of_means": retention(
                        none, nan_mean(r["evidence_nll"] for r in g), full),
                    "evidence_kept": nan_mean(r.get("evidence_kept") for r in g)})
    return out


def nan_mean(values) -> float:
    values = [v for v in values if v is not None and not np.isnan(v)]
    return float(np.mean(values)) if values else float("nan")


def summarise(records: list[dict]) -> list[dict]:
    """One row per (method, budget): mean retention (per question, and of the mean NLLs),
    evidence NLL, answer NLL, F1 overall and per category."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["method"], r["budget"]), []).append(r)
    ref = {m: nan_mean(r["evidence_nll"] for r in records if r["method"] == m)
           for m in ("full", "none")}
    gap = ref["none"] - ref["full"]
    rows = []
    for (method, budget), g in groups.items():
        summary = {"method": method, "budget": budget, "questions": len(g),
               "retention": nan_mean(r["retention"] for r in g),
               "evidence_nll": nan_mean(r["evidence_nll"] for r in g),
               "answer_nll": nan_mean(r["answer_nll"] for r in g),
               "f1": nan_mean(r.get("f1") for r in g),
               "kept_entries": nan_mean(r["kept_entries"] for r in g),
               "decode_entries": nan_mean(r.get("decode_entries") for r in g),
               "cache_budget": nan_mean(r.get("cache_budget") for r in g),
               "kv_bytes": nan_mean(r.get("kv_bytes") for r in g),
               "bytes_tokens": nan_mean(r.get("bytes_tokens") for r in g),
               "quantized_share": nan_mean(r.get("quantized_share") for r in g),
               "merged_entries": nan_mean(r.get("merged_entries") for r in g),
               "evidence_kept": nan_mean(r.get("evidence_kept") for r in g),
               "route_hit": nan_mean(float(r["route_hit"]) for r in g
                                     if r.get("route_hit") is not None),
               "topup_tokens": nan_mean(r.get("topup_tokens") for r in g),
               "topup_recall": nan_mean(r.get("topup_recall") for r in g)}
        summary["retention_of_means"] = ((ref["none"] - summary["evidence_nll"]) / gap
                                         if gap > 0 else float("nan"))
        for cat in sorted({r["category"] for r in g if r["category"] is not None}):
            summary[f"f1_cat{cat}"] = nan_mean(r.get("f1") for r in g if r["category"] == cat)
        rows.append(summary)
    return rows
