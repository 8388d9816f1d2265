"""The evaluation on Ray: one task per cell, finished cells kept under the output folder.

Each finished cell's records are keyed by the conversation's content and by what decides the
cell (the method's effective configuration, the measurement settings), so a re-run after an
interruption (or with more methods or budgets) computes only the cells it does not have.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import ray
from tqdm import tqdm

from pipeline.build.profile import allocator, layer_profile
from pipeline.corpus.schema import Conversation
from pipeline.eval.cell import Prepared, evaluate_cell, prepare
from pipeline.eval.methods import EPISODIC, EvalConfig, allocator_of, parse_method
from pipeline.eval.report import records_parquet
from pipeline.store.local import LocalStore
from pipeline.store.uri import open_store


@ray.remote
def prepare_task(conv, config: EvalConfig) -> Prepared:
    return prepare(conv, config)


@ray.remote
def profile_task(store_uri: str, config: EvalConfig, method: str = "epicache") -> list[float]:
    """The model's profile for the allocator `method` uses (layer sensitivity, or D2O's
    attention variance): measured once, then read from the store."""
    return layer_profile(open_store(store_uri), config.build_config(method, 1))


@ray.remote
def cell_task(prep: Prepared, method: str, budget: int | None,
              config: EvalConfig, layer_budgets: list[int] | None) -> list[dict]:
    return evaluate_cell(prep, method, budget, config, layer_budgets)


def conversation_digest(conv: Conversation) -> str:
    return hashlib.sha256(json.dumps(conv.to_record(), sort_keys=True,
                                     default=str).encode()).hexdigest()[:16]


def cell_key(conv: Conversation, digest: str, method: str, budget: int | None,
             config: EvalConfig, layer_budgets: list[int] | None) -> str:
    """Where a finished cell is kept under --out: keyed by the conversation's content and by
    what decides the cell's records (the method's effective build configuration, its layer
    budgets, the measurement settings), not by the method's name, so `epicache` and the variant
    it equals share one cell, and changing any knob gives a new key."""
    base, _ = parse_method(method)
    what = {"base": base, "budget": budget, "layer_budgets": layer_budgets,
            "build": config.build_config(method, budget).as_dict(),
            "measure": {k: getattr(config, k) for k in (
                "max_context_tokens", "questions_per_conversation", "generate", "max_new_tokens",
                "recall_words", "recall_tokens")}}
    if base == "epicache-paper":
        what["base"] = "epicache"  # the same method under its paper recipe
    if base not in EPISODIC:  # knobs only EpiCache reads
        for knob in ("scoring", "episodes", "encoder"):
            what["build"].pop(knob)
    cell = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"cells/{conv.conversation_id}/{digest}/{cell}.parquet"


def collect_cells(pending: dict, kept: LocalStore) -> tuple[list[dict], list[dict]]:
    """Wait for every cell task (`pending`: ref -> (conversation id, method, budget, key)); keep
    each finished cell's records under `key`. Returns the records and the failed cells."""
    records, failed = [], []
    with tqdm(total=len(pending), unit="cell", desc="evaluate") as bar:
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            cid, method, budget, key = pending.pop(ref)
            try:
                cell_records = ray.get(ref)
            except Exception as e:
                reason = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
                print(f"cell {cid}/{method}/{budget} failed: {reason}", file=sys.stderr)
                failed.append({"conversation_id": cid, "method": method, "budget": budget,
                               "error": reason})
            else:
                kept.put(key, records_parquet(cell_records))
                records.extend(cell_records)
            bar.update(1)
    return records, failed


@dataclass
class Outcome:
    """What a run of the cells gave: every question's record, the failed cells, the cells
    reused from an earlier run, and each conversation as prepared."""
    records: list[dict]
    failed: list[dict]
    reused: int
    prepared: list[Prepared]


def layer_budgets_of(config: EvalConfig, methods: list[str], budgets: list[int],
                     out: Path) -> dict[tuple[str, int], list[int]]:
    """The layer budgets of every (method, budget) whose method allocates them from a measured
    profile (one profile per allocator, kept under `out/profiles`); the others are uniform."""
    allocated = [m for m in methods if config.needs_profile(m)]
    profiles = {}
    for m in allocated:
        kind = allocator_of(m)
        if kind not in profiles:
            profiles[kind] = ray.get(profile_task.remote(str(out / "profiles"), config, m))
    return {(m, b): allocator(config.build_config(m, b)).allocate(
        profiles[allocator_of(m)], b) for m in allocated for b in budgets}


def run_cells(convs: list[Conversation], methods: list[str], budgets: list[int],
              config: EvalConfig, out: Path) -> Outcome:
    """Every cell of every conversation on the connected Ray (the two references, then each
    method at each budget), reusing the cells finished under `out` by an earlier run."""
    layer_budgets = layer_budgets_of(config, methods, budgets, out)
    kept = LocalStore(out)  # finished cells (atomic writes: a cell is whole or absent)
    pending, prep_refs, records, reused = {}, [], [], 0
    for conv in convs:
        prep = prepare_task.remote(conv, config)
        prep_refs.append(prep)
        digest = conversation_digest(conv)  # hashes the whole conversation: once, not per cell
        cells = [("none", None), ("full", None)] + [(m, b) for m in methods if m != "full"
                                                    for b in budgets]
        for method, budget in cells:  # uniform layer budgets unless the method allocates
            allocated = layer_budgets.get((method, budget))
            key = cell_key(conv, digest, method, budget, config, allocated)
            if kept.exists(key):
                records.extend(r | {"method": method} for r in
                               pq.read_table(io.BytesIO(kept.get(key))).to_pylist())
                reused += 1
                continue
            ref = cell_task.remote(prep, method, budget, config, allocated)
            pending[ref] = (conv.conversation_id, method, budget, key)
    if reused:
        print(f"reusing {reused} finished cells from {out}/cells", file=sys.stderr)
    cell_records, failed = collect_cells(pending, kept)
    return Outcome(records + cell_records, failed, reused, ray.get(prep_refs))
