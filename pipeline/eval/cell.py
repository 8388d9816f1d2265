"""One evaluation cell = (conversation, method, budget): build its caches, measure its questions.

A cell builds the caches its method needs through the product's build (`pipeline.builder`,
into an in-memory store: one cache per conversation; one per episode for EpiCache, routed per
question; one per question for the `question` upper bound), then measures every question with
`pipeline.eval.metrics`. The two references, the full cache (`full`; for a whole conversation
longer than the model, each question's oracle window: `pipeline.eval.window`) and no history
(`none`), are cells of their own, computed once per conversation; retention is derived from
them when the records are gathered (`pipeline.eval.summary`).
"""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import torch

from pipeline.answer.answerer import Answerer
from pipeline.answer.decode import generate_from_cache
from pipeline.answer.topup import TopUp, held_turns, select_topup
from pipeline.builder.cluster import cluster_conversation
from pipeline.builder.conversation import build_conversation, files_of
from pipeline.builder.episode import build_episode_cache, build_episode_caches, store_dtype
from pipeline.builder.profile import BuildBasis
from pipeline.builder.turns import index_turns
from pipeline.config import BuildConfig, CodeConfig, RoutingConfig, TopUpConfig
from pipeline.corpus.render import cut_at_session, render_conversation, render_header
from pipeline.corpus.schema import Conversation, Question
from pipeline.eval.methods import EvalConfig, Read, parse_method
from pipeline.eval.metrics import (
    ADVERSARIAL_CATEGORY,
    evidence_probe,
    f1_score,
    headed_continuation_nlls,
    question_text,
)
from pipeline.eval.reads import (
    CellCaches,
    measure_reads,
    one_cache,
    question_embeddings,
    route_scores,
    routed,
    select_read,
)
from pipeline.eval.summary import nan_mean
from pipeline.eval.window import Windows, evidence_windows
from pipeline.kv import methods, models, prompts
from pipeline.kv.cache import EpisodicCache
from pipeline.kv.layout import TokenLayout, kept_share, token_layout
from pipeline.kv.methods.full import Full
from pipeline.kv.prefill import PrefillStats, block_prefill, build_tokens, entry_bytes
from pipeline.kv.tristate import EntryBytes
from pipeline.store.backends.memory import MemoryStore
from pipeline.store.objects import cache_format
from pipeline.store.objects.turn_index import TurnIndex, read_turn_index
from pipeline.store.objects.turn_index import serialize as serialize_turn_index  # its bytes


@dataclass(frozen=True)
class Prepared:
    """A conversation ready to evaluate: cut to fit, its questions chosen; with an oracle-window
    reference (`EvalConfig.reference_window`), the windows its questions read and each one's
    (`pipeline.eval.window`: a run of sessions, or a question's evidence sessions where its
    evidence spreads past one run), the questions no window holds left out
    (`dropped_by_window`)."""
    conversation: Conversation
    questions: tuple[Question, ...]
    dropped_by_cut: int
    tokens: int
    windows: Windows | None = None
    dropped_by_window: int = 0


def prepare(conv: Conversation, config: EvalConfig) -> Prepared:
    tokenizer = models.load_tokenizer(config.model)
    count = lambda text: len(prompts.context_ids(tokenizer, text))  # noqa: E731
    cut = conv if config.max_context_tokens is None else \
        cut_at_session(conv, config.max_context_tokens, count)
    questions = [q for q in cut.questions if q.category != ADVERSARIAL_CATEGORY and q.evidence]
    if config.questions_per_conversation is not None:
        questions = questions[:config.questions_per_conversation]
    dropped = cut.meta.get("cut", {}).get("questions_dropped", 0)
    windows, dropped_by_window = None, 0
    if config.reference_window is not None:
        found = evidence_windows(cut, questions, config.reference_window, count)
        kept = [i for i, w in enumerate(found.of_question) if w is not None]
        dropped_by_window = len(questions) - len(kept)
        questions = [questions[i] for i in kept]
        windows = Windows(found.windows, tuple(found.of_question[i] for i in kept))
    return Prepared(cut, tuple(questions), dropped, count(render_conversation(cut).text),
                    windows, dropped_by_window)


def history_ids(tokenizer, conv: Conversation, turns: bool = True) -> torch.Tensor:
    """The model's input for a cache of the conversation; without `turns`, the no-history
    reference: the same template opening and header, so only the turns differ."""
    text = render_conversation(conv).text if turns else render_header(conv)
    return prompts.context_ids(tokenizer, text)


