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
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
from tqdm import tqdm

from pipeline.builder.profile import allocator, layer_profile
from pipeline.corpus.schema import Conversation
from pipeline.eval.cell import Prepared, evaluate_cell, prepare
from pipeline.eval.methods import NO_HISTORY, EvalConfig, Read, parse_method
from pipeline.eval.reads import select_read
from pipeline.eval.report import records_parquet
from pipeline.eval.summary import nan_mean
from pipeline.store.backends.local import LocalStore
from pipeline.store.backends.uri import open_store


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


def takes_budget(method: str) -> bool:
    """Whether a method's cache is built under a budget (not the references, `rag` or
    `full+topup...`)."""
    return parse_method(method).takes_budget


def shares_build(config: EvalConfig, method: str, other: str) -> bool:
    """Whether two methods read the same caches at a budget (they differ only in what a
    question reads at question time)."""
    return (config.build_config(method, 1) == config.build_config(other, 1) and
            config.allocator_of(method) == config.allocator_of(other) and
            parse_method(method).preset.scorer == parse_method(other).preset.scorer)


def cell_key(conv: Conversation, digest: str, method: str, budget: int | None,
             config: EvalConfig, layer_budgets: list[int] | None) -> str:
    """Where a finished cell is kept under --out: keyed by the conversation's content and by
    what decides the cell's records (the method's effective build configuration, its layer
    budgets, the measurement settings), not by the method's name, so `epicache` and the variant
    it equals share one cell, and changing any knob gives a new key."""
    spec = parse_method(method)
    base = spec.preset.scorer if spec.history else NO_HISTORY
    what = {"base": base, "budget": budget, "layer_budgets": layer_budgets,
            "build": config.build_config(method, budget).as_dict(),
            "measure": {k: getattr(config, k) for k in (
                "max_context_tokens", "questions_per_conversation", "recall_words",
                "recall_tokens")}}
    if config.reference_window is not None:
        # whole conversations: the window picks the questions measured (those a window
        # holds), and the full cache of a conversation is its oracle windows (the questions
        # spread past one window read their evidence sessions since `reference` 2)
        what["measure"]["reference_window"] = config.reference_window
        what["measure"]["reference"] = 2
    for section in [s for s in what["build"] if not spec.reads_section(s)]:
        what["build"].pop(section)  # knobs only other methods read
    # the encoder stays for every cell: it routes an episodic one, and chooses the top-up of
    # every read that has one (any cell's)
    cell = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"cells/{conv.conversation_id}/{digest}/{cell}.parquet"


@dataclass
class Cell:
    """One cell to compute, and every method whose records it gives (variants of one method
    that differ only in what a question reads share a cell: `pipeline.eval.reads`). `budget`
    is the cache's; `label` the budget its records are reported at (another where the cell
    runs at a method's equal decode-time entries: `run_cells`). A cell that generates answers
    for some of its reads (`answered`) is kept apart from one that does not."""
    conversation_id: str
    budget: int | None
    base_key: str  # `cell_key`: what decides its caches and its measures
    methods: list[str]  # the first computes the cell
    prep: object = None  # a Prepared, or its Ray reference
    layer_budgets: list[int] | None = None
    reads: tuple[Read, ...] = ()  # its methods' question-time reads
    label: int | None = None
    answered: tuple[Read, ...] = ()  # the reads whose answers it generates (F1)
    answer_settings: tuple = ()  # (questions sampled, answer length)
    # rows reported with a read of their own, at a budget of their own: (method, budget, read),
    # e.g. `rag` at the default's decode-time entries (a wider top-up on the no-history cell)
    sized: list[tuple[str, int | None, Read]] = field(default_factory=list)
    kept_records: list[dict] | None = None  # kept by an earlier run, without some of `reads`
    computed_by: str | None = None  # the method that computes it, where none of `methods` does

    def add(self, method: str, config: EvalConfig, reads: tuple[Read, ...] = ()) -> None:
        self.methods.append(method)
        self.reads = tuple(dict.fromkeys((*self.reads, config.read_of(method), *reads)))
        if config.answers(method):
            self.answered = tuple(dict.fromkeys((*self.answered, config.read_of(method))))
            self.answer_settings = (config.generate_questions, config.max_new_tokens)

    def add_sized(self, method: str, budget: int | None, read: Read) -> None:
        """`method`'s records at `budget`, read with `read` instead of its own."""
        self.sized.append((method, budget, read))
        self.reads = tuple(dict.fromkeys((*self.reads, read)))

    @property
    def method(self) -> str:
        return self.computed_by or self.methods[0]

    @property
    def key(self) -> str:
        """Where it is kept: its base key, or beside it with the answers it generates."""
        if not self.answered:
            return self.base_key
        what = repr((sorted(r.prefix for r in self.answered), self.answer_settings))
        return self.base_key.replace(
            ".parquet", f"-answers{hashlib.sha256(what.encode()).hexdigest()[:8]}.parquet")


