"""Answer questions about a built conversation from its episodic caches.

    python -m jobs.answer --store DIR|s3://bucket/prefix --conversation ID [--conversation ID2 ...]
        --question Q [--question Q2 ...] [--topup | --no-topup] [--json]

Every question is asked of every conversation given, in order. One conversation that cannot be
answered (not built, a manifest or cache object damaged, built with other model files) is one
error line naming it, and the others are answered: the exit code is 1 when some conversations
failed, 2 when all did (or the arguments, the store or the model did). Each question is routed
to the nearest episode; consecutive questions routed to the same
episode reuse the resident cache. With `--topup`, the question's nearest turns that the episodes
read do not hold are read after the cache (docs/serving.md#top-up). Questions and sampling
parameters are held to the limits the server holds them to (`pipeline.config.limits`;
docs/serving.md, "Limits").
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pipeline.allocator import retain_freed_memory
from pipeline.cli.numbers import non_negative
from pipeline.cli.options import add_topup_options, topup_config_from_args
from pipeline.cli.parser import add_store_options, make_parser, store_options
from pipeline.config import ROUTER_NAMES, RoutingConfig
from pipeline.config.limits import CHARS_PER_TOKEN, DEFAULT_LIMITS, AnswerLimits
from pipeline.corpus.schema import UnsafeIdError
from pipeline.store.backends.base import StoreError
from pipeline.store.backends.uri import open_store


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.answer", __doc__)
    add_store_options(p)
    p.add_argument("--conversation", action="append", required=True,
                   help="a conversation id, as in its manifest (may repeat: each is asked "
                        "every question)")
    p.add_argument("--question", action="append", required=True,
                   help="a question about it (may repeat: answered in order)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help=f"answer length at most (tokens, 1 to {DEFAULT_LIMITS.max_new_tokens})")
    p.add_argument("--temperature", type=float, default=0.0,
                   help=f"sampling temperature (0: greedy; at most "
                        f"{DEFAULT_LIMITS.max_temperature:g})")
    p.add_argument("--max-question-tokens", type=int, default=DEFAULT_LIMITS.max_question_tokens,
                   help=f"longest question (tokens); one over {CHARS_PER_TOKEN} characters a "
                        "token is refused before it is tokenised")
    p.add_argument("--route-by", default=RoutingConfig.router, choices=sorted(ROUTER_NAMES),
                   help="how a question picks its episode (docs/serving.md#routing)")
    p.add_argument("--two-below", type=non_negative, default=RoutingConfig.two_below,
                   help="read the best two episodes together when their route scores differ by "
                        "less than this (0: one episode always)")
    add_topup_options(p)
    p.add_argument("--json", action="store_true", help="one JSON object per question")
    return p


def topup_line(topup: dict) -> str:
    """What the human-readable output says of a question's top-up ("" when none was read)."""
    if topup.get("status") == "used":
        return f"   (topped up: turns {', '.join(topup['turn_ids'])}, {topup['tokens']} tokens)"
    if topup.get("status") == "unavailable":
        return f"   (no top-up: {topup['note']})"
    return ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, each question and sampling parameter checked against the limits (as the
    server checks them) before any model or library is loaded: this command's one check
    (`a.asked`: the questions as checked, answered as such); `a.limits` holds the limits."""
    p = build_parser()
    a = p.parse_args(argv)
    try:
        a.limits = AnswerLimits(max_question_tokens=a.max_question_tokens,
                                max_new_tokens=DEFAULT_LIMITS.max_new_tokens)
        a.asked = [a.limits.checked(question, a.max_new_tokens, a.temperature,
                                    ("--max-new-tokens", "--temperature"))
                   for question in a.question]
    except ValueError as e:  # LimitError, or a --max-question-tokens below 1
        p.error(str(e).replace("max_question_tokens", "--max-question-tokens"))
    return a


def print_answer(r, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r.as_dict(), ensure_ascii=False), flush=True)
        return
    t = r.timings_ms
    read = "episodes " + " and ".join(map(str, r.episodes)) if len(r.episodes) > 1 \
        else f"episode {r.episode}"
    how = (f"   ({read}, similarity {r.similarity:.3f}, "
           f"{'resident' if r.cache_hit else 'fetched'}; embed {t['embed']:.0f} ms, "
           f"route {t['route']:.1f} ms, load {t['load']:.0f} ms, decode {t['decode']:.0f} ms)")
    lines = [f"Q: {r.question}", f"A: {r.answer}", how, topup_line(r.topup)]
    print("\n".join(line for line in lines if line), flush=True)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    # Start-up time: torch, transformers and the store clients are imported once the arguments
    # are known good, so that --help and an argument error answer at once.
    from pipeline.answer.answerer import Answerer
    from pipeline.answer.lookup import ConversationNotFound, ModelMismatchError
    from pipeline.kv.models import ModelNotFoundError
    from pipeline.store.objects.cache_format import CacheCorruptError

    # what fails one conversation, not the run: the others are still answered
    conversation_faults = (ConversationNotFound, UnsafeIdError, ModelMismatchError,
                           CacheCorruptError, StoreError)
    retain_freed_memory()  # as the Serve decoder does: caches load into reused memory
    failed = 0
    try:
        answerer = Answerer(open_store(a.store, store_options(a), create=False),
                            limits=a.limits, routing=RoutingConfig(a.route_by, a.two_below),
                            topup=topup_config_from_args(a))
        for cid in a.conversation:
            if len(a.conversation) > 1 and not a.json:
                print(f"== {cid}", flush=True)
            try:
                for asked in a.asked:
                    print_answer(answerer.answer_checked(cid, asked), a.json)
            except conversation_faults as e:
                failed += 1
                where = f"conversation {cid}: " if len(a.conversation) > 1 else ""
                print(f"error: {where}{e}", file=sys.stderr, flush=True)
    except (StoreError, ModelNotFoundError, ValueError) as e:  # ValueError: LimitError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if not failed else 2 if failed == len(a.conversation) else 1


if __name__ == "__main__":
    raise SystemExit(main())
