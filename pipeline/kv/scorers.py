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

from pipeline.configs import SCORER_NAMES, ScoringConfig


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
    budget: int | None = None  # entries per KV head the layer is cut to (None: not by entries)


class Scorer(ABC):
    """Higher score = more worth keeping. Scores of invalid slots are ignored."""
    name: ClassVar[str]

    def patch_ids(self, block: BlockContext) -> torch.Tensor | None:
        """Token ids of the patched prompt to score with after this block, or None."""
        return None

    def patch_options(self) -> dict:
        """How the attention turns the patch's attention into `patch_scores`: `reduce` ("max"
        or "mean" over the patch queries) and `include_patch` (the patch's own keys in the
        softmax). Defaults: max, with the patch's keys."""
        return {}

    @abstractmethod
    def score(self, layer: LayerState) -> torch.Tensor: ...


SCORERS: dict[str, type[Scorer]] = {}


def register(cls: type[Scorer]) -> type[Scorer]:
    if cls.name not in SCORER_NAMES:  # the command line offers the names without importing this
        raise ValueError(f"scorer {cls.name!r} is not listed in pipeline.configs.SCORER_NAMES")
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
    """EpiCache: the patch is the episode's medoid windows, rendered like the conversation.
    `reduce` and `include_patch` choose how the patch's attention becomes a score (the paper's
    text: max over the patch queries; whether the patch's own keys share the softmax is an
    implementation choice, measured in docs/quality.md)."""
    reduce: str = "max"
    include_patch: bool = True
    name: ClassVar[str] = "epicache"

    def patch_options(self) -> dict:
        return {"reduce": self.reduce, "include_patch": self.include_patch}


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


