"""One evaluation cell = (conversation, method, budget): build its caches, measure its questions.

A cell builds the caches its method needs through the product's build (`pipeline.builder`,
into an in-memory store: one cache per conversation; one per episode for EpiCache, routed per
question; one per question for the `question` upper bound), then measures every question with
`pipeline.eval.metrics`. The two references, the full
cache (`full`) and no history (`none`), are cells of their own, computed once per conversation;
retention is derived from them when the records are gathered (`pipeline.eval.summary`).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from pipeline.answer.decode import generate_from_cache
from pipeline.answer.topup import TopUp, held_turns, select_topup
from pipeline.builder.cluster import ClusterResult, cluster_conversation
from pipeline.builder.episode import build_episode_cache, store_dtype
from pipeline.builder.turns import index_turns
from pipeline.config import BuildConfig, TopUpConfig
from pipeline.corpus.render import cut_at_session, render_conversation, render_header
from pipeline.corpus.schema import Conversation, Question
from pipeline.eval.episode_reads import (Route, episodic_reads, question_embeddings, route_scores,
                                         select_route)
from pipeline.eval.methods import NO_HISTORY, EvalConfig, parse_method, topup_prefix
from pipeline.eval.metrics import (ADVERSARIAL_CATEGORY, continuation_nlls, evidence_probe,
                                   f1_score, question_text)
from pipeline.eval.summary import nan_mean
from pipeline.kv import models, prompts
from pipeline.kv.cache import EpisodicCache
from pipeline.kv.layout import TokenLayout, kept_share, token_layout
from pipeline.kv.methods.full import Full
from pipeline.kv.prefill import PrefillStats, block_prefill, entry_bytes
from pipeline.kv.tristate import EntryBytes
from pipeline.store.memory import MemoryStore


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


@contextlib.contextmanager
@torch.inference_mode()
def topped_up(lm: models.LoadedModel, cache: EpisodicCache, text: str) -> Iterator[EpisodicCache]:
    """`cache` with a question's top-up text prefilled after it (as the answer path's prompt
    holds it: `prompts.topup_ids`), dropped on exit."""
    ids = prompts.topup_ids(lm.tokenizer, text)
    with cache.scratch():
        if ids.numel():
            positions = torch.arange(cache.next_position, cache.next_position + ids.numel())
            device = next(lm.model.parameters()).device
            lm.model(input_ids=ids[None].to(device), past_key_values=cache, use_cache=True,
                     position_ids=positions[None].to(device))
        yield cache


def measure_all(lm: models.LoadedModel, conv: Conversation, questions: list[Question],
                cache: EpisodicCache, config: EvalConfig,
                topups: list[TopUp] | None = None) -> list[dict]:
    """Per question: evidence-recall NLL (mean over the evidence turns) and answer NLL, every
    probe of the questions without a top-up in packed forwards over `cache`, a question with
    one (`topups`) over the cache with its top-up prefilled (`topped_up`); with
    `config.generate`, also the generated answer and its F1."""
    topups = topups or [TopUp()] * len(questions)
    records: list[dict] = [{} for _ in questions]
    groups = [([i for i, t in enumerate(topups) if not t.text], "")]
    groups += [([i], t.text) for i, t in enumerate(topups) if t.text]
    for indices, text in groups:
        if not indices:
            continue
        with topped_up(lm, cache, text) as read:
            measured = _measured(lm, conv, [questions[i] for i in indices], read, config)
        for i, record in zip(indices, measured):
            q, t = questions[i], topups[i]
            records[i] = record | {"topup_tokens": t.tokens, "topup_recall": len(
                set(q.evidence) & set(t.turn_ids)) / max(len(q.evidence), 1)}
            if config.generate:
                ids = generate_from_cache(lm, cache, prompts.question_ids(
                    lm.tokenizer, question_text(q), t.text), config.max_new_tokens)
                prediction = lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
                records[i] |= {"prediction": prediction, "f1": f1_score(prediction, q.answer)}
    return records


def _measured(lm: models.LoadedModel, conv: Conversation, questions: list[Question],
              cache: EpisodicCache, config: EvalConfig) -> list[dict]:
    """The probes' NLLs of each question, packed over `cache`."""
    probes = [probe_pairs(lm, conv, q, config) for q in questions]
    nlls = iter(continuation_nlls(lm.model, cache, [p for pairs, _ in probes for p in pairs]))
    records = []
    for pairs, n_recall in probes:
        values = [next(nlls) for _ in pairs]
        recall, answer = values[:n_recall], values[n_recall:]
        records.append({"evidence_nll": float(np.mean(recall)) if recall else float("nan"),
                        "answer_nll": answer[0] if answer else float("nan")})
    return records


