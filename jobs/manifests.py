"""Show what a store holds: per conversation and episode, the build's figures.

    python -m jobs.manifests --store DIR|s3://bucket/prefix [--conversation ID] [--json]

A store that does not exist is an error (never created); a manifest that cannot be read is
named on stderr and the others are still shown (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import sys

from jobs.cli import add_store_options, make_parser
from pipeline.corpus import UnsafeIdError
from pipeline.manifest import ManifestError, list_conversations, read_manifest
from pipeline.store import StoreError, open_store

_COLUMNS = ("episode", "tokens", "build_seconds", "kv_bytes", "object_bytes", "n_windows")


def summarise(row: dict) -> dict:
    budgets, peaks = row["layer_budgets"] or [], row["peak_entries_per_layer"] or []
    return {"conversation_id": row["conversation_id"], **{k: row[k] for k in _COLUMNS},
            "mean_budget": sum(budgets) / len(budgets) if budgets else None,
            "max_peak_entries": max(peaks, default=None), "max_peak_over_budget": max(
                (p - b for p, b in zip(peaks, budgets)), default=None),
            "scorer": row["scorer"], "config_hash": row["config_hash"],
            "episode_note": row["episode_note"], "worker": row["worker"]}


def _cell(value, spec: str) -> str:
    """The value formatted for its column; '-' for one the manifest does not record (null)."""
    if value is None:
        return format("-", spec[0] + spec[1:].split(".")[0].rstrip("df"))
    return format(value, spec)


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.manifests", __doc__)
    add_store_options(p)
    p.add_argument("--conversation", action="append",
                   help="show this conversation (may repeat; default: every conversation)")
    p.add_argument("--json", action="store_true", help="one JSON object per episode, not a table")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    rows, corrupt = [], []
    try:
        store = open_store(a.store, endpoint_url=a.s3_endpoint, create=False)
        for cid in a.conversation or list_conversations(store):
            try:
                rows.extend(summarise(r) for r in (read_manifest(store, cid) or []))
            except ManifestError as e:
                corrupt.append(e)
    except (StoreError, UnsafeIdError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for e in corrupt:
        print(f"error: {e}", file=sys.stderr)
    code = 2 if corrupt else 0
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return code
    print(f"{'conversation':<16} {'ep':>2} {'tokens':>7} {'build s':>8} {'KV MiB':>7} "
          f"{'budget':>7} {'peak':>7} {'peak-budget':>11} {'scorer':<12} note")
    for r in rows:
        mib = r["kv_bytes"] / 2**20 if r["kv_bytes"] is not None else None
        print(f"{r['conversation_id']:<16} {_cell(r['episode'], '>2')} {_cell(r['tokens'], '>7')} "
              f"{_cell(r['build_seconds'], '>8.1f')} {_cell(mib, '>7.2f')} "
              f"{_cell(r['mean_budget'], '>7.0f')} {_cell(r['max_peak_entries'], '>7.0f')} "
              f"{_cell(r['max_peak_over_budget'], '>11')} {_cell(r['scorer'], '<12')} "
              f"{r['episode_note'] or ''}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
