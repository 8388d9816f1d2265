"""Block prefill under a fixed budget (EpiCache stage 2): the loop that runs blocks, scores
and evicts.

The conversation goes through the model `block` tokens at a time. When the scorer has a patched
prompt, it rides in the same forward right after the block: its queries see the cache, the
block and the patch's own earlier tokens; its attention to every cached entry is scored inside
the attention call; its keys and values are never stored. Then each layer is cut back to its
budget. So a layer never holds more than budget + block entries, whatever the conversation's
length: peak memory is flat.

Which entries a cut keeps is the method's (`pipeline.kv.methods`); how a layer is cut, where the
patch sits and what follows a cut is a `Compression` (`pipeline.kv.eviction`), composed from
the configuration by `pipeline.kv.compression`. The loop names no method and no strategy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from pipeline.config import PrefillConfig
from pipeline.kv.cache import EpisodicCache, EpisodicLayer
from pipeline.kv.compression import compression_for
from pipeline.kv.eviction import Compression
from pipeline.kv.methods.base import BlockContext, LayerState, Scorer
from pipeline.kv.tristate import EntryBytes


@dataclass
class PrefillStats:
    tokens: int = 0
    blocks: int = 0
    patch_tokens: int = 0
    seconds: float = 0.0
    # caches built from one run of the tokens through the model (one pass: the conversation's
    # episodes), so a cache's share of the build is that run / shared_by (`build_tokens`)
    shared_by: int = 1
    # of `tokens`, those its build then ran alone (one pass's episodes going on by block
    # prefill past its first span): not shared
    tokens_alone: int = 0
    peak_entries: list[float] = field(default_factory=list)  # per layer, max valid entries per head
    peak_slots: list[int] = field(default_factory=list)  # per layer, max padded slots per head
    peak_bytes: list[int] = field(default_factory=list)  # per layer, max bytes of K + V tensors
    final_entries: list[float] = field(default_factory=list)
    # Entries (token x KV head x layer) in each state at the end, and the bytes of the kept
    # ones (Original at `original_element_size` bytes per number, Quantized codes + scales).
    original_entries: int = 0
    quantized_entries: int = 0
    evicted_entries: int = 0
    merged_entries: int = 0  # evicted entries folded into kept ones (D2O), among the evicted
    original_bytes: int = 0
    quantized_bytes: int = 0
    evicted_bytes: int = 0  # what the evicted entries would take as Original (bytes saved)
    oq_ratios: list[float] = field(default_factory=list)  # ARKV rho per layer, last step
    byte_budgets: list[int] = field(default_factory=list)  # tri-state: bytes per layer


def build_tokens(stats: PrefillStats) -> float:
    """The tokens a cache's build ran through the model: its share of the text's run, what it
    ran alone, and its own patch tokens."""
    shared = stats.tokens - stats.tokens_alone
    return shared / stats.shared_by + stats.tokens_alone + stats.patch_tokens


def check_layer_budgets(model: torch.nn.Module, budgets: list[int] | None,
                        byte_budgets: list[int] | None = None) -> int:
    """The model's layer count, once the budgets given hold one per layer."""
    n_layers = model.config.num_hidden_layers
    for name, given in (("layer budgets", budgets), ("layer byte budgets", byte_budgets)):
        if given is not None and len(given) != n_layers:
            raise ValueError(f"{len(given)} {name} for a model with {n_layers} layers")
    return n_layers


def layer_state(idx: int, layer: EpisodicLayer, block_start: int) -> LayerState:
    request = layer.last_request
    return LayerState(layer_idx=idx, keys=layer.keys[0], values=layer.values[0],
                      valid=layer.valid, positions=layer.positions,
                      patch_scores=request.scores if request is not None else None,
                      block_start=block_start,
                      patch_sum=request.patch_sum if request is not None else None,
                      patch_sumsq=request.patch_sumsq if request is not None else None,
                      patch_count=request.patch_count if request is not None else 0)


def entry_bytes(model: torch.nn.Module, original_element_size: int | None = None) -> EntryBytes:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    size = original_element_size or next(model.parameters()).element_size()
    return EntryBytes.for_dims(head_dim, head_dim, size)


def patch_after(scorer: Scorer, block: torch.Tensor, tokens_seen: int = 0) -> torch.Tensor:
    """The scorer's patch after `block` (the tokens from `tokens_seen` on), on the block's
    device; none: an empty patch."""
    patch = scorer.patch_ids(BlockContext(block_ids=block, tokens_seen=tokens_seen))
    return patch.to(block.device) if patch is not None else block.new_zeros(0)


