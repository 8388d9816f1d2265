"""Score shaping: wrappers that reshape another scorer's scores (kvpress-style composition).
EpiCache's recipe is its patch attention shaped by these (`pipeline.kv.methods.epicache`); any
scorer can be wrapped."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pipeline.kv.methods.base import BlockContext, LayerState, Scorer


@dataclass
class ShapedScorer(Scorer):
    """A scorer that reshapes the scores of `inner` (its patch unchanged)."""
    inner: Scorer

    @property
    def name(self) -> str:
        return self.inner.name

    def patch_ids(self, block: BlockContext) -> torch.Tensor | None:
        return self.inner.patch_ids(block)


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
    questions about this episode will read keeps this episode's turns first."""
    member: torch.Tensor  # [N] bool: token positions inside the episode's windows
    weight: float = 1.0

    def score(self, layer: LayerState) -> torch.Tensor:
        scores = self.inner.score(layer).float()
        member = self.member.to(scores.device)
        inside = member[layer.positions.clamp(max=member.shape[0] - 1)]
        return torch.where(inside, scores * (1 + self.weight), scores)


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


def refocused(scorer: Scorer, weight: float) -> Scorer:
    """`scorer` with its episode's own turns weighted by (1 + `weight`) instead: the same
    shaping around a `FocusScorer` of that weight. A scorer with no focus is refused (there is
    nothing to weight)."""
    if isinstance(scorer, FocusScorer):
        return replace(scorer, weight=weight)
    if isinstance(scorer, ShapedScorer):
        return replace(scorer, inner=refocused(scorer.inner, weight))
    raise ValueError(f"pass_focus weights the episode's own turns, and {scorer.name} does not "
                     f"focus on them (epicache with scoring.focus > 0 does)")
