"""The scorecard page (`jobs.scorecard`): per group of conversations the headline table, the
best row at each budget, the costs, the retention-vs-entries plot, the signal, the breakdowns
and the default's leads by group and per conversation, and how to read them."""

from __future__ import annotations

import math
from pathlib import Path

from pipeline.eval.scorecard import EQUAL_COSTS, HEADLINE, LOW_SIGNAL_NATS, SPREAD
from pipeline.eval.window import EVIDENCE_SESSIONS

FULL_LENGTH_PAGE = "scorecard-full.md"  # `jobs.scorecard --full-length`'s page, beside a cut's


def _pct(figure: dict | None, signed: bool = False) -> str:
    """A retention (or a difference of two) as `value [lo, hi]` in percent."""
    if not figure or not math.isfinite(figure.get("value", math.nan)):
        return "-"
    sign = "+" if signed else ""
    lo, hi = figure["lo"], figure["hi"]
    bounds = f" [{100 * lo:{sign}.0f}, {100 * hi:{sign}.0f}]" if math.isfinite(lo) else ""
    return f"{100 * figure['value']:{sign}.1f}{bounds}"


def _entries(row: dict) -> str:
    cache, topup = row.get("cache_entries"), row.get("topup_tokens") or 0.0
    if cache is None or not math.isfinite(cache):
        return "-"
    return f"{cache + topup:,.0f} ({cache:,.0f} + {topup:,.0f})"


def _nats(figure: dict | None) -> str:
    """A difference of mean NLLs as `value [lo, hi]` in nats."""
    if not figure or not math.isfinite(figure.get("value", math.nan)):
        return "-"
    return f"{figure['value']:+.2f} [{figure['lo']:+.2f}, {figure['hi']:+.2f}]"


def _over_retrieval(figure: dict | None) -> str:
    return _pct(figure) + (" (low)" if figure and figure.get("low") else "")


def _lead(row: dict, measure: str) -> str:
    """The default's lead at the row's budget and, where the row reads other entries or stores
    other bytes than the default there, the default's curve read at the row's own entries
    (`equal entries`) or bytes (`equal bytes`)."""
    parts = [_pct((row.get("default_minus_row") or {}).get(measure), True)]
    for cost in EQUAL_COSTS.values():
        fair = row.get(f"default_minus_row_at_its_{cost}") or {}
        if measure in fair:
            parts.append(f"equal {cost}: {_pct(fair[measure], True)}")
    return "; ".join(parts)


SCORECARD_HEAD = ["row", "budget", "decode-time entries (cache + top-up)", "answer",
                  "copy-free evidence", "over retrieval", "default - row: answer",
                  "default - row: answer NLL (nats)", "default - row: copy-free",
                  "evidence recall (copy-prone)", "route hit", "questions"]


def ordered_rows(card: dict, default: str | None) -> list[dict]:
    """A group's rows by budget (those without one last), the default first within each."""
    order = {m: i for i, m in enumerate(dict.fromkeys(r["method"] for r in card["rows"]))}
    return sorted(card["rows"], key=lambda r: (r["budget"] is None, r["budget"] or 0,
                                               r["method"] != default, order[r["method"]]))


def _mib(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x / 2 ** 20:,.2f}"


COSTS_HEAD = ["row", "budget", "answer", "decode-time entries", "question-time prefill (tokens)",
              "stored per conversation (MiB)", "fetched per question, cold (MiB)",
              "build prefill per conversation (tokens)", "build, in prefills of the conversation"]


def costs_table(card: dict, default: str | None = None) -> str:
    """What each row costs beside what it answers (`scorecard.costs`)."""
    lines = ["| " + " | ".join(COSTS_HEAD) + " |", "|" + "---|" * len(COSTS_HEAD)]
    for r in ordered_rows(card, default):
        tokens, prefills = r.get("build_tokens"), r.get("build_prefills")
        lines.append("| " + " | ".join([
            f"**{r['method']}**" if r["method"] == default else r["method"],
            str(r["budget"] or "-"), _pct(r["answer"]),
            "-" if not math.isfinite(r.get("decode_entries", math.nan)) else
            f"{r['decode_entries']:,.0f}",
            f"{r.get('question_prefill', 0) or 0:,.0f}", _mib(r.get("stored_bytes")),
            _mib(r.get("fetched_bytes")),
            "-" if tokens is None or not math.isfinite(tokens) else f"{tokens:,.0f}",
            "-" if prefills is None or not math.isfinite(prefills) else f"{prefills:.2f}x"])
            + " |")
    return "\n".join(lines) + "\n"


