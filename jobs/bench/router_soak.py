"""Router soak: one question planner (the Serve router's plan step) driven through tens of
thousands of conversations; its resident memory must stay flat once its manifest cache fills.

    python -m jobs.bench.router_soak [--conversations 20000] [--follow-ups 2] [--zipf 1.1] \\
        [--manifest-cache-bytes 268435456] [--episodes 4] [--windows 20] [--dim 384]

The store is synthetic (`lab.synthetic_manifests`: real Parquet manifests made on demand, each
`--episodes` x `--windows` window embeddings of `--dim` floats, about a megabyte as Python float
lists, as a long conversation's), the encoder a stand-in (a question's embedding is a random unit
vector seeded by its text), the top-up off (its turn indexes are kept by count, the last 256:
`pipeline.answer.topup.TopUps`). What runs is the router's own `QuestionPlanner`: the manifest
read, checked every `--manifest-ttl` seconds, kept in its byte-bounded LRU, the question routed.
The stream asks every conversation once, in a random order, each new one followed by
`--follow-ups` questions to conversations drawn with Zipf popularity (exponent `--zipf`, a
random rank order), so the hot ones stay kept and the tail is read again after eviction.

Prints the process's resident memory (RSS) every `--every` questions as a table (questions,
conversations asked, manifests read, manifests kept, their MiB, evictions, RSS MiB), then the
spread of the RSS from the first eviction on (the cache full) against its goal, at most 10%;
exits 1 when the spread is over it.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
import zlib
from collections.abc import Callable

import numpy as np
import psutil

from lab.bench_cli import bench_parser, start_bench
from lab.synthetic_manifests import SyntheticManifests, conversation_id
from lab.tables import print_table
from pipeline.answer.lookup import load_manifest
from pipeline.answer.plan import (
    DEFAULT_MANIFEST_CACHE_BYTES,
    QuestionPlanner,
    QuestionTools,
    compact_records,
    kept_bytes,
)
from pipeline.cli.numbers import count, non_negative, number, positive_int
from pipeline.config import TopUpConfig

GOAL_SPREAD = 0.10  # the RSS after the cache filled: (max - min) / min at most


def stand_in_tools(dim: int) -> Callable[[list], QuestionTools]:
    """Tools as the router makes them, with a stand-in encoder (no model: the soak measures
    the planner's memory, not the encoder's)."""

    def embed(question: str) -> np.ndarray:
        v = np.random.default_rng(zlib.crc32(question.encode())).standard_normal(dim)
        return (v / np.linalg.norm(v)).astype(np.float32)

    return lambda records: QuestionTools(embed, lambda text: len(text.split()))


def question_stream(conversations: int, follow_ups: int, zipf: float, seed: int) -> np.ndarray:
    """Conversation indices: every conversation once (a random order), each followed by
    `follow_ups` Zipf-drawn ones (a random rank order)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, conversations + 1) ** zipf
    ranked = rng.permutation(conversations)
    drawn = ranked[rng.choice(conversations, size=(conversations, follow_ups),
                              p=weights / weights.sum())]
    return np.concatenate([rng.permutation(conversations)[:, None], drawn], axis=1).ravel()


def one_conversation_bytes(store: SyntheticManifests) -> tuple[int, int]:
    """(bytes of a manifest as read: records with float lists, bytes kept by the planner)."""
    load_manifest(store, conversation_id(1))  # the first read's one-time allocations apart
    gc.collect()
    tracemalloc.start()
    records = load_manifest(store, conversation_id(0))
    as_read = tracemalloc.get_traced_memory()[0]
    kept, index = compact_records(records)
    del records
    tracemalloc.stop()
    return as_read, kept_bytes(kept, index)


def soak(store: SyntheticManifests, stream: np.ndarray, cache_bytes: int, every: int,
         ttl_s: float) -> list[dict]:
    """Plans a question for each conversation of `stream`; a row of figures every `every`."""
    process = psutil.Process()
    planner = QuestionPlanner(store, stand_in_tools(store.dim), topup=TopUpConfig(enabled=False),
                              manifest_ttl_s=ttl_s, manifest_cache_bytes=cache_bytes)
    rows, asked, start = [], np.zeros(store.conversations, dtype=bool), time.perf_counter()
    for n, i in enumerate(stream, 1):
        cid = conversation_id(int(i))
        planner.plan(cid, f"What did {cid} say about topic {n % 7}?")
        asked[i] = True
        if n % every == 0 or n == len(stream):
            stats = planner.manifest_stats()
            rows.append({"questions": n, "asked": int(asked.sum()), "reads": store.reads,
                         "kept": stats["entries"], "kept_mib": stats["bytes"] / 2**20,
                         "evictions": stats["evictions"],
                         "rss_mib": process.memory_info().rss / 2**20,
                         "seconds": time.perf_counter() - start})
            print(f"{n} questions, {rows[-1]['rss_mib']:.0f} MiB", file=sys.stderr, flush=True)
    return rows


