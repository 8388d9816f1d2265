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
the method's own), `compact` (compact positions: kept entries re-rotated to 0, 1, 2, ...).
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from pipeline import models, prompts
from pipeline.cache import EpisodicCache
from pipeline.calibrate import CalibrationConfig
from pipeline.config import BuildConfig
from pipeline.corpus import Conversation, Question, cut_at_session, render_conversation, render_header
from pipeline.episodes import EpisodeConfig, build_episodes, member_turn_ids, route
from pipeline.layout import TokenLayout, kept_share, token_layout
from pipeline.metrics import (ADVERSARIAL_CATEGORY, continuation_nlls, evidence_probe, f1_score,
                              question_text, retention)
from pipeline.answer import generate_from_cache
from pipeline.compress import EntryBytes, MergeConfig, TriStateConfig
from pipeline.positions import check_fits
from pipeline.prefill import PrefillConfig, block_prefill, entry_bytes
from pipeline.scorers import FullScorer, ScoringConfig, build_scorer, episodic_scorer

METHODS = ("full", "streamingllm", "snapkv", "infinipot", "kvzip", "keydiff", "epicache", "question")
# Known, not run by default: `epicache-paper` (the paper's recipe, for an honest comparison with
# the default), `keydiff-block` (KeyDiff anchored on the block's mean key only) and two floors
# for diagnosing the others, `random` and `oldest` (keep the first tokens).
EXTRA_METHODS = ("epicache-paper", "keydiff-block", "random", "oldest")
EPISODIC = ("epicache", "epicache-paper")  # one cache per episode, routed per question
ALLOCATED = EPISODIC + ("question",)  # methods that use the sensitivity-aware layer budgets
VARIANTS = ("tri", "fp8", "max", "dapq", "merge", "d2o", "compact",
            # EpiCache diagnosis knobs (docs/quality.md): one factor at a time
            "pastonly", "withpatch", "qmean", "qmax", "utt", "tok", "perhead", "headwise")
# Variants with a number: `oq25`, `alpha0.5`, `pool7`, `focus100` (weight 1.0), `sink16`,
# `recent64`, `cap256` (patch tokens), `floor20` (head floor 20% of the budget), `med2`
# (medoid windows), `ep8` (episodes).
NUMBERED_VARIANTS = ("oq<P>", "alpha<x>", "pool<k>", "focus<P>", "sink<n>", "recent<n>", "cap<n>",
                     "floor<P>", "med<n>", "ep<n>")
_NUMBERED = re.compile(rf"^({'|'.join(v.split('<')[0] for v in NUMBERED_VARIANTS)})"
                       r"(\d+(?:\.\d+)?)$")
ORIGINAL_ELEMENT_SIZE = 2  # Original entries counted as stored by default (float16)


def _numbered(variant: str) -> tuple[str, float] | None:
    match = _NUMBERED.match(variant)
    return (match.group(1), float(match.group(2))) if match else None


def parse_method(name: str) -> tuple[str, frozenset[str]]:
    """(base method, variants) of `epicache+tri+dapq` or `epicache-tri`; ValueError if unknown."""
    parts = name.split("+")
    base, variants = parts[0], parts[1:]
    known = METHODS + EXTRA_METHODS + ("none",)
    if base not in known and "-" in base:
        base, variant = base.rsplit("-", 1)
        variants.insert(0, variant)
    unknown = [v for v in variants if v not in VARIANTS and _numbered(v) is None]
    if base not in known or unknown or (variants and base == "full"):
        raise ValueError(f"unknown method {name!r} ({describe_methods()})")
    return base, frozenset(variants)


def describe_methods() -> str:
    """The methods and variants `parse_method` accepts, as its error and `--methods` name them."""
    return (f"methods: {', '.join(METHODS + EXTRA_METHODS)}; variants: {', '.join(VARIANTS)}, "
            f"or numbered: {' '.join(NUMBERED_VARIANTS)}")


def _oq_scale(variant: str) -> float | None:
    """`oq25` -> 0.25 (the OQ-ratio scale variant), else None."""
    n = _numbered(variant)
    return n[1] / 100 if n is not None and n[0] == "oq" else None


def allocator_of(method: str) -> str | None:
    """The layer-budget allocator a method uses (None: uniform budgets)."""
    base, variants = parse_method(method)
    if "d2o" in variants:
        return "variance"
    return "sensitivity" if base in ALLOCATED else None


@dataclass(frozen=True)
class Recipe:
    """Everything that decides an EpiCache cell's caches, after the method's variants."""
    scoring: ScoringConfig
    alpha: float
    selection: str
    head_floor: float
    episodes: EpisodeConfig


