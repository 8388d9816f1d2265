"""Screen EpiCache recipes fast: one full prefill per conversation, then each recipe's selection.

    python -m jobs.screen --corpus ../shared/data/locomo --conversations 30 --budgets 1024 \\
        --methods epicache-paper,epicache-paper+scoring.utterance=true,epicache

A proxy, not the evaluation: the cache is prefilled once with the full history, then for every
episode the patch's attention to it is scored once and each recipe (a `jobs.evaluate` preset
with its overrides) keeps its top entries per layer in one step. Block prefill decides block by
block and its later keys were computed with an already evicted history, so figures here are higher
than `jobs.evaluate`'s; they rank selection strategies in minutes instead of hours. Retention of the
mean evidence NLLs, with the same probes, routing and diagnostics as the evaluation; one process, no
Ray.
"""

from __future__ import annotations

import argparse
import sys

from pipeline.cli.options import PREFILL_OPTIONS, add_budgets_option, add_options, options_named
from pipeline.cli.parser import make_parser
from pipeline.config import BuildConfig
from pipeline.corpus.reader import iter_corpus, select_conversations
from pipeline.corpus.schema import Conversation, CorpusError
from pipeline.eval.methods import EvalConfig, parse_method
from pipeline.eval.window import CUT_TOKENS

# The screen's conversations are cut as the quality work cuts them (docs/quality.md).
SCREEN_BUILD = BuildConfig(max_context_tokens=CUT_TOKENS)


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.screen", __doc__)
    p.add_argument("--corpus", required=True, help="LoCoMo file or folder, or the project's JSONL")
    p.add_argument("--conversations", default=None,
                   help="comma-separated ids, 26 = locomo-26 (default: all)")
    p.add_argument("--methods", default="epicache-paper,epicache",
                   help="comma-separated EpiCache recipes: jobs.evaluate's epicache presets, "
                        "with overrides +PATH=VALUE (python -m jobs.evaluate --help)")
    add_budgets_option(p, "512,1024")
    add_options(p, options_named(PREFILL_OPTIONS, "--max-context-tokens"), SCREEN_BUILD)
    p.add_argument("--questions-per-conversation", type=int, default=40,
                   help="the first N questions of each conversation")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    config = EvalConfig(BuildConfig(max_context_tokens=a.max_context_tokens),
                        questions_per_conversation=a.questions_per_conversation)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    try:
        for m in methods:
            if not parse_method(m).episodic:
                raise ValueError(f"{m!r}: the screen runs EpiCache recipes only")
        budgets = a.budgets
        convs = list(iter_corpus(a.corpus))
        if a.conversations:
            convs = select_conversations(convs, a.conversations, a.corpus)
    except (ValueError, CorpusError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return screen(convs, methods, budgets, config)


def screen(convs: list[Conversation], methods: list[str], budgets: list[int],
           config: EvalConfig) -> int:
    """Screen every conversation and print the table. torch and the models load here, once
    the arguments and the corpus are known good."""
    from lab.screen import screen_conversation, table
    from pipeline.builder.profile import measure_profile
    from pipeline.kv import models

    lm, encoder = models.load_llm(config.model), models.load_encoder(config.encoder)
    profile: list[list[float]] = []  # measured once, only if a recipe allocates

    def measured_profile() -> list[float]:
        if not profile:
            profile.append(measure_profile(lm, BuildConfig()))  # the sensitivity profile
        return profile[0]

    records = []
    for conv in convs:
        records += screen_conversation(lm, encoder, conv, methods, budgets, config,
                                       measured_profile)
    print(table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
