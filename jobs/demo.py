"""The embedded default, end to end, and what the episodic cache preserves.

    python -m jobs.demo [--out demo-out] [--model SmolLM2-135M-Instruct] [--conversations 1]

A synthetic corpus (planted facts, each with a question whose evidence is one turn) is built by
the real Ray build (`jobs.build`) into a local store. Then, in this process, each question is
answered twice with the same model and prompt: from the episode it is routed to, and from the
full cache of the whole history (no eviction). So a wrong answer that the full history gives
too is the model's, not the cache's. Per question it also prints the evaluation's
evidence-recall retention (1: the evidence is recalled as well as from the full history, 0: as
with no history), then one summary line: retention, bytes and decode speed against the full
cache. The budget is set below the conversations' length so eviction happens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.answer.answerer import Answerer
from pipeline.answer.decode import decode_answer
from pipeline.answer.routing import embed_question, route_question
from pipeline.build.config import BuildConfig
from pipeline.build.driver import BuildError
from pipeline.build.job import BuildJob, configure_logging, print_outcome, run_job
from pipeline.cli.options import (EPISODE_OPTIONS, MODEL_OPTIONS, PREFILL_BENCH_OPTIONS,
                                  add_options, build_config_from_args)
from pipeline.cli.parser import make_parser
from pipeline.corpus.reader import read_corpus, write_jsonl
from pipeline.corpus.schema import Conversation, CorpusError
from pipeline.corpus.synthetic import make_corpus
from pipeline.episodes import EpisodeConfig
from pipeline.eval.cell import history_ids, measure_all, prepare
from pipeline.eval.methods import EvalConfig
from pipeline.eval.metrics import f1_score, retention
from pipeline.kv import models
from pipeline.kv.cache import EpisodicCache
from pipeline.kv.prefill import block_prefill
from pipeline.kv.scorers import FullScorer
from pipeline.store import cache_format
from pipeline.store.base import StoreError

CACHES = ("episodic", "full")  # the two caches every question is answered from
# The demo's build: a short conversation has few windows, so 2 medoid windows a patch; a budget
# of 512, a quarter of the full cache, so that eviction happens.
DEMO_CONFIG = BuildConfig(budget=512, episodes=EpisodeConfig(medoids=2))
DEMO_OPTIONS = (*MODEL_OPTIONS[:1], *PREFILL_BENCH_OPTIONS, EPISODE_OPTIONS[0])


def reference_caches(lm: models.LoadedModel, conv: Conversation,
                     config: BuildConfig) -> tuple[EpisodicCache, EpisodicCache]:
    """The full cache (the whole history, no eviction) and the no-history cache (template and
    header only) of the conversation as built. Both go through the store's dtype, as an
    episode's cache does, so the episodic and full answers differ by eviction alone."""
    dtype = getattr(torch, config.store_dtype)
    caches = []
    for turns in (True, False):
        cache, _ = block_prefill(lm.model, history_ids(lm.tokenizer, conv, turns), FullScorer(),
                                 None, config.prefill)
        data = cache_format.serialize(cache, {"conversation_id": conv.conversation_id}, dtype)
        caches.append(cache_format.deserialize(data, None, dtype=lm.model.dtype,
                                           device=lm.model.device)[0])
    return caches[0], caches[1]


def timed_answer(lm: models.LoadedModel, cache: EpisodicCache, question: str,
                 max_new_tokens: int) -> dict:
    start = time.perf_counter()
    decoded = decode_answer(lm, cache, question, max_new_tokens)
    return {"text": decoded.text, "tokens": decoded.tokens, "seconds": time.perf_counter() - start}


def compare(answerer: Answerer, conv: Conversation, n_questions: int,
            max_new_tokens: int) -> list[dict]:
    """Per question: the routed episode, both answers (text, tokens, decode seconds), the
    evidence-recall NLL from the episodic, full and no-history caches, and the bytes of the
    episodic and full caches (the episodic one as its manifest counts it)."""
    manifest = answerer.manifest(conv.conversation_id)
    config = BuildConfig.from_json(manifest[0].config_json)
    lm = models.load_llm(config.model, answerer.device)
    encoder = models.load_encoder(config.encoder, answerer.device)
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
        episode, _ = route_question(embed_question(encoder, q.question), manifest)
        episodic, _ = answerer.load_cache(episode)
        nll = {"episodic": measure_all(lm, conv, [q], episodic, probe_config)[0]["evidence_nll"],
               "full": reference["full"][i], "none": reference["none"][i]}
        records.append({"conversation_id": conv.conversation_id, "question": q.question,
                        "gold": q.answer, "episode": episode.episode, "nll": nll,
                        "retention": retention(nll["none"], nll["episodic"], nll["full"]),
                        "bytes": {"episodic": episode.kv_bytes, "full": full_bytes},
                        **{name: timed_answer(lm, cache, q.question, max_new_tokens)
                           for name, cache in zip(CACHES, (episodic, full))}})
    return records


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def print_question(r: dict) -> None:
    nll = r["nll"]
    value = "n/a (the full history recalls no better than no history)" \
        if np.isnan(r["retention"]) else f"{r['retention']:.2f}"
    print(f"\n{r['conversation_id']}: {r['question']}  (gold: {r['gold']})")
    print(f"  episodic (episode {r['episode']}): {r['episodic']['text']!r}")
    print(f"  {'full history:':<{len(str(r['episode'])) + 20}} {r['full']['text']!r}")
    print(f"  retention {value}   evidence-recall NLL: episodic {nll['episodic']:.2f}, "
          f"full {nll['full']:.2f}, no history {nll['none']:.2f}")