def _anchor_distance(keys: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """-cosine similarity of every key to the mean of the `members` keys, per head."""
    keys = keys.float()
    anchor = (keys * members[..., None]).sum(1) / members.sum(1, keepdim=True).clamp(min=1)
    return -torch.nn.functional.cosine_similarity(keys, anchor[:, None, :], dim=-1)


@register
@dataclass
class KeyDiffScorer(Scorer):
    """KeyDiff (the paper's and kvpress's anchor): keep keys unlike the mean of all the keys
    being compressed, the kept ones and the block's (score = -cosine similarity)."""
    name: ClassVar[str] = "keydiff"

    def score(self, layer: LayerState) -> torch.Tensor:
        return _anchor_distance(layer.keys, layer.valid)


@register
@dataclass
class KeyDiffBlockScorer(Scorer):
    """KeyDiff anchored on the mean key of the block just fed only (this project's first
    KeyDiff): the block's tokens look like their own mean, so it tends to keep the oldest."""
    name: ClassVar[str] = "keydiff-block"

    def score(self, layer: LayerState) -> torch.Tensor:
        return _anchor_distance(layer.keys, (layer.positions >= layer.block_start) & layer.valid)


@register
@dataclass
class OldestScorer(Scorer):
    """A diagnostic: keep the first tokens of the conversation (score = -position)."""
    name: ClassVar[str] = "oldest"

    def score(self, layer: LayerState) -> torch.Tensor:
        return -layer.positions.float()


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


# ---------------------------------------------------------------------------------------------
# Score shaping: wrappers that reshape another scorer's scores (kvpress-style composition)
# ---------------------------------------------------------------------------------------------

@dataclass
class ShapedScorer(Scorer):
    """A scorer that reshapes the scores of `inner` (its patch and patch options unchanged)."""
    inner: Scorer

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    def patch_ids(self, block: BlockContext) -> torch.Tensor | None:
        return self.inner.patch_ids(block)

    def patch_options(self) -> dict:
        return self.inner.patch_options()


@dataclass
class PooledScorer(ShapedScorer):
    """SnapKV's pooling: each entry scores the max of its neighbours' scores (`kernel` slots
    wide, per head), so the tokens around an attended token survive with it."""
    kernel: int = 7

    def score(self, layer: LayerState) -> torch.Tensor:
        scores = self.inner.score(layer).float().masked_fill(~layer.valid, float("-inf"))
        pooled = torch.nn.functional.max_pool1d(scores[:, None], self.kernel, stride=1,
                                                padding=self.kernel // 2)[:, 0]
        return pooled[:, :scores.shape[1]]


@dataclass
class UtteranceScorer(ShapedScorer):
    """Whole utterances: every held entry of a line (a turn) scores the mean of its line's
    held scores in that head, with its own score as a tie-break inside the line, so eviction
    keeps or drops turns whole and the model can still read (and copy) what it keeps."""
    line_ids: torch.Tensor  # [N] long: the line of each token position (`TokenLayout.line_ids`)
    tie_break: float = 1e-3

    def score(self, layer: LayerState) -> torch.Tensor:
        scores = self.inner.score(layer).float()
        line_ids = self.line_ids.to(scores.device)
        lines = line_ids[layer.positions.clamp(max=line_ids.shape[0] - 1)]
        n_lines = int(line_ids.max()) + 1
        valid = layer.valid.float()
        total = torch.zeros(scores.shape[0], n_lines, device=scores.device).scatter_add_(
            1, lines, torch.where(layer.valid, scores, 0.0))
        count = torch.zeros_like(total).scatter_add_(1, lines, valid)
        line_mean = (total / count.clamp(min=1)).gather(1, lines)
        return line_mean + self.tie_break * scores


@dataclass
class FocusScorer(ShapedScorer):
    """Weights the scores of the episode's own turns by (1 + `weight`): a cache that only
    questions about this episode will read keeps this episode's turns first. With `shared`,
    that share of the layer's budget first goes to the other turns the patch attends to most
    (unweighted), so a question routed here by mistake may still find its evidence."""
    member: torch.Tensor  # [N] bool: token positions inside the episode's windows
    weight: float = 1.0
    shared: float = 0.0

    def score(self, layer: LayerState) -> torch.Tensor:
        scores = self.inner.score(layer).float()
        member = self.member.to(scores.device)
        inside = member[layer.positions.clamp(max=member.shape[0] - 1)]
        focused = torch.where(inside, scores * (1 + self.weight), scores)
        held = int(self.shared * layer.budget) if layer.budget is not None else 0
        if held == 0:
            return focused
        others = scores.masked_fill(inside | ~layer.valid, float("-inf"))
        top = torch.topk(others, min(held, others.shape[1]), dim=1).indices
        shared = torch.zeros_like(inside).scatter_(1, top, True) & others.isfinite()
        return focused.masked_fill(shared, float("inf"))


@dataclass
class ProtectedScorer(ShapedScorer):
    """Always keeps the first `sink` tokens and the `recent` most recent ones (StreamingLLM's
    attention sinks and window, as a safeguard under any scorer)."""
    sink: int = 0
    recent: int = 0

    def score(self, layer: LayerState) -> torch.Tensor:
        scores = self.inner.score(layer).float()
        newest = int(layer.positions.masked_fill(~layer.valid, -1).max()) + 1
        protect = (layer.positions < self.sink) | (layer.positions >= newest - self.recent)
        return scores.masked_fill(protect, float("inf"))


def episodic_scorer(patch: torch.Tensor, config: ScoringConfig, line_ids: torch.Tensor | None = None,
                    member: torch.Tensor | None = None) -> Scorer:
    """EpiCache's scorer for one episode: the patch's attention, shaped as `config` says.
    `line_ids` ([N]: the line of each token) is needed for `utterance`, `member` ([N] bool:
    the episode's own tokens) for `focus`."""
    if config.patch_tokens is not None:
        patch = patch[:config.patch_tokens]
    scorer: Scorer = EpiCacheScorer(patch=patch, reduce=config.reduce,
                                    include_patch=config.include_patch)
    if config.pool:
        scorer = PooledScorer(scorer, config.pool)
    if config.utterance:
        if line_ids is None:
            raise ValueError("utterance scoring needs the token layout (line ids)")
        scorer = UtteranceScorer(scorer, line_ids)
    if config.focus or config.shared:
        if member is None:
            raise ValueError("focus and shared need the episode's member tokens")
        scorer = FocusScorer(scorer, member, config.focus, config.shared)
    if config.sink or config.recent:
        scorer = ProtectedScorer(scorer, config.sink, config.recent)
    return scorer


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
