"""ARKV tri-state compression: every cached entry is Original, Quantized or Evicted.

The layer's budget is in bytes. Original entries are stored at the store dtype; Quantized ones
as int8 or fp8 e4m3 codes with a per-token, per-head float32 scale. The share of a layer's bytes
spent on Original entries is the layer's OQ ratio (ARKV eq. 6-8) from the entropy, variance and
kurtosis of the patch attention; entries rank by the heavy-hitter score
mean + gamma x variance over the patch queries and the query heads of the KV group (eq. 9); the
most recent `window` tokens are always Original (eq. 10).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.config import TriStateConfig
from pipeline.kv.eviction import Compression, Cut
from pipeline.kv.methods.base import LayerState

# Bytes of one quantized (token, KV head) entry beyond its codes: a float32 scale for the key
# row and one for the value row.
SCALE_BYTES = 4


def heavy_hitter_scores(patch_sum: torch.Tensor, patch_sumsq: torch.Tensor, count: int,
                        gamma: float) -> torch.Tensor:
    """ARKV eq. 9 per KV head: mean + gamma * (population) variance of the attention an entry
    receives, over the patch queries and the query heads of the KV group (`count` of them)."""
    mean = patch_sum / count
    var = (patch_sumsq / count - mean * mean).clamp_min(0.0)
    return mean + gamma * var


def oq_score(attention: torch.Tensor, config: TriStateConfig) -> float:
    """ARKV eq. 3-6: q = H^(1/tau1) V^(1/tau2) K^(1/tau3) of p = attention / sum(attention),
    over the entries given (1-D: the summed attention each evictable entry receives)."""
    a = attention.double().flatten()
    total = a.sum()
    if a.numel() < 2 or total <= 0:
        return 0.0
    p = a / total
    entropy = -(p[p > 0] * p[p > 0].log()).sum()
    centred = p - p.mean()
    variance = (centred ** 2).mean()
    if variance <= 0:
        return 0.0
    kurtosis = (centred ** 4).mean() / variance ** 2
    q = (entropy.clamp_min(0) ** (1 / config.tau_entropy) * variance ** (1 / config.tau_variance)
         * kurtosis ** (1 / config.tau_kurtosis))
    return float(q)


def oq_ratios(scores: list[float], original_scale: float = 1.0) -> list[float]:
    """ARKV eq. 7: rho_l = q_l / max_k q_k (times `original_scale`, capped at 1); all 1 when
    no layer has a score."""
    top = max(scores, default=0.0)
    if top <= 0:
        return [min(1.0, original_scale)] * len(scores)
    return [min(1.0, original_scale * s / top) for s in scores]


def protected_window(layer, window: int) -> torch.Tensor:
    """[Hkv, slots] bool: valid entries among the `window` most recent tokens."""
    return layer.valid & (layer.positions >= layer.tokens_seen - window)


@dataclass(frozen=True)
class EntryBytes:
    """Bytes of one (token, KV head) entry in each kept state."""
    original: int  # (d_k + d_v) x element size of the stored dtype
    quantized: int  # (d_k + d_v) x 1 byte of codes + 2 float32 scales

    @classmethod
    def for_dims(cls, key_dim: int, value_dim: int, original_element_size: int) -> "EntryBytes":
        return cls((key_dim + value_dim) * original_element_size,
                   key_dim + value_dim + 2 * SCALE_BYTES)


def layer_bytes(layer, sizes: EntryBytes) -> int:
    original, quantized = layer.state_counts()
    return original * sizes.original + quantized * sizes.quantized


@dataclass
class TriStatePlan:
    keep: torch.Tensor  # [Hkv, S] bool: Original or Quantized after the step
    quantize: torch.Tensor  # [Hkv, S] bool: Quantized after the step (a subset of keep)


def plan_tristate(scores: torch.Tensor, valid: torch.Tensor, quantized: torch.Tensor,
                  window: torch.Tensor, budget_bytes: int, rho: float, sizes: EntryBytes,
                  selection: str) -> TriStatePlan:
    """ARKV eq. 10 under a byte budget. The window entries are Original; of the bytes left,
    a share `rho` buys Original entries: the top n_o = floor(rho R / C_o) entries by score
    (an entry already quantized stays Quantized, at C_q: it is never re-quantized and cannot be
    restored); what remains buys Quantized entries, next in score order; the rest is evicted.
    Head-wise: one ranking over the layer's heads; per-head: each head has budget / Hkv."""
    n_heads = valid.shape[0]
    window = window & valid
    eligible = valid & ~window
    if selection == "headwise":
        rows = lambda t: t.reshape(1, -1)  # noqa: E731
        budgets = torch.tensor([budget_bytes], dtype=torch.float64)
    else:
        rows = lambda t: t  # noqa: E731
        budgets = torch.full((n_heads,), budget_bytes / n_heads, dtype=torch.float64)
    r_eligible, r_quantized = rows(eligible), rows(quantized & eligible)
    remaining = budgets - rows(window).sum(dim=1).double() * sizes.original
    order = torch.argsort(rows(scores.float()).masked_fill(~r_eligible, float("-inf")), dim=1,
                          descending=True, stable=True)
    sorted_eligible = r_eligible.gather(1, order)
    sorted_quantized = r_quantized.gather(1, order)
    rank = torch.arange(order.shape[1])[None, :]
    n_original = torch.floor(rho * remaining.clamp_min(0) / sizes.original).long()[:, None]
    top = sorted_eligible & (rank < n_original)
    top_cost = torch.where(sorted_quantized, sizes.quantized, sizes.original) * top
    left = remaining - top_cost.sum(dim=1).double()
    n_quantized = torch.floor(left.clamp_min(0) / sizes.quantized).long()[:, None]
    later = sorted_eligible & ~top
    next_q = later & (torch.cumsum(later.long(), dim=1) <= n_quantized)
    keep_sorted = top | next_q
    quant_sorted = (top & sorted_quantized) | next_q
    keep = torch.zeros_like(r_eligible).scatter_(1, order, keep_sorted)
    quant = torch.zeros_like(r_eligible).scatter_(1, order, quant_sorted)
    keep = keep.reshape(valid.shape) | window
    return TriStatePlan(keep=keep, quantize=quant.reshape(valid.shape))


