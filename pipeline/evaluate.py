"""Evaluation of cache-building methods: one *cell* = (conversation, method, budget).

A cell builds the caches its method needs in the block-prefill setting (one per conversation;
one per episode for EpiCache, routed per question; one per question for the `question` upper
bound), then measures every question with `pipeline.metrics`. The two references, the full
cache (`full`) and no history (`none`), are cells of their own, computed once per
conversation; retention is derived from them when the records are gathered.

A method may carry variants: `<method>+<variant>+...` (or `<method>-<variant>` for one), e.g.
`epicache-tri`, `epicache+tri+dapq`. Variants: `tri` (ARKV tri-state; the cell's budget M
reads as the bytes of M Original entries per layer and KV head), `fp8` (tri-state with fp8
codes), `max` (tri-state ranked by the scorer's max attention instead of the heavy-hitter
score), `oq<P>` (tri-state with the OQ ratio scaled by P/100, e.g. `oq25`: a quarter of the
paper's share of bytes for Original entries), `dapq` (patch queries at the decode positions),
`merge` (D2O merging of evicted entries), `d2o` (D2O variance-based layer budgets instead of
the method's own).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from pipeline import models, prompts
from pipeline.cache import EpisodicCache
from pipeline.calibrate import CalibrationConfig
from pipeline.config import BuildConfig
from pipeline.corpus import Conversation, Question, cut_at_session, render_conversation, render_header
from pipeline.episodes import EpisodeConfig, build_episodes, route
from pipeline.metrics import (ADVERSARIAL_CATEGORY, continuation_nll, evidence_probe, f1_score,
                              question_text, retention)
from pipeline.answer import generate_from_cache
from pipeline.compress import EntryBytes, MergeConfig, TriStateConfig
from pipeline.prefill import PrefillConfig, block_prefill, entry_bytes
from pipeline.scorers import FullScorer, build_scorer

METHODS = ("full", "streamingllm", "snapkv", "infinipot", "kvzip", "keydiff", "epicache", "question")
EXTRA_METHODS = ("random",)  # known, not run by default: a floor for diagnosing the others
ALLOCATED = ("epicache", "question")  # methods that use the sensitivity-aware layer budgets
VARIANTS = ("tri", "fp8", "max", "dapq", "merge", "d2o")
ORIGINAL_ELEMENT_SIZE = 2  # Original entries counted as stored by default (float16)


def parse_method(name: str) -> tuple[str, frozenset[str]]:
    """(base method, variants) of `epicache+tri+dapq` or `epicache-tri`; ValueError if unknown."""
    parts = name.split("+")
    base, variants = parts[0], parts[1:]
    known = METHODS + EXTRA_METHODS + ("none",)
    if base not in known and "-" in base:
        base, variant = base.rsplit("-", 1)
        variants.insert(0, variant)
    unknown = [v for v in variants if v not in VARIANTS and _oq_scale(v) is None]
    if base not in known or unknown or (variants and base == "full"):
        raise ValueError(f"unknown method {name!r} (methods: "
                         f"{', '.join(METHODS + EXTRA_METHODS)}; variants: {', '.join(VARIANTS)})")
    return base, frozenset(variants)


def _oq_scale(variant: str) -> float | None:
    """`oq25` -> 0.25 (the OQ-ratio scale variant), else None."""
    digits = variant.removeprefix("oq")
    return int(digits) / 100 if variant.startswith("oq") and digits.isdigit() else None


def allocator_of(method: str) -> str | None:
    """The layer-budget allocator a method uses (None: uniform budgets)."""
    base, variants = parse_method(method)
    if "d2o" in variants:
        return "variance"
    return "sensitivity" if base in ALLOCATED else None


@dataclass(frozen=True)
class EvalConfig:
    model: str = models.DEFAULT_LLM
    encoder: str = models.DEFAULT_ENCODER
    block: int = 512
    selection: str = "headwise"
    alpha: float = 1.0
    episodes: EpisodeConfig = field(default_factory=EpisodeConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    max_context_tokens: int | None = None
    questions_per_conversation: int | None = None
    max_new_tokens: int = 32
    recall_words: int = 4
    recall_tokens: int = 32
    tristate: TriStateConfig = field(default_factory=lambda: TriStateConfig(enabled=True))
    merge: MergeConfig = field(default_factory=lambda: MergeConfig(enabled=True))
    variance_temperature: float = 1.0

    def prefill_config(self, method: str) -> PrefillConfig:
        """The block-prefill configuration of a method and its variants."""
        _, v = parse_method(method)
        scales = [_oq_scale(x) for x in v if _oq_scale(x) is not None]
        tri = bool(v & {"tri", "fp8", "max"}) or bool(scales)
        tristate = TriStateConfig(**(asdict(self.tristate) | {
            "enabled": True, "fp8": self.tristate.fp8 or "fp8" in v,
            "original_scale": scales[0] if scales else self.tristate.original_scale,
            "heavy_hitter": self.tristate.heavy_hitter and "max" not in v})) if tri else TriStateConfig()
        return PrefillConfig(block=self.block, selection=self.selection,
                             decode_positions="dapq" in v, tristate=tristate,
                             merge=self.merge if "merge" in v else MergeConfig())

    def build_config(self, method: str, budget: int | None) -> BuildConfig:
        """The build configuration of a cell (it decides the layer budgets)."""
        allocator = allocator_of(method)
        return BuildConfig(model=self.model, encoder=self.encoder, scorer="epicache",
                           budget=budget, alpha=self.alpha if allocator == "sensitivity" else 0.0,
                           allocator=allocator or "sensitivity",
                           variance_temperature=self.variance_temperature,
                           episodes=self.episodes, calibration=self.calibration,
                           prefill=self.prefill_config(method))

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Prepared:
    """A conversation ready to evaluate: cut to fit, its questions chosen."""
    conversation: Conversation
    questions: tuple[Question, ...]
    dropped_by_cut: int
    tokens: int


def prepare(conv: Conversation, config: EvalConfig) -> Prepared:
    tokenizer = models.load_tokenizer(config.model)
    count = lambda text: len(prompts.context_ids(tokenizer, text))  # noqa: E731
    cut = conv if config.max_context_tokens is None else \
        cut_at_session(conv, config.max_context_tokens, count)
    questions = [q for q in cut.questions if q.category != ADVERSARIAL_CATEGORY and q.evidence]
    if config.questions_per_conversation is not None:
        questions = questions[:config.questions_per_conversation]
    dropped = cut.meta.get("cut", {}).get("questions_dropped", 0)
    return Prepared(cut, tuple(questions), dropped, count(render_conversation(cut).text))


def measure(lm: models.LoadedModel, conv: Conversation, q: Question, cache: EpisodicCache,
            config: EvalConfig, generate: bool = True) -> dict:
    """Evidence-recall NLL (mean over the evidence turns), answer NLL, generated answer, F1."""
    turns = {t.turn_id: t for t in conv.turns}
    recall = []
    for turn_id in q.evidence:
        prefix, rest = evidence_probe(turns[turn_id], config.recall_words)
        target = prompts.encode(lm.tokenizer, rest)[:config.recall_tokens]
        if target.numel():
            recall.append(continuation_nll(lm.model, cache, prompts.encode(lm.tokenizer, prefix),
                                           target))
    question = prompts.question_ids(lm.tokenizer, question_text(q))
    answer = prompts.encode(lm.tokenizer, q.answer)
    record = {"evidence_nll": float(np.mean(recall)) if recall else float("nan"),
              "answer_nll": continuation_nll(lm.model, cache, question, answer)
              if answer.numel() else float("nan")}
    if generate:
        ids = generate_from_cache(lm, cache, question, config.max_new_tokens)
        record["prediction"] = lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
        record["f1"] = f1_score(record["prediction"], q.answer)
    return record


def evaluate_cell(prep: Prepared, method: str, budget: int | None, config: EvalConfig,
                  layer_budgets: list[int] | None) -> list[dict]:
    """Per-question records of one (conversation, method, budget) cell. `method` may also be
    "none": the no-history reference. `layer_budgets` None means `budget` in every layer."""
    lm = models.load_llm(config.model)
    if layer_budgets is None and budget is not None:
        layer_budgets = [budget] * lm.config.num_hidden_layers
    conv = prep.conversation
    start = time.perf_counter()
    build_seconds = 0.0
    base, _ = parse_method(method)
    prefill = config.prefill_config(method)
    sizes = entry_bytes(lm.model, ORIGINAL_ELEMENT_SIZE)
    merged: dict[int, int] = {}

    def build(ids, patch: str | None) -> EpisodicCache:
        nonlocal build_seconds
        if base in ("full", "none"):
            scorer, budgets = FullScorer(), None
        else:
            scorer = build_scorer(base, lambda text: prompts.patch_ids(lm.tokenizer, text), patch)
            budgets = layer_budgets
        cache, stats = block_prefill(lm.model, ids, scorer, budgets, prefill,
                                     original_element_size=ORIGINAL_ELEMENT_SIZE)
        build_seconds += stats.seconds
        merged[id(cache)] = stats.merged_entries
        return cache

    routes: list[tuple[int, float]] = [(0, float("nan"))] * len(prep.questions)
    ids = prompts.context_ids(lm.tokenizer, render_conversation(conv).text)
    if base == "none":  # the same template opening and header, no turns
        caches = [build(prompts.context_ids(lm.tokenizer, render_header(conv)), None)]
    elif base == "epicache":
        encoder = models.load_encoder(config.encoder)
        episodes = build_episodes(conv, encoder, config.episodes).episodes
        caches = [build(ids, ep.patch_text) for ep in episodes]
        embeddings = encoder.encode([q.question for q in prep.questions],
                                    normalize_embeddings=True, show_progress_bar=False)
        routes = [route(e, np.stack([ep.centroid for ep in episodes])) for e in embeddings]
    elif base != "question":  # one cache per conversation
        caches = [build(ids, None)]
    records = []
    for i, q in enumerate(prep.questions):
        episode, similarity = routes[i]
        # `question` is an upper bound: one build per question, with the question as the patch
        cache = build(ids, question_text(q)) if base == "question" else caches[episode]
        records.append({
            "conversation_id": conv.conversation_id, "method": method,
            "budget": budget if method not in ("full", "none") else None,
            "question_index": i, "question": q.question, "answer": q.answer,
            "category": q.category, "evidence": list(q.evidence), "episode": episode,
            "route_similarity": similarity,
            "kept_entries": float(np.mean(cache.entries_per_layer())),
            **cache_footprint(cache, sizes, merged.get(id(cache), 0)),
            **measure(lm, conv, q, cache, config)})
    elapsed = time.perf_counter() - start
    for r in records:
        r["cell_seconds"], r["build_seconds"] = elapsed, build_seconds
    return records


def cache_footprint(cache: EpisodicCache, sizes: EntryBytes, merged: int = 0) -> dict:
    """Entries per state and bytes of a cache; `bytes_tokens` is its bytes in Original
    entries per layer and KV head (comparable with the budget M of a tri-state cell)."""
    original, quantized = cache.state_counts()
    kv_bytes = original * sizes.original + quantized * sizes.quantized
    first = cache.layers[0]
    per_token = len(cache.layers) * (first.valid.shape[0] if first.valid is not None else 1) * sizes.original
    return {"original_entries": original, "quantized_entries": quantized, "merged_entries": merged,
            "kv_bytes": kv_bytes, "bytes_tokens": kv_bytes / per_token,
            "quantized_share": quantized / max(original + quantized, 1)}


def with_retention(records: list[dict]) -> list[dict]:
    """Add per-question retention, from the `full` and `none` records of the same question."""
    refs = {(r["conversation_id"], r["question_index"], r["method"]): r for r in records
            if r["method"] in ("full", "none")}
    out = []
    for r in records:
        full = refs.get((r["conversation_id"], r["question_index"], "full"))
        none = refs.get((r["conversation_id"], r["question_index"], "none"))
        value = float("nan")
        if full is not None and none is not None:
            value = retention(none["evidence_nll"], r["evidence_nll"], full["evidence_nll"])
        out.append(r | {"retention": value})
    return out


def _mean(values) -> float:
    values = [v for v in values if v is not None and not np.isnan(v)]
    return float(np.mean(values)) if values else float("nan")


def summarise(records: list[dict]) -> list[dict]:
    """One row per (method, budget): mean retention (per question, and of the mean NLLs),
    evidence NLL, answer NLL, F1 overall and per category."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["method"], r["budget"]), []).append(r)
    ref = {m: _mean(r["evidence_nll"] for r in records if r["method"] == m) for m in ("full", "none")}
    gap = ref["none"] - ref["full"]
    rows = []
    for (method, budget), g in groups.items():
        row = {"method": method, "budget": budget, "questions": len(g),
               "retention": _mean(r["retention"] for r in g),
               "evidence_nll": _mean(r["evidence_nll"] for r in g),
               "answer_nll": _mean(r["answer_nll"] for r in g),
               "f1": _mean(r["f1"] for r in g), "kept_entries": _mean(r["kept_entries"] for r in g),
               "kv_bytes": _mean(r.get("kv_bytes") for r in g),
               "bytes_tokens": _mean(r.get("bytes_tokens") for r in g),
               "quantized_share": _mean(r.get("quantized_share") for r in g),
               "merged_entries": _mean(r.get("merged_entries") for r in g)}
        row["retention_of_means"] = (ref["none"] - row["evidence_nll"]) / gap if gap > 0 else float("nan")
        for cat in sorted({r["category"] for r in g if r["category"] is not None}):
            row[f"f1_cat{cat}"] = _mean(r["f1"] for r in g if r["category"] == cat)
        rows.append(row)
    return rows
