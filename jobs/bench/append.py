"""Conversations that grow: a session appended to the stored caches against a rebuild, per step.

    python -m jobs.bench.append --corpus ../shared/data/locomo --conversations 26,30,41 \\
        [--start-tokens 3000] [--cut-tokens 7600] [--budgets 1024,512] [--questions 40] \\
        [--max-growth 2.0] [--out append.json]

Each conversation is built at its first sessions (the longest run of whole sessions within
`--start-tokens`), then grown one session at a time up to `--cut-tokens`. At every step, side by
side in one process with the models loaded once:

- `append`: the build of the grown record on the store that holds the previous step, as
  `jobs.build` runs it (`pipeline.builder.conversation.build_conversation`): the new session
  block-prefilled into each episode's stored cache, or re-clustered and rebuilt where the
  growth rule says so (the `decision` column);
- `rebuild`: the same record built from its first turn on a store of its own (re-clustered).

Both are timed from the manifest read to the commit. Then the questions whose evidence lies in
the current sessions (at most `--questions`, LoCoMo's adversarial ones left out) are routed by
each store's episodes as the server routes them (to the best one only), and read from the
stored caches: the retention of the mean evidence-recall NLLs of each, against the full cache
and no history at that length (`pipeline.eval.metrics.retention`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from lab.bench_cli import bench_conversations, bench_parser, start_bench
from pipeline.answer.lookup import route_index, route_records
from pipeline.builder.append import read_stored_cache
from pipeline.builder.conversation import build_conversation
from pipeline.cli.options import add_budgets_option, add_threads_option
from pipeline.config import BuildConfig, GrowthConfig
from pipeline.corpus.render import render_conversation
from pipeline.corpus.schema import Conversation
from pipeline.episodes import embed_texts
from pipeline.eval.cell import history_ids, measure_all
from pipeline.eval.methods import EvalConfig
from pipeline.eval.metrics import ADVERSARIAL_CATEGORY, retention
from pipeline.eval.window import CUT_TOKENS
from pipeline.kv import models, prompts
from pipeline.kv.methods.full import Full
from pipeline.kv.prefill import block_prefill
from pipeline.store.backends.local import LocalStore
from pipeline.store.catalogue.manifest import read_manifest

REBUILD = GrowthConfig(append=False)


def steps_of(conv: Conversation, tokenizer, start_tokens: int, cut_tokens: int
             ) -> list[Conversation]:
    """The conversation at each step: its first k whole sessions, from the most that fit in
    `start_tokens` to the most that fit in `cut_tokens`, one session more at a time."""
    sessions = sorted({t.session for t in conv.turns})
    steps = []
    for k in range(1, len(sessions) + 1):
        kept = set(sessions[:k])
        step = dataclasses.replace(conv, turns=tuple(t for t in conv.turns if t.session in kept))
        tokens = len(prompts.context_ids(tokenizer, render_conversation(step).text))
        if tokens > cut_tokens:
            break
        if tokens <= start_tokens:
            steps = [step]
        else:
            steps.append(step)
    return steps


def questions_in(conv: Conversation, limit: int) -> list:
    """The questions whose evidence is all inside `conv`'s turns (adversarial ones left out)."""
    ids = {t.turn_id for t in conv.turns}
    kept = [q for q in conv.questions if q.category != ADVERSARIAL_CATEGORY and q.evidence
            and all(e in ids for e in q.evidence)]
    return kept[:limit]


def mean_nll(records: list[dict]) -> float:
    return float(np.mean([r["evidence_nll"] for r in records]))


def stored_nll(lm, encoder, store: LocalStore, conv: Conversation, questions: list,
               config: EvalConfig) -> tuple[float, float]:
    """(mean evidence-recall NLL, mean cache objects bytes read per question) of the questions
    routed by the evaluation's router to their best episode and read from the stored caches."""
    records = sorted(read_manifest(store, conv.conversation_id), key=lambda r: r.episode)
    one, index = dataclasses.replace(config.routing, two_below=0.0), route_index(records)
    embeddings = embed_texts(encoder, [q.question for q in questions])
    routed = defaultdict(list)
    for q, e in zip(questions, embeddings):
        routed[route_records(e, records, one, index)[0][0].episode].append(q)
    measured, read = [], 0
    for episode, group in routed.items():
        cache = read_stored_cache(store, records[episode], lm.model)
        measured += measure_all(lm, conv, group, cache, config)
        read += records[episode].object_bytes * len(group)
    return mean_nll(measured), read / len(questions)


def reference_nlls(lm, conv: Conversation, questions: list, config: EvalConfig
                   ) -> tuple[float, float]:
    """(no history, full cache) mean evidence-recall NLLs at this length."""
    none, _ = block_prefill(lm.model, history_ids(lm.tokenizer, conv, turns=False), Full(),
                            None)
    full, _ = block_prefill(lm.model, history_ids(lm.tokenizer, conv), Full(), None)
    return (mean_nll(measure_all(lm, conv, questions, none, config)),
            mean_nll(measure_all(lm, conv, questions, full, config)))


def timed_build(conv: Conversation, config: BuildConfig, store: LocalStore,
                growth: GrowthConfig) -> tuple[list, float]:
    start = time.perf_counter()
    records = build_conversation(conv, config, store, growth).records
    return records, time.perf_counter() - start