class Probes(NamedTuple):
    """A question's (prefix, target) pairs: one evidence-recall probe per evidence turn with
    text (`turns`: the turns probed, in order), then the question and its gold answer (if any)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    turns: tuple[str, ...]


def probe_pairs(lm: models.LoadedModel, conv: Conversation, q: Question,
                config: EvalConfig) -> Probes:
    turns = {t.turn_id: t for t in conv.turns}
    pairs, probed = [], []
    for turn_id in q.evidence:
        prefix, rest = evidence_probe(turns[turn_id], config.recall_words)
        target = prompts.encode(lm.tokenizer, rest)[:config.recall_tokens]
        if target.numel():
            pairs.append((prompts.encode(lm.tokenizer, prefix), target))
            probed.append(turn_id)
    answer = prompts.encode(lm.tokenizer, q.answer)
    if answer.numel():
        pairs.append((prompts.question_ids(lm.tokenizer, question_text(q)), answer))
    return Probes(pairs, tuple(probed))


def measure_all(lm: models.LoadedModel, conv: Conversation, questions: list[Question],
                cache: EpisodicCache, config: EvalConfig, topups: list[TopUp] | None = None,
                generate: list[bool] | None = None) -> list[dict]:
    """Per question: the evidence-recall NLL of each evidence turn (`evidence_nlls`, of the
    turns `evidence_probed`) and their mean, and the answer NLL, each probe read after the
    question's top-up (`topups`) as the answer path's prompt holds it (`prompts.question_ids`:
    the top-up's ids, then the question's), every probe of every question in packed forwards
    over `cache`, each top-up once (`headed_continuation_nlls`); where `generate` says so, also
    the generated answer and its F1."""
    topups = topups or [TopUp()] * len(questions)
    generate = generate or [False] * len(questions)
    probes = [probe_pairs(lm, conv, q, config) for q in questions]
    measured = headed_continuation_nlls(lm.model, cache, [
        (prompts.topup_ids(lm.tokenizer, t.text) if t.text else None, probe.pairs)
        for probe, t in zip(probes, topups)])
    records = []
    for q, probe, topup, answer_it, values in zip(questions, probes, topups, generate, measured):
        recall, answer = values[:len(probe.turns)], values[len(probe.turns):]
        record = {"evidence_nll": float(np.mean(recall)) if recall else float("nan"),
                  "evidence_nlls": recall, "evidence_probed": list(probe.turns),
                  "answer_nll": answer[0] if answer else float("nan"),
                  "topup_tokens": topup.tokens, "topup_turn_ids": list(topup.turn_ids),
                  "topup_recall": len(set(q.evidence) & set(topup.turn_ids)) /
                  max(len(q.evidence), 1)}
        if answer_it:
            ids = generate_from_cache(lm, cache, prompts.question_ids(
                lm.tokenizer, question_text(q), topup.text), config.max_new_tokens)
            record |= scored_answer(lm.tokenizer.decode(ids, skip_special_tokens=True), q)
        records.append(record)
    return records


def question_cache(cache: EpisodicCache, layout: TokenLayout, topup: TopUp) -> EpisodicCache:
    """The cache a question reads: with a top-up read once (`TopUp.hidden_spans`), a view less
    its entries of the top-up's turns (where `layout`, the cache's, places them), else (or if
    it holds none of them) the cache itself."""
    if not topup.hidden_spans:
        return cache
    view = cache.without_tokens(layout.turn_mask(topup.turn_ids))
    return cache if view.entries_per_layer() == cache.entries_per_layer() else view


def measure_over(lm: models.LoadedModel, conv: Conversation, questions: list[Question],
                 cache: EpisodicCache, reads: list[EpisodicCache], config: EvalConfig,
                 topups: list[TopUp], generate: list[bool]) -> list[dict]:
    """`measure_all` of each question over the cache it reads (`reads`, `question_cache`):
    those reading `cache` itself in its packed pass, each view (a top-up read once) alone;
    with the entries it read (`kept_entries`, and `decode_entries` with its top-up's)."""
    measured: list[dict] = [{}] * len(questions)
    shared = [j for j, read in enumerate(reads) if read is cache]
    for j, record in zip(shared, measure_all(lm, conv, [questions[j] for j in shared], cache,
                                             config, [topups[j] for j in shared],
                                             [generate[j] for j in shared])):
        measured[j] = record
    for j in (j for j, read in enumerate(reads) if read is not cache):
        measured[j] = measure_all(lm, conv, [questions[j]], reads[j], config, [topups[j]],
                                  [generate[j]])[0]
    kept = [float(np.mean(read.entries_per_layer())) for read in reads]
    return [{"kept_entries": k, "decode_entries": k + topup.tokens, **record}
            for k, topup, record in zip(kept, topups, measured)]


def scored_answer(prediction: str, q: Question) -> dict:
    prediction = prediction.strip()
    return {"prediction": prediction, "f1": f1_score(prediction, q.answer)}


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
                  layer_budgets: list[int] | None, reads: tuple[Read, ...] = (),
                  answered: tuple[Read, ...] | None = None) -> list[dict]:
    """Per-question records of one (conversation, method, budget) cell. `method` may also be
    "none": the no-history reference. `layer_budgets` None means the build's entry budget
    (`BuildConfig.entry_budget`) in every layer.
    The cell measures its method's read and each of `reads` (the question-time reads of the
    variants that share its caches: `pipeline.eval.reads`), each question on the cache its
    route picks; the records hold every read's fields and `method`'s under their plain names.
    With `config.generate`, the answers of the reads `answered` (None: all) are generated for
    the questions sampled (`EvalConfig.generates`).

    The caches are built as `jobs.build` builds them (`pipeline.builder`: the conversation
    fitted and clustered, each episode block-prefilled and stored, here in an in-memory store
    dropped with the cell), and measured as built."""
    spec = parse_method(method)
    reads = tuple(dict.fromkeys((config.read_of(method), *reads)))
    answered = reads if answered is None else answered
    if not config.generate:
        answered = ()
    lm = models.load_llm(config.model)
    build = config.build_config(method, budget)
    if layer_budgets is None and build.entry_budget is not None:
        layer_budgets = [build.entry_budget] * lm.config.num_hidden_layers
    conv, questions = prep.conversation, list(prep.questions)
    start = time.perf_counter()
    element_size = store_dtype(build)[1]  # Original entries counted as the build stores them
    sizes = entry_bytes(lm.model, element_size)
    layout = token_layout(lm.tokenizer, conv)
    layouts: dict[int, TokenLayout] = {}  # id(cache) -> its layout, where not `layout` (windows)
    builds = CellBuilds(sizes, build.code)
    built, costs = builds.built, builds.costs
    # episodic cells answer through the product's answer path instead (`_answered`)
    def generates(read: Read, i: int) -> bool:
        return read in answered and config.generates(i) and not spec.episodic

    def measure(cache: EpisodicCache, indices: list[int], topups: list[TopUp],
                answer: list[bool]) -> list[dict]:
        chosen = [questions[i] for i in indices]
        footprint = cache_footprint(cache, sizes, builds.merged.get(id(cache), 0),  # joined: 0
                                    build.code)
        cache_layout = layouts.get(id(cache), layout)
        reads = [question_cache(cache, cache_layout, topup) for topup in topups]
        measured = measure_over(lm, conv, chosen, cache, reads, config, topups, answer)
        # a cold question fetches its cache(s) and, topped up, the turn index
        return [{"fetched_bytes": footprint["kv_bytes"] +
                 (costs["turn_index_bytes"] if topup.tokens else 0),
                 **evidence_diagnostics(conv, q, cache_layout, read), **footprint, **record}
                for q, topup, read, record in zip(chosen, topups, reads, measured)]

    def full_cache(ids: torch.Tensor) -> EpisodicCache:  # the references': nothing evicted
        return built(*block_prefill(lm.model, ids, Full(), None, build.prefill,
                                    original_element_size=element_size))

    if not spec.history:  # the reference: the same prompt without the turns
        cache = full_cache(history_ids(lm.tokenizer, conv, turns=False))
        measured = measure_reads(len(questions), reads, one_cache(lambda: cache), measure,
                                 topup_chooser(conv, questions, config, costs=costs),
                                 generates)
    elif prep.windows is not None and not methods.registered(build.scorer).evicts:
        # the full cache of a whole conversation: each question reads its oracle window's
        caches = window_caches(prep.windows, lm.tokenizer, full_cache, layouts)
        measured = measure_reads(len(questions), reads, caches, measure,
                                 topup_chooser(conv, questions, config, costs=costs), generates)
    else:
        measured = _built_and_measured(conv, questions, method, build,
                                       None if build.budget is None else layer_budgets,
                                       config, built, measure, reads, generates, answered, costs)
    records = [{"conversation_id": conv.conversation_id, "method": method,
                "budget": budget if build.budget is not None and spec.history else None,
                "question_index": i, "question": q.question, "answer": q.answer,
                "category": q.category, "evidence": list(q.evidence), "episode": 0,
                "route_similarity": float("nan"), "route_hit": None, **record,
                "cell_seconds": time.perf_counter() - start, **builds.fields(),
                "conversation_tokens": prep.tokens,
                # whole conversations: the kind of full-history reference the question reads
                "reference": None if prep.windows is None else prep.windows.kind(i)}
               for i, (q, record) in enumerate(zip(questions, measured))]
    return [r | select_read(r, method, config) for r in records]  # every read's fields kept


