"""Memory benchmark: the block-prefill peak stays flat in the conversation's length, the full
prefill's grows linearly.

    python -m jobs.bench.memory [--lengths 4096,8192,16384,32768,65536] [--budget 1024] \\
        [--block 512] [--layers 2] [--full-max-tokens 65536] [--threads 2]

For each length, one synthetic conversation is built as one EpiCache episode (the real
clustering picks the medoid patch, cut to `--patch-tokens` so that it is the same size at
every length: the patch rides in the forward, so its size moves the transient peak) and, side by
side, prefilled in full with transformers' DynamicCache. Reported per layer (the worst layer), from
instrumentation of the caches: the peak number of cached entries per KV head and the peak bytes of
key and value tensors held — for block prefill the moment after a block and its patch are appended,
before eviction. Ratios are against the shortest length. `--layers N` runs the first N decoder
layers only: a layer's cache depends on the layers below it alone, so the per-layer figures are
those of the whole model (the totals scale with the number of layers).
"""

from __future__ import annotations

import argparse
import sys

import torch

from lab.bench_cli import bench_parser, start_bench
from lab.bench_support import bench_text, dynamic_cache_bytes, first_layers, full_prefill
from lab.tables import print_table
from pipeline.cli.options import add_model_options, add_prefill_options
from pipeline.config import BuildConfig
from pipeline.kv import models, prompts
from pipeline.kv.methods.epicache import EpiCache
from pipeline.kv.prefill import PrefillConfig, block_prefill


def measure(model: torch.nn.Module, ids: torch.Tensor, patch: torch.Tensor, budget: int,
            block: int, run_full: bool) -> dict:
    n_layers = model.config.num_hidden_layers
    _, stats = block_prefill(model, ids, EpiCache(patch=patch), [budget] * n_layers,
                             PrefillConfig(block=block))
    row = {"tokens": ids.shape[0], "patch": patch.shape[0],
           "block_entries": max(stats.peak_entries), "block_slots": max(stats.peak_slots),
           "block_mib": max(stats.peak_bytes) / 2**20, "block_s": stats.seconds}
    if run_full:
        cache, seconds = full_prefill(model, ids, chunk=4096)
        row |= {"full_entries": max(layer.keys.shape[-2] for layer in cache.layers),
                "full_mib": max(dynamic_cache_bytes(cache)) / 2**20, "full_s": seconds}
    return row


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("memory", __doc__)
    add_prefill_options(p, lengths="4096,8192,16384,32768,65536")
    p.add_argument("--patch-tokens", type=int, default=256,
                   help="cut the medoid patch to this length, the same at every length")
    p.add_argument("--full-max-tokens", type=int, default=65536,
                   help="skip the full prefill above this length")
    add_model_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    a = start_bench(build_parser(), argv)
    lengths = sorted(int(x) for x in a.lengths.split(","))
    lm = models.load_llm(a.model, "cpu")
    model = first_layers(lm.model, a.layers)
    config = BuildConfig(model=a.model)
    rows = []
    for n in lengths:
        if n > lm.config.max_position_embeddings:
            print(f"note: {n} tokens is past {a.model}'s {lm.config.max_position_embeddings} "
                  "trained positions; memory does not depend on what the model outputs",
                  file=sys.stderr)
        text = bench_text(lm, n, config)
        patch = prompts.patch_ids(lm.tokenizer, text.patch_text)[:a.patch_tokens]
        rows.append(measure(model, text.ids, patch, a.budget, a.block, n <= a.full_max_tokens))
        print(f"done {n} tokens", file=sys.stderr, flush=True)
    base = rows[0]
    for row in rows:
        row["block_ratio"] = row["block_mib"] / base["block_mib"]
        if row.get("full_mib") and base.get("full_mib"):
            row["full_ratio"] = row["full_mib"] / base["full_mib"]
    layers = model.config.num_hidden_layers
    print(f"\n{a.model}, {layers} of {lm.config.num_hidden_layers} layers, budget {a.budget}, "
          f"block {a.block}, dtype {next(model.parameters()).dtype}; per layer, worst layer:")
    print_table(rows, [("tokens", "tokens", "d"), ("patch", "patch", "d"),
                       ("block_entries", "block peak entries", ".0f"),
                       ("block_slots", "block peak slots", "d"),
                       ("block_mib", "block peak MiB", ".2f"),
                       ("block_ratio", "block / shortest", ".3f"),
                       ("full_entries", "full entries", "d"), ("full_mib", "full MiB", ".2f"),
                       ("full_ratio", "full / shortest", ".2f"),
                       ("block_s", "block s", ".1f"), ("full_s", "full s", ".1f")])
    longest = rows[-1]
    print(f"\nblock-prefill peak {longest['tokens']} / {base['tokens']} tokens: "
          f"{longest['block_ratio']:.3f} (goal <= 1.05)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
