"""What the build benchmarks share: a synthetic conversation of an exact length, the episode
patch a real build would use for it, a stock full prefill to compare with, a table printer and
their common options.
"""

from __future__ import annotations

import argparse

from pipeline.kv import models


def add_threads_option(p: argparse.ArgumentParser) -> None:
    """`--threads`: pinning torch's threads gives steadier timings on a busy machine."""
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """`--model` and `--threads`, as every benchmark that loads the model takes them."""
    p.add_argument("--model", default=models.DEFAULT_LLM,
                   help="LLM: packaged name or local HF folder")
    add_threads_option(p)


def add_prefill_options(p: argparse.ArgumentParser, lengths: str) -> None:
    """The options of one episode's block prefill at growing lengths (bench_memory,
    bench_build_speed), `lengths` being the default lengths."""
    p.add_argument("--lengths", default=lengths, help="comma-separated conversation lengths (tokens)")
    p.add_argument("--budget", type=int, default=1024,
                   help="mean entries kept per layer and KV head")
    p.add_argument("--block", type=int, default=512, help="block-prefill block size (tokens)")
    p.add_argument("--layers", type=int, default=None,
                   help="run the first N decoder layers only (default: all)")


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """`columns`: (key, header, format spec); missing values print as '-'."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([("-" if row.get(k) is None else format(row[k], spec)) for k, _, spec in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for c, w in zip(r, widths)))
