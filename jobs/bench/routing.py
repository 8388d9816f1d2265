"""What a better router could still give: every question read over each episode's cache, and
each routing rule scored from those same reads.

    python -m jobs.bench.routing --corpus ../shared/data/locomo --conversations 26,30,41 \\
        [--budget 512] [--full-length] [--threads 2]

Each conversation is cut to 7,600 tokens (whole with `--full-length`, each question then
against its oracle window, as `jobs.scorecard --full-length`) and built as the scorecard's
default cell builds it, at `--budget`. Every question is read over each episode's cache alone,
with the default's top-up, and over the pair the default route joins where it reads two. A
rule's pick is one of those reads, so each rule is scored on the same measurements:

- `default`: the product's route (`RoutingConfig()`: the window router, two episodes where
  their scores are close);
- each registered router alone (`pipeline.routers.ROUTERS`), one episode a question;
- `evidence` (an oracle): the episode whose windows hold the most of the question's evidence
  turns (the window router breaks ties): what a router that never misses would reach;
- `best episode` (an oracle): the episode whose read answers best, a ceiling that also fits
  the questions' noise.

Printed per rule, over every question: answer and copy-free retention (the scorecard's
measures and references, `pipeline.eval.scorecard`), the paired lead over `default` with its
90% interval, and the route hit (an episode read holds some evidence). All rules read the same
top-up, so copy-free is read over the same turns.
"""

from __future__ import annotations

import argparse
import functools
import uuid

from lab.bench_cli import bench_conversations, bench_parser, start_bench
from lab.routing_rules import rule_records, rule_summary
from lab.tables import print_table
from pipeline.answer.topup import select_topup
from pipeline.builder.conversation import build_conversation, files_of
from pipeline.builder.episode import build_episode_caches
from pipeline.builder.profile import BuildBasis
from pipeline.cli.options import add_budget_option, add_threads_option
from pipeline.config import BuildConfig, RoutingConfig, TopUpConfig
from pipeline.corpus.schema import Conversation
from pipeline.eval.cell import Prepared, evaluate_cell, measure_all, prepare
from pipeline.eval.methods import NO_HISTORY, EvalConfig
from pipeline.eval.reads import question_embeddings, route_scores
from pipeline.eval.window import CUT_TOKENS
from pipeline.kv import models, prompts
from pipeline.kv.cache import EpisodicCache
from pipeline.routers import chosen
from pipeline.store.backends.memory import MemoryStore
from pipeline.store.objects.turn_index import read_turn_index

METHOD = "epicache"


def episode_reads(prep: Prepared, config: EvalConfig, budget: int) -> list[dict]:
    """Per question: its records over each episode alone (`by_episode`) and over the default
    route's pick (`default`), the episodes that pick reads, the routers' scores and the
    evidence turns each episode's windows hold."""
    lm, encoder = models.load_llm(config.model), models.load_encoder(config.encoder)
    build = config.build_config(METHOD, budget)
    store = MemoryStore(f"bench-routing-{uuid.uuid4().hex}")
    try:  # the product's build, each cache kept as built (as the scorecard's cell measures it)
        product = build_conversation(
            prep.conversation, build, store, prefill=build_episode_caches,
            basis=BuildBasis([build.entry_budget] * lm.config.num_hidden_layers, files_of(build)))
        planned = product.planned
        index = read_turn_index(store, planned.turn_index, planned.conversation.conversation_id,
                                planned.encoder_fingerprint)
    finally:
        store.drop()
    conv, questions = planned.conversation, list(prep.questions)
    caches = [done.cache for done in product.built]
    embeddings = question_embeddings(encoder, questions)
    scores = route_scores(embeddings, planned.episodes)
    count = functools.partial(prompts.count_tokens, lm.tokenizer)
    topups = [select_topup(index, e, set(), TopUpConfig(), count) for e in embeddings]
    by_episode = [measure_all(lm, conv, questions, cache, config, topups) for cache in caches]
    routing = RoutingConfig()
    picks = [chosen(scores[routing.router][i], routing.two_below) for i in range(len(questions))]
    joined = {}
    for pair in {p for p in picks if len(p) > 1}:
        asked = [i for i, p in enumerate(picks) if p == pair]
        measured = measure_all(lm, conv, [questions[i] for i in asked],
                               EpisodicCache.joined([caches[k] for k in pair]), config,
                               [topups[i] for i in asked])
        joined |= dict(zip(asked, measured))
    return [{"by_episode": [records[i] for records in by_episode],
             "default": joined.get(i, by_episode[pick[0]][i]), "default_pick": pick,
             "scores": {name: table[i] for name, table in scores.items()},
             "holds": [len(set(q.evidence) & set(members)) for members in planned.members]}
            for i, (q, pick) in enumerate(zip(questions, picks))]


def references(prep: Prepared, config: EvalConfig) -> list[dict]:
    """The scorecard's no-history and full-history records of the conversation's questions."""
    return [r for method in (NO_HISTORY, "full") for r in evaluate_cell(prep, method, None,
                                                                         config, None)]


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("routing", __doc__, conversations="26,30,41")
    add_budget_option(p, 512)
    p.add_argument("--full-length", action="store_true",
                   help="whole conversations, each question against its oracle window")
    add_threads_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = start_bench(parser, argv)
    config = EvalConfig(BuildConfig(max_context_tokens=None if a.full_length else CUT_TOKENS),
                        reference_window=CUT_TOKENS if a.full_length else None)
    records: list[dict] = []
    conversations: list[Conversation] = bench_conversations(parser, a)
    for conv in conversations:
        prep = prepare(conv, config)
        records += references(prep, config)
        records += rule_records(conv.conversation_id, episode_reads(prep, config, a.budget))
        print(f"{conv.conversation_id}: {len(prep.questions)} questions", flush=True)
    table = rule_summary(records)
    print(f"\nrouting rules, {len(conversations)} conversation(s) "
          f"{'whole' if a.full_length else f'cut to {CUT_TOKENS:,} tokens'}, {a.budget} entries "
          "an episode; retention (%) and the paired lead over the default route [90%]:")
    print_table(table, [("rule", "rule", "s"), ("hit", "route hit", ".0%"),
                        ("answer", "answer", ".1f"), ("answer_lead", "- default", "s"),
                        ("copy_free", "copy-free", ".1f"),
                        ("copy_free_lead", "- default", "s")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
