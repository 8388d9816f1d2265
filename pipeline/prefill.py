"""Block prefill under a fixed budget (EpiCache stage 2): the only place that evicts.

The conversation goes through the model `block` tokens at a time. When the scorer has a patched
prompt, it rides in the same forward right after the block: its queries see the cache, the
block and the patch's own earlier tokens; its attention to every cached entry is scored inside
the attention call; its keys and values are never stored. Then each layer is cut back to its
budget. So a layer never holds more than budget + block entries, whatever the conversation's
length: peak memory is flat.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from pipeline.cache import EpisodicCache, EpisodicLayer
from pipeline.scorers import BlockContext, LayerState, Scorer

Selection = Literal["headwise", "perhead"]


@dataclass(frozen=True)
class PrefillConfig:
    block: int = 512  # tokens fed per step
    selection: Selection = "headwise"  # AdaKV head-wise non-uniform top-k, or a uniform per-head top-k

    def __post_init__(self):
        if self.block < 1:
            raise ValueError(f"block must be positive, got {self.block}")
        if self.selection not in ("headwise", "perhead"):
            raise ValueError(f"selection must be 'headwise' or 'perhead', got {self.selection!r}")


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


def select_keep(scores: torch.Tensor, valid: torch.Tensor, budget: int,
                selection: Selection) -> torch.Tensor:
    """[Hkv, slots] bool: the entries to keep so that the layer holds `budget` per head.

    head-wise: the top budget x Hkv entries across the layer's heads (heads get unequal shares);
    per-head: the top `budget` entries of each head."""
    scores = scores.float().masked_fill(~valid, float("-inf"))
    keep = torch.zeros_like(valid)
    if selection == "headwise":
        k = min(budget * valid.shape[0], int(valid.sum().item()))
        keep.view(-1)[torch.topk(scores.reshape(-1), k).indices] = True
    else:
        k = min(budget, valid.shape[1])
        keep.scatter_(1, torch.topk(scores, k, dim=1).indices, True)
    return keep & valid


def _over_budget(layer: EpisodicLayer, budget: int, selection: Selection) -> bool:
    counts = layer.valid.sum(dim=1)
    if selection == "headwise":
        return int(counts.sum().item()) > budget * counts.numel()
    return int(counts.max().item()) > budget


def _layer_state(idx: int, layer: EpisodicLayer, block_start: int) -> LayerState:
    request = layer.last_request
    return LayerState(layer_idx=idx, keys=layer.keys[0], values=layer.values[0],
                      valid=layer.valid, positions=layer.positions,
                      patch_scores=request.scores if request is not None else None,
                      block_start=block_start)


@torch.inference_mode()
def block_prefill(model: torch.nn.Module, input_ids: torch.Tensor, scorer: Scorer,
                  budgets: list[int] | None, config: PrefillConfig = PrefillConfig(),
                  on_block: Callable[[int], None] | None = None) -> tuple[EpisodicCache, PrefillStats]:
    """Feed `input_ids` ([N]) block by block, evicting each layer to `budgets[layer]` entries
    per head after every block (no eviction when `budgets` is None: the full cache)."""
    start_time = time.perf_counter()
    n_layers = model.config.num_hidden_layers
    if budgets is not None and len(budgets) != n_layers:
        raise ValueError(f"{len(budgets)} layer budgets for a model with {n_layers} layers")
    decoder = model.base_model  # no LM head: block prefill needs no logits
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    cache = EpisodicCache(n_layers)
    stats = PrefillStats()
    for begin in range(0, input_ids.shape[0], config.block):
        block = input_ids[begin:begin + config.block]
        seen = cache.tokens_seen
        patch = scorer.patch_ids(BlockContext(block_ids=block, tokens_seen=seen))
        patch = patch.to(device) if patch is not None else block.new_zeros(0)
        tokens = torch.cat([block, patch])
        positions = torch.arange(seen, seen + tokens.shape[0], device=device)
        with cache.patched(patch.shape[0]):
            decoder(input_ids=tokens[None], position_ids=positions[None], past_key_values=cache,
                    use_cache=True)
        if budgets is not None:
            for idx, layer in enumerate(cache.layers):
                if _over_budget(layer, budgets[idx], config.selection):
                    scores = scorer.score(_layer_state(idx, layer, seen))
                    layer.keep(select_keep(scores, layer.valid, budgets[idx], config.selection))
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
    return cache, stats
