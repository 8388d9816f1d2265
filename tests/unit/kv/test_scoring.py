"""Patched-prompt scoring: `kernels.score` against a plain-softmax reference written here, and
the scores recorded during a real tiny-model forward against an eager model's attention
weights on the same full sequence."""

from __future__ import annotations

import pytest
import torch

from kernels.score import (
    patch_attention_scores,
    patch_attention_scores_given_logsumexp,
    patch_attention_scores_reference,
)
from pipeline.kv.cache import EpisodicCache
from tests.support.tiny_models import one_torch_thread, random_ids, stock_twin, tiny_model  # noqa: F401


def naive_scores(queries, cached_keys, patch_keys, valid, scale):
    """For each query head: a full causal softmax over [cached keys ; patch keys] (invalid cached
    slots masked), the patch rows' attention to the cached keys, max over queries, then max over
    the query heads of each KV group. Returns [Hkv, N] float64."""
    n_q_heads, n_patch, _ = queries.shape
    n_kv_heads, n_cached, _ = cached_keys.shape
    group = n_q_heads // n_kv_heads
    if valid is None:
        valid = torch.ones(n_kv_heads, n_cached, dtype=torch.bool)
    out = torch.zeros(n_kv_heads, n_cached, dtype=torch.float64)
    for h in range(n_q_heads):
        kv = h // group
        keys = torch.cat([cached_keys[kv], patch_keys[kv]]).double()  # [N + P, d]
        logits = queries[h].double() @ keys.T * scale  # [P, N + P]
        allowed = torch.cat([valid[kv].expand(n_patch, n_cached),
                             torch.ones(n_patch, n_patch, dtype=torch.bool).tril()], dim=1)
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        out[kv] = torch.maximum(out[kv], probs[:, :n_cached].max(dim=0).values)
    return out


def random_inputs(n_q_heads, n_kv_heads, n_patch, n_cached, dim=16, seed=0, invalid=0.3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q_heads, n_patch, dim, generator=g) * 1.5
    kc = torch.randn(n_kv_heads, n_cached, dim, generator=g) * 1.5
    kp = torch.randn(n_kv_heads, n_patch, dim, generator=g) * 1.5
    valid = torch.rand(n_kv_heads, n_cached, generator=g) >= invalid
    return q, kc, kp, valid


@pytest.mark.parametrize("n_q_heads,n_kv_heads", [(4, 4), (6, 2), (6, 6), (3, 1)])
@pytest.mark.parametrize("n_patch", [1, 2, 17, 70])
@pytest.mark.parametrize("n_cached", [1, 37, 101])
def test_patch_attention_scores_match_naive_softmax(n_q_heads, n_kv_heads, n_patch, n_cached):
    """The dispatch entry point equals the plain-softmax reference: MHA and GQA (groups 1, 3),
    P from 1 to 70, odd N, some invalid cached slots; invalid slots score exactly 0."""
    q, kc, kp, valid = random_inputs(n_q_heads, n_kv_heads, n_patch, n_cached,
                                     seed=n_patch * 1000 + n_cached)
    scale = 16 ** -0.5
    got = patch_attention_scores(q, kc, kp, valid, scale=scale)
    assert got.shape == (n_kv_heads, n_cached) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), naive_scores(q, kc, kp, valid, scale),
                               atol=1e-6, rtol=1e-5)
    assert (got[~valid] == 0).all()


@pytest.mark.parametrize("query_chunk", [1, 16, 33, 256])
def test_query_chunking_does_not_change_scores(query_chunk):
    """Chunking the patch queries (chunk smaller than P, not dividing it) changes nothing: the
    causal mask follows each chunk's offset."""
    q, kc, kp, valid = random_inputs(6, 2, 70, 53, seed=1)
    got = patch_attention_scores_reference(q, kc, kp, valid, scale=0.25, query_chunk=query_chunk)
    torch.testing.assert_close(got.double(), naive_scores(q, kc, kp, valid, 0.25),
                               atol=1e-6, rtol=1e-5)


