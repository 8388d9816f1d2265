"""Layer sensitivity to block-prefill eviction, and layer budgets from it (EpiCache §3.2).

Once per model: run one long text twice, with the causal mask and with a mask that lets each
token see only the first `sink` tokens and the most recent ones (a simulated budget of
`window` tokens). A layer whose Key states move a lot under that mask (low cosine similarity)
is sensitive and gets more budget.

Allocators are small classes behind one interface (`Allocator`: made from the build
configuration, a per-model profile measured once, then integer layer budgets from it):
`SensitivityAllocator` (EpiCache, the default) and `VarianceAllocator` (D2O §4.1: layers whose
cumulative attention varies less, i.e. denser attention, get more budget). Each is registered by
name in `pipeline.config.registry.ALLOCATORS` (one line: a new allocator is its class here and
that line); `allocator_class(name)` finds it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from transformers import DynamicCache

from pipeline.config import BuildConfig, CalibrationConfig, registry
from pipeline.kv.attention import attention_column_sums


def sink_recent_mask(n: int, sink: int, window: int) -> torch.Tensor:
    """[n, n] bool: causal, restricted to the first `sink` and the last `window - sink` tokens."""
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    recent = max(window - sink, 1)
    return (k <= q) & ((k < sink) | (q - k < recent))


def _key_states(model: torch.nn.Module, input_ids: torch.Tensor,
                mask: torch.Tensor | None) -> list[torch.Tensor]:
    cache = DynamicCache()
    kwargs = {}
    if mask is not None:  # additive float mask: every attention implementation honours it
        dtype = next(model.parameters()).dtype
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        kwargs["attention_mask"] = additive.masked_fill(~mask, torch.finfo(dtype).min)[None, None]
    model.base_model(input_ids=input_ids[None], past_key_values=cache, use_cache=True, **kwargs)
    return [layer.keys[0].float() for layer in cache.layers]  # [Hkv, N, d] per layer


@torch.inference_mode()
def layer_similarity(model: torch.nn.Module, input_ids: torch.Tensor,
                     config: CalibrationConfig = CalibrationConfig()) -> np.ndarray:
    """Per layer: mean cosine similarity of Key states, causal vs sink+recent mask, over heads
    and over the tokens where the two masks differ (beyond the window)."""
    n = input_ids.shape[0]
    if n <= config.window:
        raise ValueError(f"calibration text of {n} tokens must be longer than the window "
                         f"({config.window}) for the masks to differ")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    full = _key_states(model, input_ids, None)
    masked = _key_states(model, input_ids,
                         sink_recent_mask(n, config.sink, config.window).to(device))
    sims = [torch.nn.functional.cosine_similarity(a[:, config.window:], b[:, config.window:],
                                                  dim=-1).mean().item()
            for a, b in zip(full, masked)]
    return np.asarray(sims, dtype=np.float64)


def allocate_budgets(similarity: np.ndarray | list[float], mean_budget: int, alpha: float = 1.0,
                     floor_fraction: float = 0.25) -> list[int]:
    """Integer layer budgets with mean exactly `mean_budget`, each at least
    `floor_fraction * mean_budget`; layer weights (1 - minmax(similarity))^alpha."""
    sim = np.asarray(similarity, dtype=np.float64)
    n = sim.shape[0]
    spread = sim.max() - sim.min()
    weights = (1.0 - (sim - sim.min()) / spread) ** alpha if spread > 0 else np.ones(n)
    return allocate_from_weights(weights, mean_budget, floor_fraction)


def allocate_from_weights(weights: np.ndarray | list[float], mean_budget: int,
                          floor_fraction: float = 0.25) -> list[int]:
    """Integer budgets in proportion to `weights`, mean exactly `mean_budget`, each at least
    `floor_fraction * mean_budget` (water-filling)."""
    weights = np.asarray(weights, dtype=np.float64)
    n = weights.shape[0]
    total = mean_budget * n
    floor = int(np.ceil(mean_budget * floor_fraction))
    # Water-filling: layers whose share falls under the floor are pinned at it, the rest share
    # what remains in proportion to their weights.
    pinned = np.zeros(n, dtype=bool)
    while True:
        free = ~pinned
        remaining = total - floor * pinned.sum()
        w = weights[free]
        share = remaining * (w / w.sum() if w.sum() > 0 else np.full(w.shape, 1.0 / w.size))
        alloc = np.full(n, float(floor))
        alloc[free] = share
        newly = free & (alloc < floor)
        if not newly.any():
            break
        pinned |= newly
    # Round down, then hand the leftover units to the largest remainders: the sum stays exact.
    budgets = np.floor(alloc).astype(int)
    leftover = total - budgets.sum()
    budgets[np.argsort(-(alloc - budgets), kind="stable")[:leftover]] += 1
    return budgets.tolist()


# ---------------------------------------------------------------------------------------------
# D2O: layer budgets from attention variance
# ---------------------------------------------------------------------------------------------

@torch.inference_mode()
def attention_variance(model: torch.nn.Module, input_ids: torch.Tensor) -> np.ndarray:
    """Per layer (D2O §4.1): the variance over keys of the cumulative attention each key
    receives (summed over the queries of one causal pass, averaged over the query heads).
    The model must use the episodic attention (it records the sums)."""
    device = next(model.parameters()).device
    with attention_column_sums() as sums:
        model.base_model(input_ids=input_ids.to(device)[None], use_cache=False)
    n_layers = model.config.num_hidden_layers
    if len(sums) != n_layers:
        raise RuntimeError(f"attention sums for {len(sums)} of {n_layers} layers: is the model "
                           "on the episodic attention?")
    return np.asarray([sums[i].double().var(unbiased=False).item() for i in range(n_layers)])


def variance_weights(variance: np.ndarray | list[float], temperature: float = 1.0) -> np.ndarray:
    """D2O's inverse-variance softmax: softmax(-v / temperature) of the variances normalised
    to mean 1 (v_l = var_l / mean var), so higher variance = sparser attention = less budget.
    (The paper's equation did not survive the text conversion; this normalisation makes it
    independent of the text length. temperature -> inf: uniform.)"""
    v = np.asarray(variance, dtype=np.float64)
    if v.mean() <= 0:
        return np.ones_like(v)
    z = -(v / v.mean()) / temperature
    w = np.exp(z - z.max())
    return w / w.sum()


class Allocator(ABC):
    """Layer budgets from a per-model profile (measured once on the calibration text)."""
    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_config(cls, config: BuildConfig) -> Allocator:
        """This allocator with the build configuration's parameters for it."""

    @property
    def needs_profile(self) -> bool:
        """Whether its budgets come from a measured profile (False: the same in every layer,
        and no profile is measured or read)."""
        return True

    @abstractmethod
    def measure(self, model: torch.nn.Module, input_ids: torch.Tensor,
                config: CalibrationConfig) -> np.ndarray: ...

    @abstractmethod
    def allocate(self, profile: list[float], mean_budget: int) -> list[int]: ...


