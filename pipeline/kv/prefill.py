"""Block prefill under a fixed budget (EpiCache stage 2): the only place that evicts.

The conversation goes through the model `block` tokens at a time. When the scorer has a patched
prompt, it rides in the same forward right after the block: its queries see the cache, the
block and the patch's own earlier tokens; its attention to every cached entry is scored inside
the attention call; its keys and values are never stored. Then each layer is cut back to its
budget. So a layer never holds more than budget + block entries, whatever the conversation's
length: peak memory is flat.

What an eviction step does is a strategy (`pipeline.kv.eviction`): cut to a budget of entries
(EpiCache), or ARKV's tri-state Original / Quantized / Evicted under a byte budget; either may
merge what it evicts into similar kept entries (D2O). With `decode_positions` (DapQ) the patch
queries sit at the positions where decoding will start, after the whole conversation. With
compact positions (`pipeline.kv.positions`) every eviction is followed by moving the kept entries
to positions 0, 1, 2, ..., so a history of any length stays within the model's positions.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from pipeline.configs import PrefillConfig, Selection
from pipeline.kv.cache import EpisodicCache, EpisodicLayer
from pipeline.kv.eviction import Eviction, TokenEviction
from pipeline.kv.merging import Merger
from pipeline.kv.positions import KeyRotation
from pipeline.kv.scorers import BlockContext, LayerState, Scorer
from pipeline.kv.tristate import EntryBytes, TriStateEviction


@dataclass
class PrefillStats:
    tokens: int = 0
    blocks: int = 0
    patch_tokens: int = 0
    seconds: float = 0.0
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


def select_keep(scores: torch.Tensor, valid: torch.Tensor, budget: int,
                selection: Selection, head_floor: float = 0.0) -> torch.Tensor:
    """[Hkv, slots] bool: the entries to keep so that the layer holds `budget` per head.

    head-wise: the top budget x Hkv entries across the layer's heads (heads get unequal shares),
    each head first guaranteed its top `head_floor x budget` (AdaKV's safeguard);
    per-head: the top `budget` entries of each head."""
    scores = scores.float().masked_fill(~valid, float("-inf"))
    keep = torch.zeros_like(valid)
    floor = min(int(head_floor * budget), valid.shape[1])
    if selection == "headwise" and floor > 0:
        top = torch.topk(scores, floor, dim=1).indices
        scores = scores.scatter(1, top, torch.full_like(scores, float("inf"))).masked_fill(
            ~valid, float("-inf"))
    if selection == "headwise":
        k = min(budget * valid.shape[0], int(valid.sum().item()))
        keep.view(-1)[torch.topk(scores.reshape(-1), k).indices] = True
    else:
        k = min(budget, valid.shape[1])
        keep.scatter_(1, torch.topk(scores, k, dim=1).indices, True)
    return keep & valid


def layer_state(idx: int, layer: EpisodicLayer, block_start: int,
                budget: int | None = None) -> LayerState:
    request = layer.last_request
    return LayerState(layer_idx=idx, keys=layer.keys[0], values=layer.values[0],
                      valid=layer.valid, positions=layer.positions,
                      patch_scores=request.scores if request is not None else None,
                      block_start=block_start,
                      patch_sum=request.patch_sum if request is not None else None,
                      patch_sumsq=request.patch_sumsq if request is not None else None,
                      patch_count=request.patch_count if request is not None else 0,
                      budget=budget)


def patch_positions(seen: int, n_block: int, n_patch: int, total: int,
                    decode_positions: bool) -> torch.Tensor:
    """Positions of a block and its patch: consecutive after what was seen, or (DapQ) the
    patch at the positions where decoding will start, `total` (the whole input) onwards."""
    block = torch.arange(seen, seen + n_block)
    first = total if decode_positions else seen + n_block
    return torch.cat([block, torch.arange(first, first + n_patch)])


def make_eviction(config: PrefillConfig, budgets: list[int] | None,
                  byte_budgets: list[int] | None, sizes: EntryBytes) -> Eviction | None:
    """The eviction step the configuration asks for (None: the full cache)."""
    merger = Merger(config.merge) if config.merge.enabled else None
    if config.tristate.enabled:
        if byte_budgets is None and budgets is not None:  # the bytes of M Original tokens
            raise ValueError("tri-state needs byte budgets (see token_byte_budgets)")
        if byte_budgets is None:
            return None
        return TriStateEviction(byte_budgets, config.selection, config.tristate, sizes, merger)
    if byte_budgets is not None:
        raise ValueError("byte budgets need tri-state compression (PrefillConfig.tristate)")
    select = functools.partial(select_keep, head_floor=config.head_floor)
    return None if budgets is None else TokenEviction(budgets, config.selection, select, merger)


def token_byte_budgets(budgets: list[int], kv_heads: int, sizes: EntryBytes) -> list[int]:
    """Per layer, the bytes of `budgets[layer]` Original tokens in every KV head."""
    return [b * kv_heads * sizes.original for b in budgets]


def entry_bytes(model: torch.nn.Module, original_element_size: int | None = None) -> EntryBytes:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    size = original_element_size or next(model.parameters()).element_size()
    return EntryBytes.for_dims(head_dim, head_dim, size)


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
    n_layers = model.config.num_hidden_layers
    for name, given in (("layer budgets", budgets), ("layer byte budgets", byte_budgets)):
        if given is not None and len(given) != n_layers:
            raise ValueError(f"{len(given)} {name} for a model with {n_layers} layers")
    sizes = entry_bytes(model, original_element_size)
    if config.tristate.enabled and byte_budgets is None and budgets is not None:
        byte_budgets = token_byte_budgets(budgets, model.config.num_key_value_heads, sizes)
    eviction = make_eviction(config, budgets, byte_budgets, sizes)
    decoder = model.base_model  # no LM head: block prefill needs no logits
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    n_new = input_ids.shape[0]
    cache = EpisodicCache(n_layers) if cache is None else cache
    total = cache.tokens_seen + n_new  # where decoding will start (DapQ's patch positions)
    cache.collect_moments(isinstance(eviction, TriStateEviction))
    rotation = KeyRotation.for_model(model) if config.position_mode == "compact" else None
    # what a scorer may hold a share of (tri-state budgets bytes, not entries)
    entry_budgets = None if config.tristate.enabled else budgets
    stats = PrefillStats()
    for begin in range(0, n_new, config.block):
        block = input_ids[begin:begin + config.block]
        seen = cache.tokens_seen
        patch = scorer.patch_ids(BlockContext(block_ids=block, tokens_seen=seen))
        patch = patch.to(device) if patch is not None else block.new_zeros(0)
        tokens = torch.cat([block, patch])
        positions = patch_positions(cache.next_position, block.shape[0], patch.shape[0], total,
                                    config.decode_positions).to(device)
        with cache.patched(patch.shape[0], **scorer.patch_options()):
            decoder(input_ids=tokens[None], position_ids=positions[None], past_key_values=cache,
                    use_cache=True)
        if eviction is not None:
            states = [layer_state(idx, layer, seen,
                                  None if entry_budgets is None else entry_budgets[idx])
                      for idx, layer in enumerate(cache.layers)]
            eviction.step(cache.layers, states, scorer, final=begin + config.block >= n_new)
        if rotation is not None:
            cache.compact(rotation, config.compact_recent)
        for layer in cache.layers:
            layer.last_request = None
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
    _count_states(stats, cache, model, sizes, eviction)
    return cache, stats


def _count_states(stats: PrefillStats, cache: EpisodicCache, model: torch.nn.Module,
                  sizes: EntryBytes, eviction: Eviction | None) -> None:
    stats.original_entries, stats.quantized_entries = cache.state_counts()
    seen = cache.tokens_seen * model.config.num_key_value_heads * len(cache.layers)
    stats.evicted_entries = seen - stats.original_entries - stats.quantized_entries
    stats.original_bytes = stats.original_entries * sizes.original
    stats.quantized_bytes = stats.quantized_entries * sizes.quantized
    stats.evicted_bytes = stats.evicted_entries * sizes.original
    merger = getattr(eviction, "merger", None)
    stats.merged_entries = merger.merged if merger is not None else 0
    stats.oq_ratios = list(getattr(eviction, "last_ratios", []))
    stats.byte_budgets = list(getattr(eviction, "byte_budgets", []))
