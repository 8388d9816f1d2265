"""Token scorers: the strategies that decide which cached entries survive a block.

Like kvpress's presses, each scorer is a small dataclass with one scoring method. A scorer may
also provide a *patched prompt* (token ids) to run after each block: its queries attend to the
cache and the resulting attention (`LayerState.patch_scores`) is what patch-based scorers
return. The block-prefill loop in `prefill.py` is the only place that evicts, and it knows no
scorer by name. More scorers register themselves in `SCORERS` with `@register`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class BlockContext:
    """What a scorer may look at when choosing the patch for a block."""
    block_ids: torch.Tensor  # [T] token ids of the block just fed
    tokens_seen: int  # tokens fed before this block


@dataclass(frozen=True)
class LayerState:
    """What a scorer sees of one layer after a block (and its patch) went through."""
    layer_idx: int
    keys: torch.Tensor  # [Hkv, slots, d] after RoPE
    values: torch.Tensor  # [Hkv, slots, d]
    valid: torch.Tensor  # [Hkv, slots] bool
    positions: torch.Tensor  # [Hkv, slots] original token positions
    patch_scores: torch.Tensor | None  # [Hkv, slots]: max softmax attention from the patch


class Scorer(ABC):
    """Higher score = more worth keeping. Scores of invalid slots are ignored."""
    name: ClassVar[str]

    def patch_ids(self, block: BlockContext) -> torch.Tensor | None:
        """Token ids of the patched prompt to score with after this block, or None."""
        return None

    @abstractmethod
    def score(self, layer: LayerState) -> torch.Tensor: ...


SCORERS: dict[str, type[Scorer]] = {}


def register(cls: type[Scorer]) -> type[Scorer]:
    SCORERS[cls.name] = cls
    return cls


@dataclass
class PatchScorer(Scorer):
    """Keep what a fixed patched prompt attends to (EpiCache's medoid patch, InfiniPot's
    instruction, the question itself...)."""
    patch: torch.Tensor  # [P] token ids
    name: ClassVar[str] = "patch"

    def patch_ids(self, block: BlockContext) -> torch.Tensor | None:
        return self.patch

    def score(self, layer: LayerState) -> torch.Tensor:
        if layer.patch_scores is None:
            raise RuntimeError("patch scores missing: the model is not using episodic attention")
        return layer.patch_scores


@register
@dataclass
class EpiCacheScorer(PatchScorer):
    """EpiCache: the patch is the episode's medoid windows, rendered like the conversation."""
    name: ClassVar[str] = "epicache"


@register
@dataclass
class StreamingLLMScorer(Scorer):
    """StreamingLLM: keep the first `sink` tokens and the most recent ones."""
    sink: int = 128
    name: ClassVar[str] = "streamingllm"

    def score(self, layer: LayerState) -> torch.Tensor:
        recency = layer.positions.float()
        return torch.where(layer.positions < self.sink, torch.full_like(recency, float("inf")), recency)


@register
@dataclass
class FullScorer(Scorer):
    """Full KV: never asked to evict (the loop skips eviction when there is no budget)."""
    name: ClassVar[str] = "full"

    def score(self, layer: LayerState) -> torch.Tensor:
        return torch.ones_like(layer.positions, dtype=torch.float32)
