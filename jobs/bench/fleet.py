"""Many conversations on many decoder replicas: conversation affinity against Serve's default.

    python -m jobs.bench.fleet [--dir out/fleet] [--conversations 200] [--target-tokens 400] \\
        [--replicas 4] [--warmup 600] [--requests 600] [--concurrency 8] [--zipf 1.1] \\
        [--follow-ups 3] [--cache-bytes 268435456] [--modes default,affinity] [--kill-after N]

A store of many small synthetic conversations (`--dir`: its corpus and store, built once by
the Ray build and reused: a re-run skips what is built), then one request stream replayed
against `--replicas` decoder replicas once per mode, side by side in one run, each on fresh
replicas (cold LRUs): `default` is Serve's routing (power of two choices on queue length),
`affinity` is `pipeline.serve.affinity`. The stream is made of sessions: a conversation drawn
with Zipf popularity (`--zipf`), asked 1 + Geometric follow-up questions in a row (mean
`--follow-ups`), `--concurrency` sessions at once; its first `--warmup` questions fill the
LRUs and are not measured (the figures are a fleet's steady state, not its first minutes).

Per mode: the LRU hit rate (the answers' `cache_hit`), store objects and bytes fetched per
question (the decoders' `epicache_store_*` counters on Ray's metrics endpoint, prefetches
included), requests/s, client p50/p95 latency, and the requests each replica answered; then
affinity against default, with the goals. On 2 cores requests/s mean little; the hit rates and
bytes are the point.

`--kill-after N`: in the affinity run the replica that has answered most is killed (`ray.kill`,
as a crash) once N requests completed. The fault run's rule (`jobs.bench.serve`): requests in
flight may fail, none hangs, none started after the first success fails; the replica must be
replaced, and the killed replica's conversations are answered elsewhere. The hit rates are then
also compared on the requests the affinity run finished before the kill, the same requests in
each mode: the replacement's cold LRU is the fault's cost, not the routing's.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import ray
import requests
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from lab.bench_cli import bench_parser, start_bench
from lab.load_client import (
    GENERIC_QUESTIONS,
    Sample,
    ask,
    fault_report,
    fault_rows,
    latency_summary,
)
from pipeline.cli.numbers import number
from pipeline.cli.options import add_budget_option
from pipeline.config import BuildConfig, DriverOptions, EpisodeConfig
from pipeline.corpus.reader import read_corpus, write_jsonl
from pipeline.corpus.synthetic import iter_corpus
from pipeline.ray_runtime import WORKER_ENV
from pipeline.serve.settings import DEFAULT_MAX_IMBALANCE, ServeSettings
from pipeline.store.backends.uri import open_store
from pipeline.telemetry import SPECS

APP = "epicache-fleet"
DECODER = "EpiCacheDecoder"
FOLLOW_UPS = (*GENERIC_QUESTIONS, "What are they planning next?")  # after a conversation's own
FETCH_METRICS = ("epicache_store_bytes_fetched", "epicache_store_objects_fetched")


@dataclass(frozen=True)
class Session:
    conversation: str
    questions: tuple[str, ...]


def prepare_store(folder: Path, conversations: int, target_tokens: int, episodes: int,
                  budget: int, seed: int) -> tuple[Path, Path, str]:
    """(corpus, store, the build's summary line): the corpus written once, the store built by
    the Ray job (a re-run skips the conversations already built)."""
    folder.mkdir(parents=True, exist_ok=True)
    corpus, store = folder / "corpus.jsonl", folder / "store"
    if not corpus.exists():
        write_jsonl(iter_corpus(conversations, target_tokens, seed, n_topics=2), corpus)
    config = BuildConfig(budget=budget, episodes=EpisodeConfig(episodes=episodes))
    from pipeline.builder.driver import run_build  # torch: not loaded for --help or a bad value

    summary = run_build(str(corpus), str(store), config, DriverOptions(progress=False))
    return corpus, store, summary.line(store=str(store))


def make_sessions(corpus: Path, warmup: int, n_requests: int, zipf: float, follow_ups: float,
                  seed: int) -> tuple[list[Session], list[Session]]:
    """(warm-up, measured) sessions of about `warmup` and exactly `n_requests` questions, one
    stream: conversations by Zipf popularity (a random rank order), each asking its own
    questions then generic ones, 1 + Geometric in a row."""
    convs = read_corpus(str(corpus))[0]
    rng = np.random.default_rng(seed)
    ranked = [convs[i] for i in rng.permutation(len(convs))]
    weights = 1.0 / np.arange(1, len(ranked) + 1) ** zipf
    phases: tuple[list[Session], list[Session]] = ([], [])
    for phase, n in zip(phases, (warmup, n_requests)):
        total = 0
        while total < n:
            conv = ranked[rng.choice(len(ranked), p=weights / weights.sum())]
            pool = [q.question for q in conv.questions] + list(FOLLOW_UPS)
            k = min(int(rng.geometric(1.0 / follow_ups)), n - total)
            start = int(rng.integers(len(pool)))
            phase.append(Session(conv.conversation_id,
                                 tuple(pool[(start + i) % len(pool)] for i in range(k))))
            total += k
    return phases


def scrape(url: str) -> tuple[dict[tuple[str, str], float], set[str]]:
    """({(metric, replica): value} of the decoders' fetch counters, every sample name) on
    Ray's metrics endpoint."""
    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - a loopback URL we made
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        base = next((m for m in FETCH_METRICS if m in family.name), None)
        for s in family.samples:
            names.add(s.name)
            if base is None or s.name.endswith("_created"):
                continue
            key = (base, s.labels.get("replica", ""))
            out[key] = out.get(key, 0.0) + s.value
    return out, names


def missing_metrics(url: str) -> list[str]:
    """The project's metrics (`pipeline.telemetry.SPECS`) not on Ray's metrics endpoint."""
    names = scrape(url)[1]
    return [s.name for s in SPECS if not set(s.exported) & names]


def settled_fetches(url: str, replicas: set[str], minimum_objects: int,
                    timeout: float = 60.0) -> dict[str, float]:
    """The fetch counters summed over `replicas`, once two scrapes 3 s apart agree and the
    objects counted reach `minimum_objects` (the answers' cache misses): Ray reports metrics
    every few seconds."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        values = scrape(url)[0]
        total = {m: sum(v for (name, rep), v in values.items() if name == m and rep in replicas)
                 for m in FETCH_METRICS}
        if (total == last and total["epicache_store_objects_fetched"] >= minimum_objects) \
                or time.monotonic() > deadline:
            return total
        last = total
        time.sleep(3)


class ReplicaKiller:
    """Kills the replica that has answered most (`ray.kill`: a crash) after `after` requests."""

    def __init__(self, after: int, replicas: int):
        self.after, self.replicas = after, replicas
        self.done, self.at, self.replica, self.error = 0, None, None, ""
        self.answered: Counter[str] = Counter()
        self.lock = threading.Lock()

    def completed(self, sample: Sample) -> None:
        with self.lock:
            self.done += 1
            if sample.replica:
                self.answered[sample.replica] += 1
            due = self.done == self.after
        if not due:
            return
        self.replica = self.answered.most_common(1)[0][0] if self.answered else None
        try:
            name = next(n["name"] for n in ray.util.list_named_actors(all_namespaces=True)
                        if n["name"].endswith(f"#{self.replica}"))
            self.at = time.perf_counter()
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        except (StopIteration, ValueError) as e:
            self.error = f"could not kill replica {self.replica}: {e!r}"


def running_replicas() -> int:
    status = serve.status().applications.get(APP)
    if status is None or DECODER not in status.deployments:
        return 0
    return status.deployments[DECODER].replica_states.get("RUNNING", 0)


def play(url: str, sessions: list[Session], concurrency: int, max_new_tokens: int,
         killer: ReplicaKiller | None, timeout: float) -> tuple[list[Sample], float]:
    """Every session's questions in order, `concurrency` sessions at once; (samples, wall s)."""
    local = threading.local()

    def one(session: Session) -> list[Sample]:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        out = []
        for q in session.questions:
            out.append(ask(local.session, url, session.conversation, q, max_new_tokens, {},
                           timeout))
            if killer is not None:
                killer.completed(out[-1])
        return out

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples = [s for group in pool.map(one, sessions) for s in group]
    return samples, time.perf_counter() - start


def run_mode(mode: str, settings: ServeSettings, model: str, encoder: str,
             stream: tuple[list[Session], list[Session]], a: argparse.Namespace, http_port: int,
             metrics_url: str) -> dict:
    """One mode on fresh replicas: the warm-up sessions, then the measured ones, their figures
    (the store's counters read after each), and the kill's report if asked."""
    settings = replace(settings, affinity=mode == "affinity")
    from pipeline.serve.app import build_app

    serve.run(build_app(settings, model, encoder), name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{http_port}"
    killer = (ReplicaKiller(a.kill_after, a.replicas) if a.kill_after and mode == "affinity"
              else None)
    try:
        warm = play(url, stream[0], a.concurrency, a.max_new_tokens, None, a.timeout)[0]
        warm_misses = sum(s.cache_hit is False for s in warm if s.ok)
        before = settled_fetches(metrics_url, {s.replica for s in warm if s.replica}, warm_misses)
        samples, wall = play(url, stream[1], a.concurrency, a.max_new_tokens, killer, a.timeout)
        ok = [s for s in samples if s.ok]
        replicas = {s.replica for s in ok + warm if s.replica}
        misses = sum(s.cache_hit is False for s in ok)
        after = settled_fetches(metrics_url, replicas, warm_misses + misses)
        fetched = {m: after[m] - before[m] for m in FETCH_METRICS}
        kill = kill_summary(killer, samples) if killer is not None else None
        missing = missing_metrics(metrics_url)
    finally:
        serve.delete(APP)
    load = Counter(s.replica for s in ok)
    hits = [s.cache_hit if s.ok else None for s in samples]
    finished_before_kill = [killer is None or killer.at is None or s.end <= killer.at
                            for s in samples]
    before_kill = [s for s, before in zip(samples, finished_before_kill) if before and s.ok]
    return {"mode": mode, "warmup": len(warm), "warmup_errors": sum(not s.ok for s in warm),
            "requests": len(samples), "errors": len(samples) - len(ok),
            "error_examples": sorted({f"{s.status} {s.error[:100]}" for s in samples + warm
                                      if not s.ok})[:3],
            "lru_hit_rate": hit_rate(hits), "hits": hits, "before_kill": finished_before_kill,
            "objects_per_question": fetched["epicache_store_objects_fetched"] / max(1, len(ok)),
            "mib_per_question": fetched["epicache_store_bytes_fetched"] / max(1, len(ok)) / 2**20,
            "requests_per_s": len(samples) / wall, "latency_ms": latency_summary(samples),
            "per_replica": sorted(load.values(), reverse=True),
            "one_replica_share": one_replica_share(before_kill), "kill": kill,
            "metrics_missing": missing}


def hit_rate(hits) -> float | None:
    """The share of True among the answers that report a cache hit (None: none did)."""
    known = [h for h in hits if h is not None]
    return sum(known) / len(known) if known else None


def hit_rates_before_kill(results: list[dict], before_kill: list[bool]) -> None:
    """Each mode's hit rate on the same requests: those the affinity run finished before its
    kill. The stream is one, in one order, in every mode, so request i is the same question
    everywhere; the replacement replica's cold LRU is the fault run's cost, not routing's."""
    for r in results:
        r["lru_hit_rate_before_kill"] = hit_rate(
            h for h, keep in zip(r["hits"], before_kill) if keep)


def one_replica_share(samples: list[Sample]) -> float | None:
    """Of the conversations asked more than once, the share all answered by one replica."""
    homes: dict[str, set[str]] = {}
    asked = Counter(s.conversation for s in samples)
    for s in samples:
        homes.setdefault(s.conversation, set()).add(s.replica or "")
    repeated = [c for c, n in asked.items() if n > 1]
    return sum(len(homes[c]) == 1 for c in repeated) / len(repeated) if repeated else None


def kill_summary(killer: ReplicaKiller, samples: list[Sample], wait_s: float = 180.0) -> dict:
    """The fault rule's report, whether the replica was replaced, and where its conversations
    went."""
    if killer.at is None:
        return {"killed": False, "error": killer.error or "the run ended before the kill"}
    deadline = time.monotonic() + wait_s
    while running_replicas() < killer.replicas and time.monotonic() < deadline:
        time.sleep(1)
    homed = {s.conversation for s in samples if s.ok and s.end <= killer.at
             and s.replica == killer.replica}
    after = [s for s in samples if s.ok and s.start > killer.at and s.conversation in homed]
    return {"killed": True, "replica": killer.replica,
            "replaced": running_replicas() >= killer.replicas,
            "moved_conversations": len({s.conversation for s in after}),
            "answered_by_the_dead": sum(s.replica == killer.replica for s in after),
            **fault_report(samples, killer.at)}


def format_table(results: list[dict]) -> str:
    rows = [("errors", lambda r: str(r["errors"])),
            ("LRU hit rate", lambda r: "-" if r["lru_hit_rate"] is None
             else f"{100 * r['lru_hit_rate']:.1f}%"),
            *([("LRU hit rate, requests before the kill", lambda r: "-"
                if r["lru_hit_rate_before_kill"] is None
                else f"{100 * r['lru_hit_rate_before_kill']:.1f}%")]
              if "lru_hit_rate_before_kill" in results[0] else []),
            ("store objects fetched / question", lambda r: f"{r['objects_per_question']:.3f}"),
            ("store MiB fetched / question", lambda r: f"{r['mib_per_question']:.2f}"),
            ("requests/s", lambda r: f"{r['requests_per_s']:.2f}"),
            ("latency p50 / p95 (client)",
             lambda r: f"{r['latency_ms']['p50']:.0f} / {r['latency_ms']['p95']:.0f} ms"),
            ("requests per replica", lambda r: " / ".join(map(str, r["per_replica"]))),
            ("conversations answered by one replica", lambda r: "-" if r["one_replica_share"]
             is None else f"{100 * r['one_replica_share']:.0f}%")]
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | " + " | ".join(r["mode"] for r in results) + " |",
             f"| {'-' * width} |" + " --- |" * len(results)]
    lines += [f"| {name.ljust(width)} | " + " | ".join(f(r) for r in results) + " |"
              for name, f in rows]
    return "\n".join(lines)


def format_ratios(base: dict, aff: dict) -> str:
    def ratio(x: float, y: float) -> str:
        return f"{x / y:.2f}x" if y else "-"
    killed = "lru_hit_rate_before_kill" in aff  # then compared on the requests before the kill
    hits = "lru_hit_rate_before_kill" if killed else "lru_hit_rate"
    return "\n".join([
        f"store bytes / question, affinity / default: "
        f"{ratio(aff['mib_per_question'], base['mib_per_question'])} (goal <= 0.33x)",
        f"LRU hit rate, affinity / default{', requests before the kill' if killed else ''}: "
        f"{ratio(aff[hits] or 0, base[hits] or 0)} (goal >= 2x)",
        f"requests/s, affinity / default: "
        f"{ratio(aff['requests_per_s'], base['requests_per_s'])} (goal >= 1x)",
        f"p95 latency, affinity / default: "
        f"{ratio(aff['latency_ms']['p95'], base['latency_ms']['p95'])} (goal <= 1.5x)"])


def format_kill(k: dict) -> str:
    if not k["killed"]:
        return f"replica kill: not done ({k['error']})"
    rows = [("killed replica", k["replica"]), *fault_rows(k),
            ("replaced", "yes" if k["replaced"] else "NO"),
            ("its conversations asked after the kill", str(k["moved_conversations"])),
            ("... answered by the dead replica", str(k["answered_by_the_dead"]))]
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'replica kill'.ljust(width)} | value |", f"| {'-' * width} | --- |"]
    return "\n".join(lines + [f"| {name.ljust(width)} | {v} |" for name, v in rows])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COUNT = number(int, at_least=1)


def build_parser() -> argparse.ArgumentParser:
    """Every value checked here (exit 2 naming the option), before Ray starts or a store is
    built; torch loads only once they are good."""
    p = bench_parser("fleet", __doc__)
    p.add_argument("--dir", default="out/fleet", help="the corpus and store, made once and reused")
    p.add_argument("--conversations", type=COUNT, default=200, help="conversations in the store")
    p.add_argument("--target-tokens", type=COUNT, default=400, help="tokens per conversation")
    p.add_argument("--episodes", type=COUNT, default=2, help="episodes per conversation")
    add_budget_option(p, 128)
    p.add_argument("--replicas", type=COUNT, default=4, help="decoder replicas")
    p.add_argument("--cache-bytes", type=COUNT, default=256 * 2**20,
                   help="each replica's LRU in bytes (default 256 MiB: about a tenth of the store)")
    p.add_argument("--warmup", type=number(int, at_least=0), default=600,
                   help="questions asked per mode before the measured ones (fills the LRUs: the "
                        "figures are a fleet's steady state, not its cold start; 0: none)")
    p.add_argument("--requests", type=COUNT, default=600, help="questions measured per mode")
    p.add_argument("--max-imbalance", type=number(int, at_least=0), default=DEFAULT_MAX_IMBALANCE,
                   help="affinity: --affinity-max-imbalance of the app")
    p.add_argument("--concurrency", type=COUNT, default=8, help="sessions asked at once")
    p.add_argument("--zipf", type=number(float, at_least=0), default=1.1,
                   help="Zipf exponent of popularity (0: uniform)")
    p.add_argument("--follow-ups", type=number(float, at_least=1), default=3.0,
                   help="mean questions per session (at least 1)")
    p.add_argument("--max-new-tokens", type=COUNT, default=8, help="answer length at most")
    p.add_argument("--modes", default="default,affinity", help="routings run, in this order")
    p.add_argument("--kill-after", type=COUNT, default=None, metavar="N",
                   help="affinity run: kill the busiest replica once N measured requests "
                        "completed (default: no kill)")
    p.add_argument("--timeout", type=number(float, above=0), default=300.0,
                   help="client timeout per request, s")
    p.add_argument("--seed", type=number(int, at_least=0), default=0,
                   help="corpus and workload seed")
    p.add_argument("--json", help="also write the figures to this file (default: not written)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = start_bench(build_parser(), argv)
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - {"default", "affinity"}:
        print(f"error: --modes takes default and/or affinity, got {a.modes!r}", file=sys.stderr)
        return 2
    from pipeline.serve.app import resolve_models  # torch, after the arguments are checked

    metrics_port, http_port = free_port(), free_port()
    ray.init(logging_level="WARNING", runtime_env={"env_vars": WORKER_ENV},
             _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        corpus, store, built = prepare_store(Path(a.dir), a.conversations, a.target_tokens,
                                             a.episodes, a.budget, a.seed)
        print(built, flush=True)
        stream = make_sessions(corpus, a.warmup, a.requests, a.zipf, a.follow_ups, a.seed)
        model, encoder = resolve_models(open_store(str(store), create=False), None, None)
        cpus = ray.cluster_resources().get("CPU", 2)
        settings = ServeSettings(
            store=str(store), decoder_replicas=a.replicas, cache_bytes=a.cache_bytes,
            decoder_cpus=cpus / (2 * a.replicas), router_cpus=cpus / 4, torch_threads=1,
            affinity_max_imbalance=a.max_imbalance)
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        results = []
        for mode in modes:
            results.append(run_mode(mode, settings, model, encoder, stream, a, http_port,
                                    f"http://127.0.0.1:{metrics_port}/metrics"))
            print(f"{mode}: done", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"{a.requests} questions measured in {len(stream[1])} sessions after {a.warmup} "
          f"warm-up questions, {a.conversations} conversations, {a.replicas} replicas, "
          f"{a.concurrency} sessions at once, Zipf {a.zipf}")
    by_mode = {r["mode"]: r for r in results}
    kill = by_mode.get("affinity", {}).get("kill")
    if kill is not None and kill["killed"]:
        hit_rates_before_kill(results, by_mode["affinity"]["before_kill"])
    print(format_table(results))
    if {"default", "affinity"} <= set(by_mode):
        print(format_ratios(by_mode["default"], by_mode["affinity"]))
    missing = results[-1]["metrics_missing"]
    print(f"metrics on Ray's endpoint: {len(SPECS) - len(missing)} of {len(SPECS)}"
          + (f" (not seen: {', '.join(missing)})" if missing else ""))
    if kill is not None:
        print(format_kill(kill))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    if kill is not None:
        return 1 if (not kill["killed"] or kill["hangs"] or kill["failed_after_recovery"]
                     or not kill["replaced"] or kill["answered_by_the_dead"]) else 0
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
