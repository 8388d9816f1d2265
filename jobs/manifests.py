"""Show what a store holds: per conversation and episode, the build's figures.

    python -m jobs.manifests --store DIR [--conversation ID] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from pipeline.corpus import UnsafeIdError
from pipeline.manifest import list_conversations, read_manifest
from pipeline.store import StoreError, open_store

_COLUMNS = ("episode", "tokens", "build_seconds", "kv_bytes", "object_bytes", "n_windows")


def summarise(row: dict) -> dict:
    budgets, peaks = row["layer_budgets"] or [], row["peak_entries_per_layer"]
    return {"conversation_id": row["conversation_id"], **{k: row[k] for k in _COLUMNS},
            "mean_budget": sum(budgets) / len(budgets) if budgets else None,
            "max_peak_entries": max(peaks), "max_peak_over_budget": max(
                (p - b for p, b in zip(peaks, budgets)), default=None),
            "scorer": row["scorer"], "config_hash": row["config_hash"],
            "episode_note": row["episode_note"], "worker": row["worker"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.manifests", description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--conversation", action="append", help="default: every conversation")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        store = open_store(a.store)
        rows = [summarise(r) for cid in (a.conversation or list_conversations(store))
                for r in (read_manifest(store, cid) or [])]
    except (StoreError, UnsafeIdError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{'conversation':<16} {'ep':>2} {'tokens':>7} {'build s':>8} {'KV MiB':>7} "
          f"{'budget':>7} {'peak':>7} {'peak-budget':>11} {'scorer':<12} note")
    for r in rows:
        print(f"{r['conversation_id']:<16} {r['episode']:>2} {r['tokens']:>7} "
              f"{r['build_seconds']:>8.1f} {r['kv_bytes'] / 2**20:>7.2f} "
              f"{r['mean_budget'] or 0:>7.0f} {r['max_peak_entries']:>7.0f} "
              f"{r['max_peak_over_budget'] if r['max_peak_over_budget'] is not None else '-':>11} "
              f"{r['scorer']:<12} "
              f"{r['episode_note']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