def best_lines(card: dict) -> str:
    """Which row is best at each budget on each headline measure, and by how much."""
    names = {"answer": "answers", "copy_free": "copy-free evidence"}
    out = []
    for b in card.get("best", ()):
        best, nxt = b["best"], b["next"]
        out.append(f"- **{b['budget']:,} entries, {names[b['measure']]}: "
                   f"`{best['method']}`{'' if best['budget'] else ' (its own top-up)'}** "
                   f"{_pct(best[b['measure']])}; next `{nxt['method']}`"
                   f"{'' if nxt['budget'] else ' (its own top-up)'} {_pct(nxt[b['measure']])}; "
                   f"best - next {_pct(b['lead'], True)}"
                   + ("" if b["lead"]["lo"] > 0 else " (the interval crosses 0: a tie)"))
    return "\n".join(out) + "\n" if out else ""


def scorecard_table(card: dict, default: str | None = None) -> str:
    """The headline table of one group's scorecard (`pipeline.eval.scorecard`): retention
    of the mean NLLs in percent with its 90% interval, per row and budget."""
    lines = ["| " + " | ".join(SCORECARD_HEAD) + " |", "|" + "---|" * len(SCORECARD_HEAD)]
    for r in ordered_rows(card, default):
        name = f"**{r['method']}**" if r["method"] == default else r["method"]
        hit = r.get("route_hit")
        lines.append("| " + " | ".join([
            name, str(r["budget"] or "-"), _entries(r), _pct(r["answer"]),
            _pct(r["copy_free"]), _over_retrieval(r.get("over_retrieval")),
            _lead(r, "answer"), _nats(r.get("default_minus_row_nats")),
            _lead(r, "copy_free"),
            _pct(r["evidence"]), "-" if hit is None or not math.isfinite(hit) else
            f"{100 * hit:.0f}%", f"{r['questions']} ({r['copy_free']['questions']} copy-free)"])
            + " |")
    return "\n".join(lines) + "\n"


BREAKDOWNS = {"third": "the evidence's third of the conversation",
              "sessions": "the evidence's (first) session",
              "category": "LoCoMo's question category",
              "retrieval": "whether retrieval's turns hold the evidence (`rag` at the row's "
                           "budget: all, some or none of the evidence turns)",
              "route_hit": "whether the route read an episode holding evidence"}
# the groupings whose default's leads get a table of their own: where each row wins
LEADS = ("category", "retrieval", "third")


def breakdown_tables(card: dict, default: str | None = None) -> str:
    """Answer retention per group of questions (`scorecard.breakdown`), one table per way of
    grouping: a row per method and budget, a column per group (its questions in brackets)."""
    parts = []
    for by, title in BREAKDOWNS.items():
        lines = [line for line in card.get("breakdown", ()) if line["by"] == by]
        if not lines:
            continue
        groups = sorted({line["group"] for line in lines}, key=_group_order)
        rows = list(dict.fromkeys((line["method"], line["budget"]) for line in lines))
        rows.sort(key=lambda r: (r[1] is None, r[1] or 0, r[0] != default))
        cell = {(line["method"], line["budget"], line["group"]): line["answer"] for line in lines}
        head = ["row", "budget", *(f"{g} ({_count(cell, g)})" for g in groups)]
        table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for method, budget in rows:
            table.append("| " + " | ".join([method, str(budget or "-"), *(
                _pct(cell.get((method, budget, g))) for g in groups)]) + " |")
        parts.append(f"Answer retention by {title} (questions in brackets):\n\n"
                     + "\n".join(table) + "\n")
    for by in LEADS:
        lines = [line for line in card.get("breakdown", ()) if line["by"] == by
                 and "default_minus_row" in line]
        if not lines:
            continue
        groups = sorted({line["group"] for line in lines}, key=_group_order)
        rows = list(dict.fromkeys((line["method"], line["budget"]) for line in lines))
        rows.sort(key=lambda r: (r[1] is None, r[1] or 0))
        cell = {(line["method"], line["budget"], line["group"]): line for line in lines}
        head = ["row", "budget", *(f"{g} ({_count({k: v['answer'] for k, v in cell.items()}, g)})"
                                   for g in groups)]
        table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for method, budget in rows:
            table.append("| " + " | ".join([method, str(budget or "-"), *(
                _pct((cell.get((method, budget, g)) or {}).get("default_minus_row"), True)
                for g in groups)]) + " |")
        parts.append(f"The default's lead on answers (default - row, paired) by {BREAKDOWNS[by]} "
                     "(questions in brackets):\n\n" + "\n".join(table) + "\n")
    return "\n".join(parts)


