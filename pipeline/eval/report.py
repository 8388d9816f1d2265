"""The evaluation's report: Markdown tables of the summaries and the retention plot."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.eval.scorecard import HEADLINE, LOW_SIGNAL_NATS


def records_parquet(records: list[dict]) -> bytes:
    """Question records as the bytes of one Parquet file, every field any record has a column
    (pyarrow takes the columns from the first record alone)."""
    fields = list(dict.fromkeys(k for r in records for k in r))
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in fields} for r in records]), sink)
    return sink.getvalue()

def _fmt(x, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{100 * x:.1f}%" if pct else f"{x:.3f}"


def markdown_table(rows: list[dict]) -> str:
    cats = sorted({k for r in rows for k in r if k.startswith("f1_cat")})
    head = ["method", "budget", "questions", "retention", "retention (of means)", "evidence NLL",
            "answer NLL", "F1", "kept", "decode-time entries", "bytes (tokens)", "quantized", "evidence kept",
            "route hit", "top-up tokens", "top-up recall"] + \
        [f"F1 {c.removeprefix('f1_')}" for c in cats]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["method"], str(r["budget"] or "-"), str(r["questions"]),
                 _fmt(r["retention"], True), _fmt(r.get("retention_of_means"), True),
                 _fmt(r["evidence_nll"]), _fmt(r["answer_nll"]), _fmt(r["f1"]),
                 _fmt(r.get("kept_entries")), _fmt(r.get("decode_entries")),
                 _fmt(r.get("bytes_tokens")),
                 _fmt(r.get("quantized_share"), True), _fmt(r.get("evidence_kept"), True),
                 _fmt(r.get("route_hit"), True), _fmt(r.get("topup_tokens")),
                 _fmt(r.get("topup_recall"), True)]
        cells += [_fmt(r.get(c)) for c in cats]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


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


def _lead(lead: dict, fair: dict, measure: str) -> str:
    """The default's lead at the row's budget and, where the row reads other entries than
    the default there, at the row's own entries (`equal entries`)."""
    same = _pct(lead.get(measure), True)
    if measure not in fair:
        return same
    return f"{same}; equal entries: {_pct(fair[measure], True)}"


SCORECARD_HEAD = ["row", "budget", "decode-time entries (cache + top-up)", "answer",
                  "copy-free evidence", "over retrieval", "default - row: answer",
                  "default - row: copy-free", "evidence recall (copy-prone)", "route hit",
                  "questions"]


def scorecard_table(card: dict, default: str | None = None) -> str:
    """The headline table of one group's scorecard (`pipeline.eval.scorecard`): retention
    of the mean NLLs in percent with its 90% interval, per row and budget."""
    lines = ["| " + " | ".join(SCORECARD_HEAD) + " |", "|" + "---|" * len(SCORECARD_HEAD)]
    order = {m: i for i, m in enumerate(dict.fromkeys(r["method"] for r in card["rows"]))}
    rows = sorted(card["rows"], key=lambda r: (r["budget"] is None, r["budget"] or 0,
                                              r["method"] != default, order[r["method"]]))
    for r in rows:
        lead = r.get("default_minus_row") or {}
        fair = r.get("default_minus_row_at_its_entries") or {}
        name = f"**{r['method']}**" if r["method"] == default else r["method"]
        hit = r.get("route_hit")
        lines.append("| " + " | ".join([
            name, str(r["budget"] or "-"), _entries(r), _pct(r["answer"]),
            _pct(r["copy_free"]), _pct(r.get("over_retrieval")),
            _lead(lead, fair, "answer"), _lead(lead, fair, "copy_free"),
            _pct(r["evidence"]), "-" if hit is None or not math.isfinite(hit) else
            f"{100 * hit:.0f}%", f"{r['questions']} ({r['copy_free']['questions']} copy-free)"])
            + " |")
    return "\n".join(lines) + "\n"


BREAKDOWNS = {"third": "the evidence's third of the conversation",
              "sessions": "the evidence's (first) session",
              "route_hit": "whether the route read an episode holding evidence"}


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
    return "\n".join(parts)


def _group_order(group) -> tuple:
    thirds = ("first", "middle", "last")
    if group in thirds:
        return (0, thirds.index(group))
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
        for method in dict.fromkeys(r["method"] for r in card["rows"]):
            rows = sorted((r for r in card["rows"] if r["method"] == method
                           and math.isfinite(r[measure]["value"])),
                          key=lambda r: r["decode_entries"])
            if not rows:
                continue
            x = [r["decode_entries"] for r in rows]
            y = [100 * r[measure]["value"] for r in rows]
            err = [[100 * (r[measure]["value"] - r[measure]["lo"]) for r in rows],
                   [100 * (r[measure]["hi"] - r[measure]["value"]) for r in rows]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=method,
                        ls="-" if rows[0]["budget"] is not None else "none")
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