def naive_logsumexp(queries, cached_keys, patch_keys, valid, scale):
    """Each patch query's log-normaliser over the keys `naive_scores` softmaxes: [Hq, P]."""
    n_q_heads, n_patch, _ = queries.shape
    group = n_q_heads // cached_keys.shape[0]
    out = torch.empty(n_q_heads, n_patch, dtype=torch.float64)
    for h in range(n_q_heads):
        kv = h // group
        logits = queries[h].double() @ torch.cat([cached_keys[kv], patch_keys[kv]]).double().T
        allowed = torch.cat([valid[kv].expand(n_patch, -1),
                             torch.ones(n_patch, n_patch, dtype=torch.bool).tril()], dim=1)
        out[h] = torch.logsumexp((logits * scale).masked_fill(~allowed, float("-inf")), dim=-1)
    return out


@pytest.mark.parametrize("key_chunk", [1, 16, 2048])
@pytest.mark.parametrize("n_q_heads,n_kv_heads", [(4, 4), (6, 2), (3, 1)])
def test_scores_given_the_attentions_logsumexp_match_naive_softmax(key_chunk, n_q_heads,
                                                                   n_kv_heads):
    """Given each patch query's log-normaliser (what SDPA's CPU kernel hands the attention),
    the max scores are the plain softmax's, whatever the key chunks; invalid slots score 0."""
    q, kc, kp, valid = random_inputs(n_q_heads, n_kv_heads, 17, 53, seed=key_chunk)
    lse = naive_logsumexp(q, kc, kp, valid, 0.25).float()
    got = patch_attention_scores_given_logsumexp(q, kc, lse, valid, 0.25, key_chunk=key_chunk)
    assert got.shape == (n_kv_heads, 53) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), naive_scores(q, kc, kp, valid, 0.25),
                               atol=1e-6, rtol=1e-5)
    assert (got[~valid] == 0).all()


def test_no_valid_mask_means_all_valid_and_empty_head_scores_zero():
    """cached_valid=None is all valid; a head with no valid cached slot scores 0 everywhere."""
    q, kc, kp, _ = random_inputs(6, 3, 9, 20, seed=2)
    all_valid = torch.ones(3, 20, dtype=torch.bool)
    torch.testing.assert_close(patch_attention_scores(q, kc, kp, None, scale=0.25),
                               patch_attention_scores(q, kc, kp, all_valid, scale=0.25))
    valid = all_valid.clone()
    valid[1] = False
    got = patch_attention_scores(q, kc, kp, valid, scale=0.25)
    assert (got[1] == 0).all() and (got[0] > 0).all()
    torch.testing.assert_close(got.double(), naive_scores(q, kc, kp, valid, 0.25),
                               atol=1e-6, rtol=1e-5)


