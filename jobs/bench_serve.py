"""A bounded load against a running decode endpoint (`python -m jobs.serve`).

    python -m jobs.bench_serve --url http://127.0.0.1:8000 --corpus corpus.jsonl \
        [--conversations 3] [--requests 200] [--concurrency 8] [--max-new-tokens 16]

Each (conversation, question) pair is asked once first (warm-up, not measured: it fetches the
caches), then `--requests` questions cycle over the pairs from `--concurrency` client threads.
Prints requests/s, client latency p50/p95, the server's per-stage split, the cache hit rate
and the share of the turn spent on embed + route + fetch (the goal: at most 5% with a warm
cache), and exits 1 if any request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import requests

from jobs.cli import make_parser

STAGES = ("embed", "route", "fetch", "decode")
GENERIC_QUESTIONS = ("What did they talk about most?", "Where did they go last weekend?",
                     "What is the name of the pet?", "What did they cook for the party?")


@dataclass
class Sample:
    ok: bool
    latency_ms: float
    status: int
    timings: dict = field(default_factory=dict)
    cache_hit: bool | None = None
    error: str = ""


def load_questions(corpus: str | None, conversations: list[str], limit: int,
                   per_conversation: int) -> list[tuple[str, str]]:
    """(conversation id, question) pairs: the corpus's own questions, else generic ones."""
    pairs: list[tuple[str, str]] = []
    if corpus:
        from pipeline.corpus import read_corpus

        convs = read_corpus(corpus)[0]
        if conversations:
            convs = [c for c in convs if c.conversation_id in set(conversations)]
        for conv in convs[:limit]:
            qs = [q.question for q in conv.questions][:per_conversation] or list(GENERIC_QUESTIONS)
            pairs += [(conv.conversation_id, q) for q in qs]
    else:
        for cid in conversations[:limit]:
            pairs += [(cid, q) for q in GENERIC_QUESTIONS[:per_conversation]]
    if not pairs:
        raise ValueError("no conversations to ask about: give --corpus or --conversation")
    return pairs


def ask(session: requests.Session, url: str, cid: str, question: str, max_new_tokens: int,
        headers: dict, timeout: float) -> Sample:
    t = time.perf_counter()
    try:
        r = session.post(f"{url}/v1/conversations/{cid}/answer", headers=headers, timeout=timeout,
                         json={"question": question, "max_new_tokens": max_new_tokens})
    except requests.RequestException as e:
        return Sample(False, (time.perf_counter() - t) * 1000, 0, error=type(e).__name__)
    latency = (time.perf_counter() - t) * 1000
    if r.status_code != 200:
        return Sample(False, latency, r.status_code, error=r.text[:200])
    body = r.json()
    return Sample(True, latency, 200, body["timings_ms"], body.get("cache_hit"))


def run_bench(url: str, pairs: list[tuple[str, str]], n_requests: int = 200,
              concurrency: int = 8, max_new_tokens: int = 16, token: str | None = None,
              warmup: bool = True, seed: int = 0, timeout: float = 300.0) -> dict:
    """Warm up, then run the bounded load; returns the measured figures."""
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if warmup:
        with requests.Session() as s:
            for cid, q in pairs:
                sample = ask(s, url, cid, q, max_new_tokens, headers, timeout)
                if not sample.ok:
                    raise RuntimeError(f"warm-up request for {cid!r} failed: {sample.status} "
                                       f"{sample.error}")
    order = [pairs[i % len(pairs)] for i in range(n_requests)]
    random.Random(seed).shuffle(order)
    local = threading.local()

    def one(pair: tuple[str, str]) -> Sample:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        return ask(local.session, url, *pair, max_new_tokens, headers, timeout)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples = list(pool.map(one, order))
    wall = time.perf_counter() - start
    ok = [s for s in samples if s.ok]
    lat = np.array([s.latency_ms for s in ok]) if ok else np.zeros(1)
    stage = {k: np.array([s.timings[k] for s in ok]) if ok else np.zeros(1) for k in STAGES}
    server_turn = sum(stage[k].sum() for k in STAGES)
    overhead = stage["embed"].sum() + stage["route"].sum() + stage["fetch"].sum()
    hits = [s.cache_hit for s in ok if s.cache_hit is not None]
    return {
        "requests": n_requests, "concurrency": concurrency, "pairs": len(pairs),
        "conversations": len({c for c, _ in pairs}), "max_new_tokens": max_new_tokens,
        "errors": len(samples) - len(ok),
        "error_examples": sorted({f"{s.status} {s.error}" for s in samples if not s.ok})[:3],
        "wall_s": round(wall, 2), "requests_per_s": round(len(samples) / wall, 3),
        "latency_ms": {"p50": round(float(np.percentile(lat, 50)), 1),
                       "p95": round(float(np.percentile(lat, 95)), 1),
                       "mean": round(float(lat.mean()), 1)},
        "stages_ms": {k: {"mean": round(float(v.mean()), 2),
                          "p50": round(float(np.percentile(v, 50)), 2),
                          "p95": round(float(np.percentile(v, 95)), 2)} for k, v in stage.items()},
        "cache_hit_rate": round(sum(hits) / len(hits), 4) if hits else None,
        "overhead_share": round(float(overhead / server_turn), 4) if server_turn else None,
        # the client's view: what the turn cost end to end beyond the decode itself
        "client_overhead_share": round(float(1 - stage["decode"].sum() / lat.sum()), 4)
        if ok else None,
    }


