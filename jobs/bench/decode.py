"""Decode benchmark: one answering turn from an episodic cache against the same turn from the
full cache, split into embed, route, load and decode.

    python -m jobs.bench.decode [--tokens 8000] [--budget 1024] [--episodes 4] [--questions 8] \\
        [--max-new-tokens 32] [--store DIR] [--threads 2] [--return-freed-memory]

A synthetic conversation of about `--tokens` tokens is built twice into a local store with the
real pipeline (`pipeline.builder.conversation.build_conversation`): as EpiCache episodes under
`--budget`, and as one full cache. Then each planted question is answered by
`pipeline.answer.Answerer` from both stores, and from the episodic store with the question-time
top-up (`pipeline.answer.topup`: its nearest turns the episode lacks prefilled before the question;
`--topup-turns`, `--topup-max-tokens`), alternately: once *cold* (a fresh answerer fetches the cache
from the store and verifies its checksum; the models are already loaded) and once more *warm* (the
same question again: its episode's cache is resident, as for a follow-up turn). Reported: the median
of each stage per turn, the share of embed + route + load in the turn, and decode time per generated
token (answers may differ in length). With `--store DIR`, a re-run finds both builds in their
manifests (same configuration hash) and goes straight to the turns.

Then the cold load itself, per episode of the episodic build, side by side: from the store
(read, then parsed and rebuilt while its checksum is computed on a second thread: the split is
printed) and, after a first load filled a local-disk tier (`pipeline.store.objects.disk_tier`), from
that tier through a fresh `DiskTier` over the same folder, as a restarted replica sees it, with the
number of objects each read from the store (counted on the store).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lab.bench_cli import bench_parser, start_bench
from lab.tables import print_table
from pipeline.allocator import retain_freed_memory
from pipeline.answer.answerer import Answerer
from pipeline.builder.conversation import build_conversation, files_of, is_built
from pipeline.cli.numbers import positive_int
from pipeline.cli.options import (
    BUILD_OPTIONS,
    add_model_options,
    add_options,
    apply_options,
    options_named,
)
from pipeline.config import BuildConfig, TopUpConfig
from pipeline.corpus.synthetic import make_conversation
from pipeline.kv import models
from pipeline.store.backends.local import LocalStore
from pipeline.store.catalogue.manifest import ManifestRecord, read_manifest
from pipeline.store.objects import cache_format
from pipeline.store.objects.cache_read import read_cache
from pipeline.store.objects.disk_tier import DiskTier

STAGES = ("embed", "route", "load", "decode")


class CountingStore(LocalStore):
    """A local store that counts the objects read from it."""
    reads = 0

    def open(self, key: str):
        self.reads += 1
        return super().open(key)

    def get(self, key: str) -> bytes:
        self.reads += 1
        return super().get(key)


def cold_loads(root: Path, records: list[ManifestRecord], dtype: torch.dtype,
               repeats: int = 3) -> list[dict]:
    """Median ms of loading each episode's cache: from the store (split into the read, and the
    parse + rebuild with the SHA-256 computed beside it; the hash alone for reference), and from
    a filled disk tier as a restarted replica (a new `DiskTier` over the folder) reads it; with
    the objects read from the store."""
    store = CountingStore(root, create=False)
    split: dict[str, list[float]] = {"read": [], "parse+rebuild, hash beside": [],
                                     "(sha256 alone)": []}
    from_store, from_disk = [], []
    with tempfile.TemporaryDirectory(prefix="bench-disk-tier-") as folder:
        for _ in range(repeats):
            for record in records:
                t0 = time.perf_counter()
                with store.open(record.object_key) as f:
                    data = cache_format.read_object(f, record.object_key, record.object_bytes)
                t1 = time.perf_counter()
                with cache_format.verifying(data, record.sha256, record.object_key):
                    cache_format.parse(data, record.object_key, dtype)
                t2 = time.perf_counter()
                cache_format.sha256(data)
                split["read"].append((t1 - t0) * 1000)
                split["parse+rebuild, hash beside"].append((t2 - t1) * 1000)
                split["(sha256 alone)"].append((time.perf_counter() - t2) * 1000)
                from_store.append((t2 - t0) * 1000)
                del data
        store_reads = store.reads
        filled = DiskTier(folder, sum(r.object_bytes for r in records))
        for record in records:
            read_cache(store, record.ref, filled, dtype)
        before_restart = store.reads
        for _ in range(repeats):
            restarted = DiskTier(folder, filled.max_bytes)  # a new replica over the folder
            for record in records:
                t = time.perf_counter()
                read_cache(store, record.ref, restarted, dtype)
                from_disk.append((time.perf_counter() - t) * 1000)
        restart_reads = store.reads - before_restart
    out = [{"load": "store (cold)", "ms": statistics.median(from_store), "reads": store_reads,
            "loads": len(from_store)}]
    out += [{"load": f"store: {k}", "ms": statistics.median(v), "reads": None,
             "loads": len(v)} for k, v in split.items()]
    out.append({"load": "disk tier (restart)", "ms": statistics.median(from_disk),
                "reads": restart_reads, "loads": len(from_disk)})
    return out


def turn(answerer: Answerer, conversation_id: str, question: str, max_new_tokens: int) -> dict:
    result = answerer.answer(conversation_id, question, max_new_tokens)
    lm = models.load_llm(answerer.manifest(conversation_id)[0].model_id)
    generated = len(lm.tokenizer(result.answer, add_special_tokens=False)["input_ids"]) + 1
    timings = dict(result.timings_ms)
    timings["load"] += timings.pop("topup", 0.0)  # the index's fetch and the turns' choice
    return timings | {"tokens": min(generated, max_new_tokens), "hit": result.cache_hit,
                      "topup_tokens": result.topup.get("tokens", 0)}


def summarise(name: str, turns: list[dict], entries: float) -> dict:
    row = {"cache": name, "entries": entries,
           "topup_tokens": statistics.mean(t["topup_tokens"] for t in turns)}
    for stage in STAGES:
        row[stage] = statistics.median(t[stage] for t in turns)
    row["turn"] = statistics.median(sum(t[s] for s in STAGES) for t in turns)
    row["overhead"] = statistics.median(
        (t["embed"] + t["route"] + t["load"]) / sum(t[s] for s in STAGES) for t in turns)
    row["hits"] = statistics.mean(t["hit"] for t in turns)
    row["ms_per_token"] = statistics.median(t["decode"] / t["tokens"] for t in turns)
    return row


# The episodic build's knobs (the rest as `jobs.build`'s defaults).
DECODE_BUILD_OPTIONS = options_named(BUILD_OPTIONS, "--budget", "--episodes", "--alpha")


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("decode", __doc__)
    p.add_argument("--tokens", type=int, default=8000, help="length of the synthetic conversation")
    add_options(p, DECODE_BUILD_OPTIONS, BuildConfig())
    p.add_argument("--questions", type=int, default=8, help="planted questions answered (turns)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="answer length at most (tokens)")
    p.add_argument("--topup-turns", type=positive_int, default=TopUpConfig.turns,
                   help="the top-up's nearest turns searched")
    p.add_argument("--topup-max-tokens", type=positive_int, default=TopUpConfig.max_tokens,
                   help="the top-up's tokens at most")
    p.add_argument("--store", default=None,
                   help="a local folder to build into (default: a temp dir)")
    p.add_argument("--return-freed-memory", action="store_true",
                   help="leave malloc's thresholds as they are (freed memory goes back to the "
                        "kernel), to compare with what the Serve decoder does")
    add_model_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    a = start_bench(build_parser(), argv)
    conv = make_conversation("bench-decode", target_tokens=a.tokens, seed=0)
    episodic = apply_options(BuildConfig(model=a.model, max_context_tokens=a.tokens),
                             DECODE_BUILD_OPTIONS, a)
    full = BuildConfig(model=a.model, scorer="full", budget=None, max_context_tokens=a.tokens)
    root = Path(a.store or tempfile.mkdtemp(prefix="bench-decode-"))
    stores = {"episodic": LocalStore(root / "episodic"), "full": LocalStore(root / "full")}
    entries = {}
    for name, config in (("episodic", episodic), ("full", full)):
        done = is_built(stores[name], conv.conversation_id, config, files_of(config))
        records = read_manifest(stores[name], conv.conversation_id) if done else \
            build_conversation(conv, config, stores[name]).records
        entries[name] = statistics.mean(e for r in records for e in r.entries_per_layer)
        index = f", turn index {records[0].turn_index_bytes / 1024:.0f} KiB" \
            if records[0].turn_index_bytes else ""
        print(f"{'found' if done else 'built'} {name}: {len(records)} cache(s) of "
              f"{statistics.mean(r.object_bytes for r in records) / 2**20:.1f} MiB{index}, "
              f"{records[0].tokens} tokens, {sum(r.build_seconds for r in records):.0f} s of "
              f"block prefill, {records[0].cluster_seconds:.1f} s of stage 1 (clustering and "
              f"the turn index)", file=sys.stderr, flush=True)
    questions = [q.question for q in conv.questions][:a.questions]
    first = read_manifest(stores["episodic"], conv.conversation_id)[0]
    device = models.default_device()  # the GPU where there is one, as the Serve decoder does
    models.load_llm(first.model_id, device), models.load_encoder(first.encoder_id, device)
    gc.freeze()  # as the Serve deployments do: no collector pass over the models inside a turn
    if not a.return_freed_memory:
        retain_freed_memory()  # as the Serve decoder does: caches load into reused memory
    topup = TopUpConfig(enabled=True, turns=a.topup_turns, max_tokens=a.topup_max_tokens)
    answering = {"episodic": (stores["episodic"], TopUpConfig(enabled=False)),
                 "episodic+topup": (stores["episodic"], topup),
                 "full": (stores["full"], TopUpConfig(enabled=False))}
    entries["episodic+topup"] = entries["episodic"]
    turns = {(name, cold): [] for name in answering for cold in (True, False)}
    for question in questions:  # the caches alternate, turn by turn
        for name, (store, topup_config) in answering.items():
            # no cache yet; the models stay loaded
            answerer = Answerer(store, device=device, topup=topup_config)
            for cold in (True, False):  # the same question again: its episode is resident
                turns[name, cold].append(turn(answerer, conv.conversation_id, question,
                                              a.max_new_tokens))
    rows = [summarise(f"{name} ({'cold' if cold else 'warm'})", t, entries[name])
            for (name, cold), t in turns.items()]
    print(f"\n{a.model}, {len(questions)} questions, "
          f"conversation of {a.tokens} tokens, budget {a.budget}, "
          f"{torch.get_num_threads()} threads; medians per turn (ms):")
    print_table(rows, [("cache", "cache", "s"), ("entries", "entries/layer", ".0f"),
                       ("embed", "embed", ".1f"), ("route", "route", ".2f"),
                       ("load", "load", ".1f"),
                       ("hits", "resident", ".0%"), ("topup_tokens", "top-up tokens", ".0f"),
                       ("decode", "decode", ".0f"), ("turn", "turn", ".0f"),
                       ("overhead", "embed+route+load share", ".1%"),
                       ("ms_per_token", "decode ms/token", ".1f")])
    by = {r["cache"]: r for r in rows}
    print(f"\ndecode ms/token, full / episodic (warm): "
          f"{by['full (warm)']['ms_per_token'] / by['episodic (warm)']['ms_per_token']:.2f}x")
    for when in ("warm", "cold"):
        print(f"turn, episodic+topup / episodic ({when}): "
              f"{by[f'episodic+topup ({when})']['turn'] / by[f'episodic ({when})']['turn']:.2f}x")
    records = read_manifest(stores["episodic"], conv.conversation_id)
    dtype = models.load_llm(records[0].model_id).model.dtype
    loads = cold_loads(root / "episodic", records, dtype)
    print(f"\ncold load of the {len(records)} episodic caches "
          f"({statistics.mean(r.object_bytes for r in records) / 2**20:.1f} MiB each), medians:")
    print_table(loads, [("load", "from", "s"), ("ms", "ms per cache", ".1f"),
                        ("loads", "loads", "d"), ("reads", "objects read from the store", "d")])
    print(f"restart from the disk tier / cold load from the store: "
          f"{loads[-1]['ms'] / loads[0]['ms']:.2f}x the time, {loads[-1]['reads']} store reads")
    gc.unfreeze()  # frozen objects are never freed at exit: nanobind would report them leaked
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
