"""Evaluate cache-building methods on a corpus: retention, answer NLL and F1, per method and budget.

    python -m jobs.evaluate --corpus ../shared/data/locomo --conversations 26,30,41 \\
        --max-context-tokens 7600 --questions-per-conversation 40 --budgets 512,1024 \\
        --methods full,streamingllm,snapkv,keydiff,epicache --out eval-out

One Ray task per (conversation, method, budget) cell, plus the two references per
conversation (full cache, no history), so the same command scales from this machine to a
cluster. Writes results.parquet (per question), summary.json, table.md and retention.png.
Each finished cell's records are kept under `--out` (cells/...), keyed by the conversation's
content and what decides the cell (the method's effective configuration, the measurement
settings), so a re-run after an interruption (or with more methods or budgets) computes only
the cells it does not have. A failed cell is listed in summary.json and the run exits 1.

Methods take variants (see `pipeline.evaluate`): `epicache-tri` (ARKV tri-state, budget M =
the bytes of M float16 tokens per layer and KV head), `epicache-dapq`, `epicache-merge`,
`epicache-d2o`, or combined, `epicache+tri+dapq+merge`; EpiCache's recipe knobs one at a time,
`epicache+alpha1`, `epicache+tok`, `epicache+focus0`, ... (docs/quality.md).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from tqdm import tqdm

from jobs.cli import make_parser
from jobs.environment import init_ray
from pipeline import builder, evaluate, models
from pipeline.calibrate import CalibrationConfig
from pipeline.compress import MergeConfig, TriStateConfig
from pipeline.config import BuildConfig
from pipeline.corpus import (SKIP_REPORT, Conversation, CorpusError, ReadStats,
                             add_corpus_options, check_corpus, iter_corpus, limits_from_args,
                             select_conversations)
from pipeline.episodes import EpisodeConfig
from pipeline.store import LocalStore, open_store


@ray.remote
def prepare_task(conv, config: evaluate.EvalConfig) -> evaluate.Prepared:
    return evaluate.prepare(conv, config)


@ray.remote
def profile_task(store_uri: str, config: evaluate.EvalConfig, method: str = "epicache") -> list[float]:
    """The model's profile for the allocator `method` uses (layer sensitivity, or D2O's
    attention variance): measured once, then read from the store."""
    return builder.layer_profile(open_store(store_uri), config.build_config(method, 1))


@ray.remote
def cell_task(prep: evaluate.Prepared, method: str, budget: int | None,
              config: evaluate.EvalConfig, layer_budgets: list[int] | None) -> list[dict]:
    return evaluate.evaluate_cell(prep, method, budget, config, layer_budgets)


def conversation_digest(conv: Conversation) -> str:
    return hashlib.sha256(json.dumps(conv.to_record(), sort_keys=True,
                                     default=str).encode()).hexdigest()[:16]


def cell_key(conv: Conversation, digest: str, method: str, budget: int | None,
             config: evaluate.EvalConfig, layer_budgets: list[int] | None) -> str:
    """Where a finished cell is kept under --out: keyed by the conversation's content and by
    what decides the cell's records (the method's effective build configuration, its layer
    budgets, the measurement settings), not by the method's name, so `epicache` and the variant
    it equals share one cell, and changing any knob gives a new key."""
    base, _ = evaluate.parse_method(method)
    what = {"base": base, "budget": budget, "layer_budgets": layer_budgets,
            "build": config.build_config(method, budget).as_dict(),
            "measure": {k: getattr(config, k) for k in (
                "max_context_tokens", "questions_per_conversation", "generate", "max_new_tokens",
                "recall_words", "recall_tokens")}}
    if base == "epicache-paper":
        what["base"] = "epicache"  # the same method under its paper recipe
    if base not in evaluate.EPISODIC:  # knobs only EpiCache reads
        for knob in ("scoring", "episodes", "encoder"):
            what["build"].pop(knob)
    cell = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"cells/{conv.conversation_id}/{digest}/{cell}.parquet"


def _records_bytes(records: list[dict]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), sink)
    return sink.getvalue()


def _fmt(x, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{100 * x:.1f}%" if pct else f"{x:.3f}"


def markdown_table(rows: list[dict]) -> str:
    cats = sorted({k for r in rows for k in r if k.startswith("f1_cat")})
    head = ["method", "budget", "questions", "retention", "retention (of means)", "evidence NLL",
            "answer NLL", "F1", "kept", "bytes (tokens)", "quantized", "evidence kept",
            "route hit"] + \
        [f"F1 {c.removeprefix('f1_')}" for c in cats]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["method"], str(r["budget"] or "-"), str(r["questions"]),
                 _fmt(r["retention"], True), _fmt(r.get("retention_of_means"), True),
                 _fmt(r["evidence_nll"]), _fmt(r["answer_nll"]), _fmt(r["f1"]),
                 _fmt(r.get("kept_entries")), _fmt(r.get("bytes_tokens")),
                 _fmt(r.get("quantized_share"), True), _fmt(r.get("evidence_kept"), True),
                 _fmt(r.get("route_hit"), True)]
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
        lines.append("| " + " | ".join([method, str(budget)] + cells) + " |")
    return "\n".join(lines) + "\n"


def plot_retention(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows if r["budget"] is not None):
        pts = sorted((r["budget"], 100 * r["retention"]) for r in rows if r["method"] == method)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    ax.axhline(100, color="grey", ls="--", lw=1, label="full cache")
    ax.axhline(0, color="grey", ls=":", lw=1, label="no history")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (entries per layer and KV head)")
    ax.set_ylabel("evidence-recall retention (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def collect_cells(pending: dict, kept: LocalStore) -> tuple[list[dict], list[dict]]:
    """Wait for every cell task (`pending`: ref -> (conversation id, method, budget, key)); keep
    each finished cell's records under `key`. Returns the records and the failed cells."""
    records, failed = [], []
    with tqdm(total=len(pending), unit="cell", desc="evaluate") as bar:
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            cid, method, budget, key = pending.pop(ref)
            try:
                cell_records = ray.get(ref)
            except Exception as e:
                reason = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
                print(f"cell {cid}/{method}/{budget} failed: {reason}", file=sys.stderr)
                failed.append({"conversation_id": cid, "method": method, "budget": budget,
                               "error": reason})
            else:
                kept.put(key, _records_bytes(cell_records))
                records.extend(cell_records)
            bar.update(1)
    return records, failed


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.evaluate", __doc__)
    p.add_argument("--corpus", required=True, help="LoCoMo .json, the project's JSONL, or a folder")
    p.add_argument("--out", default="eval-out", help="output folder (finished cells kept in cells/)")
    p.add_argument("--methods", default=", ".join(evaluate.METHODS),
                   help="comma-separated, each <method>, <method>-<variant> or "
                        f"<method>+<variant>+... ({evaluate.describe_methods()}; what each does: "
                        "the README's 'Evaluation')")
    p.add_argument("--budgets", default="256,512,1024",
                   help="comma-separated budgets, one cell each; a budget is the mean entries "
                        "kept per layer and KV head (tri-state variants: the bytes of that many "
                        "Original float16 entries)")
    p.add_argument("--model", default=models.DEFAULT_LLM, help="LLM: packaged name or local folder")
    p.add_argument("--encoder", default=models.DEFAULT_ENCODER, help="sentence encoder (routing)")
    p.add_argument("--max-context-tokens", type=int, default=None,
                   help="cut each conversation at a session boundary to fit (default: whole)")
    p.add_argument("--questions-per-conversation", type=int, default=None,
                   help="the first N questions of each conversation (default: all)")
    p.add_argument("--limit-conversations", type=int, default=None,
                   help="the first N conversations (default: all)")
    p.add_argument("--conversations", default=None,
                   help="comma-separated conversation ids to evaluate (LoCoMo's locomo-26 may be "
                        "given as 26); default: all")
    p.add_argument("--episodes", type=int, default=4, help="EpiCache episodes per conversation")
    p.add_argument("--medoids", type=int, default=4, help="medoid windows in an episode's patch")
    p.add_argument("--window", type=int, default=4, help="utterances per clustering window")
    p.add_argument("--alpha", type=float, default=BuildConfig.alpha,
                   help="EpiCache layer-allocation sharpness (0: uniform budgets)")
    p.add_argument("--block", type=int, default=512, help="block-prefill block (tokens)")
    p.add_argument("--selection", default="headwise", choices=["headwise", "perhead"],
                   help="top-k across a layer's heads (AdaKV) or per head")
    p.add_argument("--f1", action="store_true",
                   help="also generate answers and score F1 (slow; at the floor for a 135M model)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="answer length with --f1")
    p.add_argument("--calibration-tokens", type=int, default=4096,
                   help="calibration text length (layer profiles)")
    p.add_argument("--calibration-window", type=int, default=1024,
                   help="calibration: the simulated budget (sink + recent tokens)")
    add_corpus_options(p)
    t = TriStateConfig()
    p.add_argument("--tri-window", type=int, default=t.window, help="ARKV protected recent window")
    p.add_argument("--tri-gamma", type=float, default=t.gamma, help="ARKV heavy-hitter gamma")
    p.add_argument("--tri-original-scale", type=float, default=t.original_scale,
                   help="scales ARKV's OQ ratio (share of bytes spent on Original entries)")
    p.add_argument("--tri-slack", type=float, default=t.slack, help="ARKV slack factor")
    p.add_argument("--merge-beta", type=float, default=MergeConfig().beta, help="D2O EMA beta")
    p.add_argument("--variance-temperature", type=float, default=1.0,
                   help="D2O inverse-variance softmax temperature")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = set()
    for m in methods:
        try:
            evaluate.parse_method(m)
        except ValueError:
            unknown.add(m)
    try:
        budgets = [int(b) for b in a.budgets.split(",") if b.strip()]
        if unknown or not methods or not budgets or min(budgets) < 1:
            raise ValueError(f"unknown methods {sorted(unknown)}" if unknown else
                             "need at least one method and positive budgets")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = evaluate.EvalConfig(
        model=a.model, encoder=a.encoder, block=a.block, selection=a.selection, alpha=a.alpha,
        episodes=EpisodeConfig(window=a.window, episodes=a.episodes, medoids=a.medoids),
        calibration=CalibrationConfig(tokens=a.calibration_tokens, window=a.calibration_window,
                                      sink=min(128, a.calibration_window // 4)),
        max_context_tokens=a.max_context_tokens,
        questions_per_conversation=a.questions_per_conversation, max_new_tokens=a.max_new_tokens,
        generate=a.f1,
        tristate=TriStateConfig(enabled=True, window=a.tri_window, gamma=a.tri_gamma,
                                original_scale=a.tri_original_scale, slack=a.tri_slack),
        merge=MergeConfig(enabled=True, beta=a.merge_beta),
        variance_temperature=a.variance_temperature)
    out = Path(a.out)
    # The corpus is read whole before --out is written to and before Ray starts.
    with tempfile.TemporaryFile("w+", encoding="utf-8") as report:
        try:
            limits = limits_from_args(a)
            read = check_corpus(a.corpus, a.on_bad_record, limits, report)
            convs = list(iter_corpus(a.corpus, a.on_bad_record, ReadStats(keep=0), limits))
            if a.conversations:
                convs = select_conversations(convs, a.conversations, a.corpus)
            convs = convs[:a.limit_conversations]
        except (CorpusError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        out.mkdir(parents=True, exist_ok=True)
        (out / SKIP_REPORT).unlink(missing_ok=True)  # no stale report from an earlier run
        if report.tell():  # the run's skips, beside its summary
            report.seek(0)
            (out / SKIP_REPORT).write_text(report.read(), encoding="utf-8")
            print(f"skip report: {out / SKIP_REPORT}", file=sys.stderr)
    init_ray()
    start = time.perf_counter()
    allocated = [m for m in methods if config.needs_profile(m)]
    profiles = {}  # one profile per allocator, measured by the first method that needs it
    for m in allocated:
        kind = evaluate.allocator_of(m)
        if kind not in profiles:
            profiles[kind] = ray.get(profile_task.remote(str(out / "profiles"), config, m))
    layer_budgets = {(m, b): config.build_config(m, b).allocator_strategy().allocate(
        profiles[evaluate.allocator_of(m)], b) for m in allocated for b in budgets}
    kept = LocalStore(out)  # finished cells (atomic writes: a cell is whole or absent)
    pending, prep_refs, records, reused = {}, [], [], 0
    for conv in convs:
        prep = prepare_task.remote(conv, config)
        prep_refs.append(prep)
        digest = conversation_digest(conv)  # hashes the whole conversation: once, not per cell
        cells = [("none", None), ("full", None)] + [(m, b) for m in methods if m != "full"
                                                    for b in budgets]
        for method, budget in cells:  # uniform layer budgets unless the method allocates
            key = cell_key(conv, digest, method, budget, config, layer_budgets.get((method, budget)))
            if kept.exists(key):
                records.extend(r | {"method": method} for r in
                               pq.read_table(io.BytesIO(kept.get(key))).to_pylist())
                reused += 1
                continue
            ref = cell_task.remote(prep, method, budget, config, layer_budgets.get((method, budget)))
            pending[ref] = (conv.conversation_id, method, budget, key)
    if reused:
        print(f"reusing {reused} finished cells from {out}/cells", file=sys.stderr)
    cell_records, failed = collect_cells(pending, kept)
    records.extend(cell_records)
    records = evaluate.with_retention(records)
    rows = evaluate.summarise(records)
    preps = ray.get(prep_refs)
    summary = {"config": config.as_dict(), "methods": methods, "budgets": budgets,
               "conversations": [{"conversation_id": p.conversation.conversation_id,
                                  "tokens": p.tokens, "questions": len(p.questions),
                                  "questions_dropped_by_cut": p.dropped_by_cut} for p in preps],
               "context": ("cut at a session boundary to fit" if a.max_context_tokens else
                           "whole conversations"), "seconds": time.perf_counter() - start,
               "cells_reused": reused, "cells_failed": failed, "rows": rows,
               "bad_records_skipped": read.records_skipped,
               "questions_dropped": read.questions_dropped,
               "by_evidence_position": evaluate.summarise_by(records, "evidence_third"),
               "by_route_hit": evaluate.summarise_by(records, "route_hit")}
    (out / "results.parquet").write_bytes(_records_bytes(records))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    table = markdown_table(rows) + "\n" + breakdown_table(
        summary["by_evidence_position"], "evidence in the conversation's first / middle / last third",
        ["first", "middle", "last"]) + "\n" + breakdown_table(
        summary["by_route_hit"], "route hit (the routed episode holds an evidence turn)",
        [True, False])
    (out / "table.md").write_text(table)
    plot_retention(rows, out / "retention.png")
    print(table)
    print(f"outputs: {out}/results.parquet, summary.json, table.md, retention.png "
          f"({len(records)} question records, {time.perf_counter() - start:.0f}s)")
    if failed:
        print(f"error: {len(failed)} cells failed (listed in {out}/summary.json)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
