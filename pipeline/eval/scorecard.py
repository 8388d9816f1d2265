"""The scorecard's figures: retention on measures a copy cannot win, with bootstrap intervals.

Two headline measures, each a retention of the mean NLLs between no history (0) and the full
history (1), over the questions of a group:

- `answer`: the teacher-forced NLL of the gold answer after the question;
- `copy_free`: evidence recall over the evidence turns the question's top-up does not hold (a
  turn the top-up holds is probed by its own line a few dozen tokens after it: a copy), the
  references read over the same turns. Where two rows are compared (the default's lead), both
  are read over the turns neither's top-up holds: a larger top-up leaves fewer, harder turns,
  and rows read over different turns are not comparable.

Beside them `evidence`, today's evidence recall over every evidence turn (a diagnostic,
copy-prone where a top-up is read), and `over_retrieval`: (rag - m) / (rag - full+top-up) on
the answer NLLs, what a cache adds to the retrieved turns. Intervals are percentile bootstraps
over questions (90%); "the default beats row X" is a paired bootstrap of the difference, both
rows resampled with the same questions. Questions are few (tens per conversation): every figure
carries its interval and its count.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from pipeline.eval.methods import NO_HISTORY
from pipeline.eval.window import EVIDENCE_SESSIONS, SESSION_RUN

MEASURES = ("answer", "copy_free", "evidence")
HEADLINE = ("answer", "copy_free")
RAG, CEILING = "rag", "full+topup.enabled=true"  # the rows "over retrieval" is measured between
LEVEL = 0.90  # the intervals' coverage
RESAMPLES = 2000
# A measure whose none -> full gap's lower bound is below this has too little signal to judge a
# method in that group: retention divides by the gap.
LOW_SIGNAL_NATS = 0.25
# A row whose mean decode-time entries (or stored cache bytes) differ from the default's at its
# budget by more than this share reads (or stores) more or less than the default: it is also
# compared with the default's curve at its own entries (bytes), the record field -> its name.
EQUAL_COST_SLACK = 0.02
EQUAL_COSTS = {"decode_entries": "entries", "stored_cache_bytes": "bytes"}

Key = tuple[str, int]  # (conversation, question index)


def question_key(record: dict) -> Key:
    return record["conversation_id"], record["question_index"]


def _mean(values: Iterable[float]) -> float:
    values = [v for v in values if v is not None and np.isfinite(v)]
    return float(np.mean(values)) if values else float("nan")


def copy_free_turns(record: dict, *paired: dict) -> list[str]:
    """The evidence turns a record's read probed that neither its top-up nor those of the
    `paired` records (the same question in the rows it is compared with) hold."""
    held = {t for r in (record, *paired) for t in r.get("topup_turn_ids") or ()}
    return [t for t in record.get("evidence_probed") or () if t not in held]


def turn_nlls(record: dict) -> dict[str, float]:
    """A record's evidence-recall NLL by evidence turn."""
    return dict(zip(record.get("evidence_probed") or (), record.get("evidence_nlls") or ()))


def nll_triple(record: dict, none: dict, full: dict, measure: str,
               paired: Iterable[dict] = ()) -> tuple[float, float, float]:
    """(method, no history, full history) NLLs of one question on `measure` (NaN: undefined,
    e.g. copy-free where the top-up holds every evidence turn; `paired`: see
    `copy_free_turns`)."""
    if measure == "answer":
        return record["answer_nll"], none["answer_nll"], full["answer_nll"]
    if measure == "evidence":
        return record["evidence_nll"], none["evidence_nll"], full["evidence_nll"]
    turns = copy_free_turns(record, *paired)
    got, low, high = turn_nlls(record), turn_nlls(none), turn_nlls(full)
    return (_mean(got.get(t) for t in turns), _mean(low.get(t) for t in turns),
            _mean(high.get(t) for t in turns))


