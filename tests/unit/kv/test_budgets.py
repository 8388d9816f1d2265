"""Layer sensitivity (sink + recent mask, key similarity) and the layer budget allocation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.kv.budgets import (
    CalibrationConfig,
    allocate_budgets,
    layer_similarity,
    sink_recent_mask,
)
from tests.support.tiny_models import one_torch_thread, random_ids, stock_twin, tiny_model  # noqa: F401


def test_sink_recent_mask_pattern():
    """[n, n] bool, causal; a query sees the first `sink` tokens and its `window - sink` most
    recent ones (itself included), nothing else."""
    n, sink, window = 12, 2, 5
    mask = sink_recent_mask(n, sink, window)
    assert mask.shape == (n, n) and mask.dtype == torch.bool
    for q in range(n):
        expected = {k for k in range(q + 1) if k < sink or q - k < window - sink}
        assert set(torch.nonzero(mask[q]).flatten().tolist()) == expected
    assert not mask.triu(1).any()  # causal
    assert mask.sum(dim=1).max() == window  # a query never sees more than the window
    # Within the window it is exactly the causal mask.
    assert torch.equal(sink_recent_mask(6, 2, 10), torch.ones(6, 6, dtype=torch.bool).tril())


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_layer_similarity_sanity(llama):
    """One value per layer in [-1, 1]. Layer 0's keys depend only on the tokens (no attention
    before them): similarity 1. Later layers see the restricted mask: similarity below 1."""
    config = CalibrationConfig(tokens=64, sink=4, window=16)
    sims = layer_similarity(llama, random_ids(64, seed=1), config)
    assert sims.shape == (llama.config.num_hidden_layers,)
    assert np.all(sims >= -1 - 1e-6) and np.all(sims <= 1 + 1e-6)
    assert sims[0] == pytest.approx(1.0, abs=1e-5)
    assert np.all(sims[1:] < 1 - 1e-4)


def test_layer_similarity_rejects_text_within_the_window(llama):
    with pytest.raises(ValueError, match="longer than the window"):
        layer_similarity(llama, random_ids(16), CalibrationConfig(sink=4, window=16))


def test_layer_similarity_matches_explicit_reference(llama):
    """Against a reference computed here: keys of a causal run vs keys of a run with the
    sink+recent mask given as an additive float mask to an eager twin; cosine similarity
    beyond the window, mean over heads and tokens."""
    from transformers import DynamicCache

    config = CalibrationConfig(tokens=48, sink=4, window=16)
    ids = random_ids(48, seed=2)
    eager = stock_twin(llama, "eager")
    additive = torch.zeros(48, 48).masked_fill(~sink_recent_mask(48, 4, 16), float("-inf"))
    full, masked = DynamicCache(), DynamicCache()
    with torch.no_grad():
        eager.model(ids[None], past_key_values=full, use_cache=True)
        eager.model(ids[None], past_key_values=masked, attention_mask=additive[None, None],
                    use_cache=True)
    expected = [torch.nn.functional.cosine_similarity(a.keys[0, :, 16:], b.keys[0, :, 16:], dim=-1)
                .mean().item() for a, b in zip(full.layers, masked.layers)]
    np.testing.assert_allclose(layer_similarity(llama, ids, config), expected, atol=1e-5)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_layer_similarity_same_on_every_attention_implementation(llama, implementation):
    """The calibration mask means the same thing whichever attention the model runs (the
    episodic model's fallback, stock sdpa, stock eager)."""
    config = CalibrationConfig(tokens=48, sink=4, window=16)
    ids = random_ids(48, seed=2)
    expected = layer_similarity(llama, ids, config)
    got = layer_similarity(stock_twin(llama, implementation), ids, config)
    np.testing.assert_allclose(got, expected, atol=1e-5)


# --------------------------------------------------------------------------------------------
# allocate_budgets
# --------------------------------------------------------------------------------------------

SIMILARITIES = [
    [0.9, 0.5, 0.7, 0.95, 0.6, 0.8],
    [0.99, 0.98, 0.2, 0.97, 0.96, 0.95, 0.94, 0.5],
    [1.0, 0.3],
    list(np.random.default_rng(0).uniform(0.2, 1.0, 30)),
    list(np.random.default_rng(1).uniform(-0.5, 1.0, 7)),
]


@pytest.mark.parametrize("sims", SIMILARITIES)
@pytest.mark.parametrize("mean_budget", [1, 7, 64, 1000])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 2.0, 4.0])
def test_allocate_budgets_invariants(sims, mean_budget, alpha):
    """Sum == mean x L exactly; every budget >= ceil(mean / 4); a more sensitive layer (lower
    similarity) never gets less than a less sensitive one; integers."""
    budgets = allocate_budgets(sims, mean_budget, alpha)
    assert len(budgets) == len(sims)
    assert all(isinstance(b, int) for b in budgets)
    assert sum(budgets) == mean_budget * len(sims)
    assert min(budgets) >= math.ceil(mean_budget / 4)
    for i in range(len(sims)):
        for j in range(len(sims)):
            if sims[i] < sims[j]:
                assert budgets[i] >= budgets[j], (i, j, budgets)


@pytest.mark.parametrize("sims", SIMILARITIES)
def test_alpha_zero_is_uniform(sims):
    assert allocate_budgets(sims, 64, alpha=0.0) == [64] * len(sims)


def test_equal_similarities_are_uniform():
    assert allocate_budgets([0.8] * 5, 100, alpha=2.0) == [100] * 5


def test_larger_alpha_is_more_unequal():
    """Sharper weights concentrate the budget on the most sensitive layer."""
    sims = [0.5, 0.7, 0.9, 0.95]
    mild, sharp = allocate_budgets(sims, 100, 1.0), allocate_budgets(sims, 100, 2.0)
    assert max(sharp) > max(mild) > 100
    assert np.std(sharp) > np.std(mild)
    assert sharp.index(max(sharp)) == 0  # the least similar layer gets the most


def test_least_sensitive_layer_sits_at_the_floor():
    """With alpha > 0 the most similar layer has weight 0: it gets exactly the floor."""
    budgets = allocate_budgets([0.5, 0.7, 0.9, 0.95], 100, 1.0)
    assert budgets[3] == 25
