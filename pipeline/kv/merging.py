"""D2O merging (§4.2.2): evicted entries folded into their most similar kept ones.

Each evicted key goes to its most similar kept key (cosine); if that similarity reaches the
layer's EMA threshold it is folded into that entry by similarity-weighted averaging (keys and
values), else dropped. `Merging` does this around any eviction strategy.
"""

from __future__ import annotations

import math

import torch

from pipeline.config import MergeConfig
from pipeline.kv.eviction import Cut, Wrapper


class Merger:
    """D2O token merging with a per-layer EMA similarity threshold."""

    def __init__(self, config: MergeConfig):
        self.config = config
        self.threshold: dict[int, float] = {}
        self.merged = 0  # entries folded into kept ones so far

    def merge(self, idx: int, layer, keep: torch.Tensor, targets: torch.Tensor) -> None:
        """Fold the entries evicted by `keep` into their most similar entries among `targets`
        (a subset of `keep`), in place. The kept set itself does not change."""
        evicted = layer.valid & ~keep
        targets = targets & keep
        if not evicted.any() or not targets.any():
            return
        keys, values = layer.keys[0], layer.values[0]  # [Hkv, S, d]
        unit = torch.nn.functional.normalize(keys.float(), dim=-1)
        sim = unit @ unit.transpose(1, 2)  # [Hkv, S(evicted rows), S(target columns)]
        sim.masked_fill_(~targets[:, None, :], float("-inf"))
        best, nearest = sim.max(dim=-1)  # [Hkv, S]
        candidates = evicted & torch.isfinite(best)
        if not candidates.any():
            return
        current = float(best[candidates].mean())
        previous = self.threshold.get(idx)
        ema = current if previous is None else \
            self.config.beta * current + (1 - self.config.beta) * previous
        self.threshold[idx] = ema
        merge = candidates & (best >= max(ema, self.config.min_threshold))
        if not merge.any():
            return
        # Similarity-weighted average (GAT-style weights, D2O eq. 11-12): the kept entry weighs
        # exp(1) (its self-similarity), each evicted entry merged into it exp(similarity).
        weight = torch.where(merge, best.exp(), torch.zeros_like(best))  # [Hkv, S]
        index = torch.where(merge, nearest, torch.zeros_like(nearest))
        den = torch.zeros_like(weight).scatter_add_(1, index, weight) + math.e
        hits = torch.zeros_like(index).scatter_add_(1, index, merge.long())
        touched = (hits > 0) & targets
        for tensor in (keys, values):
            num = (tensor.float() * math.e).scatter_add_(
                1, index[..., None].expand(-1, -1, tensor.shape[-1]),
                tensor.float() * weight[..., None])
            tensor[touched] = (num / den[..., None])[touched].to(tensor.dtype)
        self.merged += int(merge.sum().item())


class Merging(Wrapper):
    """D2O merging around an eviction: before a layer is cut, what the cut evicts is folded
    into the entries it may fold into (`Cut.targets`)."""

    def __init__(self, inner, config: MergeConfig):
        super().__init__(inner)
        self.merger = Merger(config)

    def apply(self, layer_idx: int, layer, cut: Cut) -> None:
        targets = cut.keep if cut.targets is None else cut.targets
        self.merger.merge(layer_idx, layer, cut.keep, targets)
        self.inner.apply(layer_idx, layer, cut)

    def report(self, stats) -> None:
        self.inner.report(stats)
        stats.merged_entries = self.merger.merged