def evidence_diagnostics(conv: Conversation, q: Question, layout: TokenLayout,
                         cache: EpisodicCache) -> dict:
    """Where a question's evidence sits (session, relative token position) and how much of it
    the cache it reads still holds (`evidence_kept`, over layers and KV heads)."""
    turns = {t.turn_id: t for t in conv.turns}
    spans = [layout.span_of(t) for t in q.evidence]
    return {"evidence_session": min(turns[t].session for t in q.evidence),
            "evidence_position": float(np.mean([s / layout.n_tokens for s, _ in spans])),
            "evidence_kept": nan_mean(kept_share(cache, s, e) for s, e in spans)}


def evaluate_cell(prep: Prepared, method: str, budget: int | None, config: EvalConfig,
                  layer_budgets: list[int] | None,
                  topups: tuple[tuple[TopUpConfig, Route], ...] = ()) -> list[dict]:
    """Per-question records of one (conversation, method, budget) cell. `method` may also be
    "none": the no-history reference. `layer_budgets` None means `budget` in every layer.
    An episodic cell also measures its method's question-time top-up and each of `topups` (its
    variants'), each on the reads its routing picks (fields prefixed `topup_prefix(...)`).

    The caches are built as `jobs.build` builds them (`pipeline.builder`: the conversation
    fitted and clustered, each episode block-prefilled and stored, here in an in-memory store
    dropped with the cell), and measured as built. An episodic cell reads every episode for
    every question (`pipeline.eval.episode_reads`): its records carry each router's choice, and
    the method's own routing is selected."""
    own = config.topup_read(method)
    topups = tuple(dict.fromkeys(((own,) if own else ()) + tuple(topups)))
    lm = models.load_llm(config.model)
    if layer_budgets is None and budget is not None:
        layer_budgets = [budget] * lm.config.num_hidden_layers
    conv, questions = prep.conversation, list(prep.questions)
    start = time.perf_counter()
    build = config.build_config(method, budget)
    element_size = store_dtype(build)[1]  # Original entries counted as the build stores them
    sizes = entry_bytes(lm.model, element_size)
    layout = token_layout(lm.tokenizer, conv)
    merged: dict[int, int] = {}  # id(cache) -> entries merged (D2O) by its build
    seconds = []

    def built(cache: EpisodicCache, stats: PrefillStats) -> EpisodicCache:
        merged[id(cache)] = stats.merged_entries
        seconds.append(stats.seconds)
        return cache

    def measure(cache: EpisodicCache, indices: list[int],
                topups: list[TopUp] | None = None) -> list[dict]:
        chosen = [questions[i] for i in indices]
        footprint = cache_footprint(cache, sizes, merged.get(id(cache), 0))  # joined: 0
        return [{"kept_entries": float(np.mean(cache.entries_per_layer())),
                 **evidence_diagnostics(conv, q, layout, cache), **footprint, **record}
                for q, record in zip(chosen, measure_all(lm, conv, chosen, cache, config, topups))]

    if method == NO_HISTORY:  # the reference: the same prompt without the turns
        cache = built(*block_prefill(lm.model, history_ids(lm.tokenizer, conv, turns=False),
                                     Full(), None, build.prefill,
                                     original_element_size=element_size))
        measured = measure(cache, list(range(len(questions))))
    else:
        measured = _built_and_measured(conv, questions, method, build,
                                       None if build.budget is None else layer_budgets,
                                       config, built, measure, topups)
    elapsed = time.perf_counter() - start
    return [{"conversation_id": conv.conversation_id, "method": method,
             "budget": budget if build.budget is not None and method != NO_HISTORY else None,
             "question_index": i, "question": q.question, "answer": q.answer,
             "category": q.category, "evidence": list(q.evidence), "episode": 0,
             "route_similarity": float("nan"), "route_hit": None,
             **record, "cell_seconds": elapsed, "build_seconds": sum(seconds)}
            for i, (q, record) in enumerate(zip(questions, measured))]


