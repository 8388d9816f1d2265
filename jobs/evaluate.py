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

Methods take variants (see `pipeline.eval`): `epicache-tri` (ARKV tri-state, budget M =
the bytes of M float16 tokens per layer and KV head), `epicache-dapq`, `epicache-merge`,
`epicache-d2o`, or combined, `epicache+tri+dapq+merge`; EpiCache's recipe knobs one at a time,
`epicache+alpha1`, `epicache+tok`, `epicache+focus0`, ... (docs/quality.md).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import ray

from pipeline.build.config import BuildConfig
from pipeline.cli.options import add_corpus_options, limits_from_args
from pipeline.cli.parser import make_parser
from pipeline.corpus.reader import (
    SKIP_REPORT,
    ReadStats,
    check_corpus,
    iter_corpus,
    select_conversations,
)
from pipeline.corpus.schema import CorpusError
from pipeline.episodes import EpisodeConfig
from pipeline.eval.methods import METHODS, EvalConfig, allocator_of, describe_methods, parse_method
from pipeline.eval.report import breakdown_table, markdown_table, plot_retention
from pipeline.eval.runner import (
    _records_bytes,
    cell_key,
    cell_task,
    collect_cells,
    conversation_digest,
    prepare_task,
    profile_task,
)
from pipeline.eval.summary import summarise, summarise_by, with_retention
from pipeline.kv import models
from pipeline.kv.budgets import CalibrationConfig
from pipeline.kv.merging import MergeConfig
from pipeline.kv.tristate import TriStateConfig
from pipeline.ray_runtime import init_ray
from pipeline.store.local import LocalStore


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.evaluate", __doc__)
    p.add_argument("--corpus", required=True, help="LoCoMo .json, the project's JSONL, or a folder")
    p.add_argument("--out", default="eval-out", help="output folder (finished cells kept in cells/)")
    p.add_argument("--methods", default=", ".join(METHODS),
                   help="comma-separated, each <method>, <method>-<variant> or "
                        f"<method>+<variant>+... ({describe_methods()}; what each does: "
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
            parse_method(m)
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
    config = EvalConfig(
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
        kind = allocator_of(m)
        if kind not in profiles:
            profiles[kind] = ray.get(profile_task.remote(str(out / "profiles"), config, m))
    layer_budgets = {(m, b): config.build_config(m, b).allocator_strategy().allocate(
        profiles[allocator_of(m)], b) for m in allocated for b in budgets}
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
    records = with_retention(records)
    rows = summarise(records)
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
               "by_evidence_position": summarise_by(records, "evidence_third"),
               "by_route_hit": summarise_by(records, "route_hit")}
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