@dataclass
class CellBuilds:
    """What a cell's builds cost, counted as each cache is built (`built`): their seconds, the
    tokens they ran through the model (patches included), the bytes the caches take stored, and
    the turn index's bytes where a top-up reads it (`topup_chooser`); and the entries each
    build merged (D2O), by cache. A cache in low-bit codes is measured as the store gives it
    back (`cache_format.as_stored`)."""
    sizes: EntryBytes
    code: CodeConfig = CodeConfig()
    merged: dict[int, int] = field(default_factory=dict)  # id(cache) -> entries merged
    seconds: float = 0.0
    costs: dict = field(default_factory=lambda: {"build_tokens": 0, "stored_cache_bytes": 0,
                                                 "turn_index_bytes": 0})

    def built(self, cache: EpisodicCache, stats: PrefillStats) -> EpisodicCache:
        cache = cache_format.as_stored(cache, self.code)
        self.merged[id(cache)] = stats.merged_entries
        self.seconds += stats.seconds
        self.costs["build_tokens"] += build_tokens(stats)
        self.costs["stored_cache_bytes"] += cache_footprint(cache, self.sizes,
                                                            code=self.code)["kv_bytes"]
        return cache

    def fields(self) -> dict:
        return {"build_seconds": self.seconds, **self.costs}


