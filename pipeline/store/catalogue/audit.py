"""What a store holds, checked: its episodes listed from the manifest table or the manifests,
each conversation the table lists checked against its manifest, and each episode flagged by the
model files it was built with. `jobs.manifests` prints these; the rules live here, beside the
table and the manifests they read, so any reader of a store (a command, a service) lists it
alike.

    Filters        the conversations, configuration hashes and models a listing keeps
    summarise      a manifest record as a listing's row (the table's columns, and the budgets)
    manifest_rows  the rows of the per-conversation manifests (a store without a table, or
                   with a damaged one), and the manifests that could not be read
    checked_rows   the table's rows, each conversation's only once its manifest backs them
    ModelFiles     the model-files rule: "none" (no fingerprint), "stale", "unknown"
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa

from pipeline.store.backends.base import Store
from pipeline.store.catalogue.manifest import (
    ManifestError,
    ManifestRecord,
    list_conversations,
    read_manifest,
)
from pipeline.store.catalogue.table import PENDING_PREFIX
from pipeline.store.catalogue.table_query import Totals
from pipeline.store.catalogue.table_sync import mismatches

_COLUMNS = ("episode", "tokens", "build_seconds", "kv_bytes", "object_bytes", "n_windows",
            "turn_index_key", "turn_index_bytes")
CHECK_CHUNK = 1_000  # conversations checked against their manifests at a time


@dataclass(frozen=True)
class Filters:
    """What a listing keeps (each None or empty: any): conversations, configuration hashes,
    model ids; as `table_query.select` and `totals` take them (`query`)."""
    conversations: Sequence[str] | None = None
    config_hashes: Sequence[str] | None = None
    models: Sequence[str] | None = None

    @property
    def query(self) -> dict[str, Sequence[str] | None]:
        return {"conversations": self.conversations, "config_hashes": self.config_hashes,
                "models": self.models}

    @property
    def whole(self) -> bool:
        """Whether a listed conversation shows all its episodes (no hash or model filter), so
        an episode its manifest has and the table lacks is a mismatch."""
        return not (self.config_hashes or self.models)

    def keeps(self, record: ManifestRecord) -> bool:
        return all(not values or getattr(record, column) in values for column, values in
                   (("config_hash", self.config_hashes), ("model_id", self.models)))


def summarise(record: ManifestRecord) -> dict:
    """A manifest record as a listing's row: the table's columns, its mean layer budget and its
    peak entries over the budget (what only a manifest records)."""
    budgets, peaks = record.layer_budgets or [], record.peak_entries_per_layer or []
    return {"conversation_id": record.conversation_id,
            **{k: getattr(record, k) for k in _COLUMNS},
            "mean_budget": sum(budgets) / len(budgets) if budgets else None,
            "max_peak_entries": max(peaks, default=None), "max_peak_over_budget": max(
                (p - b for p, b in zip(peaks, budgets)), default=None),
            "scorer": record.scorer, "config_hash": record.config_hash,
            "model_id": record.model_id, "encoder_id": record.encoder_id,
            "model_fingerprint": record.model_fingerprint,
            "encoder_fingerprint": record.encoder_fingerprint,
            "episode_note": record.episode_note, "worker": record.worker}


def manifest_rows(store: Store, filters: Filters) -> tuple[list[dict], list[ManifestError]]:
    """The rows of the per-conversation manifests the filters keep, read one by one, and the
    manifests that could not be read (their conversations left out)."""
    rows, corrupt = [], []
    for cid in filters.conversations or list_conversations(store):
        try:
            rows.extend(summarise(r) for r in (read_manifest(store, cid) or [])
                        if filters.keeps(r))
        except ManifestError as e:
            corrupt.append(e)
    return rows, corrupt


def rows_totals(rows: Sequence[dict]) -> Totals:
    """The totals of listed rows, as the table's `totals` gives them."""
    return Totals(len(rows), len({r["conversation_id"] for r in rows}),
                  *(sum(r[k] or 0 for r in rows) for k in ("tokens", "object_bytes", "kv_bytes")))