def records_of(cell_records: list[dict], cell: Cell, config: EvalConfig) -> list[dict]:
    """A cell's records as each of its methods reads them, at the cell's reported budget, and
    its sized rows' (`Cell.add_sized`) at theirs."""
    budget = cell.budget if cell.label is None else cell.label
    return [select_read(r, m, config) | {
        "budget": budget if r.get("budget") is not None else None,
        "cache_budget": r.get("budget")} for m in cell.methods for r in cell_records] + [
        select_read(r, m, config, read) | {"budget": b, "cache_budget": r.get("budget")}
        for m, b, read in cell.sized for r in cell_records]


def merged_records(kept_records: list[dict] | None, computed: list[dict]) -> list[dict]:
    """A cell's records computed for the reads it lacked, joined with those kept before (the
    same questions: every read's fields on one record), so a kept cell only ever gains reads."""
    if not kept_records or [r["question_index"] for r in kept_records] != \
            [r["question_index"] for r in computed]:
        return computed
    return [old | new for old, new in zip(kept_records, computed)]


def collect_cells(pending: dict, kept: LocalStore,
                  config: EvalConfig) -> tuple[list[dict], list[dict]]:
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
                cell_records = merged_records(cell.kept_records, cell_records)
                kept.put(cell.key, records_parquet(cell_records))
                records.extend(records_of(cell_records, cell, config))
            bar.update(1)
    return records, failed


def cell_failure(cell: Cell, e: Exception) -> dict:
    reason = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
    print(f"cell {cell.conversation_id}/{cell.method}/{cell.budget} failed: {reason}",
          file=sys.stderr)
    return {"conversation_id": cell.conversation_id, "method": cell.method, "budget": cell.budget,
            "error": reason}


def compute_in_process(cells: list[Cell], kept: LocalStore,
                       config: EvalConfig) -> tuple[list[dict], list[dict]]:
    """Every cell in this process, one after another (one GPU, no Ray), each kept once done."""
    records, failed = [], []
    for cell in tqdm(cells, unit="cell", desc="evaluate"):
        try:
            cell_records = evaluate_cell(cell.prep, cell.method, cell.budget, config,
                                         cell.layer_budgets, missing_reads(cell),
                                         cell.answered)
        except Exception as e:  # noqa: BLE001 - a failed cell is reported; the others run
            failed.append(cell_failure(cell, e))
            continue
        cell_records = merged_records(cell.kept_records, cell_records)
        kept.put(cell.key, records_parquet(cell_records))
        records.extend(records_of(cell_records, cell, config))
    return records, failed


def holds_read(cell_records: list[dict], read: Read) -> bool:
    return all(f"{read.prefix}evidence_nll" in r for r in cell_records)


def kept_cell(kept: LocalStore, key: str, reads: tuple[Read, ...] = ()) -> list[dict] | None:
    """A finished cell's records, or None: not kept, or kept without a read its methods make
    (`reads`; a cell kept before reads were measured has none)."""
    if not kept.exists(key):
        return None
    cell_records = pq.read_table(io.BytesIO(kept.get(key))).to_pylist()
    return cell_records if all(holds_read(cell_records, read) for read in reads) else None


def missing_reads(cell: Cell) -> tuple[Read, ...]:
    """The reads a cell must measure: those its kept records lack (all when none are kept)."""
    if not cell.kept_records:
        return cell.reads
    return tuple(r for r in cell.reads if not holds_read(cell.kept_records, r))


