"""Costs at full length: the build of a conversation, block by block and in one pass, against
one full prefill of the same tokens, at its 7,600-token cut and whole.

    python -m jobs.bench.full_length --corpus ../shared/data/locomo [--conversations 30] \\
        [--cut-tokens 7600] [--questions 20] \\
        [--paths block,one-pass,one-pass-shared,one-pass-shared-2048,one-pass-window] \\
        [--repeats 1] [--threads 2]

Per conversation and length (the cut, the whole), each run in a fresh process so that one's
peak memory is its own: transformers' stock prefill (one forward, DynamicCache) of the same
tokens, the cache a full-history answer would read, then the product's build
(`pipeline.builder.conversation.build_conversation`, the default configuration, into a local
store) for each `--paths`: `block` (a block prefill per episode), `one-pass`
(`PrefillConfig.one_pass`: every episode from one layer-by-layer pass, block prefill past its
first span), `one-pass-shared` (the rest read once over the episodes' caches joined past it;
`-2048`: spans down to 2,048 tokens where the joined caches need more of the positions,
`PrefillConfig.shared_span`) and `one-pass-window` (the pass sliding a window past it).
Reported: tokens, seconds, the peak memory the run adds to the loaded model (the kernel's
resident high-water mark on CPU, reset first; the allocator's peak on a GPU), bytes stored per
conversation (every object the build wrote: caches, manifest, turn index; for the full prefill,
its cache in the store's float16), and bytes read per question: the cache objects of the
episodes the answer path reads for each of the first `--questions` questions (routed by
`Answerer` as `jobs.answer` routes them; for the full prefill, the whole cache). Ratios:
seconds against the full prefill of the same tokens (the build's bill in prefills; on a GPU, a
build's tokens/s against the model's own prefill's), peak memory against the same run at the
cut.
A build's seconds include its clustering and turn index (the encoder), as a build task's do.
Past the model's 8,192 positions the full prefill's output does not matter, only its cost.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from lab.bench_cli import bench_conversations, bench_parser, start_bench
from lab.bench_support import cpu_peak_extra, cuda_peak_extra, dynamic_cache_bytes, full_prefill
from lab.tables import print_table
from pipeline.answer.answerer import Answerer
from pipeline.builder.conversation import build_conversation
from pipeline.cli.numbers import positive_int
from pipeline.cli.options import add_threads_option
from pipeline.config import BuildConfig
from pipeline.corpus.render import cut_at_session, render_conversation
from pipeline.corpus.schema import Conversation
from pipeline.eval.window import CUT_TOKENS
from pipeline.kv import models, prompts
from pipeline.store.backends.local import LocalStore
from pipeline.store.catalogue.manifest import read_manifest

# --paths: the PrefillConfig fields of each build path
PATHS = {"block": {"one_pass": False}, "one-pass": {"one_pass": True},
         "one-pass-shared": {"one_pass": True, "one_pass_beyond": "shared"},
         "one-pass-shared-2048": {"one_pass": True, "one_pass_beyond": "shared",
                                  "shared_span": 2048},
         "one-pass-window": {"one_pass": True, "one_pass_beyond": "window"}}
PREFILL = "full prefill"
COLUMNS = [("conversation", "conversation", ""), ("length", "length", ""), ("run", "run", ""),
           ("tokens", "tokens", ","), ("episodes", "caches", ""), ("seconds", "seconds", ".1f"),
           ("tokens_per_s", "tokens/s", ",.0f"), ("x_prefill", "x prefill", ".2f"),
           ("peak_mib", "peak added MiB", ".0f"),
           ("x_peak", "peak x cut", ".2f"), ("stored_mib", "stored MiB", ".1f"),
           ("read_mib", "read per question MiB", ".2f")]


def measured(call: Callable[[], object], device: str) -> tuple[float, int]:
    """The seconds a call takes and the peak memory it adds (`lab.bench_support`)."""
    start = time.perf_counter()
    peak = (cuda_peak_extra if device == "cuda" else cpu_peak_extra)(call)
    return time.perf_counter() - start, peak


def run_build(conv: Conversation, questions: int, threads: int | None,
              config: BuildConfig) -> dict:
    """The product's build of `conv` into a fresh local store, then the answer path's reads."""
    if threads:
        torch.set_num_threads(threads)
    device = models.default_device()
    lm = models.load_llm(config.model)
    models.load_encoder(config.encoder)
    with tempfile.TemporaryDirectory() as where:
        store = LocalStore(where)
        seconds, peak = measured(lambda: build_conversation(conv, config, store), device)
        stored = sum(p.stat().st_size for p in Path(where).rglob("*") if p.is_file())
        sizes = {r.episode: r.object_bytes for r in read_manifest(store, conv.conversation_id)}
        answerer = Answerer(store, device=device)
        read = [sum(sizes[e] for e in answerer.answer(conv.conversation_id, q.question, 1)
                    .episodes) for q in conv.questions[:questions]]
    return {"tokens": token_count(lm, conv), "seconds": seconds, "peak_added": peak,
            "stored": stored, "read_per_question": sum(read) / max(len(read), 1),
            "episodes": len(sizes)}


def run_full_prefill(conv: Conversation, questions: int, threads: int | None,
                     config: BuildConfig) -> dict:
    """One stock prefill of the whole conversation: the full cache a question would read."""
    if threads:
        torch.set_num_threads(threads)
    device = models.default_device()
    lm = models.load_llm(config.model)
    ids = prompts.context_ids(lm.tokenizer, render_conversation(conv).text).to(device)
    caches = []
    seconds, peak = measured(lambda: caches.append(full_prefill(lm.model, ids)[0]), device)
    element = next(lm.model.parameters()).element_size()
    stored = sum(dynamic_cache_bytes(caches[0])) * 2 // element  # as the store keeps it: float16
    return {"tokens": int(ids.shape[0]), "seconds": seconds, "peak_added": peak,
            "stored": stored, "read_per_question": stored, "episodes": 1}


def token_count(lm, conv: Conversation) -> int:
    return int(prompts.context_ids(lm.tokenizer, render_conversation(conv).text).shape[0])


def _child(run, conv: Conversation, questions: int, threads: int | None, config: BuildConfig,
           queue) -> None:
    queue.put(run(conv, questions, threads, config))


def in_fresh_process(run, conv: Conversation, questions: int, threads: int | None,
                     config: BuildConfig) -> dict:
    """`run` in a new process (spawned: nothing of this one's memory carried over)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_child, args=(run, conv, questions, threads, config, queue))
    child.start()
    result = queue.get()
    child.join()
    return result


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("full_length", __doc__, conversations="30")
    p.add_argument("--cut-tokens", type=int, default=CUT_TOKENS,
                   help="the cut build's length, at a session boundary (default: %(default)s)")
    p.add_argument("--questions", type=int, default=20,
                   help="questions routed per conversation for the bytes read "
                        "(default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="rounds per length, each the prefill and every build in turn; each "
                        "figure the median of the rounds, a ratio the median of each round's "
                        "(this machine's speed drifts by 10-20%% between runs) (default: 1)")
    p.add_argument("--paths", default=",".join(PATHS),
                   help=f"the build paths to run, comma-separated, of {', '.join(PATHS)} "
                   "(default: all)")
    add_threads_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = start_bench(parser, argv)
    paths = [p.strip() for p in a.paths.split(",") if p.strip()]
    if unknown := [p for p in paths if p not in PATHS]:
        parser.error(f"--paths: unknown {', '.join(unknown)} (of {', '.join(PATHS)})")
    default = BuildConfig()
    configs = {f"build, {p}": replace(default, prefill=replace(default.prefill, **PATHS[p]))
               for p in paths}
    rows = []
    tokenizer = models.load_tokenizer(default.model)
    for conv in bench_conversations(parser, a):
        cut = cut_at_session(conv, a.cut_tokens,
                             lambda text: len(prompts.context_ids(tokenizer, text)))
        at_cut: dict[str, dict] = {}
        for length, text in (("cut", cut), ("whole", replace(conv, questions=cut.questions))):
            rounds = []
            for _ in range(a.repeats):  # each round: the prefill, then each build, in turn
                rounds.append({PREFILL: in_fresh_process(run_full_prefill, text, a.questions,
                                                         a.threads, default)})
                rounds[-1] |= {name: in_fresh_process(run_build, text, a.questions, a.threads,
                                                      config) for name, config in configs.items()}
            for name in rounds[0]:
                r = rounds[0][name] | {key: statistics.median(one[name][key] for one in rounds)
                                       for key in ("seconds", "peak_added")}
                at_cut.setdefault(name, r)
                rows.append(r | {"conversation": conv.conversation_id, "length": length,
                                 "run": name, "x_prefill": statistics.median(
                                     one[name]["seconds"] / one[PREFILL]["seconds"]
                                     for one in rounds),
                                 "tokens_per_s": r["tokens"] / r["seconds"],
                                 "peak_mib": r["peak_added"] / 2**20,
                                 "x_peak": r["peak_added"] / max(at_cut[name]["peak_added"], 1),
                                 "stored_mib": r["stored"] / 2**20,
                                 "read_mib": r["read_per_question"] / 2**20})
                print(rows[-1], file=sys.stderr, flush=True)
    print_table(rows, COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
