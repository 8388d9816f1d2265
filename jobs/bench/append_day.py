"""A day of a growing corpus through the Ray job: every conversation gains one session.

    python -m jobs.bench.append_day [--conversations 100] [--target-tokens 1500] [--seed 0] \\
        [--budget 1024] [--episodes 4]

A synthetic corpus (`jobs.make_corpus`'s) is built without each conversation's last session
(day 1, the Ray job of `jobs.build`). Day 2 is the corpus whole, run twice side by side on two
copies of the day-1 store: appending (the default) and `--no-append` (each grown conversation
re-clustered and rebuilt). For each: the wall time, the tokens prefilled, and every call the
build made to the store, from the driver and the Ray workers alike (the store logs each call to
a file they share), by operation, with its bytes. A call is one S3 request on an S3 store (a
put of an object over the multipart threshold is several); the manifest table's Delta commits
are written by deltalake itself and are not in the log.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from lab.bench_cli import bench_parser, start_bench
from pipeline.builder.driver import run_build
from pipeline.cli.options import add_budget_option
from pipeline.config import BuildConfig, DriverOptions, EpisodeConfig, GrowthConfig
from pipeline.corpus.reader import write_jsonl
from pipeline.corpus.synthetic import make_corpus
from pipeline.ray_runtime import init_ray
from pipeline.store.backends.base import ObjectInfo
from pipeline.store.backends.local import LocalStore


class LoggedStore(LocalStore):
    """A local store that appends one line per call (operation, folder, bytes) to `log`; the
    driver and every Ray worker write to the same file (a short append is atomic)."""

    def __init__(self, root: str | Path, log: str | Path):
        super().__init__(root)
        self.log = str(log)

    def _note(self, op: str, key: str, size: int = 0) -> None:
        line = f"{op}\t{key.split('/', 1)[0]}\t{size}\n".encode()
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def put(self, key: str, data: bytes) -> None:
        super().put(key, data)
        self._note("put", key, len(data))

    def get(self, key: str) -> bytes:
        data = super().get(key)
        self._note("get", key, len(data))
        return data

    def info(self, key: str) -> ObjectInfo:
        self._note("head", key)
        return super().info(key)

    def exists(self, key: str) -> bool:
        self._note("head", key)
        return super().exists(key)

    def list(self, prefix: str = "") -> list[str]:
        self._note("list", prefix or "/")
        return super().list(prefix)

    def delete(self, key: str) -> None:
        self._note("delete", key)
        super().delete(key)


def read_log(path: Path) -> collections.Counter:
    """(operation, folder) -> calls, and (operation, folder, "bytes") -> bytes."""
    counts: collections.Counter = collections.Counter()
    if path.exists():
        for line in path.read_text().splitlines():
            op, folder, size = line.split("\t")
            counts[op, folder] += 1
            counts[op, folder, "bytes"] += int(size)
    return counts


def day_two(name: str, day1: Path, corpus: Path, work: Path, config: BuildConfig,
            growth: GrowthConfig) -> dict:
    """Day 2 on a copy of the day-1 store: the summary, its time and the store calls."""
    root, log = work / f"store-{name}", work / f"calls-{name}.tsv"
    shutil.copytree(day1, root)
    store = LoggedStore(root, log)
    start = time.perf_counter()
    summary = run_build(str(corpus), store, config,
                        DriverOptions(progress=False, growth=growth))
    return {"name": name, "summary": summary, "seconds": time.perf_counter() - start,
            "calls": read_log(log)}


def calls(counts: collections.Counter, op: str, folder: str) -> str:
    """"N calls", with their MiB for gets and puts."""
    text = f"{counts[op, folder]:,}"
    if op in ("get", "put"):
        text += f" ({counts[op, folder, 'bytes'] / 2**20:.1f} MiB)"
    return text


def report(runs: list[dict]) -> list[str]:
    """One table: for each day-2 run, its time, work and store calls by kind."""
    kinds = sorted({key[:2] for run in runs for key in run["calls"] if len(key) == 2})
    lines = ["| | " + " | ".join(r["name"] for r in runs) + " |",
             "|---|" + "---|" * len(runs)]

    def row(label: str, values) -> None:
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    row("wall time", [f"{r['seconds']:.1f} s" for r in runs])
    row("appended / built / skipped", [f"{r['summary'].appended} / {r['summary'].built} / "
                                       f"{r['summary'].skipped}" for r in runs])
    row("tokens prefilled", [f"{r['summary'].tokens:,}" for r in runs])
    for op, folder in kinds:
        row(f"{op} {folder}", [calls(r["calls"], op, folder) for r in runs])
    base = runs[-1]["seconds"]
    lines.append("")
    lines.append(" ".join(f"{r['name']}: {base / r['seconds']:.1f}x the speed of "
                          f"{runs[-1]['name']}." for r in runs[:-1]))
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("append_day", __doc__)
    p.add_argument("--conversations", type=int, default=100, help="conversations in the corpus")
    p.add_argument("--target-tokens", type=int, default=1500,
                   help="each conversation's length on day 2 (estimated tokens)")
    p.add_argument("--seed", type=int, default=0, help="the corpus's seed")
    add_budget_option(p, BuildConfig().budget)
    p.add_argument("--episodes", type=int, default=EpisodeConfig().episodes,
                   help="episodes per conversation")
    return p


def main(argv: list[str] | None = None) -> int:
    a = start_bench(build_parser(), argv)
    config = BuildConfig(budget=a.budget,
                         episodes=dataclasses.replace(EpisodeConfig(), episodes=a.episodes))
    # no questions: day 1's would name evidence in the session it lacks
    whole = [dataclasses.replace(c, questions=())
             for c in make_corpus(a.conversations, a.target_tokens, a.seed)]
    first = [dataclasses.replace(c, turns=tuple(
        t for t in c.turns if t.session < max(u.session for u in c.turns))) for c in whole]
    init_ray(None)
    with tempfile.TemporaryDirectory(prefix="bench-append-day-") as tmp:
        work = Path(tmp)
        write_jsonl(first, work / "day1.jsonl")
        write_jsonl(whole, work / "day2.jsonl")
        start = time.perf_counter()
        day1 = run_build(str(work / "day1.jsonl"), str(work / "day1"), config,
                         DriverOptions(progress=False))
        print(f"day 1: {day1.line(time.perf_counter() - start, 'day1')}", flush=True)
        new = sum(len(w.turns) - len(f.turns) for w, f in zip(whole, first))
        print(f"day 2: {len(whole)} conversations, {new} new turns "
              f"({new / sum(len(w.turns) for w in whole):.1%} of the turns)", flush=True)
        runs = [day_two(name, work / "day1", work / "day2.jsonl", work, config, growth)
                for name, growth in (("append", GrowthConfig()),
                                     ("rebuild", GrowthConfig(append=False)))]
    print("\n".join(report(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