def per_conversation_table(card: dict) -> str:
    """The default's answer retention and its leads per conversation, each interval over that
    conversation's questions alone."""
    lines = card.get("per_conversation") or []
    if not lines:
        return ""
    others = list(dict.fromkeys(k for line in lines for k in line["leads"]))
    head = ["conversation", "budget", "questions", "default: answer",
            *(f"- {o}" for o in others)]
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for line in lines:
        table.append("| " + " | ".join([
            line["conversation_id"], str(line["budget"] or "-"), str(line["questions"]),
            _pct(line["answer"]), *(_pct(line["leads"].get(o), True) for o in others)]) + " |")
    return ("Per conversation (answers; each interval over that conversation's questions alone, "
            "`- row`: the default's paired lead; `row@-`: the row at its own top-up):\n\n"
            + "\n".join(table) + "\n")


def _group_order(group) -> tuple:
    thirds = ("first", "middle", "last")
    if group in thirds:
        return (0, thirds.index(group))
    holds = ("all", "some", "none")
    if group in holds:
        return (0, holds.index(group))
    if isinstance(group, str) and group.split("-")[0].isdigit():
        return (1, int(group.split("-")[0]))
    return (2, str(group))


def _count(cell: dict, group) -> int:
    return max((v.get("questions", 0) for (m, b, g), v in cell.items() if g == group), default=0)


