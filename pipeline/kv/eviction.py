"""TODO docstring."""

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
