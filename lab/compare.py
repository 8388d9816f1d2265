"""The demo's comparison: each question answered from its episode's cache and from the full
cache of the whole history (no eviction), with the same model and prompt.

Per question: the routed episode, both answers (text, tokens, decode time), the
evidence-recall NLL from the episodic, full and no-history caches and the retention from them
(`pipeline.eval.metrics`), and the bytes of both caches; then the figures of the summary.
`jobs.demo` prints them; this module holds what needs torch and the models, so the demo checks
its arguments and builds before loading them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from pipeline.answer.answerer import Answerer
from pipeline.answer.decode import decode_answer
from pipeline.builder.append import read_stored_cache
from pipeline.builder.conversation import build_conversation
from pipeline.config import BuildConfig
from pipeline.corpus.schema import Conversation
from pipeline.eval.cell import history_ids, measure_all, prepare
from pipeline.eval.methods import EvalConfig
from pipeline.eval.metrics import f1_score, retention
from pipeline.kv import models
from pipeline.kv.cache import EpisodicCache
from pipeline.kv.methods.full import Full
from pipeline.kv.prefill import block_prefill
from pipeline.store.backends.memory import MemoryStore
from pipeline.store.objects import cache_format

CACHES = ("episodic", "full")  # the two caches every question is answered from


def answerer(store: Path, threads: int) -> Answerer:
    """An answerer over the built store on the default device, torch pinned to `threads`."""
    # Decoding is many small ops: with a busy core, threads waiting on each other at every one
    # made it 16x slower (88 vs 1,442 ms/token, 1 vs 2 threads, SmolLM2 on 2 shared cores).
    torch.set_num_threads(threads)
    return Answerer(store, device=models.default_device())


def reference_caches(lm: models.LoadedModel, conv: Conversation,
                     config: BuildConfig) -> tuple[EpisodicCache, EpisodicCache]:
    """The full cache and the no-history cache of the conversation as built. The full cache is
    the product's one build with nothing evicted (`build_conversation` with the `full` method,
    into a store in memory), read back as an episode's cache is read: both the episodic and the
    full cache go through the store's dtype, so their answers differ by eviction alone. The
    no-history cache (template and header only) has no conversation to build: it is prefilled
    whole and taken through the store's dtype alike."""
    store = MemoryStore(f"demo-reference-{uuid.uuid4().hex}")
    try:
        built = build_conversation(conv, replace(config, scorer="full", budget=None), store)
        full = read_stored_cache(store, built.records[0], lm.model)
    finally:
        store.drop()
    cache, _ = block_prefill(lm.model, history_ids(lm.tokenizer, conv, turns=False), Full(),
                             None, config.prefill)
    data = cache_format.serialize(cache, {"conversation_id": conv.conversation_id},
                                  getattr(torch, config.store_dtype))
    none = cache_format.deserialize(data, None, dtype=lm.model.dtype, device=lm.model.device)[0]
    return full, none


def timed_answer(lm: models.LoadedModel, cache: EpisodicCache, question: str,
                 max_new_tokens: int, topup: str = "") -> dict:
    start = time.perf_counter()
    decoded = decode_answer(lm, cache, question, max_new_tokens, topup=topup)
    return {"text": decoded.text, "tokens": decoded.tokens, "seconds": time.perf_counter() - start}


def compare(answerer: Answerer, conv: Conversation, n_questions: int,
            max_new_tokens: int) -> list[dict]:
    """Per question: the routed episode (or two, read joined, as the answerer routes) and its
    top-up (as the answerer tops up), both answers (text, tokens, decode seconds), the
    evidence-recall NLL from the episodic (topped up), full and no-history caches, and the
    bytes of the episodic and full caches."""
    manifest = answerer.manifest(conv.conversation_id)
    config = BuildConfig.from_json(manifest[0].config_json)
    lm = models.load_llm(config.model, answerer.device)
    probe_config = EvalConfig(BuildConfig(model=config.model,
                                          max_context_tokens=config.max_context_tokens),
                              questions_per_conversation=n_questions)
    prep = prepare(conv, probe_config)  # cut as the build cut it; the evaluation's questions
    conv, questions = prep.conversation, list(prep.questions)
    full, none = reference_caches(lm, conv, config)
    full_bytes = full.nbytes(getattr(torch, config.store_dtype).itemsize)
    reference = {name: [m["evidence_nll"] for m in
                        measure_all(lm, conv, questions, cache, probe_config)]
                 for name, cache in (("full", full), ("none", none))}
    timed_answer(lm, none, "Hello?", 2)  # warm-up: the first generate() pays one-time costs
    records = []
    for i, q in enumerate(questions):
        plan = answerer.planner.plan(conv.conversation_id, q.question)  # as answers are planned
        read, topup = plan.read, plan.topup
        episodic, _ = answerer.load_caches(read)
        nll = {"episodic": measure_all(lm, conv, [q], episodic, probe_config,
                                       [topup])[0]["evidence_nll"],
               "full": reference["full"][i], "none": reference["none"][i]}
        records.append({"conversation_id": conv.conversation_id, "question": q.question,
                        "gold": q.answer, "episode": read[0].episode,
                        "episodes": [r.episode for r in read], "topup": topup.as_dict(),
                        "nll": nll,
                        "retention": retention(nll["none"], nll["episodic"], nll["full"]),
                        "bytes": {"episodic": episodic.nbytes(
                                      getattr(torch, config.store_dtype).itemsize),
                                  "full": full_bytes},
                        **{name: timed_answer(lm, cache, q.question, max_new_tokens, text)
                           for name, cache, text in zip(CACHES, (episodic, full),
                                                        (topup.text, ""))}})
    return records


def figures(records: list[dict]) -> dict:
    """The summary's figures over the questions: mean retention and the retention of the mean
    NLLs (steadier over a handful of questions), decode ms per generated token (the two answers
    may differ in length) and mean bytes per cache, answers equal to the full history's, and
    token F1 against gold."""
    mean_nll = {k: np.mean([r["nll"][k] for r in records]) for k in ("episodic", "full", "none")}
    return {
        "questions": len(records),
        "retention": float(np.nanmean([r["retention"] for r in records])),
        "retention_of_means": retention(mean_nll["none"], mean_nll["episodic"], mean_nll["full"]),
        "ms_per_token": {c: 1000 * sum(r[c]["seconds"] for r in records)
                         / sum(r[c]["tokens"] for r in records) for c in CACHES},
        "bytes": {c: float(np.mean([r["bytes"][c] for r in records])) for c in CACHES},
        "same": sum(r["episodic"]["text"] == r["full"]["text"] for r in records),
        "f1": {c: float(np.mean([f1_score(r[c]["text"], r["gold"]) for r in records]))
               for c in CACHES},
    }
