"""DapQ patch positions, D2O merging and the D2O variance allocator, and the evaluation
variants that name them, on tiny random models."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.config import BuildConfig
from pipeline.eval.cell import cache_footprint
from pipeline.eval.methods import EvalConfig, parse_method
from pipeline.kv.attention import attention_column_sums
from pipeline.kv.budgets import (
    VarianceAllocator,
    allocate_from_weights,
    allocator_class,
    attention_variance,
    variance_weights,
)
from pipeline.kv.cache import EpisodicCache
from pipeline.kv.eviction import Compression
from pipeline.kv.merging import MergeConfig, Merger
from pipeline.kv.methods.epicache import EpiCache
from pipeline.kv.positions import DecodePositions
from pipeline.kv.prefill import PrefillConfig, block_prefill
from pipeline.kv.tristate import TriStateConfig
from tests.support.tiny_models import one_torch_thread, random_ids, stock_twin, tiny_model  # noqa: F401


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def scorer(n: int = 10):
    return EpiCache(patch=random_ids(n, seed=7))


# --------------------------------------------------------------------------------------------
# DapQ
# --------------------------------------------------------------------------------------------

def test_patch_positions():
    consecutive = Compression().patch_positions(100, 4, 3, 1000)
    assert consecutive.tolist() == [100, 101, 102, 103, 104, 105, 106]
    dapq = DecodePositions(Compression()).patch_positions(100, 4, 3, 1000)
    assert dapq.tolist() == [100, 101, 102, 103, 1000, 1001, 1002]


@pytest.mark.parametrize("dapq", [False, True])
def test_dapq_patch_queries_sit_at_the_decode_positions(llama, dapq):
    ids, n_patch, block = random_ids(70), 10, 32
    seen_positions = []
    handle = llama.model.rotary_emb.register_forward_hook(
        lambda module, args, kwargs, out: seen_positions.append(
            (args[1] if len(args) > 1 else kwargs["position_ids"])[0].clone()), with_kwargs=True)
    try:
        cache, _ = block_prefill(llama, ids, scorer(n_patch), [20] * 3,
                                 PrefillConfig(block=block, decode_positions=dapq))
    finally:
        handle.remove()
    assert len(seen_positions) == 3  # one forward per block
    for i, positions in enumerate(seen_positions):
        begin = i * block
        n_block = min(block, 70 - begin)
        assert positions[:n_block].tolist() == list(range(begin, begin + n_block))
        first = 70 if dapq else begin + n_block  # decoding starts after the whole input
        assert positions[n_block:].tolist() == list(range(first, first + n_patch))
    # the stored cache is unchanged in kind: token positions, tokens seen, no patch entries
    assert cache.tokens_seen == 70
    for layer in cache.layers:
        assert int(layer.positions[layer.valid].max()) < 70


def test_dapq_changes_the_scores_not_the_kind(llama):
    ids = random_ids(90)
    plain, _ = block_prefill(llama, ids, scorer(), [20] * 3, PrefillConfig(block=32))
    dapq, _ = block_prefill(llama, ids, scorer(), [20] * 3,
                            PrefillConfig(block=32, decode_positions=True))
    assert plain.entries_per_layer() == dapq.entries_per_layer()
    assert any(not torch.equal(a.positions[a.valid], b.positions[b.valid])
               for a, b in zip(plain.layers, dapq.layers))


# --------------------------------------------------------------------------------------------
# D2O merging
# --------------------------------------------------------------------------------------------

class FakeLayer:
    def __init__(self, keys, values):
        self.keys, self.values = keys[None].clone(), values[None].clone()
        self.valid = torch.ones(keys.shape[:2], dtype=torch.bool)


def test_merge_on_fixed_tensors_matches_the_weighted_average():
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [0.1, -1.0]]])  # 1 head, 4 slots
    values = torch.tensor([[[1.0], [2.0], [3.0], [4.0]]])
    layer = FakeLayer(keys, values)
    keep = torch.tensor([[True, True, False, False]])
    merger = Merger(MergeConfig(enabled=True, beta=0.7))
    merger.merge(0, layer, keep, keep)
    unit = torch.nn.functional.normalize(keys[0], dim=-1)
    s2 = float(unit[2] @ unit[0])  # slot 2's best kept match: slot 0
    s3 = max(float(unit[3] @ unit[0]), float(unit[3] @ unit[1]))  # slot 3: nearest is slot 0
    assert merger.threshold[0] == pytest.approx((s2 + s3) / 2)  # first step: the mean
    # only slot 2 reaches the threshold; it merges into slot 0
    w0, w2 = math.e, math.exp(s2)
    expected_key = (w0 * keys[0, 0] + w2 * keys[0, 2]) / (w0 + w2)
    torch.testing.assert_close(layer.keys[0, 0, 0], expected_key)
    assert layer.values[0, 0, 0].item() == pytest.approx((w0 * 1.0 + w2 * 3.0) / (w0 + w2))
    torch.testing.assert_close(layer.keys[0, 0, 1], keys[0, 1])  # untouched
    assert merger.merged == 1
    # the EMA: a second step whose evictions have a different mean similarity gives
    # beta * new mean + (1 - beta) * previous threshold (neither the old nor the new mean alone)
    first = merger.threshold[0]
    keep2 = torch.tensor([[True, False, True, False]])  # evict slots 1 and 3, keep 0 and 2
    t1 = max(float(unit[1] @ unit[0]), float(unit[1] @ unit[2]))
    t3 = max(float(unit[3] @ unit[0]), float(unit[3] @ unit[2]))
    second = (t1 + t3) / 2
    assert abs(second - first) > 0.1  # the inputs differ enough for the check to mean something
    merger.merge(0, FakeLayer(keys, values), keep2, keep2)
    assert merger.threshold[0] == pytest.approx(0.7 * second + 0.3 * first)
    # each layer keeps its own threshold
    merger.merge(1, FakeLayer(keys, values), keep2, keep2)
    assert merger.threshold[1] == pytest.approx(second)


@pytest.mark.parametrize("tristate", [False, True])
def test_merge_conserves_kept_entries_and_a_high_threshold_changes_nothing(llama, tristate):
    ids = random_ids(150)
    base = PrefillConfig(block=24, tristate=TriStateConfig(enabled=tristate, window=8))
    plain, _ = block_prefill(llama, ids, scorer(), [20] * 3, base)
    merged, stats = block_prefill(llama, ids, scorer(), [20] * 3, PrefillConfig(
        block=24, tristate=base.tristate, merge=MergeConfig(enabled=True)))
    never, never_stats = block_prefill(llama, ids, scorer(), [20] * 3, PrefillConfig(
        block=24, tristate=base.tristate, merge=MergeConfig(enabled=True, min_threshold=1.01)))
    assert stats.merged_entries > 0 and never_stats.merged_entries == 0
    for a, b, c in zip(plain.layers, merged.layers, never.layers):
        # merging changes the values of kept entries, never how many are kept (which ones may
        # differ in later blocks: they attend to the merged entries)
        if not tristate:
            assert a.state_counts() == b.state_counts()
        else:  # how many fit depends on which were quantized earlier; the budget holds
            o, q = b.state_counts()
            assert o * 128 + q * 40 <= 20 * 2 * 128  # float32 model: Original = 2 x 16 x 4 bytes
        assert torch.equal(a.valid, c.valid)
        assert torch.equal(a.positions[a.valid], c.positions[c.valid])
        assert torch.equal(a.keys[0][a.valid], c.keys[0][c.valid])
        assert torch.equal(a.values[0][a.valid], c.values[0][c.valid])
    assert any(not torch.equal(a.keys[0][a.valid], b.keys[0][b.valid])
               for a, b in zip(plain.layers, merged.layers))


@torch.inference_mode()
def test_one_merge_step_keeps_the_kept_set(llama):
    cache, _ = block_prefill(llama, random_ids(80), scorer(), None, PrefillConfig(block=40))
    layer = cache.layers[1]
    keep = torch.rand(layer.valid.shape, generator=torch.Generator().manual_seed(0)) > 0.6
    before_keys, before_valid = layer.keys.clone(), layer.valid.clone()
    merger = Merger(MergeConfig(enabled=True))
    merger.merge(1, layer, keep, keep)
    assert merger.merged > 0
    assert torch.equal(layer.valid, before_valid)
    changed = (layer.keys[0] != before_keys[0]).any(-1)
    assert changed.any() and not (changed & ~keep).any()  # only kept entries absorb others
    layer.keep(keep)
    assert int(layer.valid.sum()) == int(keep.sum())


# --------------------------------------------------------------------------------------------
# D2O variance allocator
# --------------------------------------------------------------------------------------------

def test_attention_variance_matches_eager_attention_weights(llama):
    ids = random_ids(100)
    eager = stock_twin(llama, "eager")
    with torch.no_grad():
        weights = eager.model(ids[None], output_attentions=True).attentions  # per layer [1,H,N,N]
    expected = [w[0].sum(dim=1).mean(dim=0).double().var(unbiased=False).item() for w in weights]
    got = attention_variance(llama, ids)
    np.testing.assert_allclose(got, expected, rtol=1e-4)


def test_the_probe_does_not_change_the_forward(llama):
    ids = random_ids(60)
    with torch.no_grad():
        reference = llama(ids[None]).logits
        with attention_column_sums() as sums:
            probed = llama(ids[None], use_cache=False).logits
    assert len(sums) == 3
    torch.testing.assert_close(probed, reference, atol=1e-5, rtol=0)


def test_variance_allocation():
    variance = [1.0, 4.0, 0.5, 2.0]
    w = variance_weights(variance)
    assert w.sum() == pytest.approx(1.0)
    assert list(np.argsort(w)) == [1, 3, 0, 2]  # more variance, less budget
    budgets = VarianceAllocator().allocate(variance, 100)
    assert sum(budgets) == 400 and min(budgets) >= 25
    assert budgets[2] > budgets[0] > budgets[3] >= budgets[1]
    assert VarianceAllocator(temperature=1e9).allocate(variance, 100) == [100] * 4
    assert allocate_from_weights([1, 1, 1], 10) == [10, 10, 10]
    assert allocator_class("variance") is VarianceAllocator


# --------------------------------------------------------------------------------------------
# Configuration and evaluation variants
# --------------------------------------------------------------------------------------------

def test_presets_and_overrides_are_configuration_knobs():
    config = EvalConfig(BuildConfig(model="tiny"))
    merge = "+prefill.merge.enabled=true"
    hashes = {m: config.build_config(m, 64).hash for m in
              ("epicache", "epicache-tri", "epicache-dapq", f"epicache{merge}", "epicache-d2o",
               f"epicache-tri+prefill.decode_positions=true{merge}",
               "epicache-tri+prefill.tristate.fp8=true", "keydiff")}
    assert len(set(hashes.values())) == len(hashes)
    assert config.build_config("epicache-tri", 64).prefill.tristate.enabled
    assert config.build_config("epicache-dapq", 64).prefill.decode_positions
    assert config.build_config(f"epicache{merge}", 64).prefill.merge.enabled
    assert config.build_config("epicache-d2o", 64).allocator == "variance"
    assert config.allocator_of("keydiff") is None
    assert config.allocator_of("keydiff+allocator=variance") == "variance"
    scaled = "epicache-tri+prefill.tristate.original_scale=0.25"
    assert config.build_config(scaled, 64).prefill.tristate.original_scale == 0.25
    assert config.build_config("epicache-tri", 64).prefill.tristate.original_scale == 1.0
    for bad in ("epicache-x", "full-tri", "nope", "epicache-tri+prefill.tristate.original_scale=x"):
        with pytest.raises(ValueError):
            parse_method(bad)
    # the default: the plain configuration is the library's
    assert EvalConfig().build_config("epicache", 64).prefill == PrefillConfig()
    config = BuildConfig(prefill=config.build_config(f"epicache-tri{merge}", 64).prefill,
                         allocator="variance")
    assert BuildConfig.from_json(config.to_json()) == config


def test_evaluate_records_carry_bytes(llama):
    cache = EpisodicCache(3)
    cache, _ = block_prefill(llama, random_ids(100), scorer(), [30] * 3,
                             PrefillConfig(block=24,
                                           tristate=TriStateConfig(enabled=True, window=8)),
                             original_element_size=2)
    from pipeline.kv.prefill import entry_bytes
    sizes = entry_bytes(llama, 2)
    footprint = cache_footprint(cache, sizes)
    assert footprint["kv_bytes"] == cache.nbytes(2)
    assert footprint["bytes_tokens"] <= 30
    assert footprint["quantized_share"] > 0
