"""What `jobs.evaluate` and `jobs.scorecard` share: their options, the checks made before any
work (methods, budgets, overrides, --out, the corpus), and the run that gathers the records
into a summary.

Ray, torch and the models load only in `run_evaluation`, once the arguments and the corpus are
known good.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pipeline.cli.numbers import positive_int
from pipeline.cli.options import (
    SHARED_BUILD_OPTIONS,
    add_budgets_option,
    add_corpus_options,
    add_options,
    eval_build_config_from_args,
    limits_from_args,
)
from pipeline.cli.parser import writable_folder
from pipeline.config import BuildConfig
from pipeline.corpus.reader import (
    SKIP_REPORT,
    ReadStats,
    check_corpus,
    iter_corpus,
    select_conversations,
)
from pipeline.corpus.schema import Conversation, CorpusError
from pipeline.eval.methods import EvalConfig, describe_methods, parse_method, parse_override


def add_evaluation_options(p: argparse.ArgumentParser, methods: tuple[str, ...],
                           budgets: str, out: str) -> None:
    """The options of an evaluation: corpus, methods, budgets, what is measured, where it runs."""
    p.add_argument("--corpus", required=True, help="LoCoMo .json, the project's JSONL, or a folder")
    p.add_argument("--out", default=out, help="output folder (finished cells kept in cells/)")
    p.add_argument("--methods", default=",".join(methods),
                   help="comma-separated, each <preset> or <preset>+<path>=<value>+... "
                        f"({describe_methods()}; what each does: docs/evaluation.md)")
    add_budgets_option(p, budgets, "comma-separated budgets, one cell each; a budget is the "
                       "mean entries kept per layer and KV head (tri-state variants and "
                       "+code.bytes_budget=true: the bytes of that many float16 entries)")
    p.add_argument("--questions-per-conversation", type=positive_int, default=None,
                   help="the first N questions of each conversation (default: all)")
    p.add_argument("--limit-conversations", type=positive_int, default=None,
                   help="the first N conversations (default: all)")
    p.add_argument("--conversations", default=None,
                   help="comma-separated conversation ids to evaluate (LoCoMo's locomo-26 may be "
                        "given as 26); default: all")
    p.add_argument("--default", default="epicache", metavar="METHOD",
                   help="the row every other is compared with (paired intervals of the "
                        "difference) where it runs (default: epicache)")
    p.add_argument("--max-new-tokens", type=positive_int, default=EvalConfig.max_new_tokens,
                   help="answer length of the generated answers (F1)")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="override a configuration field of every method that takes it "
                        "(repeatable), e.g. --set scoring.focus=0.5 --set routing.two_below=0")
    p.add_argument("--reference-window", type=positive_int, default=None, metavar="TOKENS",
                   help="the full-history reference of each question: the full cache of the "
                        "window of whole sessions, at most TOKENS, that holds its evidence (for "
                        "whole conversations longer than the model; a question whose evidence "
                        "spreads past one window reads its evidence sessions, reported apart); "
                        "default: the full cache of the conversation")
    p.add_argument("--in-process", action="store_true",
                   help="run the cells one after another in this process instead of as Ray "
                        "tasks (one GPU, or a machine without Ray)")
    add_options(p, SHARED_BUILD_OPTIONS, BuildConfig())
    add_corpus_options(p)


def methods_and_budgets(a: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The methods and budgets asked for; ValueError naming what is wrong."""
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = {}
    for m in methods:
        try:
            parse_method(m)
        except ValueError as e:
            bad[m] = str(e)
    budgets = list(a.budgets)  # positive integers: `--budgets` is parsed so
    if bad:
        raise ValueError("; ".join(bad.values()))
    if not methods:
        raise ValueError("need at least one method")
    return methods, budgets