@dataclass(frozen=True)
class Rows:
    """The records of a run by (method, budget) and by question, and the references'."""
    by_row: dict[tuple[str, int | None], dict[Key, dict]]
    none: dict[Key, dict]
    full: dict[Key, dict]

    @classmethod
    def of(cls, records: list[dict]) -> "Rows":
        by_row: dict[tuple[str, int | None], dict[Key, dict]] = {}
        for r in records:
            by_row.setdefault((r["method"], r["budget"]), {})[question_key(r)] = r
        return cls(by_row, by_row.get((NO_HISTORY, None), {}), by_row.get(("full", None), {}))

    def keys(self, conversations: set[str] | None = None,
             reference: str | None = None) -> list[Key]:
        """The questions both references hold (of `conversations`, when given; whose
        full-history reference is of kind `reference`, when given), in order."""
        return sorted(k for k in self.full if k in self.none and
                      (conversations is None or k[0] in conversations) and
                      (reference is None or self.full[k].get("reference") == reference))

    def arrays(self, row: tuple[str, int | None], keys: list[Key], measure: str,
               paired: Iterable[tuple[str, int | None]] = ()) -> np.ndarray:
        """[3, questions]: the row's, no history's and full history's NLLs on `measure`
        (copy-free over the turns no top-up of the row and the `paired` rows holds)."""
        got = self.by_row.get(row, {})
        others = [self.by_row.get(p, {}) for p in paired]
        nan = (float("nan"),) * 3
        return np.array([nll_triple(got[k], self.none[k], self.full[k], measure,
                                    [o[k] for o in others if k in o]) if k in got
                         else nan for k in keys], dtype=float).reshape(-1, 3).T

    def values(self, row: tuple[str, int | None], keys: list[Key], field: str) -> np.ndarray:
        """The row's `field` per question of `keys` (NaN where the row lacks the question)."""
        got = self.by_row.get(row, {})
        return np.array([got[k][field] if k in got else float("nan") for k in keys],
                        dtype=float)


