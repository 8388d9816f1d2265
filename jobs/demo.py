"""The embedded default, end to end, and what the episodic cache preserves.

    python -m jobs.demo [--out demo-out] [--model SmolLM2-135M-Instruct] [--conversations 1]

A synthetic corpus (planted facts, each with a question whose evidence is one turn) is built by
the real Ray build (`jobs.build`) into a local store. Then, in this process, each question is
answered twice with the same model and prompt: from the episode it is routed to (topped up with
its nearest turns the episode lacks, as the answer path tops it up), and from the full cache of
the whole history (no eviction). So a wrong answer that the full history gives
too is the model's, not the cache's. Per question it also prints the evaluation's
evidence-recall retention (1: the evidence is recalled as well as from the full history, 0: as
with no history), then one summary line: retention, bytes and decode speed against the full
cache. The budget is set below the conversations' length so eviction happens.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from pipeline.builder.job import BuildError, BuildJob, configure_logging, open_job, print_outcome
from pipeline.cli.options import (
    EPISODE_OPTIONS,
    MODEL_OPTIONS,
    PREFILL_BENCH_OPTIONS,
    add_options,
    build_config_from_args,
)
from pipeline.cli.parser import make_parser
from pipeline.config import BuildConfig, EpisodeConfig
from pipeline.corpus.reader import read_corpus, write_jsonl
from pipeline.corpus.schema import CorpusError
from pipeline.corpus.synthetic import make_corpus
from pipeline.kv.errors import ModelNotFoundError
from pipeline.store.backends.base import StoreError

# The demo's build: a short conversation has few windows, so 2 medoid windows a patch; a budget
# of 512, a quarter of the full cache, so that eviction happens.
DEMO_CONFIG = BuildConfig(budget=512, episodes=EpisodeConfig(medoids=2))
DEMO_OPTIONS = (*MODEL_OPTIONS[:1], *PREFILL_BENCH_OPTIONS, EPISODE_OPTIONS[0])


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def print_question(r: dict) -> None:
    nll = r["nll"]
    value = "n/a (the full history recalls no better than no history)" \
        if math.isnan(r["retention"]) else f"{r['retention']:.2f}"
    print(f"\n{r['conversation_id']}: {r['question']}  (gold: {r['gold']})")
    topup = r["topup"]
    read = f"episode {r['episode']}" + (f" + {topup['tokens']} tokens of turns "
                                         f"{', '.join(topup['turn_ids'])}"
                                         if topup["status"] == "used" else "")
    print(f"  episodic ({read}): {r['episodic']['text']!r}")
    print(f"  {'full history:':<{len(str(r['episode'])) + 20}} {r['full']['text']!r}")
    print(f"  retention {value}   evidence-recall NLL: episodic {nll['episodic']:.2f}, "
          f"full {nll['full']:.2f}, no history {nll['none']:.2f}")


def print_summary(f: dict, model: str, device: str) -> None:
    """One line of the three figures (`lab.compare.figures`), then what they mean:
    retention per question is noisy over a handful of questions, so the retention of the mean
    NLLs is given too."""
    n, ms, size = f["questions"], f["ms_per_token"], f["bytes"]
    print(f"\nsummary: retention {f['retention']:.2f} mean, "
          f"{f['retention_of_means']:.2f} of the mean NLLs | cache read {_mib(size['episodic'])} "
          f"vs full KV {_mib(size['full'])} ({size['episodic'] / size['full']:.0%}) | decode "
          f"{ms['episodic']:.1f} ms/token vs full {ms['full']:.1f} "
          f"({ms['full'] / ms['episodic']:.2f}x its speed, {device})")
    print(f"  {n} questions are a small sample: retention per question is noisy, that of the mean\n"
          f"  NLLs steadier (1: the evidence recalled as from the full history, 0: as from none).\n"
          f"  Answers the same as the full history's: {f['same']}/{n}; token F1 against gold: "
          f"episodic {f['f1']['episodic']:.2f}, full {f['f1']['full']:.2f}.\n"
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
    try:  # the arguments are checked before anything is written or loaded
        config = build_config_from_args(a, DEMO_OPTIONS, DEMO_CONFIG)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus, store = out / "corpus.jsonl", out / "store"
    write_jsonl(make_corpus(a.conversations, a.target_tokens, seed=0), corpus)
    print(f"corpus: {corpus} ({a.conversations} synthetic conversation"
          f"{'s' if a.conversations != 1 else ''} of ~{a.target_tokens} tokens)")
    configure_logging()
    start = time.perf_counter()
    try:
        with open_job(BuildJob(str(corpus), str(store))) as opened:
            # Ray, torch and the models load here, once the corpus and the store are known good
            from pipeline.builder.driver import run_job
            summary = run_job(opened, config)
    except (ValueError, CorpusError, StoreError, ModelNotFoundError, BuildError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_outcome(summary, time.perf_counter() - start, opened.store)
    if summary.failed:
        return 1
    from lab import compare  # the comparison's model, after the build
    answerer = compare.answerer(opened.store, a.threads)
    conversations, _ = read_corpus(corpus)
    print(f"\nEach question answered from its episode's cache (and its top-up) and from the "
          f"full history "
          f"(same model, same prompt), greedy, {a.max_new_tokens} tokens at most:")
    records = []
    for conv in conversations:
        for record in compare.compare(answerer, conv, a.questions, a.max_new_tokens):
            print_question(record)
            records.append(record)
    if records:
        print_summary(compare.figures(records), a.model, answerer.device)
        print_next(store, corpus, records, a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