def through_layer(decoder: torch.nn.Module, idx: int, hidden: torch.Tensor,
                  positions: torch.Tensor, cache: EpisodicCache) -> torch.Tensor:
    """Hidden states [1, T, D] at `positions` [1, T] through layer `idx` of `decoder` (a
    model's `base_model`) alone, its keys and values into `cache`: the passes that go layer by
    layer hold one layer's context at a time. No mask: the episodic attention makes its own
    from the cache's request."""
    return decoder.layers[idx](hidden, position_embeddings=decoder.rotary_emb(hidden, positions),
                               position_ids=positions, past_key_values=cache, use_cache=True)


@torch.inference_mode()
def block_prefill(model: torch.nn.Module, input_ids: torch.Tensor, scorer: Scorer,
                  budgets: list[int] | None, config: PrefillConfig = PrefillConfig(),
                  on_block: Callable[[int], None] | None = None, *,
                  byte_budgets: list[int] | None = None,
                  original_element_size: int | None = None,
                  cache: EpisodicCache | None = None) -> tuple[EpisodicCache, PrefillStats]:
    """Feed `input_ids` ([N]) block by block, evicting each layer to `budgets[layer]` entries
    per head after every block (no eviction when `budgets` is None: the full cache). With
    tri-state compression the budgets are `byte_budgets` (bytes per layer; default: the bytes
    of `budgets[layer]` Original tokens per KV head), Original entries counted at
    `original_element_size` bytes per number (default: the model's dtype).

    Given `cache` (an episode's stored cache, read back), the ids are the turns that follow
    what it has seen, and the prefill goes on from it as if the blocks had run in one call:
    the append of a grown conversation. The stats count the new tokens."""
    start_time = time.perf_counter()
    n_layers = check_layer_budgets(model, budgets, byte_budgets)
    sizes = entry_bytes(model, original_element_size)
    compression = compression_for(config, model, sizes, budgets, byte_budgets)
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    n_new = input_ids.shape[0]
    cache = EpisodicCache(n_layers) if cache is None else cache
    total = cache.tokens_seen + n_new  # where decoding will start
    cache.collect_moments(compression.collects_moments)
    stats = PrefillStats()
    for begin in range(0, n_new, config.block):
        block = input_ids[begin:begin + config.block]
        seen = cache.tokens_seen
        patch = patch_after(scorer, block, seen)
        block_step(model, cache, block, patch, scorer, compression, block_start=seen,
                   total=total, final=begin + config.block >= n_new)
        stats.blocks += 1
        stats.tokens += block.shape[0]
        stats.patch_tokens += patch.shape[0]
        if on_block is not None:
            on_block(block.shape[0])
    stats.seconds = time.perf_counter() - start_time
    stats.peak_entries = cache.peak_entries_per_layer()
    stats.peak_slots = [layer.peak_slots for layer in cache.layers]
    stats.peak_bytes = [layer.peak_bytes for layer in cache.layers]
    stats.final_entries = cache.entries_per_layer()
    count_states(stats, cache, model, sizes)
    compression.report(stats)
    return cache, stats


def block_step(model: torch.nn.Module, cache: EpisodicCache, block: torch.Tensor,
               patch: torch.Tensor, scorer: Scorer, compression: Compression, *,
               block_start: int, total: int, final: bool) -> None:
    """One step of block prefill: the `block` (tokens from `block_start` on; empty where the
    caller has put them in the cache already, as the shared spans do) and the `patch` riding
    after it through the model, then the compression's cut of every layer and what follows
    it. `total`: the tokens seen when decoding starts (where a patch may sit)."""
    tokens = torch.cat([block, patch])
    if tokens.shape[0]:
        positions = compression.patch_positions(cache.next_position, block.shape[0],
                                                patch.shape[0], total).to(tokens.device)
        with cache.patched(patch.shape[0]):
            # no LM head: block prefill needs no logits
            model.base_model(input_ids=tokens[None], position_ids=positions[None],
                             past_key_values=cache, use_cache=True)
    states = [layer_state(idx, layer, block_start) for idx, layer in enumerate(cache.layers)]
    compression.step(cache.layers, states, scorer, final=final)
    compression.after_step(cache)
    for layer in cache.layers:
        layer.last_request = None


def count_states(stats: PrefillStats, cache: EpisodicCache, model: torch.nn.Module,
                 sizes: EntryBytes) -> None:
    stats.original_entries, stats.quantized_entries = cache.state_counts()
    seen = cache.tokens_seen * model.config.num_key_value_heads * len(cache.layers)
    stats.evicted_entries = seen - stats.original_entries - stats.quantized_entries
    stats.original_bytes = stats.original_entries * sizes.original
    stats.quantized_bytes = stats.quantized_entries * sizes.quantized
    stats.evicted_bytes = stats.evicted_entries * sizes.original
