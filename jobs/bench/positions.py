"""Compact positions on whole conversations: what a history longer than the model keeps.

    python -m jobs.bench.positions --corpus ../shared/data/locomo --conversations 26 \\
        [--cut-tokens 7600] [--budget 1024] [--questions 0]

A conversation longer than the model's positions can be built whole only with compact positions
(`--positions compact`: kept entries re-rotated to 0, 1, 2, ... after every eviction). This
measures what that costs, on the questions whose evidence lies inside the first `--cut-tokens`
tokens (those a cut build also keeps), side by side in one run:

- `cut`: the EpiCache build of the conversation cut at a session boundary, original positions;
- `cut+compact`: the same cut, compact positions (the cost of re-rotation alone);
- `whole+compact`: the whole conversation, compact positions (the longer history on top);
- `whole`: the whole conversation, the default positions (compact, the last 2,048 tokens at
  their spacing).

Retention of the mean evidence-recall NLLs, the references being the cut's full cache and no
history (the whole conversation has no full cache within the model's positions).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from lab.bench_cli import bench_conversations, bench_parser, start_bench
from pipeline.cli.options import PREFILL_BENCH_OPTIONS, add_options, add_threads_option
from pipeline.config import BuildConfig
from pipeline.eval.cell import evaluate_cell, prepare
from pipeline.eval.methods import EvalConfig
from pipeline.eval.metrics import retention
from pipeline.eval.window import CUT_TOKENS
from pipeline.kv import models

COMPACT = "epicache+prefill.compact_recent=0"  # every kept entry packed
ROWS = (("cut", "epicache-orig", False), ("cut+compact", COMPACT, False),
        ("whole+compact", COMPACT, True), ("whole", "epicache", True))


def measure(conv, config: EvalConfig, budget: int) -> list[dict]:
    """One row per build of `ROWS`, over the questions the cut keeps."""
    cut = prepare(conv, config)
    whole = replace(prepare(conv, replace(config, build=replace(config.build,
                                                                 max_context_tokens=None))),
                    questions=cut.questions)
    refs = {m: evaluate_cell(cut, m, None, config, None) for m in ("full", "none")}
    mean = lambda records: sum(r["evidence_nll"] for r in records) / len(records)  # noqa: E731
    rows = []
    for name, method, is_whole in ROWS:
        start = time.perf_counter()
        records = evaluate_cell(whole if is_whole else cut, method, budget, config, None)
        rows.append({"conversation": conv.conversation_id, "build": name,
                     "tokens": (whole if is_whole else cut).tokens, "questions": len(records),
                     "evidence_nll": mean(records),
                     "retention_of_means": retention(mean(refs["none"]), mean(records),
                                                     mean(refs["full"])),
                     "evidence_kept": sum(r["evidence_kept"] for r in records) / len(records),
                     "seconds": time.perf_counter() - start})
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("positions", __doc__, conversations="26")
    p.add_argument("--cut-tokens", type=int, default=CUT_TOKENS,
                   help="the cut build's length, and which questions are measured")
    add_options(p, PREFILL_BENCH_OPTIONS[:1], BuildConfig())
    p.add_argument("--questions", type=int, default=0,
                   help="questions per conversation (0: every question inside the cut)")
    add_threads_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = start_bench(parser, argv)
    config = EvalConfig(BuildConfig(max_context_tokens=a.cut_tokens),
                        questions_per_conversation=a.questions or None)
    conversations = bench_conversations(parser, a)
    rows = [row for conv in conversations for row in measure(conv, config, a.budget)]
    print(f"\nmodel {models.DEFAULT_LLM}, budget {a.budget}, retention of the mean evidence NLLs "
          f"(references: the {a.cut_tokens}-token cut's full cache and no history)\n")
    print("| conversation | build | tokens | questions | retention | evidence kept | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['conversation']} | {r['build']} | {r['tokens']:,} | {r['questions']} | "
              f"{100 * r['retention_of_means']:.1f}% | {100 * r['evidence_kept']:.1f}% | "
              f"{r['seconds']:.0f} |")
    for name, _, _ in ROWS[1:]:
        own = [r for r in rows if r["build"] == name]
        base = [r for r in rows if r["build"] == "cut"]
        ratio = (sum(r["retention_of_means"] for r in own)
                 / max(sum(r["retention_of_means"] for r in base), 1e-9))
        print(f"{name} / cut retention: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