def kept_or_none(kept: LocalStore, cell: Cell) -> list[dict] | None:
    """A cell's kept records; one that generates no answers may also read the records of the
    same cell kept with answers."""
    found = kept_cell(kept, cell.key, cell.reads)
    if found is None and not cell.answered:
        prefix = cell.base_key.removesuffix(".parquet") + "-answers"
        for key in kept.list(prefix):
            found = kept_cell(kept, key, cell.reads)
            if found is not None:
                break
    return found


@dataclass
class Outcome:
    """What a run of the cells gave: every question's record, the failed cells, the cells
    reused from an earlier run, and each conversation as prepared."""
    records: list[dict]
    failed: list[dict]
    reused: int
    prepared: list[Prepared]


def profiles_of(config: EvalConfig, methods: list[str], out: Path,
                in_process: bool = False) -> dict[str, list[float]]:
    """The measured profile of every allocator the methods' layer budgets come from (one per
    allocator, kept under `out/profiles`)."""
    profiles = {}
    for m in methods:
        kind = config.allocator_of(m)
        if config.needs_profile(m) and kind not in profiles:
            where = str(out / "profiles")
            profiles[kind] = profile(where, config, m) if in_process else \
                ray_tasks().get(ray_tasks().profile.remote(where, config, m))
    return profiles


def layer_budgets_of(config: EvalConfig, method: str, budget: int | None,
                     profiles: dict[str, list[float]]) -> list[int] | None:
    """A cell's layer budgets when its method allocates them from a measured profile (None:
    the same budget in every layer)."""
    if budget is None or not config.needs_profile(method):
        return None
    build = config.build_config(method, budget)
    return allocator(build).allocate(profiles[config.allocator_of(method)], build.entry_budget)


class CellPlan:
    """The cells a run needs, each once (methods sharing a cell join it), those finished under
    `out` by an earlier run read back instead."""

    def __init__(self, config: EvalConfig, out: Path, profiles: dict[str, list[float]]):
        self.config, self.out, self.profiles = config, out, profiles
        self.kept = LocalStore(out)  # finished cells (atomic writes: a cell is whole or absent)
        self.todo: dict[tuple[str, int | None], Cell] = {}  # (key, label) -> cell

    def add(self, conv: Conversation, digest: str, prep, method: str, budget: int | None,
            label: int | None = None, reads: tuple[Read, ...] = ()) -> Cell:
        allocated = layer_budgets_of(self.config, method, budget, self.profiles)
        key = cell_key(conv, digest, method, budget, self.config, allocated)  # its base key
        cell = self.todo.setdefault((key, label), Cell(conv.conversation_id, budget, key, [],
                                                       prep, allocated, label=label))
        cell.add(method, self.config, reads)
        return cell

    def add_sized(self, conv: Conversation, digest: str, prep, method: str, budget: int,
                  read: Read) -> Cell:
        """A row of no history (`rag`) reported at `budget`, reading `read`: one more read of
        the conversation's no-history cell (computed again only for the reads it lacks)."""
        key = cell_key(conv, digest, NO_HISTORY, None, self.config, None)
        cell = self.todo.setdefault((key, None), Cell(conv.conversation_id, None, key, [], prep,
                                                      computed_by=NO_HISTORY))
        cell.add_sized(method, budget, read)
        return cell

    def run(self, in_process: bool) -> tuple[list[dict], list[dict], int]:
        """Every cell's records (kept ones read back), the failed cells, and how many were
        reused."""
        records, compute, reused = [], [], 0
        for cell in self.todo.values():
            kept_records = kept_or_none(self.kept, cell)
            if kept_records is None:
                if not cell.answered and self.kept.exists(cell.key):  # it lacks some reads
                    cell.kept_records = kept_cell(self.kept, cell.key)
                compute.append(cell)
            else:
                records.extend(records_of(kept_records, cell, self.config))
                reused += 1
        if reused:
            print(f"reusing {reused} finished cells from {self.out}/cells", file=sys.stderr)
        if in_process:
            computed, failed = compute_in_process(compute, self.kept, self.config)
        else:
            pending = {ray_tasks().cell.remote(c.prep, c.method, c.budget, self.config,
                                               c.layer_budgets, missing_reads(c), c.answered): c
                       for c in compute}
            computed, failed = collect_cells(pending, self.kept, self.config)
        return records + computed, failed, reused

    def cell_records(self, cell: Cell) -> list[dict]:
        """A finished cell's records as kept (every read's fields)."""
        return kept_or_none(self.kept, cell) or []