def print_summary(records: list[dict], model: str, device: str) -> None:
    """One line of the three figures, then what they mean: retention per question is noisy
    over a handful of questions, so the retention of the mean NLLs is given too."""
    n = len(records)
    mean_nll = {k: np.mean([r["nll"][k] for r in records]) for k in ("episodic", "full", "none")}
    of_means = retention(mean_nll["none"], mean_nll["episodic"], mean_nll["full"])
    ms = {c: 1000 * sum(r[c]["seconds"] for r in records) / sum(r[c]["tokens"] for r in records)
          for c in CACHES}  # time per generated token: the two answers may differ in length
    size = {c: np.mean([r["bytes"][c] for r in records]) for c in CACHES}
    print(f"\nsummary: retention {np.nanmean([r['retention'] for r in records]):.2f} mean, "
          f"{of_means:.2f} of the mean NLLs | cache read {_mib(size['episodic'])} vs full KV "
          f"{_mib(size['full'])} ({size['episodic'] / size['full']:.0%}) | decode "
          f"{ms['episodic']:.1f} ms/token vs full {ms['full']:.1f} "
          f"({ms['full'] / ms['episodic']:.2f}x its speed, {device})")
    same = sum(r["episodic"]["text"] == r["full"]["text"] for r in records)
    f1 = {c: np.mean([f1_score(r[c]["text"], r["gold"]) for r in records]) for c in CACHES}
    print(f"  {n} questions are a small sample: retention per question is noisy, that of the mean\n"
          f"  NLLs steadier (1: the evidence recalled as from the full history, 0: as from none).\n"
          f"  Answers the same as the full history's: {same}/{n}; token F1 against gold: episodic "
          f"{f1['episodic']:.2f}, full {f1['full']:.2f}.\n"
          f"  Where the full history answers wrong too, the error is the model's ({model}).\n"
          f"  Over a short history, decode time is mostly the model's weights; the gap grows with\n"
          f"  the history (python -m jobs.bench.decode).")


def _python() -> str:
    """How to call this interpreter from the current folder (`.venv/bin/python` under make)."""
    exe = Path(sys.executable)
    return os.path.relpath(exe) if exe.is_relative_to(Path.cwd()) else "python"


def print_next(store: Path, corpus: Path, records: list[dict], a: argparse.Namespace) -> None:
    py = _python()
    print(f"\nstore: {store}   (corpus: {corpus})\nnext:")
    print(f"  {py} -m jobs.answer --store {store} --conversation {records[0]['conversation_id']} "
          f"--question {records[0]['question']!r}")
    print(f"  {py} -m jobs.serve --store {store}   # then POST /v1/conversations/<id>/answer on "
          f"127.0.0.1:8000 (docs/serving.md)")
    print(f"  {py} -m jobs.evaluate --corpus {corpus} --out {store.parent / 'eval'} "
          f"--model {a.model} --methods epicache --budgets {a.budget} --episodes {a.episodes} "
          f"--medoids {DEMO_CONFIG.episodes.medoids} --block {a.block}")
    print(f"a larger model and a GPU: {py} -m jobs.demo --model <local Hugging Face folder of a "
          f"Llama, Qwen2 or Mistral model>; with CUDA the build puts each episode on a GPU and "
          f"this comparison runs there too.")


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.demo", __doc__)
    p.add_argument("--out", default="demo-out", help="folder for the corpus and the store")
    p.add_argument("--conversations", type=int, default=1, help="synthetic conversations built")
    p.add_argument("--target-tokens", type=int, default=2000,
                   help="length of each conversation (estimated tokens)")
    add_options(p, DEMO_OPTIONS, DEMO_CONFIG)
    p.add_argument("--questions", type=int, default=6, help="questions answered per conversation")
    p.add_argument("--max-new-tokens", type=int, default=16, help="answer length (tokens)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the comparison in this process (the build's workers use "
                        "one each): one keeps decode steady on a shared machine")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus, store = out / "corpus.jsonl", out / "store"
    write_jsonl(make_corpus(a.conversations, a.target_tokens, seed=0), corpus)
    print(f"corpus: {corpus} ({a.conversations} synthetic conversation"
          f"{'s' if a.conversations != 1 else ''} of ~{a.target_tokens} tokens)")
    configure_logging()
    start = time.perf_counter()
    try:
        summary, built = run_job(BuildJob(str(corpus), str(store)), build_config_from_args(
            a, DEMO_OPTIONS, DEMO_CONFIG))
    except (ValueError, CorpusError, StoreError, models.ModelNotFoundError, BuildError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_outcome(summary, time.perf_counter() - start, built)
    if summary.failed:
        return 1
    # Decoding is many small ops: with a busy core, threads waiting on each other at every one
    # made it 16x slower (88 vs 1,442 ms/token, 1 vs 2 threads, SmolLM2 on 2 shared cores).
    torch.set_num_threads(a.threads)
    device = models.default_device()
    answerer = Answerer(built, device=device)
    conversations, _ = read_corpus(corpus)
    print(f"\nEach question answered from its episode's cache and from the full history "
          f"(same model, same prompt), greedy, {a.max_new_tokens} tokens at most:")
    records = []
    for conv in conversations:
        for record in compare(answerer, conv, a.questions, a.max_new_tokens):
            print_question(record)
            records.append(record)
    if records:
        print_summary(records, a.model, device)
        print_next(store, corpus, records, a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