def spread_after_fill(rows: list[dict]) -> dict:
    """The RSS from the first row with an eviction on (the cache full): min, max, spread."""
    full = [r["rss_mib"] for r in rows if r["evictions"] > 0]
    if len(full) < 2:
        return {"filled_at": None, "min": None, "max": None, "spread": None}
    first = next(r["questions"] for r in rows if r["evictions"] > 0)
    return {"filled_at": first, "min": min(full), "max": max(full),
            "spread": (max(full) - min(full)) / min(full)}


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("router_soak", __doc__)
    p.add_argument("--conversations", type=positive_int, default=20_000,
                   help="conversations in the store")
    p.add_argument("--follow-ups", type=count, default=2,
                   help="Zipf-drawn questions after each new conversation's first")
    p.add_argument("--zipf", type=number(float, above=0), default=1.1,
                   help="the popularity's Zipf exponent")
    p.add_argument("--manifest-cache-bytes", type=count, default=DEFAULT_MANIFEST_CACHE_BYTES,
                   help="the planner's manifest bound (the router's --manifest-cache-bytes)")
    p.add_argument("--manifest-ttl", type=non_negative, default=5.0,
                   help="seconds a kept manifest is trusted before it is checked (the router's)")
    p.add_argument("--episodes", type=positive_int, default=4, help="episodes a conversation")
    p.add_argument("--windows", type=positive_int, default=20, help="window embeddings an episode")
    p.add_argument("--dim", type=positive_int, default=384, help="the encoder's dimensions")
    p.add_argument("--every", type=positive_int, default=3000,
                   help="questions between two table rows")
    p.add_argument("--seed", type=int, default=0, help="the stream's and the store's seed")
    p.add_argument("--json", help="also write the rows and the verdict to this file "
                                  "(default: not written)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = start_bench(build_parser(), argv)
    store = SyntheticManifests(a.conversations, a.episodes, a.windows, a.dim, a.seed)
    as_read, kept = one_conversation_bytes(store)
    store.reads = 0
    stream = question_stream(a.conversations, a.follow_ups, a.zipf, a.seed)
    base = psutil.Process().memory_info().rss / 2**20
    print(f"{a.conversations:,} conversations ({a.episodes} episodes x {a.windows} windows x "
          f"{a.dim} dims), {len(stream):,} questions (each new conversation, then "
          f"{a.follow_ups} Zipf {a.zipf:g}), manifest cache {a.manifest_cache_bytes / 2**20:.0f} "
          f"MiB, ttl {a.manifest_ttl:g} s")
    print(f"one manifest: {as_read / 2**20:.2f} MiB as read (float lists), "
          f"{kept / 2**20:.2f} MiB kept (numpy); RSS before the first question {base:.0f} MiB")
    rows = soak(store, stream, a.manifest_cache_bytes, a.every, a.manifest_ttl)
    print_table(rows, [("questions", "questions", ","), ("asked", "conversations asked", ","),
                       ("reads", "manifests read", ","), ("kept", "kept", ","),
                       ("kept_mib", "kept MiB", ".1f"), ("evictions", "evictions", ","),
                       ("rss_mib", "RSS MiB", ".1f"), ("seconds", "s", ".0f")])
    verdict = spread_after_fill(rows)
    if verdict["spread"] is None:
        print("the manifest cache never filled: no flatness to judge (a smaller "
              "--manifest-cache-bytes, or more --conversations)")
        ok = True
    else:
        ok = verdict["spread"] <= GOAL_SPREAD
        print(f"RSS from the first eviction (question {verdict['filled_at']:,}) on: "
              f"{verdict['min']:.1f} to {verdict['max']:.1f} MiB, spread "
              f"{100 * verdict['spread']:.1f}% (goal <= {100 * GOAL_SPREAD:.0f}%): "
              f"{'flat' if ok else 'NOT flat'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "verdict": verdict, "manifest_bytes_as_read": as_read,
                       "manifest_bytes_kept": kept}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