def sized_retrieval(read: Read, tokens: int) -> Read:
    """Retrieval's read at `tokens` top-up tokens: the question's nearest turns, as many as fit
    (no cap on their number)."""
    return Read(read.route, replace(read.topup, turns=None, max_tokens=max(1, tokens)))


def run_cells(convs: list[Conversation], methods: list[str], budgets: list[int],
              config: EvalConfig, out: Path, in_process: bool = False,
              equal_entries: str | None = None) -> Outcome:
    """Every cell of every conversation (the two references, then each method at each
    budget), as Ray tasks or, `in_process`, one after another here, reusing the cells
    finished under `out` by an earlier run.

    With `equal_entries` (a method), every other method with a budget (but its variants that
    share its caches, which read what they read from the same cells, and, when it is built per
    episode, the other methods built per episode: they hold the same budget per episode and
    read what their routes join, so they are compared at its budget) runs at that method's
    decode-time entries: for each conversation and budget B, its cache budget is the mean
    decode-time entries (cache entries + top-up tokens) of `equal_entries` at B, less its own
    mean top-up tokens (its top-up takes nothing from its cache, so these are known from the
    no-history cell); its records are reported at B (`cache_budget`: the cache's). A row of
    retrieval alone (`rag`: no history, a top-up) is also read at those entries: its top-up
    the question's nearest turns, as many as fit the mean entries less the no-history prompt's,
    reported at B beside its own row (at its own top-up, reported without a budget)."""
    profiles = profiles_of(config, methods, out, in_process)
    episodic_default = bool(equal_entries) and parse_method(equal_entries).episodic
    matched = [m for m in methods if equal_entries and takes_budget(m)
               and not shares_build(config, m, equal_entries)
               and not (episodic_default and parse_method(m).episodic)]
    retrieval = [m for m in methods if equal_entries and not parse_method(m).history
                 and config.topup_of(m) is not None]
    topped = tuple(dict.fromkeys(config.read_of(m) for m in matched
                                 if config.topup_of(m) is not None))
    plan = CellPlan(config, out, profiles)
    preps, references = [], {}
    for conv in convs:
        prep = prepare(conv, config) if in_process else ray_tasks().prepare.remote(conv, config)
        preps.append(prep)
        digest = conversation_digest(conv)  # hashes the whole conversation: once, not per cell
        references[conv.conversation_id] = (
            plan.add(conv, digest, prep, NO_HISTORY, None, reads=topped), digest, prep)
        plan.add(conv, digest, prep, "full", None)
        for m in methods:
            if m == "full" or m in matched:
                continue
            for b in (budgets if takes_budget(m) else [None]):
                plan.add(conv, digest, prep, m, b)
    records, failed, reused = plan.run(in_process)
    if matched or retrieval:
        second = CellPlan(config, out, profiles)
        for conv in convs:
            none_cell, digest, prep = references[conv.conversation_id]
            none_records = plan.cell_records(none_cell)
            for b in budgets:
                target = nan_mean(r["decode_entries"] for r in records if
                                  r["method"] == equal_entries and r["budget"] == b and
                                  r["conversation_id"] == conv.conversation_id)
                for m in matched:
                    read = config.read_of(m)
                    topup = 0.0 if read.topup is None else nan_mean(
                        r[f"{read.prefix}topup_tokens"] for r in none_records)
                    cache_budget = b if math.isnan(target) else max(1, round(target - topup))
                    second.add(conv, digest, prep, m, cache_budget, label=b)
                prompt = nan_mean(r["kept_entries"] for r in none_records)
                if math.isnan(target) or math.isnan(prompt):
                    continue
                for m in retrieval:
                    second.add_sized(conv, digest, prep, m, b, sized_retrieval(
                        config.read_of(m), round(target - prompt)))
        more, failed_too, reused_too = second.run(in_process)
        records, failed, reused = records + more, failed + failed_too, reused + reused_too
    return Outcome(records, failed, reused, preps if in_process else ray_tasks().get(preps))
