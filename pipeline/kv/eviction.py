"""What the block-prefill loop does to the cache beside the forward: the `Compression` interface.

`pipeline.kv.prefill.block_prefill` asks one `Compression` where a block's patch sits, which
layers to cut and how, and what to do after each block; it knows no strategy by name. The
strategies compose as kvpress's presses do: an eviction at the core (`TokenEviction` here,
EpiCache's top-k cut to a budget of entries; ARKV's `pipeline.kv.tristate.TriStateEviction`
under a byte budget; the base class itself for the full cache), wrapped by what may go with any
of them: D2O merging (`pipeline.kv.merging.Merging`), DapQ's decode positions and compact
positions (`pipeline.kv.positions`). `pipeline.kv.compression.compression_for` composes them
from a `PrefillConfig`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pipeline.config import Selection
from pipeline.kv.methods.base import LayerState, Scorer


@dataclass(frozen=True)
class Cut:
    """What one eviction step does to one layer."""
    keep: torch.Tensor  # [Hkv, slots] bool: the entries that stay
    quantize: torch.Tensor | None = None  # [Hkv, slots] bool: kept entries quantized (tri-state)
    fp8: bool = False  # quantized to fp8 e4m3 codes instead of int8
    targets: torch.Tensor | None = None  # entries evicted ones may fold into (None: `keep`)


class Compression:
    """The full cache: no eviction, patches right after their block. Strategies override the
    hooks they change; `step` runs `plan` and `apply` for every layer that needs a cut."""

    @property
    def collects_moments(self) -> bool:
        """Whether patch forwards must return the patch attention's moments (ARKV)."""
        return False

    def patch_positions(self, first: int, n_block: int, n_patch: int, total: int) -> torch.Tensor:
        """Positions of a block starting at `first` and its patch: consecutive. `total` is where
        decoding will start (the whole input)."""
        return torch.arange(first, first + n_block + n_patch)

    def plan(self, layers: list, states: list[LayerState], scorer: Scorer,
             final: bool) -> Iterator[tuple[int, Cut]]:
        """The cut of each layer that needs one after a block (`final`: the last block)."""
        return iter(())

    def apply(self, layer_idx: int, layer, cut: Cut) -> None:
        if cut.quantize is not None:
            layer.quantize(cut.quantize, fp8=cut.fp8)
        layer.keep(cut.keep)

    def step(self, layers: list, states: list[LayerState], scorer: Scorer, final: bool) -> None:
        """Cut `layers`, each with its state beside it: every layer of the cache after a block,
        or one pass's one layer (`pipeline.kv.one_pass`). Cuts name layers by index."""
        by_index = {state.layer_idx: layer for layer, state in zip(layers, states)}
        for idx, cut in self.plan(layers, states, scorer, final):
            self.apply(idx, by_index[idx], cut)

    def after_step(self, cache) -> None:
        """After a block's eviction (compact positions re-rotate the kept entries here)."""

    def report(self, stats) -> None:
        """Fill the strategy's own figures into the prefill's stats."""


class Wrapper(Compression):
    """A strategy around another: every hook is the inner one's unless overridden. `step` stays
    the base's, so a wrapper's `plan` or `apply` is the one that runs."""

    def __init__(self, inner: Compression):
        self.inner = inner

    @property
    def collects_moments(self) -> bool:
        return self.inner.collects_moments

    def patch_positions(self, first: int, n_block: int, n_patch: int, total: int) -> torch.Tensor:
        return self.inner.patch_positions(first, n_block, n_patch, total)

    def plan(self, layers, states, scorer, final):
        return self.inner.plan(layers, states, scorer, final)

    def apply(self, layer_idx: int, layer, cut: Cut) -> None:
        self.inner.apply(layer_idx, layer, cut)

    def after_step(self, cache) -> None:
        self.inner.after_step(cache)

    def report(self, stats) -> None:
        self.inner.report(stats)


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


class TokenEviction(Compression):
    """Cut each layer back to `budgets[layer]` entries per KV head (EpiCache): the top-k of the
    scorer's scores, head-wise (AdaKV) or per head."""

    def __init__(self, budgets: list[int], selection: Selection, head_floor: float = 0.0):
        self.budgets, self.selection, self.head_floor = budgets, selection, head_floor

    def over_budget(self, layer, budget: int) -> bool:
        counts = layer.valid.sum(dim=1)
        if self.selection == "headwise":
            return int(counts.sum().item()) > budget * counts.numel()
        return int(counts.max().item()) > budget

    def plan(self, layers, states, scorer, final):
        for layer, state in zip(layers, states):
            budget = self.budgets[state.layer_idx]
            if self.over_budget(layer, budget):
                yield state.layer_idx, Cut(select_keep(scorer.score(state), layer.valid, budget,
                                                       self.selection, self.head_floor))
