"""What the build benchmarks measure with: a synthetic conversation of an exact length and its
episode patch, a model cut to its first layers, and a stock full prefill to compare with.

Here (not in `jobs/bench/`, which nothing imports) so the tests can hold these shortcuts to what
they claim: that they do not change what the benchmarks measure.
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from pipeline.builder.cluster import cluster_conversation
from pipeline.builder.episode import episode_scorer
from pipeline.config import BuildConfig
from pipeline.corpus.render import render_conversation
from pipeline.corpus.synthetic import make_conversation
from pipeline.kv import models, prompts
from pipeline.kv.methods.base import Scorer


@dataclass(frozen=True)
class BenchText:
    ids: torch.Tensor  # [N] the cached context: template opening + rendered conversation
    patch_text: str  # episode 0's medoid text, as the real clustering stage picks it
    scorer: Scorer  # episode 0's scorer, as a build with the given configuration makes it


def bench_text(lm: models.LoadedModel, tokens: int, config: BuildConfig,
               seed: int = 0) -> BenchText:
    """A synthetic conversation cut to exactly `tokens` tokens, with its first episode's patch
    and scorer."""
    conv = make_conversation(f"bench-{tokens}", target_tokens=int(tokens * 1.1), seed=seed)
    ids = prompts.context_ids(lm.tokenizer, render_conversation(conv).text)
    if ids.shape[0] < tokens:
        raise RuntimeError(f"synthetic conversation too short: {ids.shape[0]} < {tokens} tokens")
    clustered = cluster_conversation(conv, config, fit=False)
    episode = clustered.episodes.episodes[0]
    scorer = episode_scorer(lm.tokenizer, clustered.conversation, episode.patch_text,
                            clustered.members[0], config)
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


def cuda_peak_extra(call: Callable[[], object]) -> int:
    """Bytes the CUDA allocator held at its peak during the call beyond what was held before."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def cpu_peak_extra(call: Callable[[], object]) -> int:
    """Peak resident bytes of this process during the call above its resident bytes before it
    (Linux: the kernel's high-water mark, reset first). Run it in a fresh process: what an
    earlier call left in the allocator would hide the call's own peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident size (VmHWM) to the current one
    base = _proc_status_bytes("VmRSS")
    result = call()
    peak = _proc_status_bytes("VmHWM") - base
    del result
    return peak
