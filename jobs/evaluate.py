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
from pathlib import Path

from pipeline.cli.evaluation import (
    Evaluation,
    add_evaluation_options,
    eval_config,
    methods_and_budgets,
    read_corpus,
    run_evaluation,
)
from pipeline.cli.numbers import positive_int
from pipeline.cli.parser import make_parser
from pipeline.corpus.schema import CorpusError
from pipeline.eval.methods import DEFAULT_METHODS
from pipeline.eval.report import write_report


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.evaluate", __doc__)
    add_evaluation_options(p, DEFAULT_METHODS, "256,512,1024", "eval-out")
    p.add_argument("--f1", action="store_true",
                   help="also generate answers and score F1 (slow; at the floor for a 135M "
                        "model); an episodic method's through the product's answer path")
    p.add_argument("--f1-questions", type=positive_int, default=None, metavar="N",
                   help="with --f1: the first N questions of each conversation only "
                        "(default: every question)")
    p.add_argument("--equal-entries", default=None, metavar="METHOD",
                   help="run every other method with a budget at METHOD's mean decode-time "
                        "entries (cache entries + top-up tokens) per conversation and budget, "
                        "reported at that budget, e.g. epicache (default: each at its budget)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = Path(a.out)
    try:
        methods, budgets = methods_and_budgets(a)
        config = eval_config(a, methods, budgets, generate=a.f1,
                             generate_questions=a.f1_questions)
        if a.equal_entries is not None and a.equal_entries not in methods:
            raise ValueError(f"--equal-entries {a.equal_entries!r} is not one of --methods")
        convs, read = read_corpus(a, out)
    except (CorpusError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run = Evaluation(methods, budgets, config, out, a.in_process, a.equal_entries, a.default)
    summary, records, code = run_evaluation(run, convs, read)
    print(write_report(out, summary, records))
    print(f"outputs: {out}/results.parquet, summary.json, table.md, retention.png, "
          f"scorecard-*.png ({len(records)} question records, {summary['seconds']:.0f}s)")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
