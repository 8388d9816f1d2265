"""The evaluation's report: Markdown tables of the summaries and the retention plot (the
scorecard page's own parts are `pipeline.eval.page`)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.eval.page import plot_scorecard, scorecard_table, signal_table


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
            "answer NLL", "F1", "kept", "decode-time entries", "bytes (tokens)", "quantized",
            "evidence kept", "route hit", "top-up tokens", "top-up recall"] + \
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
                     and r["budget"] is not None and math.isfinite(r["retention"]))
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
        summary["by_evidence_position"],
        "evidence in the conversation's first / middle / last third",
        ["first", "middle", "last"]) + "\n" + breakdown_table(
        summary["by_route_hit"], "route hit (the routed episode holds an evidence turn)",
        [True, False])
    (out / "table.md").write_text(table)
    plot_retention(summary["rows"], out / "retention.png")
    for name, card in cards.items():
        plot_scorecard(card, out / f"scorecard-{name}.png", name)
    return table
