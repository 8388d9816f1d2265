"""The benchmarks' shortcuts must not change what they measure (tiny random models)."""

from __future__ import annotations

import pytest
import torch

from lab.bench_support import dynamic_cache_bytes, first_layers, full_prefill
from pipeline.kv.methods.epicache import EpiCache
from pipeline.kv.prefill import PrefillConfig, block_prefill
from tests.support.tiny_models import one_torch_thread, random_ids, tiny_model  # noqa: F401


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_first_layers_gives_the_whole_models_per_layer_caches_and_peaks(family):
    """A layer's cache depends on the layers below it only: a model cut to its first 2 layers
    builds exactly the whole model's caches for those layers, with the same instrumentation,
    and the whole model is left intact."""
    model = tiny_model(family, num_hidden_layers=4)
    ids, patch = random_ids(150), random_ids(12, seed=7)
    run = lambda m: block_prefill(m, ids, EpiCache(patch=patch),  # noqa: E731
                                  [20] * m.config.num_hidden_layers, PrefillConfig(block=32))
    whole, whole_stats = run(model)
    cut = first_layers(model, 2)
    part, part_stats = run(cut)
    assert cut.config.num_hidden_layers == 2 and model.config.num_hidden_layers == 4
    assert len(model.model.layers) == 4
    for a, b in zip(part.layers, whole.layers[:2]):
        assert torch.equal(a.valid, b.valid) and torch.equal(a.positions, b.positions)
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)
    assert part_stats.peak_entries == whole_stats.peak_entries[:2]
    assert part_stats.peak_bytes == whole_stats.peak_bytes[:2]
    assert first_layers(model, None) is model


def test_peak_bytes_counts_the_block_and_patch_on_top_of_the_held_entries():
    """The transient peak of a layer = (held slots + block + patch) x heads x (dk + dv) x 4 B,
    and stays there whatever the length once the budget is reached."""
    model = tiny_model("llama", num_hidden_layers=2)
    cfg = model.config
    budget, block, p = 16, 32, 8
    per_slot = cfg.num_key_value_heads * 2 * cfg.head_dim * 4
    peaks = []
    for n in (128, 512):
        _, stats = block_prefill(model, random_ids(n), EpiCache(patch=random_ids(p, seed=9)),
                                 [budget] * 2, PrefillConfig(block=block, selection="perhead"))
        assert stats.peak_bytes == [(budget + block + p) * per_slot] * 2
        peaks.append(stats.peak_bytes)
    assert peaks[0] == peaks[1]


def test_full_prefill_is_the_stock_cache_in_one_forward_or_in_chunks():
    model = tiny_model("llama")
    ids = random_ids(100)
    one, _ = full_prefill(model, ids)
    chunked, _ = full_prefill(model, ids, chunk=32)
    cfg = model.config
    assert dynamic_cache_bytes(one) == [100 * cfg.num_key_value_heads * 2 * cfg.head_dim * 4] * 3
    for a, b in zip(one.layers, chunked.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-4)