class TriStateEviction(Compression):
    """ARKV's tri-state cache tailor, once per block, under per-layer byte budgets."""

    def __init__(self, byte_budgets: list[int], selection: str, config: TriStateConfig,
                 sizes: EntryBytes):
        self.byte_budgets, self.selection, self.config = byte_budgets, selection, config
        self.sizes = sizes
        self.steps = 0  # eviction steps that ran (per layer, summed)
        self.last_ratios: list[float] = []

    @property
    def collects_moments(self) -> bool:
        return True

    def window_tokens(self, layer, budget_bytes: int) -> int:
        """The protected window, shrunk if the layer's budget cannot hold it Original."""
        per_head = budget_bytes // (layer.valid.shape[0] * self.sizes.original)
        return min(self.config.window, per_head)

    def layer_oq_score(self, layer, state: LayerState, budget_bytes: int) -> float:
        if state.patch_sum is None:
            return 0.0
        evictable = layer.valid & ~protected_window(layer, self.window_tokens(layer, budget_bytes))
        return oq_score(state.patch_sum[evictable], self.config)

    def plan(self, layers, states, scorer, final):
        q = [self.layer_oq_score(layer, state, self.byte_budgets[idx])
             for idx, (layer, state) in enumerate(zip(layers, states))]
        if all(s.patch_sum is None for s in states):  # no patch attention: rho = original_scale
            self.last_ratios = oq_ratios([0.0] * len(layers), self.config.original_scale)
        else:
            self.last_ratios = oq_ratios(q, self.config.original_scale)
        for idx, layer in enumerate(layers):
            budget = self.byte_budgets[idx]
            limit = budget if final else budget / self.config.slack
            if layer_bytes(layer, self.sizes) <= limit:
                continue
            state = states[idx]
            if self.config.heavy_hitter and state.patch_sum is not None:
                scores = heavy_hitter_scores(state.patch_sum, state.patch_sumsq, state.patch_count,
                                             self.config.gamma)
            else:
                scores = scorer.score(state)
            window = protected_window(layer, self.window_tokens(layer, budget))
            plan = plan_tristate(scores, layer.valid, layer.quantized_mask(), window, budget,
                                 self.last_ratios[idx], self.sizes, self.selection)
            self.steps += 1
            # evicted entries never fold into an entry already quantized (D2O merging)
            yield idx, Cut(plan.keep, plan.quantize, self.config.fp8,
                           targets=plan.keep & ~layer.quantized_mask())

    def report(self, stats) -> None:
        stats.oq_ratios = list(self.last_ratios)
        stats.byte_budgets = list(self.byte_budgets)