def _built_and_measured(conv: Conversation, questions: list[Question], method: str,
                        build: BuildConfig, budgets: list[int] | None, config: EvalConfig,
                        built: Callable, measure: Callable,
                        topups: tuple[tuple[TopUpConfig, Route], ...] = ()) -> list[dict]:
    """Build a method's caches through the product's build into an in-memory store, and
    measure each question on the cache(s) it reads."""
    store = MemoryStore(f"eval-{uuid.uuid4().hex}")
    try:
        clustered = cluster_conversation(conv, build)

        def cache_of(episode: int, patch_text: str | None = None) -> EpisodicCache:
            done = build_episode_cache(clustered, episode, budgets, build, store, patch_text)
            store.delete(done.record.object_key)  # measured as built; nothing kept
            return built(done.cache, done.stats)

        if parse_method(method).episodic:
            caches = [cache_of(ep.index) for ep in clustered.episodes.episodes]
            encoder = models.load_encoder(config.encoder)
            embeddings = question_embeddings(encoder, questions)
            scores = route_scores(embeddings, clustered.episodes)
            plain: dict[tuple[tuple[int, ...], int], dict] = {}  # (read, question) -> record

            def measure_plain(cache: EpisodicCache, idx: list[int], read: tuple[int, ...]):
                measured = measure(cache, idx)
                plain.update({(read, i): r for i, r in zip(idx, measured)})
                return measured

            measures = {"": (measure_plain, None)}
            measures |= topup_measures(clustered, embeddings, encoder, config, topups, measure,
                                       plain)
            # route hits are judged on the episode's windows, whatever its cache focused on
            return [select_route(r, method, config) for r in episodic_reads(
                questions, list(clustered.members), caches, scores, measures)]
        if build.scorer == "question":  # an upper bound: one build per question
            return [measure(cache_of(0, question_text(q)), [i])[0]
                    for i, q in enumerate(questions)]
        return measure(cache_of(0), list(range(len(questions))))
    finally:
        store.drop()


def topup_measures(clustered: ClusterResult, embeddings: np.ndarray, encoder,
                   config: EvalConfig, topups: tuple[tuple[TopUpConfig, Route], ...],
                   measure: Callable, plain: dict[tuple[tuple[int, ...], int], dict]
                   ) -> dict[str, tuple[Callable, Route]]:
    """A read's measure with each question-time top-up, by field prefix: the question's top-up
    chosen from the conversation's turn index (as `jobs.build` stores it) given the turns of
    the episodes read, as the answer path chooses it (`pipeline.answer.topup`). A question
    that gets none reads what it read without (`plain`, measured first)."""
    if not topups:
        return {}
    index = index_turns(clustered.conversation, encoder, config.encoder,
                        clustered.encoder_fingerprint)
    count = models.load_llm(config.model).count_tokens

    def measure_with(topup: TopUpConfig) -> Callable:
        def run(cache: EpisodicCache, indices: list[int], read: tuple[int, ...]) -> list[dict]:
            held = held_turns(clustered.members[k] for k in read)
            chosen = {i: select_topup(index, embeddings[i], held, topup, count) for i in indices}
            topped = [i for i in indices if chosen[i].text]
            measured = dict(zip(topped, measure(cache, topped, [chosen[i] for i in topped])))
            return [measured[i] if i in measured else plain[read, i] for i in indices]
        return run

    return {topup_prefix(t, route): (measure_with(t), route) for t, route in topups}


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