def window_caches(windows: Windows, tokenizer, full_cache: Callable[[torch.Tensor], EpisodicCache],
                  layouts: dict[int, TokenLayout]) -> CellCaches:
    """The full caches of the oracle windows (`full_cache` of each one's ids), each question
    reading its own, built one at a time (its questions measured together); each cache's layout
    kept in `layouts` for the evidence diagnostics."""
    def window_cache(key: tuple[int, ...]) -> EpisodicCache:
        window = windows.windows[key[0]]
        cache = full_cache(history_ids(tokenizer, window))
        layouts[id(cache)] = token_layout(tokenizer, window)
        return cache

    return CellCaches(functools.lru_cache(maxsize=1)(window_cache),
                      lambda read, i: (windows.of_question[i],))


def topup_chooser(conv: Conversation, questions: list[Question], config: EvalConfig,
                  encoder_fingerprint: str | None = None, embeddings: np.ndarray | None = None,
                  index: TurnIndex | None = None,
                  costs: dict | None = None) -> Callable[[TopUpConfig, int, set[str]], TopUp]:
    """A question's top-up given the turns its cache holds whole, chosen as the answer path
    chooses it (`pipeline.answer.topup`) from the conversation's turn index as `jobs.build`
    stores it (`index`, or embedded on the first top-up asked for); the index's stored bytes
    go to `costs["turn_index_bytes"]`."""
    @functools.cache
    def chooser() -> Callable[[TopUpConfig, int, set[str]], TopUp]:
        encoder = models.load_encoder(config.encoder)
        turns = index if index is not None else index_turns(
            conv, encoder, config.encoder,
            encoder_fingerprint or models.encoder_fingerprint(config.encoder),
            tokenizer=models.load_tokenizer(config.model))
        if costs is not None:
            costs["turn_index_bytes"] = len(serialize_turn_index(turns))
        embedded = question_embeddings(encoder, questions) if embeddings is None else embeddings
        count = functools.partial(prompts.count_tokens, models.load_llm(config.model).tokenizer)
        return lambda topup, i, held: select_topup(turns, embedded[i], held, topup, count)

    return lambda topup, i, held: chooser()(topup, i, held)


