"""ARKV tri-state compression: byte accounting, the OQ ratio and heavy-hitter score against
references, dequantized attention, the safetensors round trip, on tiny random models."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load

from kernels.quant_reference import (
    dequantize_reference,
    quantize_fp8_reference,
    quantize_int8_reference,
)
from pipeline.answer.decode import generate_from_cache
from pipeline.kv.attention import patch_attention_moments
from pipeline.kv.cache import EpisodicCache, EpisodicLayer
from pipeline.kv.methods.epicache import EpiCache
from pipeline.kv.methods.full import Full
from pipeline.kv.positions import KeyRotation
from pipeline.kv.prefill import PrefillConfig, block_prefill, entry_bytes
from pipeline.kv.tristate import (
    EntryBytes,
    TriStateConfig,
    heavy_hitter_scores,
    oq_ratios,
    oq_score,
    plan_tristate,
)
from pipeline.store.objects import cache_format
from tests.support.tiny_models import StandIn, one_torch_thread, random_ids, tiny_model  # noqa: F401

D = 16  # tiny models' head_dim
C_O, C_Q = 2 * D * 2, 2 * D + 8  # float16 Original entry; int8 codes + two float32 scales


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def tri(**kw) -> PrefillConfig:
    block = kw.pop("block", 24)
    selection = kw.pop("selection", "headwise")
    return PrefillConfig(block=block, selection=selection,
                         tristate=TriStateConfig(enabled=True, **({"window": 8} | kw)))


def scorer():
    return EpiCache(patch=random_ids(12, seed=7))


def kv_tensor_bytes(data: bytes) -> int:
    """Bytes of the key/value tensors in a serialized cache (codes and scales included)."""
    tensors = st_load(data)
    kinds = (".keys", ".values", ".qkeys", ".qvalues", ".qkey_scales", ".qvalue_scales")
    return sum(t.numel() * t.element_size() for k, t in tensors.items() if k.endswith(kinds))


# --------------------------------------------------------------------------------------------
# Byte accounting
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("selection", ["headwise", "perhead"])
@pytest.mark.parametrize("fp8", [False, True])
def test_stored_bytes_equal_the_formula_and_stay_within_budget(llama, selection, fp8):
    ids = random_ids(230)
    byte_budgets = [4000, 5321, 7000]  # bytes per layer (not multiples of an entry's size)
    cache, stats = block_prefill(llama, ids, scorer(), None, tri(selection=selection, fp8=fp8),
                                 byte_budgets=byte_budgets, original_element_size=2)
    data = cache_format.serialize(cache, {}, torch.float16)
    n_o, n_q = cache.state_counts()
    assert n_q > 0 and n_o > 0  # both tiers in use
    assert kv_tensor_bytes(data) == n_o * C_O + n_q * C_Q == cache.nbytes(2)
    assert stats.original_bytes + stats.quantized_bytes == cache.nbytes(2)
    assert stats.original_entries + stats.quantized_entries + stats.evicted_entries == \
        230 * 2 * 3
    for layer, budget in zip(cache.layers, byte_budgets):
        o, q = layer.state_counts()
        assert o * C_O + q * C_Q <= budget
        # the budget is used: not even one more quantized entry would fit
        assert budget - (o * C_O + q * C_Q) < C_Q + (C_O if selection == "perhead" else 0) * 2


def test_token_budget_reads_as_bytes_of_original_tokens(llama):
    """Budget M with tri-state = the bytes of M float16 tokens per layer and KV head; more than
    M tokens are kept."""
    cache, stats = block_prefill(llama, random_ids(230), scorer(), [30, 30, 30], tri(),
                                 original_element_size=2)
    assert stats.byte_budgets == [30 * 2 * C_O] * 3
    for layer in cache.layers:
        o, q = layer.state_counts()
        assert o * C_O + q * C_Q <= 30 * 2 * C_O
    assert np.mean(cache.entries_per_layer()) > 30


def test_large_budget_equals_the_plain_cache(llama):
    ids = random_ids(150)
    plain, _ = block_prefill(llama, ids, scorer(), None, PrefillConfig(block=24))
    big, stats = block_prefill(llama, ids, scorer(), [500] * 3, tri(), original_element_size=2)
    assert stats.quantized_entries == 0 and stats.evicted_entries == 0
    for a, b in zip(plain.layers, big.layers):
        assert torch.equal(a.valid, b.valid) and torch.equal(a.positions, b.positions)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert b.quantized is None


def test_slack_lets_layers_run_over_between_blocks_but_not_at_the_end(llama):
    ids = random_ids(240)
    runs = {}
    for slack in (1.0, 0.5):
        cache, _ = block_prefill(llama, ids, scorer(), [100] * 3, tri(block=20, slack=slack),
                                 original_element_size=2)
        runs[slack] = cache
        for layer in cache.layers:
            o, q = layer.state_counts()
            assert o * C_O + q * C_Q <= 100 * 2 * C_O
    # With slack 0.5, layers may hold twice their budget between blocks: fewer eviction steps,
    # hence a larger peak.
    assert (max(layer.peak_entries for layer in runs[0.5].layers)
            > max(layer.peak_entries for layer in runs[1.0].layers))


# --------------------------------------------------------------------------------------------
# The plan, the OQ ratio and the heavy-hitter score against references
# --------------------------------------------------------------------------------------------

def test_plan_on_fixed_scores():
    """One head, 8 entries (2 in the window), budget for the window + 2 Original + 3 Quantized
    at rho = 0.5: the two best Original, the next three Quantized, the rest evicted; an entry
    already quantized stays quantized and costs C_q."""
    sizes = EntryBytes(original=10, quantized=4)
    scores = torch.tensor([[0.9, 0.1, 0.8, 0.5, 0.7, 0.2, 0.0, 0.0]])
    valid = torch.ones(1, 8, dtype=torch.bool)
    window = torch.tensor([[False] * 6 + [True, True]])
    quantized = torch.zeros(1, 8, dtype=torch.bool)
    budget = 2 * 10 + 40  # window + R = 40
    plan = plan_tristate(scores, valid, quantized, window, budget, 0.5, sizes, "headwise")
    # n_o = floor(0.5 * 40 / 10) = 2 -> entries 0, 2 Original (cost 20); 20 left -> 5 Quantized
    # would fit but only 4 eligible remain: 4, 3, 5, 1
    assert plan.keep.tolist() == [[True] * 8]
    assert plan.quantize.tolist() == [[False, True, False, True, True, True, False, False]]
    plan = plan_tristate(scores, valid, quantized, window, 2 * 10 + 28, 0.5, sizes, "headwise")
    # 28 left: n_o = floor(14 / 10) = 1 -> entry 0 Original (10); 18 left -> 4 Quantized
    # (2, 4, 3, 5); entry 1 evicted
    assert plan.keep.tolist() == [[True, False, True, True, True, True, True, True]]
    assert plan.quantize.tolist() == [[False, False, True, True, True, True, False, False]]
    # entry 0 already quantized: it stays quantized at 4 bytes, leaving 24 -> all 5 others
    quantized[0, 0] = True
    plan = plan_tristate(scores, valid, quantized, window, 2 * 10 + 28, 0.5, sizes, "headwise")
    assert plan.keep.tolist() == [[True] * 8]
    assert plan.quantize.tolist() == [[True, True, True, True, True, True, False, False]]
    # per head: each of two heads gets half the budget
    two = plan_tristate(scores.repeat(2, 1), valid.repeat(2, 1),
                        torch.zeros(2, 8, dtype=torch.bool), window.repeat(2, 1),
                        2 * (2 * 10 + 28), 0.5, sizes, "perhead")
    assert two.keep.tolist() == [[True, False, True, True, True, True, True, True]] * 2


def naive_attention(queries, cached_keys, patch_keys, valid, scale):
    """[Hq, P, N] softmax probabilities on the cached keys (patch causal), the whole matrix."""
    n_q, n_p, _ = queries.shape
    n_kv, n = cached_keys.shape[0], cached_keys.shape[1]
    group = n_q // n_kv
    keys = torch.cat([cached_keys, patch_keys], 1).repeat_interleave(group, 0)
    logits = queries @ keys.transpose(1, 2) * scale
    mask = torch.cat([valid.repeat_interleave(group, 0)[:, None, :].expand(-1, n_p, -1),
                      torch.ones(n_p, n_p, dtype=torch.bool).tril()[None].expand(n_q, -1, -1)], 2)
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)[:, :, :n]


def test_moments_and_heavy_hitter_match_a_reference():
    g = torch.Generator().manual_seed(0)
    q, k, pk = (torch.randn(6, 5, 8, generator=g), torch.randn(2, 20, 8, generator=g),
                torch.randn(2, 5, 8, generator=g))
    valid = torch.rand(2, 20, generator=g) > 0.2
    s, sq, count = patch_attention_moments(q, k, pk, valid, 0.4, query_chunk=4)
    probs = naive_attention(q, k, pk, valid, 0.4)  # [6, 5, 20]
    per_kv = probs.reshape(2, 3 * 5, 20)  # rows: (query head of the group, patch query)
    assert count == 15
    torch.testing.assert_close(s, per_kv.sum(1))
    torch.testing.assert_close(sq, (per_kv ** 2).sum(1))
    hh = heavy_hitter_scores(s, sq, count, 263.81)
    arr = per_kv.double().numpy()
    expected = arr.mean(1) + 263.81 * arr.var(1)
    np.testing.assert_allclose(hh.double().numpy(), expected, rtol=1e-4, atol=1e-7)


def test_oq_score_and_ratio_match_a_reference():
    a = torch.tensor([5.0, 1.0, 0.5, 0.25, 3.0, 0.25])
    p = a.double().numpy() / a.sum().item()
    entropy = -(p * np.log(p)).sum()
    var = ((p - p.mean()) ** 2).mean()
    kurt = ((p - p.mean()) ** 4).mean() / var ** 2
    cfg = TriStateConfig()
    expected = entropy ** (1 / 7.774) * var ** (1 / 5.407) * kurt ** (1 / 5.528)
    assert oq_score(a, cfg) == pytest.approx(expected, rel=1e-9)
    assert oq_ratios([1.0, 4.0, 2.0]) == [0.25, 1.0, 0.5]
    assert oq_ratios([1.0, 4.0, 2.0], original_scale=2.0) == [0.5, 1.0, 1.0]
    assert oq_ratios([0.0, 0.0]) == [1.0, 1.0]


# --------------------------------------------------------------------------------------------
# Quantized entries: never re-quantized; attention sees their dequantized values
# --------------------------------------------------------------------------------------------

@torch.inference_mode()
def test_quantized_entries_are_not_requantized(llama):
    cache, _ = block_prefill(llama, random_ids(60), Full(), None, PrefillConfig(block=30))
    layer = cache.layers[0]
    first = torch.zeros_like(layer.valid)
    first[:, :10] = True
    layer.quantize(first)
    codes, scales = layer.key_codes.clone(), layer.key_scales.clone()
    codes_ref, scales_ref = quantize_int8_reference(
        torch.stack([layer.keys[0, h, :10] for h in range(2)]))
    layer.keys[0, :, :10] *= 3.0  # whatever the view holds now, the codes stay
    both = torch.zeros_like(layer.valid)
    both[:, :20] = True
    layer.quantize(both)
    assert torch.equal(layer.key_codes[:, :10], codes[:, :10])
    assert torch.equal(layer.key_scales[:, :10], scales[:, :10])
    assert torch.equal(layer.key_codes[:, :10], codes_ref)
    assert layer.state_counts() == (2 * 60 - 40, 40)


def plain_twin(cache):
    """A plain copy whose quantized slots hold codes x scales dequantized independently."""
    twin = copy.deepcopy(cache)
    for layer in twin.layers:
        if layer.quantized is None:
            continue
        q = layer.quantized_mask()
        for name, which, scales in (("keys", "keys", layer.key_scales),
                                    ("values", "values", layer.value_scales)):
            tensor = getattr(layer, name)
            codes = layer.codes(which)[q]
            tensor[0][q] = (codes.float() * scales[q][:, None]).to(tensor.dtype)
        layer.quantized = layer.key_codes = layer.value_codes = None
        layer.key_scales = layer.value_scales = None
    return twin


def next_logits(model, cache, ids):
    with cache.scratch(), torch.no_grad():
        n = cache.tokens_seen
        return model(ids[None], past_key_values=cache, use_cache=True,
                     position_ids=torch.arange(n, n + ids.shape[0])[None]).logits


@pytest.mark.parametrize("fp8", [False, True])
def test_attention_sees_the_dequantized_values(llama, fp8):
    ids, question = random_ids(200), random_ids(6, seed=3)
    cache, _ = block_prefill(llama, ids, scorer(), [40] * 3, tri(fp8=fp8), original_element_size=2)
    assert cache.state_counts()[1] > 0
    got = next_logits(llama, cache, question)
    torch.testing.assert_close(got, next_logits(llama, plain_twin(cache), question),
                               atol=1e-5, rtol=0)
    # the quantized slots matter: zeroing them changes the logits
    zeroed = plain_twin(cache)
    for layer, original in zip(zeroed.layers, cache.layers):
        layer.values[0][original.quantized_mask()] = 0
    assert not torch.allclose(got, next_logits(llama, zeroed, question), atol=1e-3)
    # the stored object: same tiers, same logits (Original entries at float16), same decoding
    data = cache_format.serialize(cache, {"model_id": "tiny"}, torch.float32)
    back, header = cache_format.deserialize(data, cache_format.sha256(data))
    assert header["format"] == cache_format.FORMAT
    assert header["quant"] == ("float8_e4m3fn" if fp8 else "int8")
    assert back.state_counts() == cache.state_counts()
    torch.testing.assert_close(next_logits(llama, back, question), got, atol=1e-5, rtol=0)
    assert cache_format.serialize(back, {"model_id": "tiny"}, torch.float32) == data
    lm = StandIn(llama)
    assert torch.equal(generate_from_cache(lm, back, question, 6),
                       generate_from_cache(lm, cache, question, 6))


def test_dequantized_layer_attention_equals_explicit_attention(llama):
    """Layer 0's attention output for new queries equals softmax(q K^T) V computed by hand on
    the dequantized keys and values (codes x scales) of each head."""
    cache, _ = block_prefill(llama, random_ids(120), scorer(), [20] * 3, tri(),
                             original_element_size=2)
    layer = cache.layers[0]
    assert layer.quantized_mask().any()
    attn = llama.model.layers[0].self_attn
    captured = {}

    def hook(module, args, kwargs, output):
        captured["out"] = output[0]
        captured["hidden"] = kwargs["hidden_states"]
        captured["pos"] = kwargs["position_embeddings"]
    handle = attn.register_forward_hook(hook, with_kwargs=True)
    try:
        next_logits(llama, cache, random_ids(4, seed=5))
    finally:
        handle.remove()
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    hidden = captured["hidden"]
    q = attn.q_proj(hidden).view(1, 4, 6, D).transpose(1, 2)
    k_new = attn.k_proj(hidden).view(1, 4, 2, D).transpose(1, 2)
    v_new = attn.v_proj(hidden).view(1, 4, 2, D).transpose(1, 2)
    cos, sin = captured["pos"]
    q, k_new = apply_rotary_pos_emb(q, k_new, cos, sin)
    outs = []
    quantized = layer.quantized_mask()
    for h in range(6):
        kv = h // 3
        keep = layer.valid[kv]
        k_old = layer.keys[0, kv].clone()
        v_old = layer.values[0, kv].clone()
        qm = quantized[kv]
        k_old[qm] = dequantize_reference(layer.codes("keys")[kv][qm], layer.key_scales[kv][qm])
        v_old[qm] = dequantize_reference(layer.codes("values")[kv][qm], layer.value_scales[kv][qm])
        keys = torch.cat([k_old[keep], k_new[0, kv]])
        values = torch.cat([v_old[keep], v_new[0, kv]])
        logits = q[0, h] @ keys.T / math.sqrt(D)
        n_old = int(keep.sum())
        causal = torch.ones(4, 4, dtype=torch.bool).tril()
        mask = torch.cat([torch.ones(4, n_old, dtype=torch.bool), causal], 1)
        outs.append(torch.softmax(logits.masked_fill(~mask, float("-inf")), -1) @ values)
    expected = attn.o_proj(torch.stack(outs, 1).reshape(1, 4, 6 * D))
    torch.testing.assert_close(captured["out"], expected, atol=1e-5, rtol=1e-4)


def test_plain_objects_still_read(llama):
    """A plain cache writes no quantized tensors; a format-1 object still loads."""
    cache, _ = block_prefill(llama, random_ids(80), scorer(), [20] * 3, PrefillConfig(block=24))
    data = cache_format.serialize(cache, {}, torch.float32)
    assert not any(".q" in k for k in st_load(data))
    assert cache_format.read_header(data)["quant"] is None
    import json
    import struct
    (size,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8:8 + size])
    header = json.loads(meta["__metadata__"]["header"]) | {"format": "epicache-kv/1"}
    header.pop("quant")
    from safetensors.torch import save
    old = save(st_load(data), metadata={"header": json.dumps(header)})
    back, _ = cache_format.deserialize(old, None)
    for a, b in zip(cache.layers, back.layers):
        assert torch.equal(a.keys[0][a.valid], b.keys[0][b.valid])


def test_entry_bytes_of_a_model(llama):
    assert entry_bytes(llama, 2) == EntryBytes(original=C_O, quantized=C_Q)
    assert entry_bytes(llama) == EntryBytes(original=2 * D * 4, quantized=C_Q)  # float32 model


# --------------------------------------------------------------------------------------------
# Compact positions: Quantized keys re-rotated, their codes made anew
# --------------------------------------------------------------------------------------------

def compact_tri(fp8: bool) -> PrefillConfig:
    return dataclasses.replace(tri(fp8=fp8), positions="compact", compact_recent=16)


@pytest.mark.parametrize("fp8", [False, True])
def test_a_compacted_tristate_cache_answers_as_its_float_entries_would(llama, fp8, monkeypatch):
    """Tri-state at compact positions: a Quantized entry's key is the float key the build
    quantized, moved to the entry's compact position, within two roundings of the code (its
    codes are made anew from the rotated value, never from the last codes), its value within
    one; read back from the store, the cache answers as the cache of those float entries."""
    quantized_as = {}  # (layer, head, token position) -> (key, value, rope position) as quantized
    quantize = EpisodicLayer.quantize

    def recording(layer, mask, fp8=False):
        for h, s in (mask & layer.valid & ~layer.quantized_mask()).nonzero().tolist():
            quantized_as[(id(layer), h, int(layer.positions[h, s]))] = (
                layer.keys[0, h, s].clone(), layer.values[0, h, s].clone(),
                int(layer.rope_positions[h, s]))
        quantize(layer, mask, fp8)

    monkeypatch.setattr(EpisodicLayer, "quantize", recording)
    ids, question = random_ids(200), random_ids(6, seed=3)
    cache, _ = block_prefill(llama, ids, scorer(), [40] * 3, compact_tri(fp8),
                             original_element_size=2)
    data = cache_format.serialize(cache, {"model_id": "tiny"}, torch.float32)
    back, header = cache_format.deserialize(data, cache_format.sha256(data))
    assert header["positions"] == "compact" and back.state_counts() == cache.state_counts()
    rotation = KeyRotation.for_model(llama)
    floats, moved, worst = copy.deepcopy(back), 0, 0.0
    for built, read, twin in zip(cache.layers, back.layers, floats.layers):
        for h, s in read.quantized_mask().nonzero().tolist():
            key, value, rope = quantized_as[(id(built), h, int(read.positions[h, s]))]
            shift = int(read.rope_positions[h, s]) - rope
            moved += shift != 0
            key = rotation.rotate(key[None], torch.tensor([shift]))[0]
            twin.keys[0, h, s], twin.values[0, h, s] = key, value
            # per number and rounding: int8 half a step of the row's absmax / 127, fp8 2^-4 of
            # the row's absmax (a rotation mixes each pair of numbers, so one number's relative
            # error does not survive it); the key rounded twice, its absmax moved by rotation
            step = 254 if not fp8 else 16
            assert ((read.keys[0, h, s] - key).abs() <= 2.5 * key.abs().max() / step + 1e-6).all()
            assert ((read.values[0, h, s] - value).abs() <= value.abs().max() / step + 1e-6).all()
            worst = max(worst, float((read.keys[0, h, s] - key).abs().max()))
        twin.quantized = twin.key_codes = twin.value_codes = None
        twin.key_scales = twin.value_scales = None
    assert moved > 0 and worst > 0  # Quantized entries did move, and are coded, not copied
    # within the code's error: no further from the float entries' logits than those entries
    # rounded once, at the positions they sit at, are (the stored keys were rounded twice)
    once = copy.deepcopy(floats)
    for layer, read in zip(once.layers, back.layers):
        for tensor in (layer.keys, layer.values):
            rows = tensor[0][read.quantized_mask()]
            codes, scales = (quantize_fp8_reference if fp8 else quantize_int8_reference)(rows)
            tensor[0][read.quantized_mask()] = dequantize_reference(codes, scales)
    want = next_logits(llama, floats, question)
    rounded_once = float((next_logits(llama, once, question) - want).abs().max())
    assert 0 < float((next_logits(llama, back, question) - want).abs().max()) <= 3 * rounded_once
    lm = StandIn(llama)
    assert torch.equal(generate_from_cache(lm, back, question, 6),
                       generate_from_cache(lm, floats, question, 6))
    zeroed = copy.deepcopy(floats)  # the Quantized entries matter: without them, other logits
    for layer, read in zip(zeroed.layers, back.layers):
        layer.values[0][read.quantized_mask()] = 0
    assert float((next_logits(llama, zeroed, question) - want).abs().max()) > 10 * rounded_once


def test_a_tristate_cache_joins_with_its_codes(llama):
    """A question read from two episodes: a tri-state cache joined with a plain one keeps each
    token once, its Quantized entries Quantized with their own codes; joined with itself it
    reads as itself."""
    ids, question = random_ids(200), random_ids(6, seed=3)
    tri_cache, _ = block_prefill(llama, ids, scorer(), [40] * 3, tri(), original_element_size=2)
    plain, _ = block_prefill(llama, ids, EpiCache(patch=random_ids(12, seed=8)), [40] * 3,
                             PrefillConfig(block=24))
    assert tri_cache.state_counts()[1] > 0
    itself = EpisodicCache.joined([tri_cache, tri_cache])
    assert itself.state_counts() == tri_cache.state_counts()
    torch.testing.assert_close(next_logits(llama, itself, question),
                               next_logits(llama, tri_cache, question), atol=1e-5, rtol=0)
    both = EpisodicCache.joined([tri_cache, plain])
    for joined, layer in zip(both.layers, tri_cache.layers):
        for h in range(layer.valid.shape[0]):
            held = joined.quantized_mask()[h]
            quantized = set(layer.positions[h][layer.quantized_mask()[h]].tolist())
            assert set(joined.positions[h][held].tolist()) == quantized  # the first cache's
            mine = {int(p): s for s, p in enumerate(layer.positions[h].tolist())
                    if layer.quantized_mask()[h, s]}
            for s in held.nonzero().flatten().tolist():
                source = mine[int(joined.positions[h, s])]
                assert torch.equal(joined.key_codes[h, s], layer.key_codes[h, source])
                assert joined.key_scales[h, s] == layer.key_scales[h, source]
    data = cache_format.serialize(both, {}, torch.float32)  # and it stores as any tri-state cache
    assert cache_format.deserialize(data, None)[0].state_counts() == both.state_counts()
