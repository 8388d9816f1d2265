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

A method is a preset (`pipeline.eval.methods.PRESETS`: `epicache`, `epicache-paper`,
`epicache-tri`, the baselines, ...) with optional overrides by configuration field, e.g.
`epicache+scoring.focus=0.5` or `epicache-tri+prefill.tristate.fp8=true`; `--set PATH=VALUE`
overrides a field of every method (docs/evaluation.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from pipeline.cli.numbers import positive_int
from pipeline.cli.options import (SHARED_BUILD_OPTIONS, add_corpus_options, add_options,
                                  eval_build_config_from_args, limits_from_args)
from pipeline.cli.parser import make_parser, writable_folder
from pipeline.config import BuildConfig
from pipeline.corpus.reader import (SKIP_REPORT, ReadStats, check_corpus, iter_corpus,
                                    select_conversations)
from pipeline.corpus.schema import Conversation, CorpusError
from pipeline.eval.methods import (DEFAULT_METHODS, EvalConfig, describe_methods, parse_method,
                                   parse_override)
from pipeline.eval.report import write_report


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.evaluate", __doc__)
    p.add_argument("--corpus", required=True, help="LoCoMo .json, the project's JSONL, or a folder")
    p.add_argument("--out", default="eval-out", help="output folder (finished cells kept in cells/)")
    p.add_argument("--methods", default=", ".join(DEFAULT_METHODS),
                   help="comma-separated, each <preset> or <preset>+<path>=<value>+... "
                        f"({describe_methods()}; what each does: "
                        "docs/evaluation.md)")
    p.add_argument("--budgets", default="256,512,1024",
                   help="comma-separated budgets, one cell each; a budget is the mean entries "
                        "kept per layer and KV head (tri-state variants: the bytes of that many "
                        "Original float16 entries)")
    p.add_argument("--questions-per-conversation", type=positive_int, default=None,
                   help="the first N questions of each conversation (default: all)")
    p.add_argument("--limit-conversations", type=positive_int, default=None,
                   help="the first N conversations (default: all)")
    p.add_argument("--conversations", default=None,
                   help="comma-separated conversation ids to evaluate (LoCoMo's locomo-26 may be "
                        "given as 26); default: all")
    p.add_argument("--f1", action="store_true",
                   help="also generate answers and score F1 (slow; at the floor for a 135M model)")
    p.add_argument("--max-new-tokens", type=positive_int, default=EvalConfig.max_new_tokens,
                   help="answer length with --f1")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="override a configuration field of every method (repeatable), e.g. "
                        "--set scoring.focus=0.5 --set routing.two_below=0")
    p.add_argument("--in-process", action="store_true",
                   help="run the cells one after another in this process instead of as Ray "
                        "tasks (one GPU, or a machine without Ray)")
    add_options(p, SHARED_BUILD_OPTIONS, BuildConfig())
    add_corpus_options(p)
    return p


def methods_and_budgets(a: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The methods and budgets asked for; ValueError naming what is wrong."""
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = {}
    for m in methods:
        try:
            parse_method(m)
        except ValueError as e:
            unknown[m] = str(e)
    try:
        budgets = [int(b) for b in a.budgets.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--budgets takes comma-separated integers, got {a.budgets!r}") from None
    if unknown or not methods or not budgets or min(budgets) < 1:
        raise ValueError(f"unknown methods {sorted(unknown)}: " + "; ".join(
            reason for reason in unknown.values()) if unknown else
                         "need at least one method and positive budgets")
    return methods, budgets


def read_corpus(a: argparse.Namespace, out: Path) -> tuple[list[Conversation], ReadStats]:
    """The conversations to evaluate, the whole corpus read before --out is written to and
    before Ray starts; the run's skips go to `out/skipped.jsonl`, beside its summary."""
    with tempfile.TemporaryFile("w+", encoding="utf-8") as report:
        limits = limits_from_args(a)
        try:
            read = check_corpus(a.corpus, a.on_bad_record, limits, report)
        except CorpusError:
            if report.tell():  # every record skipped: the reasons are reported all the same
                write_skip_report(report, out)
            raise
        convs = list(iter_corpus(a.corpus, a.on_bad_record, ReadStats(keep=0), limits))
        if a.conversations:
            convs = select_conversations(convs, a.conversations, a.corpus)
        write_skip_report(report, out)
    return convs[:a.limit_conversations], read


def write_skip_report(report: IO[str], out: Path) -> None:
    """`out/skipped.jsonl` from the run's spooled skips; none removes an earlier run's."""
    out.mkdir(parents=True, exist_ok=True)
    (out / SKIP_REPORT).unlink(missing_ok=True)
    if report.tell():
        report.seek(0)
        (out / SKIP_REPORT).write_text(report.read(), encoding="utf-8")
        print(f"skip report: {out / SKIP_REPORT}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = Path(a.out)
    try:
        methods, budgets = methods_and_budgets(a)
        config = EvalConfig(eval_build_config_from_args(a),
                            overrides=tuple(parse_override(o) for o in a.set),
                            questions_per_conversation=a.questions_per_conversation,
                            max_new_tokens=a.max_new_tokens, generate=a.f1)
        for m in methods:  # every configuration made once, so a bad value fails here
            config.build_config(m, budgets[0])
            config.route_of(m)
        writable_folder(out)
        convs, read = read_corpus(a, out)
    except (CorpusError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return evaluate(a, methods, budgets, config, convs, read)


def evaluate(a: argparse.Namespace, methods: list[str], budgets: list[int], config: EvalConfig,
             convs: list[Conversation], read: ReadStats) -> int:
    """Run every cell (on Ray, or in this process) and write the report; the exit code. Ray,
    torch and the models load here, once the arguments and the corpus are known good."""
    from pipeline.eval.runner import run_cells
    from pipeline.eval.summary import summarise, summarise_by, with_retention

    out = Path(a.out)
    if not a.in_process:
        from pipeline.ray_runtime import init_ray

        init_ray()
    start = time.perf_counter()
    outcome = run_cells(convs, methods, budgets, config, out, a.in_process)
    records = with_retention(outcome.records)
    summary = {"config": config.as_dict(), "methods": methods, "budgets": budgets,
               "conversations": [{"conversation_id": p.conversation.conversation_id,
                                  "tokens": p.tokens, "questions": len(p.questions),
                                  "questions_dropped_by_cut": p.dropped_by_cut}
                                 for p in outcome.prepared],
               "context": ("cut at a session boundary to fit" if a.max_context_tokens else
                           "whole conversations"), "seconds": time.perf_counter() - start,
               "cells_reused": outcome.reused, "cells_failed": outcome.failed,
               "rows": summarise(records), "bad_records_skipped": read.records_skipped,
               "questions_dropped": read.questions_dropped,
               "by_evidence_position": summarise_by(records, "evidence_third"),
               "by_route_hit": summarise_by(records, "route_hit")}
    print(write_report(out, summary, records))
    print(f"outputs: {out}/results.parquet, summary.json, table.md, retention.png "
          f"({len(records)} question records, {time.perf_counter() - start:.0f}s)")
    if outcome.failed:
        print(f"error: {len(outcome.failed)} cells failed (listed in {out}/summary.json)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