def _built_and_measured(conv: Conversation, questions: list[Question], method: str,
                        build: BuildConfig, budgets: list[int] | None, config: EvalConfig,
                        built: Callable, measure: Callable, reads: tuple[Read, ...],
                        generates: Callable[[Read, int], bool],
                        answered: tuple[Read, ...], costs: dict) -> list[dict]:
    """Build a method's caches through the product's one build (`build_conversation`, into an
    in-memory store: clustered, its turn index stored, each episode prefilled and stored, the
    manifest committed by the product's checked commit; the budgets the evaluation allocated),
    and measure each question on the cache(s) each read picks, as built (in memory, before the
    store's dtype). The `question` upper bound builds one cache per question instead (its
    question as the patch: stage 3 alone over the clustering), which no manifest could hold."""
    store = MemoryStore(f"eval-{uuid.uuid4().hex}")
    try:
        if methods.registered(build.scorer).per_question:  # one build per question
            clustered = cluster_conversation(conv, build)

            def cache_of(key: tuple[int, ...]) -> EpisodicCache:
                done = build_episode_cache(clustered, 0, budgets, build, store,
                                           question_text(questions[key[0]]))
                store.delete(done.record.object_key)  # measured as built; nothing kept
                return built(done.cache, done.stats)

            return measure_reads(len(questions), reads, CellCaches(
                functools.lru_cache(maxsize=1)(cache_of), lambda read, i: (i,)), measure,
                topup_chooser(clustered.conversation, questions, config,
                              clustered.encoder_fingerprint, costs=costs), generates)
        # stage 3 keeps each episode's cache as built (`build_episode_caches`): what is measured
        product = build_conversation(conv, build, store, basis=BuildBasis(budgets, files_of(build)),
                                     prefill=build_episode_caches)
        clustered, conv = product.planned, product.planned.conversation
        caches = [built(done.cache, done.stats) for done in product.built]
        index = read_turn_index(store, clustered.turn_index, conv.conversation_id,
                                clustered.encoder_fingerprint)  # as the build stored it
        if not parse_method(method).episodic:
            return measure_reads(len(questions), reads, one_cache(lambda: caches[0]), measure,
                                 topup_chooser(conv, questions, config,
                                               clustered.encoder_fingerprint, index=index,
                                               costs=costs), generates)
        embeddings = question_embeddings(models.load_encoder(config.encoder), questions)
        scores = route_scores(embeddings, clustered.episodes)
        members = clustered.members
        records = measure_reads(len(questions), reads, CellCaches(
            functools.lru_cache(maxsize=1)(lambda key: caches[key[0]] if len(key) == 1 else
                                           EpisodicCache.joined([caches[k] for k in key])),
            routed(scores), lambda key: held_turns(members[k] for k in key)),
            measure, topup_chooser(conv, questions, config, clustered.encoder_fingerprint,
                                   embeddings, index, costs), generates)
        if answered:  # through the answer path, over the manifest the build committed
            _answered(store, conv.conversation_id, questions, answered, config, records)
        # route hits are judged on the episode's windows, whatever its cache focused on
        return [r | {"episode_hit": [not set(q.evidence).isdisjoint(m) for m in members]}
                | {f"scores_{name}": [float(x) for x in table[i]] for name, table in scores.items()}
                for i, (q, r) in enumerate(zip(questions, records))]
    finally:
        store.drop()


def _answered(store: MemoryStore, conversation_id: str, questions: list[Question],
              reads: tuple[Read, ...], config: EvalConfig, records: list[dict]) -> None:
    """Each read's generated answers (`<prefix>prediction`, `<prefix>f1`) to the questions
    sampled (`EvalConfig.generates`), through the product's answer path (`Answerer`) over the
    cell's store: routed, topped up and decoded as `jobs.answer` and Serve answer them."""
    for read in reads:
        answerer = Answerer(store, device=models.default_device(),
                            routing=RoutingConfig(*read.route),
                            topup=read.topup or TopUpConfig(enabled=False))
        for i, q in enumerate(questions):
            if config.generates(i):
                answered = answerer.answer(conversation_id, question_text(q),
                                           config.max_new_tokens)
                records[i] |= {f"{read.prefix}{k}": v
                               for k, v in scored_answer(answered.answer, q).items()}


def cache_footprint(cache: EpisodicCache, sizes: EntryBytes, merged: int = 0,
                    code: CodeConfig = CodeConfig()) -> dict:
    """Entries per state and bytes of a cache (in `code`'s low-bit codes where it has bits);
    `bytes_tokens` is its bytes in Original entries per layer and KV head (comparable with the
    budget M of a tri-state cell)."""
    original, quantized = cache.state_counts()
    kv_bytes = (cache_format.coded_kv_bytes(cache, code) if code.bits else
                original * sizes.original + quantized * sizes.quantized)
    first = cache.layers[0]
    per_token = (len(cache.layers) * (first.valid.shape[0] if first.valid is not None else 1)
                 * sizes.original)
    return {"original_entries": original, "quantized_entries": quantized, "merged_entries": merged,
            "kv_bytes": kv_bytes, "bytes_tokens": kv_bytes / per_token,
            "quantized_share": quantized / max(original + quantized, 1)}
