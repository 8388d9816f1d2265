"""Build-speed benchmark: one episode's block-prefill build against one full prefill of the
same text, in tokens per second, at growing lengths.

    python -m jobs.bench.build_speed [--lengths 8192,16384,32768] [--budget 1024] [--block 512] \\
        [--repeats 1] [--layers N] [--threads 2]

The block build is what a build task runs for an episode: block prefill with the episode's
medoid patch (picked by the real clustering stage, scored as the default build configuration
says, `--paper` for the paper's recipe) riding after every block, evicting to `--budget`
entries per layer and KV head. The full prefill is transformers' stock path (one
forward, DynamicCache, SDPA). Neither computes logits. The two run alternately in one process,
`--repeats` times each, and the best time of each is kept, so the ratio is measured side by
side. Past SmolLM2's 8,192 trained positions the outputs do not matter for timing: the compute
is the same. `--layers N` runs the first N decoder layers only (every layer costs the same, so
the ratio holds; the tokens/s scale by N / 30).
"""

from __future__ import annotations

import argparse
import sys

import torch

from lab.bench_cli import bench_parser, start_bench
from lab.bench_support import bench_text, first_layers, full_prefill
from lab.tables import print_table
from pipeline.cli.options import add_model_options, add_prefill_options
from pipeline.config import BuildConfig, ScoringConfig
from pipeline.kv import models
from pipeline.kv.prefill import PrefillConfig, block_prefill


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("build_speed", __doc__)
    add_prefill_options(p, lengths="8192,16384,32768")
    p.add_argument("--repeats", type=int, default=1, help="runs of each side; the best is kept")
    add_model_options(p)
    p.add_argument("--paper", action="store_true",
                   help="score with the paper's recipe (ScoringConfig.paper(): the whole patch)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = start_bench(build_parser(), argv)
    config = BuildConfig(model=a.model, scoring=ScoringConfig.paper()) if a.paper else \
        BuildConfig(model=a.model)
    lm = models.load_llm(a.model, "cpu")
    model = first_layers(lm.model, a.layers)
    budgets = [a.budget] * model.config.num_hidden_layers
    rows = []
    for n in sorted(int(x) for x in a.lengths.split(",")):
        text = bench_text(lm, n, config)
        patch = text.scorer.patch_ids(None)
        block_s, full_s = [], []
        for _ in range(a.repeats):
            _, stats = block_prefill(model, text.ids, text.scorer, budgets,
                                     PrefillConfig(block=a.block))
            block_s.append(stats.seconds)
            full_s.append(full_prefill(model, text.ids)[1])
        rows.append({"tokens": n, "patch": patch.shape[0], "block_s": min(block_s),
                     "full_s": min(full_s), "block_tps": n / min(block_s),
                     "full_tps": n / min(full_s), "speedup": min(full_s) / min(block_s)})
        print(f"done {n} tokens", file=sys.stderr, flush=True)
    print(f"\n{a.model}, {model.config.num_hidden_layers} of {lm.config.num_hidden_layers} layers, "
          f"{'paper' if a.paper else 'default'} scoring, budget {a.budget}, block {a.block}, "
          f"{torch.get_num_threads()} threads, best of {a.repeats}:")
    print_table(rows, [("tokens", "tokens", "d"), ("patch", "patch tokens/block", "d"),
                       ("block_s", "block build s", ".1f"), ("full_s", "full prefill s", ".1f"),
                       ("block_tps", "block tok/s", ".0f"), ("full_tps", "full tok/s", ".0f"),
                       ("speedup", "block / full speed", ".2f")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
