"""Show what a store holds: per conversation and episode, the build's figures.

    python -m jobs.manifests --store DIR|s3://bucket/prefix [--conversation ID] [--config-hash H]
        [--model M] [--totals] [--json] [--manifests]
    python -m jobs.manifests --store ... \\
        --sql "SELECT config_hash, sum(object_bytes) FROM episodes GROUP BY 1"
    python -m jobs.manifests --store ... --compact | --rebuild

It reads the store's manifest table (`<store>/index/episodes`, Delta Lake, kept by every build)
when there is one, checks each listed conversation's rows against its manifest (a manifest
truncated, replaced or removed since is named on stderr, its rows left out, exit code 2), and
ends with the totals of episodes, conversations, tokens and bytes (--totals: those alone, from
the table, no manifest read); without one (or with --manifests) it reads the per-conversation
manifests, as stores built before the table were read. --sql runs a DuckDB query over the
table, which is the view `episodes` (the query reads nothing else: no files, no network).
--compact brings the table up to date with manifests an interrupted build committed, rewrites
it sorted by conversation and removes old files; --rebuild recreates it from the manifests. Run
those two when no build is writing to the store (the build's driver is the table's one writer).

A damaged table (a data file deleted, a log entry that is not JSON or truncated, a gap in its
log, a checkpoint that is not Parquet) does not hide the store: the listing and --totals say so
on stderr in one line (`error: manifest table ... cannot be read (...); reading the manifests
instead; ... --rebuild rebuilds it`), read the per-conversation manifests instead and exit 2;
--sql and --compact, which need the table itself, say so in one line naming --rebuild and exit
2; --rebuild removes the damaged table's objects and creates it anew from the manifests (exit 0),
and so does the next build when it opens the table.

Each episode shows the fingerprint of the model files it was built with ("model files"); a
warning on stderr counts the episodes without one (built before caches were bound to their
model: not served until rebuilt). --check-models also fingerprints the models' files as they
are here now and flags the episodes built with other files ("stale": a reader refuses them).
"index KiB" is the size of the conversation's turn index (the same on every row; "-": built
before turn indexes, so its questions get no top-up); --json rows carry its key.

A store that does not exist is an error (never created); a manifest that cannot be read is
named on stderr and the others are still shown (exit code 2). Exit codes: 0, everything read
and sound; 2, an error or something damaged (a manifest, the table), named on stderr.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys

from pipeline.cli.numbers import non_negative
from pipeline.cli.parser import add_store_options, make_parser, store_options
from pipeline.corpus.schema import UnsafeIdError
from pipeline.store.backends.base import Store, StoreError
from pipeline.store.backends.uri import open_store
from pipeline.store.catalogue import table_sync
from pipeline.store.catalogue.audit import (
    Filters,
    ModelFiles,
    checked_rows,
    manifest_rows,
    pending_conversations,
    rows_totals,
)
from pipeline.store.catalogue.table import TABLE_SCHEMA, ManifestTable, TableDamagedError
from pipeline.store.catalogue.table_query import Totals, connect, select, totals
from pipeline.store.catalogue.table_sync import repair


def current_fingerprint(kind: str, name: str) -> str | None:
    """The fingerprint of the model's (`kind` "model") or encoder's files as they are here now;
    None where they are not here (`--check-models`; only then is torch loaded)."""
    from pipeline.kv import models

    fingerprint = models.llm_fingerprint if kind == "model" else models.encoder_fingerprint
    try:
        return fingerprint(name)
    except models.ModelNotFoundError:
        return None


def _cell(value, spec: str) -> str:
    """The value formatted for its column; '-' for one the manifest does not record (null)."""
    if value is None:
        return format("-", spec[0] + spec[1:].split(".")[0].rstrip("df"))
    return format(value, spec)


def _mib(value) -> float | None:
    return value / 2**20 if value is not None else None


def _index_cell(r: dict) -> str:
    """The conversation's turn index, in KiB ('-': none recorded)."""
    size = r["turn_index_bytes"]
    return _cell(size / 2**10 if size is not None else None, ">9.1f")


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.manifests", __doc__)
    add_store_options(p)
    p.add_argument("--conversation", action="append",
                   help="show this conversation (may repeat; default: every conversation)")
    p.add_argument("--config-hash", action="append",
                   help="only episodes built with this configuration hash (may repeat; "
                        "default: any)")
    p.add_argument("--model", action="append",
                   help="only episodes built with this model id (may repeat; default: any)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per episode (or per --sql result row), not a table")
    p.add_argument("--totals", action="store_true",
                   help="from the table: print only the totals line (episodes, conversations, "
                        "tokens, bytes), not one line per episode (the table alone: no manifest "
                        "is read, where a listing checks each conversation against its "
                        "manifest; a damaged table: from the manifests, exit code 2)")
    p.add_argument("--manifests", action="store_true",
                   help="read the per-conversation manifests even where the store has a table "
                        "(they also hold the per-layer budgets and peaks)")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--sql", metavar="QUERY", default=None,
                        help="run a DuckDB query over the table, the view `episodes`, and print "
                             "its rows as CSV (--json: JSON lines); default: no query")
    action.add_argument("--compact", action="store_true",
                        help="bring the table up to date with manifests an interrupted build "
                             "committed, rewrite it sorted by conversation, remove old files "
                             "(creates it from the manifests where there is none)")
    action.add_argument("--rebuild", action="store_true",
                        help="recreate the table from every per-conversation manifest")
    p.add_argument("--check-models", action="store_true",
                   help="fingerprint the models' files as they are here now and flag the "
                        "episodes built with other files as stale (default: show the recorded "
                        "fingerprints only)")
    p.add_argument("--retain-hours", type=non_negative, default=168.0,
                   help="--compact: keep the files older table versions need for this long")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    filters = Filters(a.conversation, a.config_hash, a.model)
    try:
        store = open_store(a.store, store_options(a), create=False)
        if a.rebuild or a.compact:
            return maintain(store, a.rebuild, a.retain_hours)
        table = ManifestTable(store)
        if a.sql is not None:
            if any(filters.query.values()) or a.manifests or a.totals:
                raise ValueError("--sql queries the whole table: put the conditions in the "
                                 "query (columns conversation_id, config_hash, model_id, ...)")
            return run_sql(table, a.sql, a.json)
        files = ModelFiles(current_fingerprint if a.check_models else None)
        code = listing(store, table, filters, a, files)
        for line in files.warnings():
            print(f"warning: {line}", file=sys.stderr)
        return code
    except TableDamagedError as e:  # --sql and --compact need the table itself
        needs = "--sql" if a.sql is not None else "--compact" if a.compact else None
        print(f"error: {e.unreadable(f': {needs} needs it; ')}" if needs else f"error: {e}",
              file=sys.stderr)
        return 2
    except (StoreError, UnsafeIdError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def listing(store: Store, table: ManifestTable, filters: Filters, a: argparse.Namespace,
            files: ModelFiles) -> int:
    """The rows (or --totals) from the table where there is one, else from the manifests; a
    damaged table is named on stderr and the manifests are read instead (exit code 2)."""
    if a.manifests or not table.exists():
        if a.totals:
            raise ValueError("--totals reads the manifest table, and this store has none "
                             "(`--rebuild` makes it)")
        return from_manifests(store, filters, a.json, files)
    try:
        return from_table(store, table, filters, a.json, a.totals, files)
    except TableDamagedError as e:  # raised before any row is printed
        print(f"error: {e.unreadable('; reading the manifests instead; ')}", file=sys.stderr)
        from_manifests(store, filters, a.json, files, a.totals)
        return 2


def from_manifests(store: Store, filters: Filters, as_json: bool, files: ModelFiles,
                   only_totals: bool = False) -> int:
    """The per-conversation manifests, read one by one (stores without a table, or with a
    damaged one); `only_totals`: their totals line alone, as the table would give it."""
    rows, corrupt = manifest_rows(store, filters)
    for e in corrupt:
        print(f"error: {e}", file=sys.stderr)
    code = 2 if corrupt else 0
    if only_totals:
        print_totals(rows_totals(rows), as_json, "from the manifests")
        return code
    for r in rows:
        files.mark(r)
    if as_json:
        for r in rows:
            print(json.dumps(files.shown(r)))
        return code
    print(f"{'conversation':<16} {'ep':>2} {'tokens':>7} {'build s':>8} {'KV MiB':>7} "
          f"{'budget':>7} {'peak':>7} {'peak-budget':>11} {'index KiB':>9} {'scorer':<12} "
          f"{'model files':<22} note")
    for r in rows:
        print(f"{r['conversation_id']:<16} {_cell(r['episode'], '>2')} {_cell(r['tokens'], '>7')} "
              f"{_cell(r['build_seconds'], '>8.1f')} {_cell(_mib(r['kv_bytes']), '>7.2f')} "
              f"{_cell(r['mean_budget'], '>7.0f')} {_cell(r['max_peak_entries'], '>7.0f')} "
              f"{_cell(r['max_peak_over_budget'], '>11')} {_index_cell(r)} "
              f"{_cell(r['scorer'], '<12')} {r['model_files']:<22} {r['episode_note'] or ''}")
    return code


def from_table(store: Store, table: ManifestTable, filters: Filters, as_json: bool,
               only_totals: bool, files: ModelFiles) -> int:
    """The table's rows (streamed), each conversation's shown once its manifest was read and
    found to match them, then the totals (from the table alone); a conversation whose manifest
    does not back its rows is left out and named on stderr (exit code 2). Warns when a build
    left rows pending. The table is read before a line is printed, so a damaged one
    (`TableDamagedError`) is found before any row is shown."""
    rows = None if only_totals else select(table, TABLE_SCHEMA.names, **filters.query)
    t = totals(table, **filters.query)
    pending = pending_conversations(store)
    if pending:
        print(f"warning: {len(pending)} conversation(s) committed since the table's last append "
              "(an interrupted build): `python -m jobs.manifests --compact` brings it up to date",
              file=sys.stderr)
    faults: dict[str, str] = {}
    if rows is not None:
        if not as_json:
            print(f"{'conversation':<16} {'ep':>2} {'tokens':>7} {'build s':>8} {'KV MiB':>7} "
                  f"{'obj MiB':>7} {'index KiB':>9} {'scorer':<12} {'config':<16} "
                  f"{'model files':<22} note")
        for r in checked_rows(store, rows, pending, filters.whole, faults):
            files.mark(r)
            print(json.dumps(files.shown(r)) if as_json else _table_line(r))
    for reason in faults.values():
        print(f"error: {reason}", file=sys.stderr)
    if faults:
        print(f"error: {len(faults)} conversation(s) of the table left out: "
              "`python -m jobs.manifests --rebuild` recreates the table from the manifests, and a "
              "build replaces a corrupt manifest", file=sys.stderr)
    if not as_json or only_totals:
        checked = ("manifests not read (a listing without --totals checks them)" if only_totals
                   else "every conversation listed checked against its manifest"
                   + (f" ({len(pending)} pending: not checked)" if pending else ""))
        print_totals(t, as_json, f"table {table.uri}; {checked}")
    return 2 if faults else 0


def print_totals(t: Totals, as_json: bool, source: str) -> None:
    """The totals line (ending with where they come from), or its JSON object."""
    if as_json:
        print(json.dumps({"totals": t.__dict__}))
        return
    print(f"total: {t.episodes:,} episodes of {t.conversations:,} conversations; "
          f"{t.tokens:,} tokens; objects {t.object_bytes / 2**30:.3f} GiB "
          f"({t.object_bytes:,} bytes); KV {t.kv_bytes / 2**30:.3f} GiB; {source}")


def _table_line(r: dict) -> str:
    return (f"{r['conversation_id']:<16} {_cell(r['episode'], '>2')} {_cell(r['tokens'], '>7')} "
            f"{_cell(r['build_seconds'], '>8.1f')} {_cell(_mib(r['kv_bytes']), '>7.2f')} "
            f"{_cell(_mib(r['object_bytes']), '>7.2f')} {_index_cell(r)} "
            f"{_cell(r['scorer'], '<12')} "
            f"{_cell(r['config_hash'], '<16')} {r['model_files']:<22} {r['episode_note'] or ''}")


def run_sql(table: ManifestTable, query: str, as_json: bool) -> int:
    """The query's rows as CSV with a header (or JSON lines), streamed."""
    import duckdb

    con = connect(table)
    try:
        result = con.sql(query)
        if result is None:  # a statement without rows
            return 0
        columns = result.columns
        reader = result.to_arrow_reader(10_000)
        writer = csv.writer(sys.stdout, lineterminator="\n")
        if not as_json:
            writer.writerow(columns)
        for batch in reader:
            for row in batch.to_pylist():
                if as_json:
                    print(json.dumps(row, default=str))
                else:
                    writer.writerow(row[c] for c in columns)
    except duckdb.Error as e:
        failure = table.failure("query", e)
        if isinstance(failure, TableDamagedError):  # not the query's fault: a data file's
            raise failure from None
        raise ValueError(f"--sql: {(str(e).strip().splitlines() or [type(e).__name__])[0]}") \
            from None
    return 0


def maintain(store: Store, rebuild: bool, retain_hours: float) -> int:
    """--rebuild, or --compact (repair, then sort and vacuum); corrupt manifests are named and
    left out (exit code 2). --rebuild recreates a damaged table; --compact raises
    `TableDamagedError` for one."""
    table = ManifestTable(store)
    if rebuild or not table.exists():
        done = table_sync.rebuild(store, table)
        line = (f"rebuilt the manifest table from {done.conversations:,} manifests "
                f"({done.rows:,} episodes)"
                + (f" in place of a damaged one ({done.damage})" if done.damage else ""))
    else:
        done = repair(store, table)
        stats = table.compact(retain_hours)
        line = (f"compacted the manifest table: {done.conversations:,} pending conversation(s) "
                f"brought up to date; {stats['files_before']} files -> {stats['files_after']} "
                f"sorted by conversation; {stats['vacuumed']} old files removed "
                f"(version {stats['version']})")
    for e in done.corrupt:
        print(f"error: {e}", file=sys.stderr)
    print(f"{line}; table {table.uri}")
    return 2 if done.corrupt else 0


if __name__ == "__main__":
    raise SystemExit(main())
