"""What the build benchmarks share: a synthetic conversation of an exact length, the episode
patch a real build would use for it, a stock full prefill to compare with, a table printer and
their common options.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from pipeline import models, prompts
from pipeline.builder import cluster_conversation, episode_scorer
from pipeline.config import BuildConfig
from pipeline.corpus import render_conversation
from pipeline.scorers import Scorer
from pipeline.synthetic import make_conversation


def add_threads_option(p: argparse.ArgumentParser) -> None:
    """`--threads`: pinning torch's threads gives steadier timings on a busy machine."""
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """`--model` and `--threads`, as every benchmark that loads the model takes them."""
    p.add_argument("--model", default=models.DEFAULT_LLM,
                   help="LLM: packaged name or local HF folder")
    add_threads_option(p)


def add_prefill_options(p: argparse.ArgumentParser, lengths: str) -> None:
    """The options of one episode's block prefill at growing lengths (bench_memory,
    bench_build_speed), `lengths` being the default lengths."""
    p.add_argument("--lengths", default=lengths, help="comma-separated conversation lengths (tokens)")
    p.add_argument("--budget", type=int, default=1024,
                   help="mean entries kept per layer and KV head")
    p.add_argument("--block", type=int, default=512, help="block-prefill block size (tokens)")
    p.add_argument("--layers", type=int, default=None,
                   help="run the first N decoder layers only (default: all)")


@dataclass(frozen=True)
class BenchText:
    ids: torch.Tensor  # [N] the cached context: template opening + rendered conversation
    patch_text: str  # episode 0's medoid text, as the real clustering stage picks it
    scorer: Scorer  # episode 0's scorer, as a build with the given configuration makes it


def bench_text(lm: models.LoadedModel, tokens: int, config: BuildConfig, seed: int = 0) -> BenchText:
    """A synthetic conversation cut to exactly `tokens` tokens, with its first episode's patch
    and scorer."""
    conv = make_conversation(f"bench-{tokens}", target_tokens=int(tokens * 1.1), seed=seed)
    ids = prompts.context_ids(lm.tokenizer, render_conversation(conv).text)
    if ids.shape[0] < tokens:
        raise RuntimeError(f"synthetic conversation too short: {ids.shape[0]} < {tokens} tokens")
    clustered = cluster_conversation(conv, config, fit=False)
    episode = clustered.episodes.episodes[0]
    scorer = episode_scorer(lm.tokenizer, clustered.conversation, episode, config)
    return BenchText(ids[:tokens], episode.patch_text, scorer)


def first_layers(model: torch.nn.Module, layers: int | None) -> torch.nn.Module:
    """The model cut to its first `layers` decoder layers (a copy; None = the whole model).

    Layer i's cache depends only on layers 0..i, so per-layer figures of the cut model are
    those of the whole model, and every decoder layer costs the same, so time ratios hold."""
    if layers is None or layers >= model.config.num_hidden_layers:
        return model
    model = copy.deepcopy(model)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    return model


@torch.inference_mode()
def full_prefill(model: torch.nn.Module, ids: torch.Tensor, chunk: int | None = None
                 ) -> tuple[DynamicCache, float]:
    """The stock prefill (transformers' DynamicCache, SDPA), in one forward or in `chunk`-token
    forwards; no LM head, as in block prefill. Returns the cache and the seconds taken."""
    cache = DynamicCache(config=model.config)
    decoder = model.base_model
    chunk = chunk or ids.shape[0]
    start = time.perf_counter()
    for begin in range(0, ids.shape[0], chunk):
        piece = ids[begin:begin + chunk]
        positions = torch.arange(begin, begin + piece.shape[0])
        decoder(input_ids=piece[None], position_ids=positions[None], past_key_values=cache,
                use_cache=True)
    return cache, time.perf_counter() - start


def dynamic_cache_bytes(cache: DynamicCache) -> list[int]:
    """Bytes of each layer's key and value tensors."""
    return [layer.keys.nbytes + layer.values.nbytes for layer in cache.layers]


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """`columns`: (key, header, format spec); missing values print as '-'."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([("-" if row.get(k) is None else format(row[k], spec)) for k, _, spec in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for c, w in zip(r, widths)))