def set_overrides(texts: list[str], methods: list[str]) -> tuple[tuple[str, Any], ...]:
    """`--set PATH=VALUE`s, each applied to the methods that take it; one that no method takes
    is refused (it would change nothing)."""
    overrides = tuple(parse_override(o) for o in texts)
    for path, _ in overrides:
        reasons = {m: parse_method(m).refuses(path) for m in methods}
        if methods and all(reasons.values()):
            raise ValueError(f"--set {path}=...: no method takes it ("
                             + "; ".join(f"{m}: {r}" for m, r in reasons.items()) + ")")
    return overrides


def eval_config(a: argparse.Namespace, methods: list[str], budgets: list[int],
                **measure: Any) -> EvalConfig:
    """The evaluation's configuration, every method's configuration made once so that a bad
    value fails here; `measure`: the EvalConfig fields the command sets itself."""
    config = EvalConfig(eval_build_config_from_args(a), overrides=set_overrides(a.set, methods),
                        questions_per_conversation=a.questions_per_conversation,
                        max_new_tokens=a.max_new_tokens, reference_window=a.reference_window,
                        **measure)
    for m in methods:
        config.build_config(m, budgets[0])
        config.read_of(m)
    return config


def read_corpus(a: argparse.Namespace, out: Path) -> tuple[list[Conversation], ReadStats]:
    """The conversations to evaluate, the whole corpus read before --out is written to and
    before Ray starts; the run's skips go to `out/skipped.jsonl`, beside its summary."""
    writable_folder(out)
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


@dataclass(frozen=True)
class Evaluation:
    """What one run asks for, checked: the methods at the budgets, the configuration, where
    and how the cells run, the groups its scorecard reports (name -> conversation ids)."""
    methods: list[str]
    budgets: list[int]
    config: EvalConfig
    out: Path
    in_process: bool = False
    equal_entries: str | None = None
    default: str | None = None
    groups: dict[str, list[str]] | None = None


def run_evaluation(run: Evaluation, convs: list[Conversation],
                   read: ReadStats) -> tuple[dict, list[dict], int]:
    """Every cell (on Ray, or in this process) and the summary of their records: the summary,
    the records (per question and method), and the exit code (1 when a cell failed)."""
    from pipeline.eval.runner import run_cells
    from pipeline.eval.scorecard import scorecard
    from pipeline.eval.summary import summarise, summarise_by, with_retention

    if not run.in_process:
        from pipeline.ray_runtime import init_ray

        init_ray()
    start = time.perf_counter()
    outcome = run_cells(convs, run.methods, run.budgets, run.config, run.out, run.in_process,
                        run.equal_entries)
    records = with_retention(outcome.records)
    default = run.default if run.default in run.methods else None
    summary = {"config": run.config.as_dict(), "methods": run.methods, "budgets": run.budgets,
               "conversations": [{"conversation_id": p.conversation.conversation_id,
                                  "tokens": p.tokens, "questions": len(p.questions),
                                  "questions_dropped_by_cut": p.dropped_by_cut,
                                  "questions_dropped_by_window": p.dropped_by_window,
                                  "windows": None if p.windows is None else [
                                      w.meta["window"] for w in p.windows.windows]}
                                 for p in outcome.prepared],
               "context": ("cut at a session boundary to fit" if run.config.max_context_tokens
                           else "whole conversations"), "seconds": time.perf_counter() - start,
               "cells_reused": outcome.reused, "cells_failed": outcome.failed,
               "equal_entries": run.equal_entries, "default": default,
               "scorecard": scorecard(records, default, run.groups),
               "rows": summarise(records), "bad_records_skipped": read.records_skipped,
               "questions_dropped": read.questions_dropped,
               "by_evidence_position": summarise_by(records, "evidence_third"),
               "by_route_hit": summarise_by(records, "route_hit")}
    if outcome.failed:
        print(f"error: {len(outcome.failed)} cells failed (listed in {run.out}/summary.json)",
              file=sys.stderr)
    return summary, records, 1 if outcome.failed else 0