def test_scores_are_softmax_probabilities_including_patch_keys():
    """The normaliser includes the patch's own keys: with a patch query that matches its own key
    strongly, the cached keys get little mass (scores well below 1), and scores are in [0, 1]."""
    q, kc, kp, valid = random_inputs(2, 2, 1, 5, seed=3, invalid=0.0)
    kp = q.clone() * 4  # the single patch query attends mostly to its own key
    got = patch_attention_scores(q, kc, kp, valid, scale=0.25)
    assert (got >= 0).all() and (got <= 1).all()
    assert got.sum(dim=1).max() < 0.5
    torch.testing.assert_close(got.double(), naive_scores(q, kc, kp, valid, 0.25),
                               atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama-mha"])
def test_forward_scores_match_eager_attention_weights(family):
    """During a real forward with `cache.patched(P)` (history prefilled, then some cached
    entries evicted per head), each layer's recorded patch scores equal the eager model's
    attention weights on the same full sequence, with the same entries masked for the block and
    patch rows: the patch rows, restricted to cached columns, max over queries and over each KV
    group's query heads. Evicted slots score 0."""
    model = tiny_model(family)
    eager = stock_twin(model, "eager")
    cfg = model.config
    n_kv, group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    n_hist, n_block, n_patch = 40, 8, 6
    total = n_hist + n_block + n_patch
    ids = random_ids(total, seed=21)
    keep = torch.rand(n_kv, n_hist, generator=torch.Generator().manual_seed(5)) < 0.6

    cache = EpisodicCache(cfg.num_hidden_layers)
    with torch.no_grad():
        model.model(ids[None, :n_hist], past_key_values=cache,
                    position_ids=torch.arange(n_hist)[None], use_cache=True)
        for layer in cache.layers:
            layer.keep(keep)  # the same per-head eviction in every layer
        with cache.patched(n_patch):
            model.model(ids[None, n_hist:], past_key_values=cache,
                        position_ids=torch.arange(n_hist, total)[None], use_cache=True)

        # Eager reference: causal; rows after the history do not see the evicted entries.
        allowed = torch.ones(total, total, dtype=torch.bool).tril().repeat(n_kv * group, 1, 1)
        allowed[:, n_hist:, :n_hist] &= keep.repeat_interleave(group, dim=0)[:, None, :]
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None]
        attentions = eager.model(ids[None], attention_mask=additive,
                                 output_attentions=True).attentions

    n_cached = n_hist + n_block
    for idx, layer in enumerate(cache.layers):
        scores = layer.last_request.scores  # [Hkv, slots]
        assert scores.shape == layer.valid.shape
        weights = attentions[idx][0, :, n_cached:, :n_cached]  # [Hq, P, N + T]
        reference = weights.amax(dim=1).reshape(n_kv, group, n_cached).amax(dim=1)
        expected = reference.gather(1, layer.positions)  # slot -> its token position
        torch.testing.assert_close(scores[layer.valid], expected[layer.valid], atol=1e-5, rtol=1e-4)
        assert (scores[~layer.valid] == 0).all()
        assert scores[layer.valid].max() > 1e-3  # not trivially zero


@pytest.mark.parametrize("per_head,sliding", [(False, None), (True, None), (True, 30)])
def test_the_attention_scores_a_patch_as_without_sdpas_normalisers(monkeypatch, per_head,
                                                                   sliding):
    """The attention call that scores a patch on CPU (the cache and the new tokens apart, by
    SDPA's kernel with its normalisers, `_attend_apart`) gives the output and the scores
    it gives without them (SDPA over every query head, the reference softmax): with every
    cached slot valid (one pass: a mask the heads share), with some evicted per head, and with
    a sliding window (each patch query sees other slots: the scores' own softmax)."""
    from pipeline.kv import attention

    n_kv, group, n_past, n_new, n_patch, dim = 2, 3, 40, 12, 5, 16
    g = torch.Generator().manual_seed(7)
    query = torch.randn(1, n_kv * group, n_new, dim, generator=g)
    key, value = (torch.randn(1, n_kv, n_past + n_new, dim, generator=g) for _ in range(2))
    valid = torch.rand(n_kv, n_past, generator=g) < (0.6 if per_head else 2.0)

    def attend():
        request = attention.AttentionRequest(
            key=key, past_valid=valid, past_positions=torch.arange(n_past).expand(n_kv, -1),
            first_position=n_past, n_patch=n_patch)
        attention.hand_off(request)
        out, _ = attention.episodic_attention(None, query, key, value, None, scaling=0.25,
                                              sliding_window=sliding)
        return out, request.scores

    assert attention._FLASH_CPU is not None  # the path under test runs in this torch
    got_out, got_scores = attend()
    monkeypatch.setattr(attention, "_FLASH_CPU", None)
    want_out, want_scores = attend()
    torch.testing.assert_close(got_out, want_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_scores, want_scores, atol=1e-6, rtol=1e-5)
    assert (got_scores[:, :n_past][~valid] == 0).all() and got_scores.max() > 1e-3
