"""What batched decoding costs and gains, in one process (no server): decode steps at growing
batch sizes over an episodic cache, side by side with the unbatched `generate()` path.

    python -m jobs.bench.batch [--tokens 4000] [--budget 512] [--batches 1,2,4,8] \
        [--new-tokens 16] [--threads N]

One synthetic conversation is block-prefilled once (budget `--budget`); B requests (generic
questions, cycled) are then decoded together (`pipeline.answer.packed.packed_step`), each starting
from the cache and the question instruction's entries (computed once per cache, as the server
does): the joining step prefills the rest of the B prompts, each later step decodes one token
per request. Prints per batch size the joining step and the mean decode step (ms), answer
tokens/s and their ratio to batch 1, and the memory each request holds while it decodes (its
private copy of the cache plus room for the prompt and the answer); and the unbatched path's ms
per token. Greedy answers are checked against `generate()`'s answers to the same questions
alone (the run fails if any differs).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from lab.bench_cli import bench_parser, start_bench
from lab.bench_support import bench_text
from lab.tables import print_table
from pipeline.answer.decode import generate_from_cache
from pipeline.answer.packed import DecodeRow, Prefix, packed_step
from pipeline.cli.options import add_budget_option, add_model_options
from pipeline.config import BuildConfig
from pipeline.kv import models, prompts
from pipeline.kv.prefill import PrefillConfig, block_prefill

QUESTIONS = ("What did they talk about most?", "Where did they go last weekend?",
             "What is the name of the pet?", "What did they cook for the party?",
             "Who did they meet at the concert?", "What book were they reading?",
             "Which city did they visit?", "What did they buy for the trip?")


def row_bytes(row: DecodeRow) -> int:
    """Bytes a request's private view holds (keys, values, valid flags, positions)."""
    return sum(t.nbytes for layer in row.layers for t in
               (layer.keys, layer.values, layer.valid, layer.rope_positions))


@torch.inference_mode()
def run_batch(lm: models.LoadedModel, cache, questions: list[torch.Tensor], new_tokens: int,
              prefix: Prefix) -> dict:
    """As the server's batcher does: each row starts from the cache and the instruction's
    entries (`prefix`), and the joining step prefills the rest of each prompt."""
    n = len(prefix.ids)
    start = time.perf_counter()
    rows = [DecodeRow(cache, len(q) + new_tokens, prefix) for q in questions]
    fork_s = time.perf_counter() - start
    start = time.perf_counter()
    logits = packed_step(lm.model, rows, [q[n:] for q in questions])
    join_s = time.perf_counter() - start
    answers: list[list[int]] = [[] for _ in rows]
    steps = []
    for step in range(new_tokens):
        tokens = logits.argmax(-1)
        for got, t in zip(answers, tokens.tolist()):
            got.append(t)
        if step < new_tokens - 1:
            start = time.perf_counter()
            logits = packed_step(lm.model, rows, [t[None] for t in tokens])
            steps.append(time.perf_counter() - start)
    step_ms = 1000 * sum(steps) / len(steps) if steps else None
    return {"batch": len(rows), "fork_ms": 1000 * fork_s / len(rows), "join_ms": 1000 * join_s,
            "step_ms": step_ms, "tokens_per_s": len(rows) / (step_ms / 1000) if step_ms else None,
            "row_mib": row_bytes(rows[0]) / 2**20, "answers": answers}


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("batch", __doc__)
    add_model_options(p)
    p.add_argument("--tokens", type=int, default=4000, help="conversation length (tokens)")
    add_budget_option(p, 512)
    p.add_argument("--batches", default="1,2,4,8", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=16, help="answer tokens per request")
    return p


def main(argv: list[str] | None = None) -> int:
    a = start_bench(build_parser(), argv)
    batches = [int(b) for b in a.batches.split(",")]
    lm = models.load_llm(a.model)
    config = BuildConfig(budget=a.budget)
    text = bench_text(lm, a.tokens, config)
    n_layers = lm.config.num_hidden_layers
    cache, _ = block_prefill(lm.model, text.ids, text.scorer, [a.budget] * n_layers,
                             PrefillConfig(block=512))
    questions = [prompts.question_ids(lm.tokenizer, q) for q in QUESTIONS]
    start = time.perf_counter()
    reference = [generate_from_cache(lm, cache, q, max_new_tokens=a.new_tokens).tolist()
                 for q in questions[:max(batches)]]
    generate_ms = 1000 * (time.perf_counter() - start) / sum(len(r) for r in reference)
    start = time.perf_counter()
    prefix = Prefix(lm.model, cache, prompts.question_prefix_ids(lm.tokenizer))
    prefix_ms = 1000 * (time.perf_counter() - start)
    if any(not torch.equal(q[:len(prefix.ids)], prefix.ids) for q in questions):
        raise RuntimeError("a question prompt does not open with the instruction's tokens")
    rows, mismatches = [], 0
    for b in batches:
        qs = [questions[i % len(questions)] for i in range(b)]
        result = run_batch(lm, cache, qs, a.new_tokens, prefix)
        for i, answer in enumerate(result.pop("answers")):
            # generate() stops at end-of-sequence; the bench decodes on: compare up to there
            want = reference[i % len(questions)]
            mismatches += answer[:len(want)] != want
        rows.append(result)
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base if base and r["tokens_per_s"] else None
    print(f"{lm.model_id}, {a.tokens}-token conversation, budget {a.budget}, "
          f"{torch.get_num_threads()} torch threads; unbatched generate(): "
          f"{generate_ms:.1f} ms per answer token (prompt included); the instruction's "
          f"{len(prefix.ids)} tokens prefilled once per cache in {prefix_ms:.0f} ms")
    print_table(rows, [("batch", "batch", "d"), ("fork_ms", "fork ms/request", ".1f"),
                       ("join_ms", "joining step ms", ".0f"), ("step_ms", "decode step ms", ".1f"),
                       ("tokens_per_s", "tokens/s", ".1f"), ("speedup", "vs batch 1", ".2f"),
                       ("row_mib", "MiB per request", ".1f")])
    print(f"greedy answers differing from generate()'s alone: {mismatches} of "
          f"{sum(r['batch'] for r in rows)}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