def breakdown_table(groups: list[dict], title: str, keys: list) -> str:
    """Retention of the mean NLLs per (method, budget) and per group (`evaluate.summarise_by`)."""
    head = ["method", "budget"] + [f"{k} (n)" for k in keys]
    lines = [f"Retention of the mean NLLs by {title}:", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows: dict[tuple, dict] = {}
    for g in groups:
        rows.setdefault((g["method"], g["budget"]), {})[g["group"]] = g
    for (method, budget), by in rows.items():
        if method in ("full", "none"):
            continue
        cells = [f"{_fmt(by[k]['retention_of_means'], True)} ({by[k]['questions']})" if k in by
                 else "-" for k in keys]
        lines.append("| " + " | ".join([method, str(budget or "-")] + cells) + " |")
    return "\n".join(lines) + "\n"


def plot_retention(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    plotted = False
    for method in dict.fromkeys(r["method"] for r in rows if r["budget"] is not None):
        pts = sorted((r["budget"], 100 * r["retention"]) for r in rows if r["method"] == method
                     and math.isfinite(r["retention"]))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            plotted = True
    ax.axhline(100, color="grey", ls="--", lw=1, label="full cache")
    ax.axhline(0, color="grey", ls=":", lw=1, label="no history")
    if plotted:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (entries per layer and KV head)")
    ax.set_ylabel("evidence-recall retention (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(out: Path, summary: dict, records: list[dict]) -> str:
    """results.parquet (per question), summary.json, table.md and retention.png under `out`;
    returns the tables (the summary's rows, then by evidence position and by route hit)."""
    (out / "results.parquet").write_bytes(records_parquet(records))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    cards = summary.get("scorecard") or {}
    default = summary.get("default")
    headline = "".join(
        f"Scorecard ({name}: {card['questions']} questions; retention of the mean NLLs, %, "
        f"[90% interval]; tens of questions are noisy):\n\n{scorecard_table(card, default)}\n"
        f"None -> full gap in nats [90% interval], share of questions the full history is "
        f"better on:\n\n{signal_table(card)}\n" for name, card in cards.items())
    table = headline + markdown_table(summary["rows"]) + "\n" + breakdown_table(
        summary["by_evidence_position"], "evidence in the conversation's first / middle / last third",
        ["first", "middle", "last"]) + "\n" + breakdown_table(
        summary["by_route_hit"], "route hit (the routed episode holds an evidence turn)",
        [True, False])
    (out / "table.md").write_text(table)
    plot_retention(summary["rows"], out / "retention.png")
    for name, card in cards.items():
        plot_scorecard(card, out / f"scorecard-{name}.png", name)
    return table


def f1_table(card: dict) -> str:
    """Token F1 of the generated answers (a sample of questions), per row that generated any."""
    rows = [r for r in card["rows"] if r.get("answered")]
    lines = ["| row | budget | answers | token F1 |", "|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['budget'] or '-'} | {r['answered']} | {_fmt(r['f1'])} |"
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
        f"The whole conversations, each question measured against its oracle window: "
        f"[{page.stem}-full.md]({page.stem}-full.md) (`jobs.scorecard --full-length`).\n",
        READING,
    ]
    for name, card in summary["scorecard"].items():
        ids = sorted({cid for cid in card["signal_by_conversation"]})
        plot = page.with_name(f"{page.stem}-{name}.png")
        plot_scorecard(card, plot, name)
        parts += [f"## {name.capitalize()}: {', '.join(ids)} ({card['questions']} questions)\n",
                  scorecard_table(card, summary.get("default")),
                  f"![retention against decode-time entries, {name}]({plot.name})\n",
                  "None -> full gap in nats [90% interval], and the share of questions the full "
                  f"history is better on; `(low)`: the gap's lower bound is under "
                  f"{LOW_SIGNAL_NATS} nats, too little signal to judge a method by that measure "
                  "there:\n",
                  signal_table(card), breakdown_tables(card, summary.get("default")),
                  "Generated answers (greedy, a sample of questions):\n", f1_table(card)]
    return "\n".join(parts)


def window_note(summary: dict) -> str:
    """What `full` means on a page whose reference is the oracle window (else nothing)."""
    window = summary["config"].get("reference_window")
    if not window:
        return ""
    convs = summary["conversations"]
    dropped = sum(c.get("questions_dropped_by_window", 0) for c in convs)
    windows = sum(len(c.get("windows") or ()) for c in convs)
    return (f"**The full-history reference (`full`, 100) is each question's oracle window**: the "
            f"full cache of the window of whole sessions, at most {window:,} tokens, that holds "
            f"its evidence ({windows} windows over the {len(convs)} conversations; "
            f"{dropped} questions whose evidence no window holds are left out). It is the best "
            "a full-attention model with this window does when told where to look, not the "
            "full history: a row above 100 reads more of what the answer needs than that window "
            "gives (docs/evaluation.md, \"The oracle window\").\n")


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
  extrapolation).
- **decode-time entries**: what a question reads before its own prompt, per layer and KV head:
  cache entries + top-up tokens.
- Every figure is over tens of questions per conversation: read the intervals, not the
  decimals.
"""
