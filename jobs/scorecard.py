"""The scorecard: the default against every fair row, on measures a copy cannot win, with intervals.

    python -m jobs.scorecard --corpus ../shared/data/locomo --page docs/scorecard.md

Runs the evaluation (`jobs.evaluate`) of the default (`epicache`), the episode alone, each
baseline topped up with the question's nearest turns and StreamingLLM alone (every one at the
default's decode-time entries: cache entries + top-up tokens), retrieval alone (`rag`), the
full history with the same top-up (`full+topup.enabled=true`) and the two references, on every
question of each conversation cut to fit the model, at 512 and 1,024 entries. The headline is
retention of the mean answer NLLs and copy-free evidence recall, each with a 90% bootstrap
interval and the default's paired lead over every row; the conversations are reported in two
groups, those tuned on (`--tuning`) and the untouched others. Answers are also generated for a
sample of questions (token F1; the default's through the product's answer path). Writes the
evaluation's outputs to --out and the page (tables, a retention-vs-entries plot per group,
each measure's signal) to --page, its data beside it (`<page>.json`). Finished cells are kept
under --out: a re-run computes only what it lacks. On 2 CPU cores the ten LoCoMo conversations
take about two hours.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
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
from pipeline.cli.numbers import count
from pipeline.cli.parser import make_parser, writable_folder
from pipeline.corpus.reader import select_conversations
from pipeline.corpus.schema import CorpusError
from pipeline.eval.page import FULL_LENGTH_PAGE, scorecard_page
from pipeline.eval.report import write_report
from pipeline.eval.window import CUT_TOKENS

ROWS = ("full", "epicache", "epicache-episode", "streamingllm",
        "streamingllm+topup.enabled=true", "snapkv+topup.enabled=true",
        "keydiff+topup.enabled=true", "rag", "full+topup.enabled=true")
# --full-length: whole conversations, longer than the model's positions, so the baselines keep
# compact positions too (at original positions they would not fit), and the full-history
# reference is each question's oracle window (`pipeline.eval.window`)
COMPACT = "+prefill.positions=compact"
FULL_LENGTH_ROWS = ("full", "epicache", "epicache-episode", f"streamingllm{COMPACT}",
                    f"streamingllm{COMPACT}+topup.enabled=true",
                    f"snapkv{COMPACT}+topup.enabled=true", f"keydiff{COMPACT}+topup.enabled=true",
                    "rag", "full+topup.enabled=true")
TUNING = ("locomo-26", "locomo-30", "locomo-41")  # the only conversations tuned on

# the summary's parts the page is made from, written beside it (`<page>.json`)
PAGE_DATA = ("config", "methods", "budgets", "conversations", "equal_entries", "default",
             "scorecard")


def build_parser(full_length: bool = False) -> argparse.ArgumentParser:
    """The options; `--full-length` changes the defaults of the rows, budgets, --out and --page."""
    p = make_parser("jobs.scorecard", __doc__)
    add_evaluation_options(p, FULL_LENGTH_ROWS if full_length else ROWS,
                           "512,1024,2048" if full_length else "512,1024",
                           "scorecard-full-out" if full_length else "scorecard-out")
    p.add_argument("--full-length", action="store_true",
                   help="whole conversations (no cut), each question's reference the full cache "
                        f"of the {CUT_TOKENS:,}-token window holding its evidence; its own rows "
                        "(baselines at compact positions), budgets (512,1024,2048), --out "
                        f"(scorecard-full-out) and --page (docs/{FULL_LENGTH_PAGE})")
    for action in p._actions:
        if action.dest == "max_context_tokens" and not full_length:
            action.default = CUT_TOKENS
            action.help = ("cut each conversation at a session boundary to fit this many "
                           f"tokens (default: {CUT_TOKENS})")
        if action.dest == "reference_window" and full_length:
            action.default = CUT_TOKENS
    p.add_argument("--tuning", default=None,
                   help="the conversations tuned on, reported apart from the untouched others; "
                        "each must be evaluated (default: LoCoMo "
                        f"{', '.join(t.removeprefix('locomo-') for t in TUNING)}, those of them "
                        "evaluated)")
    p.add_argument("--page", default=f"docs/{FULL_LENGTH_PAGE}" if full_length else
                   "docs/scorecard.md", help="the scorecard page to write (its plots beside it)")
    p.add_argument("--f1-questions", type=count, default=0 if full_length else 8, metavar="N",
                   help="generate answers for the first N questions of each conversation "
                        "(token F1); 0: none")
    p.add_argument("--f1-methods", default="epicache,full",
                   help="comma-separated rows whose answers are generated")
    return p


def main(argv: list[str] | None = None) -> int:
    full_length = "--full-length" in (sys.argv[1:] if argv is None else argv)
    a = build_parser(full_length).parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out, page = Path(a.out), Path(a.page)
    try:
        methods, budgets = methods_and_budgets(a)
        answered = tuple(m.strip() for m in a.f1_methods.split(",") if m.strip())
        unknown = [m for m in answered if m not in methods]
        if unknown:
            raise ValueError(f"--f1-methods {', '.join(unknown)}: not among --methods")
        config = eval_config(a, methods, budgets, generate=a.f1_questions > 0,
                             generate_questions=a.f1_questions, generate_methods=answered)
        writable_folder(page.parent, "--page")
        convs, read = read_corpus(a, out)
        tuning = [c.conversation_id for c in convs if c.conversation_id in TUNING] \
            if a.tuning is None else \
            [c.conversation_id for c in select_conversations(convs, a.tuning, a.corpus)]
    except (CorpusError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    groups = {"tuning": tuning,
              "untouched": [c.conversation_id for c in convs if c.conversation_id not in tuning]}
    run = Evaluation(methods, budgets, config, out, a.in_process, a.default, a.default,
                     {k: v for k, v in groups.items() if v})
    summary, records, code = run_evaluation(run, convs, read)
    write_report(out, summary, records)
    command = "python -m jobs.scorecard " + shlex.join(argv if argv is not None else sys.argv[1:])
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(scorecard_page(summary, command, page), encoding="utf-8")
    data = {k: summary[k] for k in PAGE_DATA} | {"command": command}
    page.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n",
                                         encoding="utf-8")
    print(f"scorecard: {page} (its data: {page.with_suffix('.json')}); outputs: "
          f"{out}/results.parquet, summary.json, table.md "
          f"({len(records)} question records, {summary['seconds']:.0f}s)")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
