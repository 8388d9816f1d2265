"""What an eviction step does to a layer: the strategy interface behind the block-prefill loop.

`pipeline.kv.prefill.block_prefill` runs one `Eviction` after every block and knows no strategy
by name. `TokenEviction` (the default) cuts each layer to its budget of entries per KV head
(head-wise or per-head top-k of the scorer's scores), as EpiCache does; ARKV's tri-state
strategy is `pipeline.kv.tristate.TriStateEviction`. Either may merge what it evicts
(`pipeline.kv.merging`).
"""

from __future__ import annotations

from typing import Callable

from pipeline.kv.merging import Merger
from pipeline.kv.scorers import LayerState, Scorer


class Eviction:
    """One eviction step over every layer, after a block went through."""

    def step(self, layers: list, states: list[LayerState], scorer: Scorer, final: bool) -> None:
        raise NotImplementedError


class TokenEviction(Eviction):
    """Cut each layer back to `budgets[layer]` entries per KV head (EpiCache)."""

    def __init__(self, budgets: list[int], selection: str, select: Callable, merger: Merger | None):
        self.budgets, self.selection, self.select, self.merger = budgets, selection, select, merger

    def over_budget(self, layer, budget: int) -> bool:
        counts = layer.valid.sum(dim=1)
        if self.selection == "headwise":
            return int(counts.sum().item()) > budget * counts.numel()
        return int(counts.max().item()) > budget

    def step(self, layers, states, scorer, final):
        for idx, layer in enumerate(layers):
            if self.over_budget(layer, self.budgets[idx]):
                keep = self.select(scorer.score(states[idx]), layer.valid, self.budgets[idx],
                                   self.selection)
                if self.merger is not None:
                    self.merger.merge(idx, layer, keep, keep)
                layer.keep(keep)