def format_table(r: dict) -> str:
    s = r["stages_ms"]
    rows = [
        ("load", f"{r['requests']} requests, {r['concurrency']} clients, "
                 f"{r['conversations']} conversations ({r['pairs']} questions), "
                 f"max_new_tokens {r['max_new_tokens']}"),
        ("errors", str(r["errors"])),
        ("requests/s", f"{r['requests_per_s']:.2f}"),
        ("latency p50 / p95 (client)", f"{r['latency_ms']['p50']:.0f} / {r['latency_ms']['p95']:.0f} ms"),
        *[(f"{k} mean / p50 / p95", f"{s[k]['mean']:.2f} / {s[k]['p50']:.2f} / {s[k]['p95']:.2f} ms")
          for k in STAGES],
        ("cache hit rate", "-" if r["cache_hit_rate"] is None else f"{100 * r['cache_hit_rate']:.1f}%"),
        ("embed + route + fetch share of the turn",
         "-" if r["overhead_share"] is None else f"{100 * r['overhead_share']:.2f}% (goal <= 5%)"),
        ("client latency beyond decode (queueing, HTTP, routing)",
         "-" if r["client_overhead_share"] is None else f"{100 * r['client_overhead_share']:.1f}%"),
    ]
    width = max(len(a) for a, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"| {'-' * width} | --- |"]
    lines += [f"| {a.ljust(width)} | {b} |" for a, b in rows]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.bench_serve", __doc__)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the running jobs.serve app")
    p.add_argument("--corpus", help="JSONL corpus the store was built from, for its questions "
                                    "(default: none; generic questions to each --conversation)")
    p.add_argument("--conversation", action="append", default=[],
                   help="a conversation id to ask about (may repeat; default: the corpus's)")
    p.add_argument("--conversations", type=int, default=3, help="conversations asked, at most")
    p.add_argument("--questions-per-conversation", type=int, default=4,
                   help="questions asked of each conversation, at most")
    p.add_argument("--requests", type=int, default=200, help="requests measured")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--max-new-tokens", type=int, default=16, help="answer length at most (tokens)")
    p.add_argument("--no-warmup", action="store_true",
                   help="measure from the first request (no warm-up pass over the questions)")
    p.add_argument("--token", default=os.environ.get("EPICACHE_SERVE_TOKEN"),
                   help="bearer token (default: $EPICACHE_SERVE_TOKEN)")
    p.add_argument("--json", help="also write the figures to this file (default: not written)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        pairs = load_questions(a.corpus, a.conversation, a.conversations,
                               a.questions_per_conversation)
        result = run_bench(a.url, pairs, a.requests, a.concurrency, a.max_new_tokens, a.token,
                           warmup=not a.no_warmup)
    except (ValueError, RuntimeError, OSError, requests.RequestException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    if result["errors"]:
        print("errors: " + "; ".join(result["error_examples"]), file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