def retention_of_means(method: np.ndarray, low: np.ndarray, high: np.ndarray,
                       axis: int = -1) -> np.ndarray:
    """(mean low - mean method) / (mean low - mean high) over the questions where all three
    are defined (NaN where the high end is no better than the low)."""
    ok = np.isfinite(method) & np.isfinite(low) & np.isfinite(high)
    count = ok.sum(axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = [np.where(ok, x, 0).sum(axis=axis) / count for x in (method, low, high)]
        gap = means[1] - means[2]
        return np.where(gap > 0, (means[1] - means[0]) / gap, np.nan)


def resamples(n: int, seed: int = 0, draws: int = RESAMPLES) -> np.ndarray:
    """[draws, n] question indices drawn with replacement (fixed seed: the same draws for every
    row, so paired differences and rows' intervals use the same resamples)."""
    return np.random.default_rng(seed).integers(0, n, size=(draws, n)) if n else \
        np.zeros((draws, 0), dtype=int)


def interval(point: float, draws: np.ndarray) -> dict:
    draws = draws[np.isfinite(draws)]
    tail = 100 * (1 - LEVEL) / 2
    lo, hi = (np.percentile(draws, [tail, 100 - tail]) if len(draws) else (np.nan, np.nan))
    return {"value": float(point), "lo": float(lo), "hi": float(hi)}


def bootstrap_retention(triple: np.ndarray, index: np.ndarray) -> dict:
    """Retention of the means with its interval; `triple` [3, n] (method, low, high)."""
    point = retention_of_means(*triple)
    draws = retention_of_means(*(x[index] for x in triple))
    defined = np.isfinite(triple).all(axis=0)
    return interval(point, draws) | {"questions": int(defined.sum())}


def paired_difference(a: np.ndarray, b: np.ndarray, index: np.ndarray) -> dict:
    """Retention of row a minus row b, with the interval of the difference (paired: the same
    resampled questions for both)."""
    point = retention_of_means(*a) - retention_of_means(*b)
    draws = retention_of_means(*(x[index] for x in a)) - retention_of_means(*(x[index] for x in b))
    return interval(point, draws)


def nats_difference(a: np.ndarray, b: np.ndarray, index: np.ndarray) -> dict:
    """Row b's mean NLL less row a's over the questions both define (positive: a is better),
    with the interval of a paired bootstrap; `a`, `b` [3, n] as `Rows.arrays` gives them."""
    diff = b[0] - a[0]
    ok = np.isfinite(diff)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        draws = np.nanmean(np.where(ok, diff, np.nan)[index], axis=1)
    return interval(float(np.nanmean(diff)) if ok.any() else float("nan"), draws)


def lead_at_equal_cost(rows: Rows, default: str, row: tuple[str, int | None],
                       keys: list[Key], measure: str, index: np.ndarray,
                       cost: str = "decode_entries") -> dict | None:
    """The default's retention at the row's mean `cost`, less the row's: the default's curve
    (retention against its mean cost, linear between its budgets) read at the row's cost,
    every resample drawing its own curve from the same questions as the row's (paired). The
    fair comparison for a row that reads more decode-time entries than the default at its
    budget (a larger top-up read from the default's caches), or stores fewer bytes (a low-bit
    code: `cost="stored_cache_bytes"`). None where the default has fewer than two budgets or the
    row's cost lies outside its curve: no extrapolation."""
    budgets = sorted(b for m, b in rows.by_row if m == default and b is not None)
    if len(budgets) < 2:
        return None

    curve_rows = [(default, b) for b in budgets]
    curve = [(rows.arrays(r, keys, measure, [row, *curve_rows]), rows.values(r, keys, cost))
             for r in curve_rows]
    triple = rows.arrays(row, keys, measure, curve_rows)
    own = rows.values(row, keys, cost)

    def lead(ix: np.ndarray) -> np.ndarray:  # ix [draws, questions] -> [draws]
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a draw of all-NaN costs
            xs = np.stack([np.nanmean(c[ix], axis=1) for _, c in curve])
            ys = np.stack([retention_of_means(*(x[ix] for x in t)) for t, _ in curve])
            at = np.nanmean(own[ix], axis=1)
        return np.array([np.interp(a, x, y) if np.all(np.diff(x) > 0) and x[0] <= a <= x[-1]
                         else np.nan for a, x, y in zip(at, xs.T, ys.T)]) - \
            retention_of_means(*(x[ix] for x in triple))

    point = lead(np.arange(len(keys))[None, :])[0]
    return interval(point, lead(index)) if np.isfinite(point) else None


def signal(rows: Rows, keys: list[Key], measure: str) -> dict:
    """How much the full history is better than no history on `measure` over `keys`: the gap of
    the mean NLLs in nats (interval), the share of questions it is better on, and whether it is
    too small to judge a method by (`low`)."""
    none = np.array([nll_triple(rows.none[k], rows.none[k], rows.full[k], measure)[1]
                     for k in keys], dtype=float)
    full = np.array([nll_triple(rows.full[k], rows.none[k], rows.full[k], measure)[2]
                     for k in keys], dtype=float)
    ok = np.isfinite(none) & np.isfinite(full)
    none, full = none[ok], full[ok]
    gap = float(np.mean(none - full)) if len(none) else float("nan")
    draws = (none - full)[resamples(len(none))].mean(axis=1) if len(none) else np.array([])
    out = interval(gap, draws) | {"questions": int(ok.sum()),
                                  "full_better": float(np.mean(full < none)) if len(none) else
                                  float("nan")}
    return out | {"low": not out["lo"] >= LOW_SIGNAL_NATS}


def retrieval_signal(rag: np.ndarray, ceiling: np.ndarray) -> dict:
    """The gap "over retrieval" divides by: the mean answer NLL of `rag` less the ceiling's
    (the full history with the same top-up), in nats, with its interval; `low` where its lower
    bound is under `LOW_SIGNAL_NATS`, as for the none -> full gap."""
    ok = np.isfinite(rag) & np.isfinite(ceiling)
    diff = (rag - ceiling)[ok]
    draws = diff[resamples(len(diff))].mean(axis=1) if len(diff) else np.array([])
    out = interval(float(diff.mean()) if len(diff) else float("nan"), draws)
    return out | {"questions": int(ok.sum()), "low": not out["lo"] >= LOW_SIGNAL_NATS}


def _differs(cost: float, default_cost: float) -> bool:
    """Whether a row's mean cost is not the default's (beyond `EQUAL_COST_SLACK`); False
    where either is unknown."""
    return bool(default_cost > 0 and abs(cost / default_cost - 1) > EQUAL_COST_SLACK)


def _row_mean(records: dict[Key, dict], keys: list[Key], field: str) -> float:
    return _mean(records[k].get(field) for k in keys if k in records)


SESSIONS_PER_BIN = 5  # the evidence's session, reported in bins of this many sessions


def evidence_third(position: float | None) -> str | None:
    """The third of the conversation (its tokens) a relative position falls in."""
    if position is None or np.isnan(position):
        return None
    return ("first", "middle", "last")[min(int(position * 3), 2)]


def position_groups(record: dict) -> dict[str, str | None]:
    """Where a question's evidence lies (from its no-history record, laid out over the whole
    conversation): its third of the conversation's tokens and its first session's bin."""
    session = record.get("evidence_session")
    low = None if session is None else \
        SESSIONS_PER_BIN * ((int(session) - 1) // SESSIONS_PER_BIN) + 1
    return {"third": evidence_third(record.get("evidence_position")),
            "sessions": None if low is None else f"{low}-{low + SESSIONS_PER_BIN - 1}"}


# LoCoMo's question categories (5, adversarial, is never evaluated)
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}


def retrieval_holds(record: dict | None) -> str | None:
    """Whether a retrieval row's top-up holds a question's evidence turns: all, some or none."""
    if record is None:
        return None
    evidence, held = set(record.get("evidence") or ()), set(record.get("topup_turn_ids") or ())
    if not evidence:
        return None
    return "all" if evidence <= held else "some" if evidence & held else "none"


def breakdown(rows: Rows, keys: list[Key], default: str | None = None) -> list[dict]:
    """Answer retention (90% interval) of every row but the references, per group of
    questions: by the evidence's third and session bin, by LoCoMo category, by whether
    retrieval's turns hold the evidence (`rag` at the row's budget: at the default's entries
    there, its own top-up for a row without a budget), and for a routed row by whether its
    route read an evidence episode (`route_hit`); with the default's paired lead over the row
    in each group where the default runs at the row's budget."""
    where = {k: position_groups(rows.none[k]) for k in keys}
    out = []
    for (method, budget), got in rows.by_row.items():
        if method in (NO_HISTORY, "full") or not any(k in got for k in keys):
            continue
        retrieval = rows.by_row.get((RAG, budget)) or rows.by_row.get((RAG, None), {})
        by = {"third": lambda k: where[k]["third"], "sessions": lambda k: where[k]["sessions"],
              "category": lambda k: CATEGORIES.get(got[k].get("category")) if k in got else None,
              "retrieval": lambda k: retrieval_holds(retrieval.get(k)),
              "route_hit": lambda k: got[k].get("route_hit") if k in got else None}
        compared = default is not None and method != default and \
            (default, budget) in rows.by_row
        for name, group_of in by.items():
            groups: dict = {}
            for k in keys:
                group = group_of(k)
                if group is not None:
                    groups.setdefault(group, []).append(k)
            for group, own in sorted(groups.items(), key=lambda g: str(g[0])):
                index = resamples(len(own))
                line = {"method": method, "budget": budget, "by": name, "group": group,
                        "answer": bootstrap_retention(rows.arrays((method, budget), own,
                                                                  "answer"), index)}
                if compared:
                    line["default_minus_row"] = paired_difference(
                        rows.arrays((default, budget), own, "answer"),
                        rows.arrays((method, budget), own, "answer"), index)
                out.append(line)
    return out


def best_rows(table: list[dict], rows: Rows, keys: list[Key], index: np.ndarray,
              default: str | None = None) -> list[dict]:
    """Per budget and headline measure, the row with the highest retention among those read
    there (a budget's rows, and the rows without one that read no more entries than the
    default there: `rag` at its own top-up or at another size; the references and the ceiling
    left out), and its paired lead over the next best."""
    out = []
    budgets = sorted({r["budget"] for r in table if r["budget"] is not None})
    for budget in budgets:
        cap = next((r["decode_entries"] for r in table if (r["method"], r["budget"]) ==
                    (default, budget)), float("inf"))
        here = [r for r in table if r["method"] not in ("full", CEILING) and (
            r["budget"] == budget or r["budget"] is None and
            not r["decode_entries"] > cap * (1 + EQUAL_COST_SLACK))]
        for measure in HEADLINE:
            ranked = sorted((r for r in here if np.isfinite(r[measure]["value"])),
                            key=lambda r: -r[measure]["value"])
            if len(ranked) < 2:
                continue
            first, second = ranked[:2]
            a, b = ((r["method"], r["budget"]) for r in (first, second))
            out.append({"budget": budget, "measure": measure,
                        "best": {"method": a[0], "budget": a[1],
                                 measure: first[measure]},
                        "next": {"method": b[0], "budget": b[1], measure: second[measure]},
                        "lead": paired_difference(rows.arrays(a, keys, measure, [b]),
                                                  rows.arrays(b, keys, measure, [a]), index)})
    return out


def per_conversation(rows: Rows, keys: list[Key], default: str | None) -> list[dict]:
    """Per conversation and budget: the default's answer retention and its paired lead over
    every other row there, each with its interval over that conversation's questions alone
    (the pooled intervals hold for these conversations together, not for each)."""
    out = []
    if default is None:
        return out
    for cid in sorted({k[0] for k in keys}):
        own = [k for k in keys if k[0] == cid]
        index = resamples(len(own))
        for (method, budget) in sorted((r for r in rows.by_row if r[0] == default),
                                       key=lambda r: r[1] or 0):
            line = {"conversation_id": cid, "budget": budget, "questions": len(own),
                    "answer": bootstrap_retention(rows.arrays((method, budget), own, "answer"),
                                                  index), "leads": {}}
            for other in rows.by_row:
                if other[0] in (NO_HISTORY, "full", default) or other[1] not in (budget, None):
                    continue
                line["leads"][f"{other[0]}@{other[1] or '-'}"] = paired_difference(
                    rows.arrays((method, budget), own, "answer"),
                    rows.arrays(other, own, "answer"), index)
            out.append(line)
    return out


def per_conversation_mean(records: dict[Key, dict], keys: list[Key], value) -> float:
    """The mean over conversations of `value(record)` of each conversation's first record (a
    figure of the conversation, not of a question: bytes stored, build tokens)."""
    first: dict[str, dict] = {}
    for k in keys:
        if k in records:
            first.setdefault(k[0], records[k])
    return _mean(value(r) for r in first.values())


def costs(got: dict[Key, dict], keys: list[Key]) -> dict:
    """What a row costs beside what it answers: tokens prefilled at question time (its top-up;
    the question itself is the same in every row), bytes stored per conversation (its caches,
    and the turn index where it reads a top-up), bytes a cold question fetches (the cache(s)
    it reads and the turn index), and the tokens its build ran through the model per
    conversation, also in prefills of the conversation."""
    topped = {k[0] for k in keys if k in got and (got[k].get("topup_tokens") or 0) > 0}

    def stored(r: dict) -> float:
        index = r.get("turn_index_bytes") or 0 if r["conversation_id"] in topped else 0
        return (r.get("stored_cache_bytes") or float("nan")) + index

    def prefills(r: dict) -> float:
        tokens = r.get("conversation_tokens")
        return (r.get("build_tokens") or float("nan")) / tokens if tokens else float("nan")

    return {"question_prefill": _row_mean(got, keys, "topup_tokens"),
            "stored_bytes": per_conversation_mean(got, keys, stored),
            "fetched_bytes": _row_mean(got, keys, "fetched_bytes"),
            "build_tokens": per_conversation_mean(got, keys, lambda r: r.get("build_tokens")),
            "build_prefills": per_conversation_mean(got, keys, prefills)}


def group_scorecard(records: list[dict], default: str | None,
                    conversations: set[str] | None = None, reference: str | None = None) -> dict:
    """The scorecard of one group of conversations (all when None): per (method, budget) row,
    each measure's retention with its interval, "over retrieval", the default's paired lead
    on each headline measure, and the decode-time entries; and each measure's signal, for the
    group and per conversation."""
    rows = Rows.of(records)
    keys = rows.keys(conversations, reference)
    index = resamples(len(keys))
    rag, ceiling = (rows.values((r, None), keys, "answer_nll") for r in (RAG, CEILING))
    has_retrieval_rows = np.isfinite(rag).any() and np.isfinite(ceiling).any()
    retrieval_gap = retrieval_signal(rag, ceiling) if has_retrieval_rows else None
    table = []
    for (method, budget), got in rows.by_row.items():
        if method in (NO_HISTORY,) or not any(k in got for k in keys):
            continue
        triples = {m: rows.arrays((method, budget), keys, m) for m in MEASURES}
        line = {"method": method, "budget": budget,
               "questions": sum(k in got for k in keys),
               "decode_entries": _row_mean(got, keys, "decode_entries"),
               "cache_entries": _row_mean(got, keys, "kept_entries"),
               "topup_tokens": _row_mean(got, keys, "topup_tokens"),
               "cache_budget": _row_mean(got, keys, "cache_budget"),
               "route_hit": _mean(float(got[k]["route_hit"]) for k in keys
                                  if k in got and got[k].get("route_hit") is not None),
               "f1": _row_mean(got, keys, "f1"),
               "answered": sum(1 for k in keys if k in got and got[k].get("prediction")
                               is not None), **costs(got, keys)}
        line |= {m: bootstrap_retention(t, index) for m, t in triples.items()}
        if has_retrieval_rows:
            line["over_retrieval"] = bootstrap_retention(
                np.stack([triples["answer"][0], rag, ceiling]), index) | {
                "low": retrieval_gap["low"]}
        if default is not None and (default, budget) in rows.by_row and method != default:
            line["default_minus_row"] = {m: paired_difference(
                rows.arrays((default, budget), keys, m, [(method, budget)]),
                rows.arrays((method, budget), keys, m, [(default, budget)]), index)
                for m in HEADLINE}
            line["default_minus_row_nats"] = nats_difference(
                rows.arrays((default, budget), keys, "answer"), triples["answer"], index)
            for cost, name in EQUAL_COSTS.items():
                if budget is None or not _differs(_row_mean(got, keys, cost), _row_mean(
                        rows.by_row[(default, budget)], keys, cost)):
                    continue  # the same cost (or none known): the lead above is the fair one
                fair = {m: lead_at_equal_cost(rows, default, (method, budget), keys, m, index,
                                              cost) for m in HEADLINE}
                line[f"default_minus_row_at_its_{name}"] = {
                    m: lead for m, lead in fair.items() if lead is not None}
        table.append(line)
    by_conversation = {}
    for cid in sorted({k[0] for k in keys}):
        own = [k for k in keys if k[0] == cid]
        by_conversation[cid] = {m: signal(rows, own, m) for m in MEASURES}
    return {"questions": len(keys), "rows": table, "breakdown": breakdown(rows, keys, default),
            "best": best_rows(table, rows, keys, index, default),
            "per_conversation": per_conversation(rows, keys, default),
            "signal": {m: signal(rows, keys, m) for m in MEASURES},
            "retrieval_signal": retrieval_gap,
            "signal_by_conversation": by_conversation}


SPREAD = "-spread"  # a group's questions whose evidence spreads past one oracle window


def scorecard(records: list[dict], default: str | None,
              groups: dict[str, list[str]] | None = None) -> dict:
    """`group_scorecard` of every group (name -> conversation ids; one group `all` when none).
    Where some questions' full-history reference is their evidence sessions (whole
    conversations, evidence spread past one window: `pipeline.eval.window`), a group's card
    holds the questions read against an oracle window, and `<group>-spread` those."""
    groups = groups or {"all": None}
    kinds = {r.get("reference") for r in records if r["method"] == "full"} - {None}
    out = {}
    for name, ids in groups.items():
        conversations = None if ids is None else set(ids)
        if EVIDENCE_SESSIONS not in kinds:
            out[name] = group_scorecard(records, default, conversations)
            continue
        out[name] = group_scorecard(records, default, conversations, SESSION_RUN)
        spread = group_scorecard(records, default, conversations, EVIDENCE_SESSIONS)
        if spread["questions"]:
            out[name + SPREAD] = spread
    return out
