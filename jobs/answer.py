"""Answer questions about a built conversation from its episodic caches.

    python -m jobs.answer --store DIR|s3://bucket/prefix --conversation ID --question Q
        [--question Q2 ...] [--json]

Each question is routed to the nearest episode; consecutive questions routed to the same
episode reuse the resident cache.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pipeline.answer.answerer import Answerer
from pipeline.answer.malloc_tuning import retain_freed_memory
from pipeline.answer.routing import ConversationNotFound, ModelMismatchError
from pipeline.cli.options import add_store_options
from pipeline.cli.parser import make_parser
from pipeline.corpus.schema import UnsafeIdError
from pipeline.kv.models import ModelNotFoundError
from pipeline.store.base import StoreError
from pipeline.store.cache_format import CacheCorruptError
from pipeline.store.uri import open_store


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.answer", __doc__)
    add_store_options(p)
    p.add_argument("--conversation", required=True, help="the conversation id, as in its manifest")
    p.add_argument("--question", action="append", required=True,
                   help="a question about it (may repeat: answered in order)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="answer length at most (tokens)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (0: greedy)")
    p.add_argument("--json", action="store_true", help="one JSON object per question")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    retain_freed_memory()  # as the Serve decoder does: caches load into reused memory
    try:
        answerer = Answerer(open_store(a.store, endpoint_url=a.s3_endpoint, create=False))
        for q in a.question:
            r = answerer.answer(a.conversation, q, a.max_new_tokens, a.temperature)
            if a.json:
                print(json.dumps(r.as_dict(), ensure_ascii=False), flush=True)
            else:
                t = r.timings_ms
                print(f"Q: {q}\nA: {r.answer}\n   (episode {r.episode}, similarity {r.similarity:.3f}, "
                      f"{'resident' if r.cache_hit else 'fetched'}; embed {t['embed']:.0f} ms, "
                      f"route {t['route']:.1f} ms, load {t['load']:.0f} ms, decode {t['decode']:.0f} ms)",
                      flush=True)
    except (ConversationNotFound, UnsafeIdError, ModelMismatchError, CacheCorruptError,
            StoreError, ModelNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