def run_conversation(conv: Conversation, budgets: list[int], args, root: Path) -> list[dict]:
    """The conversation's steps, each budget appended to and rebuilt at every step (the
    references, full cache and no history, measured once per step)."""
    lm = models.load_llm(args.model)
    encoder = models.load_encoder(args.encoder)
    steps = steps_of(conv, lm.tokenizer, args.start_tokens, args.cut_tokens)
    growth = GrowthConfig(max_growth=args.max_growth)
    eval_config = EvalConfig(build=BuildConfig(model=args.model, encoder=args.encoder))
    configs = {b: BuildConfig(model=args.model, encoder=args.encoder, budget=b) for b in budgets}
    appended = {b: LocalStore(root / f"{conv.conversation_id}-{b}-append") for b in budgets}
    tokens_before = {b: build_conversation(steps[0], configs[b], appended[b]).records[0].tokens
                     for b in budgets}  # the first sessions, built once
    rows = []
    for k, step in enumerate(steps[1:], start=1):
        questions = questions_in(step, args.questions)
        none, full = reference_nlls(lm, step, questions, eval_config)
        for budget in budgets:
            config = configs[budget]
            rebuilt = LocalStore(root / f"{conv.conversation_id}-{budget}-rebuild-{k}")
            records, append_s = timed_build(step, config, appended[budget], growth)
            _, rebuild_s = timed_build(step, config, rebuilt, REBUILD)
            nll_a, bytes_a = stored_nll(lm, encoder, appended[budget], step, questions,
                                        eval_config)
            nll_r, bytes_r = stored_nll(lm, encoder, rebuilt, step, questions, eval_config)
            row = {"conversation": conv.conversation_id, "budget": budget, "step": k,
                   "sessions": len({t.session for t in step.turns}),
                   "tokens": records[0].tokens,
                   "new_tokens": records[0].tokens - tokens_before[budget],
                   "decision": decision(records),
                   "append_s": append_s, "rebuild_s": rebuild_s, "speedup": rebuild_s / append_s,
                   "questions": len(questions), "retention_appended": retention(none, nll_a, full),
                   "retention_rebuilt": retention(none, nll_r, full),
                   "bytes_per_question_appended": bytes_a, "bytes_per_question_rebuilt": bytes_r}
            rows.append(row)
            tokens_before[budget] = records[0].tokens
            print(format_row(row), flush=True)
    return rows


def decision(records) -> str:
    """"appended", or "re-clustered" (the growth rule, or the first build)."""
    return "appended" if all((r.appends or 0) > 0 for r in records) else "re-clustered"


HEADER = ("| conv | budget | step | sessions | tokens | new | decision | append s | rebuild s | "
          "speed-up | questions | retention appended | retention rebuilt | points |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def format_row(r: dict) -> str:
    points = 100 * (r["retention_appended"] - r["retention_rebuilt"])
    return (f"| {r['conversation']} | {r['budget']} | {r['step']} | {r['sessions']} | "
            f"{r['tokens']:,} | {r['new_tokens']:,} | {r['decision']} | {r['append_s']:.1f} | "
            f"{r['rebuild_s']:.1f} | {r['speedup']:.1f}x | {r['questions']} | "
            f"{r['retention_appended']:.1%} | {r['retention_rebuilt']:.1%} | {points:+.1f} |")


def summary(rows: list[dict]) -> list[str]:
    """Per budget: how many steps appended, their median speed-up, and the retention of the
    appended and the rebuilt caches at the last step and over every step."""
    lines = []
    for budget in sorted({r["budget"] for r in rows}, reverse=True):
        mine = [r for r in rows if r["budget"] == budget]
        appended = [r for r in mine if r["decision"] == "appended"]
        final = {r["conversation"]: r for r in mine}  # each conversation's last step
        last = list(final.values())
        mean = lambda key, rs: float(np.mean([r[key] for r in rs]))  # noqa: E731
        speedup = float(np.median([r["speedup"] for r in appended])) if appended else float("nan")
        lines.append(
            f"budget {budget}: {len(appended)} of {len(mine)} steps appended, median speed-up "
            f"{speedup:.1f}x; retention at the last step, appended "
            f"{mean('retention_appended', last):.1%} vs rebuilt "
            f"{mean('retention_rebuilt', last):.1%} ({len(last)} conversations); over every "
            f"step {mean('retention_appended', mine):.1%} vs {mean('retention_rebuilt', mine):.1%}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("append", __doc__, conversations="26,30,41")
    p.add_argument("--model", default=BuildConfig().model, help="LLM: packaged name or folder")
    p.add_argument("--encoder", default=BuildConfig().encoder, help="sentence encoder")
    p.add_argument("--start-tokens", type=int, default=3000,
                   help="the first build: the most whole sessions within this many tokens")
    p.add_argument("--cut-tokens", type=int, default=CUT_TOKENS,
                   help="grown one session at a time up to this many tokens")
    add_budgets_option(p, "1024,512")
    p.add_argument("--questions", type=int, default=40,
                   help="questions per step at most (those whose evidence is in the sessions)")
    p.add_argument("--max-growth", type=float, default=GrowthConfig().max_growth,
                   help="the growth rule's --max-growth for the appended store")
    p.add_argument("--out", type=Path,
                   help="also write the rows as JSON here (default: print only)")
    add_threads_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = start_bench(parser, argv)
    convs = bench_conversations(parser, args)
    print(HEADER, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-append-") as root:
        for conv in convs:
            rows += run_conversation(conv, args.budgets, args, Path(root))
    print("\n".join(summary(rows)))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
