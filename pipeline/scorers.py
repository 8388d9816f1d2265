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
from typing import Callable, ClassVar

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
    block_start: int = 0  # position of the first token of the block just fed
    # Moments of the patch attention over the patch queries and the query heads of each KV
    # group (ARKV statistics; None without a patch): sum and sum of squares [Hkv, slots], and
    # how many (query head, patch query) rows they sum.
    patch_sum: torch.Tensor | None = None
    patch_sumsq: torch.Tensor | None = None
    patch_count: int = 0


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


class AttentionScorer(Scorer):
    """Scores are the attention the patch's queries pay to each cached entry."""

    def score(self, layer: LayerState) -> torch.Tensor:
        if layer.patch_scores is None:
            raise RuntimeError("patch scores missing: the model is not using episodic attention")
        return layer.patch_scores


@dataclass
class PatchScorer(AttentionScorer):
    """Keep what a fixed patched prompt attends to (EpiCache's medoid patch, InfiniPot's
    instruction, the question itself...)."""
    patch: torch.Tensor  # [P] token ids
    name: ClassVar[str] = "patch"

    def patch_ids(self, block: BlockContext) -> torch.Tensor | None:
        return self.patch


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
class SnapKVScorer(AttentionScorer):
    """SnapKV in the block setting: the patch is the last `window` tokens of the block."""
    window: int = 64
    name: ClassVar[str] = "snapkv"

    def patch_ids(self, block: BlockContext) -> torch.Tensor | None:
        return block.block_ids[-self.window:]


@register
@dataclass
class InfiniPotScorer(PatchScorer):
    """InfiniPot: a fixed instruction as the patch (the caller tokenizes INSTRUCTION)."""
    INSTRUCTION: ClassVar[str] = "Summarize the previous context highlighting the most important parts."
    name: ClassVar[str] = "infinipot"


@register
@dataclass
class KVzipScorer(AttentionScorer):
    """KVzip in the block setting: a repeat instruction followed by the block's own tokens."""
    instruction: torch.Tensor  # token ids of INSTRUCTION
    INSTRUCTION: ClassVar[str] = "Repeat the previous context exactly."
    name: ClassVar[str] = "kvzip"

    def patch_ids(self, block: BlockContext) -> torch.Tensor | None:
        return torch.cat([self.instruction.to(block.block_ids.device), block.block_ids])


@register
@dataclass
class KeyDiffScorer(Scorer):
    """KeyDiff: keep keys unlike the block's mean key (score = -cosine similarity)."""
    name: ClassVar[str] = "keydiff"

    def score(self, layer: LayerState) -> torch.Tensor:
        keys = layer.keys.float()
        in_block = (layer.positions >= layer.block_start) & layer.valid
        anchor = (keys * in_block[..., None]).sum(1) / in_block.sum(1, keepdim=True).clamp(min=1)
        return -torch.nn.functional.cosine_similarity(keys, anchor[:, None, :], dim=-1)


@register
@dataclass
class RandomScorer(Scorer):
    """A floor for the others (kvpress's RandomPress): uniform random scores, reproducible from
    the seed, the layer and the block."""
    seed: int = 0
    name: ClassVar[str] = "random"

    def score(self, layer: LayerState) -> torch.Tensor:
        generator = torch.Generator().manual_seed(
            self.seed + 1_000_003 * layer.layer_idx + layer.block_start)
        return torch.rand(layer.positions.shape, generator=generator).to(layer.positions.device)


@register
@dataclass
class QuestionScorer(PatchScorer):
    """Upper bound that cannot be deployed: the patch is the question itself (one build per
    question)."""
    name: ClassVar[str] = "question"


@register
@dataclass
class FullScorer(Scorer):
    """Full KV: never asked to evict (the loop skips eviction when there is no budget)."""
    name: ClassVar[str] = "full"

    def score(self, layer: LayerState) -> torch.Tensor:
        return torch.ones_like(layer.positions, dtype=torch.float32)


def build_scorer(name: str, encode: Callable[[str], torch.Tensor], patch_text: str | None = None,
                 **options) -> Scorer:
    """The scorer `name`, its text patch (if any) tokenized with `encode`. `patch_text` is the
    episode's medoid text (epicache) or the question (question)."""
    cls = SCORERS.get(name)
    if cls is None:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(sorted(SCORERS))}")
    if cls in (InfiniPotScorer,):
        return cls(patch=encode(cls.INSTRUCTION), **options)
    if cls is KVzipScorer:
        return cls(instruction=encode(cls.INSTRUCTION), **options)
    if issubclass(cls, PatchScorer):
        if not patch_text:
            raise ValueError(f"method {name!r} needs a patch text")
        return cls(patch=encode(patch_text), **options)
    return cls(**options)