@dataclass(frozen=True)
class EvalConfig:
    model: str = models.DEFAULT_LLM
    encoder: str = models.DEFAULT_ENCODER
    block: int = 512
    selection: str = "headwise"
    head_floor: float = 0.0
    alpha: float = BuildConfig.alpha
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    episodes: EpisodeConfig = field(default_factory=EpisodeConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    max_context_tokens: int | None = None
    questions_per_conversation: int | None = None
    generate: bool = False  # generate answers for F1 (slow; at the floor for a 135M model)
    max_new_tokens: int = 32
    recall_words: int = 4
    recall_tokens: int = 32
    tristate: TriStateConfig = field(default_factory=lambda: TriStateConfig(enabled=True))
    merge: MergeConfig = field(default_factory=lambda: MergeConfig(enabled=True))
    variance_temperature: float = 1.0

    def recipe(self, method: str) -> Recipe:
        """The scoring, layer allocation, selection and episodes of a method and its variants.
        `epicache` starts from this configuration; `epicache-paper` from the paper's recipe
        (alpha 1, head-wise, max attention token by token, 4 episodes of 4 medoid windows)."""
        base, v = parse_method(method)
        if base == "epicache-paper":
            scoring, alpha, selection, floor = ScoringConfig.paper(), 1.0, "headwise", 0.0
            episodes = EpisodeConfig(window=self.episodes.window, seed=self.episodes.seed)
        else:
            scoring, alpha, selection, floor = self.scoring, self.alpha, self.selection, self.head_floor
            episodes = self.episodes
        flags = {"pastonly": ("include_patch", False), "withpatch": ("include_patch", True),
                 "qmean": ("reduce", "mean"), "qmax": ("reduce", "max"),
                 "utt": ("utterance", True), "tok": ("utterance", False)}
        changes = dict(flags[x] for x in v if x in flags)
        numbers = dict(n for n in map(_numbered, sorted(v)) if n is not None)
        changes |= {key: int(numbers[key]) for key in ("pool", "sink", "recent") if key in numbers}
        if "focus" in numbers:
            changes["focus"] = numbers["focus"] / 100
        if "cap" in numbers:
            changes["patch_tokens"] = int(numbers["cap"]) or None
        scoring = replace(scoring, **changes)
        alpha = numbers.get("alpha", alpha)
        selection = "perhead" if "perhead" in v else "headwise" if "headwise" in v else selection
        floor = numbers["floor"] / 100 if "floor" in numbers else floor
        ep_changes = {field_: int(numbers[key]) for key, field_ in
                      (("med", "medoids"), ("ep", "episodes")) if key in numbers}
        return Recipe(scoring, alpha, selection, floor, replace(episodes, **ep_changes))

    def prefill_config(self, method: str) -> PrefillConfig:
        """The block-prefill configuration of a method and its variants."""
        _, v = parse_method(method)
        recipe = self.recipe(method)
        scales = [_oq_scale(x) for x in v if _oq_scale(x) is not None]
        tri = bool(v & {"tri", "fp8", "max"}) or bool(scales)
        tristate = TriStateConfig(**(asdict(self.tristate) | {
            "enabled": True, "fp8": self.tristate.fp8 or "fp8" in v,
            "original_scale": scales[0] if scales else self.tristate.original_scale,
            "heavy_hitter": self.tristate.heavy_hitter and "max" not in v})) if tri else TriStateConfig()
        return PrefillConfig(block=self.block, selection=recipe.selection,
                             head_floor=recipe.head_floor,
                             decode_positions="dapq" in v, tristate=tristate,
                             merge=self.merge if "merge" in v else MergeConfig(),
                             positions="compact" if "compact" in v else "original")

    def build_config(self, method: str, budget: int | None) -> BuildConfig:
        """The build configuration of a cell (it decides the layer budgets)."""
        allocator = allocator_of(method)
        recipe = self.recipe(method)
        base, _ = parse_method(method)
        scorer = "epicache" if base in EPISODIC else "full" if base == "none" else base
        return BuildConfig(model=self.model, encoder=self.encoder, scorer=scorer,
                           budget=budget, alpha=recipe.alpha if allocator == "sensitivity" else 0.0,
                           allocator=allocator or "sensitivity",
                           variance_temperature=self.variance_temperature,
                           episodes=recipe.episodes, calibration=self.calibration,
                           scoring=recipe.scoring, prefill=self.prefill_config(method))

    def needs_profile(self, method: str) -> bool:
        """Whether a method's layer budgets come from a measured profile (not uniform)."""
        allocator = allocator_of(method)
        return allocator == "variance" or (allocator == "sensitivity" and self.recipe(method).alpha > 0)

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


def history_ids(tokenizer, conv: Conversation, turns: bool = True) -> torch.Tensor:
    """The model's input for a cache of the conversation; without `turns`, the no-history
    reference: the same template opening and header, so only the turns differ."""
    text = render_conversation(conv).text if turns else render_header(conv)
    return prompts.context_ids(tokenizer, text)


def probe_pairs(lm: models.LoadedModel, conv: Conversation, q: Question,
                config: EvalConfig) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """(prefix, target) pairs of a question: one evidence-recall probe per evidence turn with
    text, then the question and its gold answer (if any). Returns the pairs and how many of
    them are evidence probes."""
    turns = {t.turn_id: t for t in conv.turns}
    pairs = []
    for turn_id in q.evidence:
        prefix, rest = evidence_probe(turns[turn_id], config.recall_words)
        target = prompts.encode(lm.tokenizer, rest)[:config.recall_tokens]
        if target.numel():
            pairs.append((prompts.encode(lm.tokenizer, prefix), target))
    n_recall = len(pairs)
    answer = prompts.encode(lm.tokenizer, q.answer)
    if answer.numel():
        pairs.append((prompts.question_ids(lm.tokenizer, question_text(q)), answer))
    return pairs, n_recall


def measure_all(lm: models.LoadedModel, conv: Conversation, questions: list[Question],
                cache: EpisodicCache, config: EvalConfig) -> list[dict]:
    """Per question: evidence-recall NLL (mean over the evidence turns) and answer NLL, every
    probe of every question in packed forwards over `cache`; with `config.generate`, also the
    generated answer and its F1."""
    probes = [probe_pairs(lm, conv, q, config) for q in questions]
    nlls = iter(continuation_nlls(lm.model, cache, [p for pairs, _ in probes for p in pairs]))
    records = []
    for q, (pairs, n_recall) in zip(questions, probes):
        values = [next(nlls) for _ in pairs]
        recall, answer = values[:n_recall], values[n_recall:]
        record = {"evidence_nll": float(np.mean(recall)) if recall else float("nan"),
                  "answer_nll": answer[0] if answer else float("nan")}
        if config.generate:
            ids = generate_from_cache(lm, cache, prompts.question_ids(lm.tokenizer, question_text(q)),
                                      config.max_new_tokens)
            record["prediction"] = lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
            record["f1"] = f1_score(record["prediction"], q.answer)
        records.append(record)
    return records


def evidence_diagnostics(conv: Conversation, q: Question, layout: TokenLayout,
                         cache: EpisodicCache) -> dict:
    """Where a question's evidence sits (session, relative token position) and how much of it
    the cache it reads still holds (`evidence_kept`, over layers and KV heads)."""
    turns = {t.turn_id: t for t in conv.turns}
    spans = [layout.span_of(t) for t in q.evidence]
    return {"evidence_session": min(turns[t].session for t in q.evidence),
            "evidence_position": float(np.mean([s / layout.n_tokens for s, _ in spans])),
            "evidence_kept": _mean(kept_share(cache, s, e) for s, e in spans)}


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
    recipe = config.recipe(method)
    prefill = config.prefill_config(method)
    if prefill.positions == "original" and base != "none":
        check_fits(conv.conversation_id, prep.tokens, lm.config.max_position_embeddings)
    sizes = entry_bytes(lm.model, ORIGINAL_ELEMENT_SIZE)
    layout = token_layout(lm.tokenizer, conv)
    merged: dict[int, int] = {}
    encode = lambda text: prompts.patch_ids(lm.tokenizer, text)  # noqa: E731

    def build(ids, scorer) -> EpisodicCache:
        nonlocal build_seconds
        budgets = None if base in ("full", "none") else layer_budgets
        cache, stats = block_prefill(lm.model, ids, scorer, budgets, prefill,
                                     original_element_size=ORIGINAL_ELEMENT_SIZE)
        build_seconds += stats.seconds
        merged[id(cache)] = stats.merged_entries
        return cache

    questions = list(prep.questions)
    routes: list[tuple[int, float]] = [(0, float("nan"))] * len(questions)
    members: list[set[str]] | None = None
    ids = history_ids(lm.tokenizer, conv)
    if base == "none":
        caches = [build(history_ids(lm.tokenizer, conv, turns=False), FullScorer())]
    elif base in EPISODIC:
        encoder = models.load_encoder(config.encoder)
        episodes = build_episodes(conv, encoder, recipe.episodes).episodes
        embeddings = encoder.encode([q.question for q in questions],
                                    normalize_embeddings=True, show_progress_bar=False)
        routes = [route(e, np.stack([ep.centroid for ep in episodes])) for e in embeddings]
        members = [set(member_turn_ids(conv, ep, recipe.episodes.window)) for ep in episodes]
        routed = {episode for episode, _ in routes}
        caches = [build(ids, episodic_scorer(encode(ep.patch_text), recipe.scoring, layout.line_ids,
                                             layout.turn_mask(members[ep.index])))
                  if ep.index in routed else None for ep in episodes]  # unread caches: not built
    elif base == "full":
        caches = [build(ids, FullScorer())]
    elif base != "question":  # one cache per conversation
        caches = [build(ids, build_scorer(base, encode))]
    if base == "question":  # an upper bound: one build per question, the question as the patch
        readers = [(build(ids, build_scorer(base, encode, question_text(q))), [i])
                   for i, q in enumerate(questions)]
    else:
        readers = [(cache, [i for i, (episode, _) in enumerate(routes) if episode == k])
                   for k, cache in enumerate(caches) if cache is not None]
    measured: dict[int, tuple[dict, EpisodicCache]] = {}
    for cache, indices in readers:
        for i, record in zip(indices, measure_all(lm, conv, [questions[i] for i in indices],
                                                  cache, config)):
            measured[i] = (record, cache)
    records = []
    for i, q in enumerate(questions):
        episode, similarity = routes[i]
        record, cache = measured[i]
        records.append({
            "conversation_id": conv.conversation_id, "method": method,
            "budget": budget if method not in ("full", "none") else None,
            "question_index": i, "question": q.question, "answer": q.answer,
            "category": q.category, "evidence": list(q.evidence), "episode": episode,
            "route_similarity": similarity,
            "route_hit": bool(members[episode] & set(q.evidence)) if members is not None else None,
            "kept_entries": float(np.mean(cache.entries_per_layer())),
            **evidence_diagnostics(conv, q, layout, cache),
            **cache_footprint(cache, sizes, merged.get(id(cache), 0)), **record})
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


def _third(position: float | None) -> str | None:
    if position is None or np.isnan(position):
        return None
    return ("first", "middle", "last")[min(int(position * 3), 2)]


def summarise_by(records: list[dict], key: str) -> list[dict]:
    """Retention of the mean NLLs per (method, budget, group), the groups being the values of
    `key` ("route_hit", or "evidence_third": the evidence's relative position in thirds). The
    references are the full and no-history NLLs of the same questions."""
    def group_of(r):
        return _third(r.get("evidence_position")) if key == "evidence_third" else r.get(key)

    refs = {(r["conversation_id"], r["question_index"], r["method"]): r["evidence_nll"]
            for r in records if r["method"] in ("full", "none")}
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if group_of(r) is not None:
            groups.setdefault((r["method"], r["budget"], group_of(r)), []).append(r)
    out = []
    for (method, budget, group), g in groups.items():
        keys = [(r["conversation_id"], r["question_index"]) for r in g]
        full = _mean(refs.get(k + ("full",)) for k in keys)
        none = _mean(refs.get(k + ("none",)) for k in keys)
        out.append({"method": method, "budget": budget, "group": group, "questions": len(g),
                    "retention_of_means": retention(none, _mean(r["evidence_nll"] for r in g), full),
                    "evidence_kept": _mean(r.get("evidence_kept") for r in g)})
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
               "f1": _mean(r.get("f1") for r in g), "kept_entries": _mean(r["kept_entries"] for r in g),
               "kv_bytes": _mean(r.get("kv_bytes") for r in g),
               "bytes_tokens": _mean(r.get("bytes_tokens") for r in g),
               "quantized_share": _mean(r.get("quantized_share") for r in g),
               "merged_entries": _mean(r.get("merged_entries") for r in g),
               "evidence_kept": _mean(r.get("evidence_kept") for r in g),
               "route_hit": _mean(float(r["route_hit"]) for r in g if r.get("route_hit") is not None)}
        row["retention_of_means"] = (ref["none"] - row["evidence_nll"]) / gap if gap > 0 else float("nan")
        for cat in sorted({r["category"] for r in g if r["category"] is not None}):
            row[f"f1_cat{cat}"] = _mean(r.get("f1") for r in g if r["category"] == cat)
        rows.append(row)
    return rows
