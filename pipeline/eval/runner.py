"""The evaluation on Ray (one task per cell) or in one process (`--in-process`, e.g. on one GPU),
finished cells kept under the output folder.

Each finished cell's records are keyed by the conversation's content and by what decides the
cell (the method's effective configuration, the measurement settings), so a re-run after an
interruption (or with more methods or budgets) computes only the cells it does not have.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
from tqdm import tqdm

from pipeline.builder.profile import allocator, layer_profile
from pipeline.config import TopUpConfig
from pipeline.corpus.schema import Conversation
from pipeline.eval.cell import Prepared, evaluate_cell, prepare
from pipeline.eval.episode_reads import Route, select_route
from pipeline.eval.methods import NO_HISTORY, EvalConfig, parse_method, topup_prefix
from pipeline.eval.report import records_parquet
from pipeline.store.local import LocalStore
from pipeline.store.uri import open_store


def profile(store_uri: str, config: EvalConfig, method: str = "epicache") -> list[float]:
    """The model's profile for the allocator `method` uses (layer sensitivity, or D2O's
    attention variance): measured once, then read from the store."""
    return layer_profile(open_store(store_uri), config.build_config(method, 1))


@functools.cache
def ray_tasks() -> SimpleNamespace:
    """The cells' Ray tasks; Ray is imported only for a run on Ray (`--in-process` needs none)."""
    import ray

    return SimpleNamespace(prepare=ray.remote(prepare), profile=ray.remote(profile),
                           cell=ray.remote(evaluate_cell), wait=ray.wait, get=ray.get)


def conversation_digest(conv: Conversation) -> str:
    return hashlib.sha256(json.dumps(conv.to_record(), sort_keys=True,
                                     default=str).encode()).hexdigest()[:16]


def cell_key(conv: Conversation, digest: str, method: str, budget: int | None,
             config: EvalConfig, layer_budgets: list[int] | None) -> str:
    """Where a finished cell is kept under --out: keyed by the conversation's content and by
    what decides the cell's records (the method's effective build configuration, its layer
    budgets, the measurement settings), not by the method's name, so `epicache` and the variant
    it equals share one cell, and changing any knob gives a new key."""
    spec = parse_method(method)
    base = NO_HISTORY if method == NO_HISTORY else spec.preset.scorer
    what = {"base": base, "budget": budget, "layer_budgets": layer_budgets,
            "build": config.build_config(method, budget).as_dict(),
            "measure": {k: getattr(config, k) for k in (
                "max_context_tokens", "questions_per_conversation", "generate", "max_new_tokens",
                "recall_words", "recall_tokens")}}
    if not spec.episodic:  # knobs only EpiCache reads
        for knob in ("scoring", "episodes", "encoder"):
            what["build"].pop(knob)
    cell = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"cells/{conv.conversation_id}/{digest}/{cell}.parquet"


@dataclass
class Cell:
    """One cell to compute, and every method whose records it gives (routing variants of one
    episodic method share a cell: `pipeline.eval.episode_reads`)."""
    conversation_id: str
    budget: int | None
    key: str
    methods: list[str]  # the first computes the cell
    prep: object = None  # a Prepared, or its Ray reference
    layer_budgets: list[int] | None = None
    # its methods' question-time top-ups, each measured on the reads its routing picks
    topups: tuple[tuple[TopUpConfig, Route], ...] = ()

    def add(self, method: str, config: EvalConfig) -> None:
        self.methods.append(method)
        read = config.topup_read(method)
        if read is not None and read not in self.topups:
            self.topups += (read,)

    @property
    def method(self) -> str:
        return self.methods[0]


def records_of(cell_records: list[dict], methods: list[str], config: EvalConfig) -> list[dict]:
    """A cell's records as each of its methods reads them."""
    return [select_route(r, m, config) | {"method": m} for m in methods for r in cell_records]


def collect_cells(pending: dict, kept: LocalStore, config: EvalConfig) -> tuple[list[dict], list[dict]]:
    """Wait for every cell task (`pending`: ref -> Cell); keep each finished cell's records
    under its key. Returns the records and the failed cells."""
    records, failed = [], []
    with tqdm(total=len(pending), unit="cell", desc="evaluate") as bar:
        while pending:
            [ref], _ = ray_tasks().wait(list(pending), num_returns=1)
            cell = pending.pop(ref)
            try:
                cell_records = ray_tasks().get(ref)
            except Exception as e:
                failed.append(cell_failure(cell, e))
            else:
                kept.put(cell.key, records_parquet(cell_records))
                records.extend(records_of(cell_records, cell.methods, config))
            bar.update(1)
    return records, failed


def cell_failure(cell: Cell, e: Exception) -> dict:
    reason = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
    print(f"cell {cell.conversation_id}/{cell.method}/{cell.budget} failed: {reason}", file=sys.stderr)
    return {"conversation_id": cell.conversation_id, "method": cell.method, "budget": cell.budget,
            "error": reason}