def signal_table(card: dict) -> str:
    """Each measure's none -> full gap in nats (90% interval) and the share of questions the
    full history is better on, for the group and each conversation; low-signal ones marked."""
    def cell(s: dict) -> str:
        if not math.isfinite(s["value"]):
            return "-"
        flag = " (low)" if s["low"] else ""
        return (f"{s['value']:.2f} [{s['lo']:.2f}, {s['hi']:.2f}], "
                f"{100 * s['full_better']:.0f}%{flag}")

    head = ["conversation", "questions", "answer NLL gap", "evidence-recall gap"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, by in [("all", card["signal"]), *card["signal_by_conversation"].items()]:
        lines.append(f"| {name} | {by['answer']['questions']} | {cell(by['answer'])} | "
                     f"{cell(by['evidence'])} |")
    return "\n".join(lines) + "\n"


def plot_scorecard(card: dict, path: Path, title: str = "") -> None:
    """Retention (90% interval) against decode-time entries, one panel per headline measure:
    a line per method over its budgets, a point for each row without a budget."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(HEADLINE), figsize=(12, 5.2), sharey=True,
                             layout="constrained")
    for ax, measure in zip(axes, HEADLINE):
        plotted = False
        # a line per method over its budgets; its row without a budget a point of its own
        # (`rag` at its own top-up beside `rag` at the default's entries)
        for method, budgeted in dict.fromkeys((r["method"], r["budget"] is not None)
                                              for r in card["rows"]):
            rows = sorted((r for r in card["rows"] if r["method"] == method
                           and (r["budget"] is not None) == budgeted
                           and math.isfinite(r[measure]["value"])),
                          key=lambda r: r["decode_entries"])
            if not rows:
                continue
            x = [r["decode_entries"] for r in rows]
            y = [100 * r[measure]["value"] for r in rows]
            err = [[100 * (r[measure]["value"] - r[measure]["lo"]) for r in rows],
                   [100 * (r[measure]["hi"] - r[measure]["value"]) for r in rows]]
            label = method if budgeted or not any(
                r["method"] == method and r["budget"] is not None for r in card["rows"]) \
                else f"{method} (its own top-up)"
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label,
                        ls="-" if budgeted else "none")
            plotted = True
        ax.axhline(100, color="grey", ls="--", lw=1)
        ax.axhline(0, color="grey", ls=":", lw=1)
        if plotted:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("decode-time entries (cache + top-up) per layer and KV head")
        ax.set_title(f"{title} {measure.replace('_', '-')} retention (%)".strip())
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _f1(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.3f}"


def f1_table(card: dict) -> str:
    """Token F1 of the generated answers (a sample of questions), per row that generated any."""
    rows = [r for r in card["rows"] if r.get("answered")]
    lines = ["| row | budget | answers | token F1 |", "|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['budget'] or '-'} | {r['answered']} | {_f1(r['f1'])} |"
              for r in rows]
    return "\n".join(lines) + "\n" if rows else "No answers were generated.\n"


def scorecard_page(summary: dict, command: str, page: Path) -> str:
    """The scorecard page (`jobs.scorecard`): per group the headline table, the
    retention-vs-entries plot (written beside `page`), each measure's signal and the
    generated answers' F1; then how to read it."""
    config = summary["config"]["build"]
    convs = summary["conversations"]
    cut = config.get("max_context_tokens")
    parts = [
        "# The scorecard: answers, not copies\n",
        "Made by one command (its cells are kept under its `--out`; a re-run computes only what "
        "it lacks):\n", f"```bash\n{command}\n```\n",
        f"Model `{config['model']}`, encoder `{config['encoder']}`; {len(convs)} conversations "
        + (f"cut at a session boundary to at most {cut:,} tokens" if cut else "whole")
        + f", every question with evidence inside (category 5 excluded): "
        f"{sum(c['questions'] for c in convs)} questions. Budgets "
        f"{', '.join(str(b) for b in summary['budgets'])} entries per layer and KV head; every "
        f"row with a budget runs at `{summary.get('equal_entries')}`'s mean decode-time entries "
        "(its cache budget less its own top-up tokens) per conversation and budget.\n",
        window_note(summary) if not cut else
        "The whole conversations, each question measured against its oracle window: "
        f"[{FULL_LENGTH_PAGE}]({FULL_LENGTH_PAGE}) (`jobs.scorecard --full-length`).\n",
        READING,
    ]
    for name, card in summary["scorecard"].items():
        ids = sorted({cid for cid in card["signal_by_conversation"]})
        plot = page.with_name(f"{page.stem}-{name}.png")
        plot_scorecard(card, plot, name)
        parts += [f"## {group_title(name)}: {', '.join(ids)} ({card['questions']} questions)\n",
                  "The best row at each budget (among the rows read there and those without a "
                  "budget, the references and the ceiling left out):\n", best_lines(card),
                  scorecard_table(card, summary.get("default")),
                  f"![retention against decode-time entries, {name}]({plot.name})\n",
                  "What each row costs (per conversation where it is a figure of the "
                  "conversation, else per question; mean over the group):\n",
                  costs_table(card, summary.get("default")), over_retrieval_note(card),
                  per_conversation_table(card),
                  "None -> full gap in nats [90% interval], and the share of questions the full "
                  f"history is better on; `(low)`: the gap's lower bound is under "
                  f"{LOW_SIGNAL_NATS} nats, too little signal to judge a method by that measure "
                  "there:\n",
                  signal_table(card), breakdown_tables(card, summary.get("default")),
                  "Generated answers (greedy, a sample of questions):\n", f1_table(card)]
    return "\n".join(parts)


def group_title(name: str) -> str:
    """A group's heading: its name, or for its questions spread past one window, saying so."""
    if name.endswith(SPREAD):
        return (f"{name.removesuffix(SPREAD).capitalize()}, evidence spread past one window "
                "(the reference: each question's evidence sessions)")
    return name.capitalize()


def over_retrieval_note(card: dict) -> str:
    """The gap "over retrieval" divides by, and whether it is large enough to judge by."""
    gap = card.get("retrieval_signal")
    if not gap or not math.isfinite(gap.get("value", math.nan)):
        return ""
    return (f"\"Over retrieval\" divides by the answer NLL of `rag` less the ceiling's: "
            f"{gap['value']:.2f} [{gap['lo']:.2f}, {gap['hi']:.2f}] nats"
            + (f"; its lower bound is under {LOW_SIGNAL_NATS} nats (low): read that column as "
               "noise here.\n" if gap["low"] else ".\n"))


def window_note(summary: dict) -> str:
    """What `full` means on a page whose reference is the oracle window (else nothing)."""
    window = summary["config"].get("reference_window")
    if not window:
        return ""
    convs = summary["conversations"]
    dropped = sum(c.get("questions_dropped_by_window", 0) for c in convs)
    described = [w for c in convs for w in c.get("windows") or ()]
    spread = sum(w.get("kind") == EVIDENCE_SESSIONS for w in described)
    return (f"**The full-history reference (`full`, 100) is each question's oracle window**: the "
            f"full cache of the window of whole sessions, at most {window:,} tokens, that holds "
            f"its evidence ({len(described) - spread} windows over the {len(convs)} "
            "conversations). It is the best a full-attention model with this window does when "
            "told where to look, not the full history: a row above 100 reads more of what the "
            "answer needs than that window gives (docs/evaluation.md, \"The oracle window\"). "
            "A question whose evidence spreads past one window (facts over months) reads **its "
            f"evidence sessions** instead ({spread} such references): those sessions in order, "
            "trimmed around the evidence turns to fit; its questions are reported apart, in the "
            "`-spread` sections" + (f"; {dropped} questions left out" if dropped else "")
            + ".\n")


READING = """
How to read it:

- **answer**: retention of the mean teacher-forced NLL of the gold answer after the question,
  between no history (0) and the full history (100). **copy-free evidence**: evidence recall
  (the NLL of an evidence turn's words after its line's first words) over the evidence turns
  the question's top-up does not hold, the references read over the same turns: what the cache
  itself holds. **evidence recall (copy-prone)**: over every evidence turn; a turn the top-up
  holds is probed a few dozen tokens after its own copy, so a topped-up row can pass 100.
- **over retrieval**: (rag - row) / (rag - full+top-up) on the answer NLLs: what the cache adds
  to the retrieved turns (0: as retrieval alone, 100: as the full history with them).
- **default - row**: the default's retention less the row's, with the 90% interval of a paired
  bootstrap (the same resampled questions for both): an interval above 0 is a lead the
  questions support. On copy-free both rows are read over the evidence turns neither row's
  top-up holds, so a lead can differ from the difference of the two copy-free columns. A row
  that reads more or fewer entries than the default at its budget (a question-time variant of
  the default, say a larger top-up) is also given **equal entries**: the default's retention
  read off its curve (linear in mean decode-time entries between its budgets) at the row's
  entries, less the row's; none where the row's entries lie outside the default's budgets (no
  extrapolation). Likewise a row that stores other bytes than the default at its budget (a
  low-bit code) is given **equal bytes**: the default's curve read at the row's stored cache
  bytes per conversation.
- **decode-time entries**: what a question reads before its own prompt, per layer and KV head:
  cache entries + top-up tokens. **`rag` at a budget**: retrieval alone given the default's
  decode-time entries there (the question's nearest turns, as many as fit); `rag` without a
  budget reads the default's own top-up, so it is the row at **equal question-time prefill**.
  Compare at equal entries to choose what a GPU's memory holds per question (decode cost);
  at equal question-time prefill to choose what each question's latency and compute pay
  (the costs table: prefill tokens, bytes stored and fetched, build tokens).
- **Why a row passes 100 on answers**: the top-up puts the evidence turns a few tokens before
  the question, where a 135M model uses them best; the full history holds the same turns
  thousands of tokens back. So the top-up alone (`rag`) or any cache with it can read the
  gold answer more easily than the full history does: retention over 100 means "better than
  the full history on this measure", not an error.
- Every figure is over tens of questions per conversation: read the intervals, not the
  decimals; the pooled intervals hold for these conversations together (the per-conversation
  table gives each its own).
"""