@dataclass(frozen=True)
class SensitivityAllocator(Allocator):
    """EpiCache §3.2: Key similarity under a sink + recent mask; weights (1 - minmax)^alpha."""
    alpha: float = 1.0
    name: ClassVar[str] = "sensitivity"

    @classmethod
    def from_config(cls, config):
        return cls(alpha=config.alpha)

    @property
    def needs_profile(self) -> bool:
        return self.alpha != 0  # alpha 0: uniform budgets

    def measure(self, model, input_ids, config):
        return layer_similarity(model, input_ids, config)

    def allocate(self, profile, mean_budget):
        if self.alpha == 0:
            return [mean_budget] * len(profile)
        return allocate_budgets(profile, mean_budget, self.alpha)


@dataclass(frozen=True)
class VarianceAllocator(Allocator):
    """D2O §4.1: inverse-variance softmax of the layers' cumulative-attention variance."""
    temperature: float = 1.0
    name: ClassVar[str] = "variance"

    @classmethod
    def from_config(cls, config):
        return cls(temperature=config.variance_temperature)

    def measure(self, model, input_ids, config):
        return attention_variance(model, input_ids)

    def allocate(self, profile, mean_budget):
        return allocate_from_weights(variance_weights(profile, self.temperature), mean_budget)


def allocator_class(name: str) -> type[Allocator]:
    """The registered allocator called `name` (ValueError naming the known ones)."""
    return registry.ALLOCATORS.load(name)