def compute_in_process(cells: list[Cell], kept: LocalStore,
                       config: EvalConfig) -> tuple[list[dict], list[dict]]:
    """Every cell in this process, one after another (one GPU, no Ray), each kept once done."""
    records, failed = [], []
    for cell in tqdm(cells, unit="cell", desc="evaluate"):
        try:
            cell_records = evaluate_cell(cell.prep, cell.method, cell.budget, config,
                                         cell.layer_budgets, cell.topups)
        except Exception as e:  # noqa: BLE001 - a failed cell is reported; the others run
            failed.append(cell_failure(cell, e))
            continue
        kept.put(cell.key, records_parquet(cell_records))
        records.extend(records_of(cell_records, cell.methods, config))
    return records, failed


def kept_cell(kept: LocalStore, key: str, topups: tuple[tuple[TopUpConfig, Route], ...] = ()
              ) -> list[dict] | None:
    """A finished cell's records, or None: not kept, an episodic cell kept before every
    episode was measured for every question (it holds one router's reads only), or one kept
    without a top-up its methods read (`topups`)."""
    if not kept.exists(key):
        return None
    cell_records = pq.read_table(io.BytesIO(kept.get(key))).to_pylist()
    stale = any(r.get("episode") is not None and r.get("route_hit") is not None
                and "scores_centroid" not in r for r in cell_records)
    missing = any(f"{topup_prefix(t, route)}episode_evidence_nll" not in r
                  for t, route in topups for r in cell_records)
    return None if stale or missing else cell_records


@dataclass
class Outcome:
    """What a run of the cells gave: every question's record, the failed cells, the cells
    reused from an earlier run, and each conversation as prepared."""
    records: list[dict]
    failed: list[dict]
    reused: int
    prepared: list[Prepared]


def layer_budgets_of(config: EvalConfig, methods: list[str], budgets: list[int],
                     out: Path, in_process: bool = False) -> dict[tuple[str, int], list[int]]:
    """The layer budgets of every (method, budget) whose method allocates them from a measured
    profile (one profile per allocator, kept under `out/profiles`); the others are uniform."""
    allocated = [m for m in methods if config.needs_profile(m)]
    profiles = {}
    for m in allocated:
        kind = config.allocator_of(m)
        if kind not in profiles:
            where = str(out / "profiles")
            profiles[kind] = profile(where, config, m) if in_process else \
                ray_tasks().get(ray_tasks().profile.remote(where, config, m))
    return {(m, b): allocator(config.build_config(m, b)).allocate(
        profiles[config.allocator_of(m)], b) for m in allocated for b in budgets}


def run_cells(convs: list[Conversation], methods: list[str], budgets: list[int],
              config: EvalConfig, out: Path, in_process: bool = False) -> Outcome:
    """Every cell of every conversation (the two references, then each method at each
    budget), as Ray tasks or, `in_process`, one after another here, reusing the cells
    finished under `out` by an earlier run."""
    layer_budgets = layer_budgets_of(config, methods, budgets, out, in_process)
    kept = LocalStore(out)  # finished cells (atomic writes: a cell is whole or absent)
    todo: dict[str, Cell] = {}
    preps, records, reused = [], [], 0
    for conv in convs:
        prep = prepare(conv, config) if in_process else ray_tasks().prepare.remote(conv, config)
        preps.append(prep)
        digest = conversation_digest(conv)  # hashes the whole conversation: once, not per cell
        cells = [(NO_HISTORY, None), ("full", None)] + [(m, b) for m in methods if m != "full"
                                                    for b in budgets]
        for method, budget in cells:  # uniform layer budgets unless the method allocates
            allocated = layer_budgets.get((method, budget))
            key = cell_key(conv, digest, method, budget, config, allocated)
            read = config.topup_read(method)
            kept_records = None if key in todo else \
                kept_cell(kept, key, () if read is None else (read,))
            if key in todo:
                todo[key].add(method, config)
            elif kept_records is not None:
                records.extend(records_of(kept_records, [method], config))
                reused += 1
            else:
                todo[key] = Cell(conv.conversation_id, budget, key, [], prep, allocated)
                todo[key].add(method, config)
    if reused:
        print(f"reusing {reused} finished cells from {out}/cells", file=sys.stderr)
    if in_process:
        cell_records, failed = compute_in_process(list(todo.values()), kept, config)
    else:
        pending = {ray_tasks().cell.remote(c.prep, c.method, c.budget, config, c.layer_budgets,
                                           c.topups): c for c in todo.values()}
        cell_records, failed = collect_cells(pending, kept, config)
    return Outcome(records + cell_records, failed, reused, preps if in_process else ray_tasks().get(preps))