def pending_conversations(store: Store) -> set[str]:
    """The conversations committed since the table's last append (a build's pending markers):
    the table is known to lag their manifests."""
    return {k.removeprefix(PENDING_PREFIX) for k in store.list(PENDING_PREFIX)}


def checked_rows(store: Store, batches: Iterable[pa.RecordBatch], pending: set[str], whole: bool,
                 faults: dict[str, str]) -> Iterator[dict]:
    """The rows of `batches` (sorted by conversation), `CHECK_CHUNK` conversations at a time,
    those whose manifest does not back them left out and their reasons put in `faults`. A
    pending conversation is passed unchecked: the table is known to lag its manifest."""
    chunk: list[dict] = []
    ids: set[str] = set()

    def sound() -> list[dict]:
        found = mismatches(store, [r for r in chunk if r["conversation_id"] not in pending], whole)
        faults.update(found)
        return [r for r in chunk if r["conversation_id"] not in found]

    for batch in batches:
        for r in batch.to_pylist():
            if len(ids) >= CHECK_CHUNK and r["conversation_id"] not in ids:
                yield from sound()
                chunk, ids = [], set()
            chunk.append(r)
            ids.add(r["conversation_id"])
    yield from sound()


# (kind, model or encoder id) -> the fingerprint of its files here now; None: not here
Fingerprint = Callable[[str, str], str | None]


class ModelFiles:
    """The model-files rule of a listing: each episode flagged by the files it was built with,
    "none" (no fingerprint: built before caches were bound to their model, not served), and,
    given `current` (the fingerprints of the files here now), "stale" (other files: a reader
    refuses it) or "unknown" (its files are not here). Counts what needs a rebuild."""

    def __init__(self, current: Fingerprint | None = None):
        self.current = current
        self.unbound = self.stale = 0
        self._now: dict[tuple[str, str], str | None] = {}

    @property
    def check(self) -> bool:
        return self.current is not None

    def _now_of(self, kind: str, name: str) -> str | None:
        if (kind, name) not in self._now:
            self._now[kind, name] = self.current(kind, name)
        return self._now[kind, name]

    def flag(self, r: dict) -> str:
        """The row's model files cell: its model fingerprint, and what is wrong with it."""
        if r["model_fingerprint"] is None or r["encoder_fingerprint"] is None:
            self.unbound += 1
            return "none"
        if not self.check:
            return r["model_fingerprint"]
        now = [self._now_of(kind, r[f"{kind}_id"]) for kind in ("model", "encoder")]
        if None in now:
            return f"{r['model_fingerprint']} unknown"
        if now != [r["model_fingerprint"], r["encoder_fingerprint"]]:
            self.stale += 1
            return f"{r['model_fingerprint']} stale"
        return r["model_fingerprint"]

    def mark(self, r: dict) -> None:
        """The row's "model_files" cell, set (and counted)."""
        r["model_files"] = self.flag(r)

    def shown(self, r: dict) -> dict:
        """The row as a JSON listing shows it: "model_files" only when the files are checked,
        so the rows stay the table's columns otherwise."""
        return r if self.check else {k: v for k, v in r.items() if k != "model_files"}

    def warnings(self) -> list[str]:
        """What needs a rebuild, one line each."""
        lines = []
        if self.unbound:
            lines.append(f"{self.unbound} episode(s) have no model fingerprint (built before "
                         "caches were bound to their model's files): they are not served; "
                         "rebuild them: python -m jobs.build --force ...")
        if self.stale:
            lines.append(f"{self.stale} episode(s) were built with other files of their model "
                         "or encoder than the ones here now (stale): they are refused by a "
                         "reader loading these files; rebuild them: python -m jobs.build ...")
        return lines
