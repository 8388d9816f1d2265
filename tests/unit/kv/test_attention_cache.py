"""The episodic attention and cache against transformers' stock attention, and block prefill's
budget, eviction and generation guarantees, on tiny random Llama / Qwen2 / Mistral models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from pipeline.answer.decode import generate_from_cache
from pipeline.eval.metrics import continuation_nll
from pipeline.kv.attention import AttentionRequest, _attend, episodic_mask
from pipeline.kv.cache import EpisodicCache
from pipeline.kv.eviction import select_keep
from pipeline.kv.layout import token_mask
from pipeline.kv.methods.epicache import EpiCache
from pipeline.kv.methods.full import Full
from pipeline.kv.methods.shaping import ShapedScorer
from pipeline.kv.methods.streamingllm import StreamingLLM
from pipeline.kv.prefill import PrefillConfig, block_prefill
from tests.support.tiny_models import (  # noqa: F401
    FAMILIES,
    StandIn,
    one_torch_thread,
    random_ids,
    stock_twin,
    tiny_model,
)

ATOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def models(request):
    """(episodic model, stock sdpa twin with identical weights) per family."""
    model = tiny_model(request.param)
    return model, stock_twin(model, "sdpa")


def blockwise_logits(model, ids: torch.Tensor, block: int, cache) -> torch.Tensor:
    """Logits of `ids` fed `block` tokens at a time through `cache`, with explicit positions."""
    out = []
    with torch.no_grad():
        for begin in range(0, ids.shape[0], block):
            chunk = ids[begin:begin + block]
            positions = torch.arange(begin, begin + chunk.shape[0])[None]
            out.append(model(chunk[None], past_key_values=cache, position_ids=positions,
                             use_cache=True).logits)
    return torch.cat(out, dim=1)


def stock_prefill(twin, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache()
    with torch.no_grad():
        twin.model(ids[None], past_key_values=cache, use_cache=True)
    return cache


def stock_generate(twin, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        out = twin.generate(ids[None], max_new_tokens=n, do_sample=False, pad_token_id=0,
                            temperature=None, top_p=None, top_k=None)
    return out[0, ids.shape[0]:]


def cache_state(cache: EpisodicCache):
    """Everything generation must leave untouched."""
    return [(layer.tokens_seen, layer.keys.clone(), layer.values.clone(), layer.valid.clone(),
             layer.positions.clone()) for layer in cache.layers]


def assert_same_state(before, after):
    for (t0, k0, v0, m0, p0), (t1, k1, v1, m1, p1) in zip(before, after):
        assert t0 == t1
        assert k0.shape == k1.shape and torch.equal(k0, k1) and torch.equal(v0, v1)
        assert torch.equal(m0, m1) and torch.equal(p0, p1)


# --------------------------------------------------------------------------------------------
# The attention paths against stock sdpa
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [1, 7, 16])
def test_blockwise_episodic_cache_matches_full_stock_forward(models, block):
    """Feeding a sequence in blocks through an EpisodicCache gives the logits of one full
    forward with stock sdpa attention (all families, GQA and MHA)."""
    model, twin = models
    ids = random_ids(45)
    with torch.no_grad():
        reference = twin(ids[None]).logits
    got = blockwise_logits(model, ids, block, EpisodicCache(model.config.num_hidden_layers))
    torch.testing.assert_close(got, reference, atol=ATOL, rtol=0)


def test_history_matters(models):
    """Guard for the test above: logits of a block without its history differ far beyond the
    tolerance, so a mask that dropped the cache would be caught."""
    model, twin = models
    ids = random_ids(45)
    with torch.no_grad():
        full = twin(ids[None]).logits[0, 30:]
        alone = twin(ids[None, 30:]).logits[0]
    assert (full - alone).abs().max() > 100 * ATOL


def test_fallback_paths_match_stock(models):
    """The episodic attention with no cache, or with a plain DynamicCache, is the stock path."""
    model, twin = models
    ids = random_ids(40, seed=2)
    with torch.no_grad():
        reference = twin(ids[None]).logits
        no_cache = model(ids[None], use_cache=False).logits
    torch.testing.assert_close(no_cache, reference, atol=ATOL, rtol=0)
    dynamic = blockwise_logits(model, ids, 13, DynamicCache())
    torch.testing.assert_close(dynamic, reference, atol=ATOL, rtol=0)


def test_sliding_window_model_matches_stock():
    """A Mistral config whose sliding window is shorter than the sequence (Mistral-7B-v0.1 has
    4096, shorter than LoCoMo conversations): the episodic attention masks keys beyond the
    window (episodic_mask), so block prefill runs and blockwise logits are the stock
    sliding-window attention's, never silently attending beyond it. (If the project ever
    chooses to refuse such models instead, test the refusal's message here.)"""
    model = tiny_model("mistral", sliding_window=24)
    twin = stock_twin(model, "sdpa")
    ids = random_ids(64, seed=4)
    with torch.no_grad():
        reference = twin(ids[None]).logits
        unwindowed = stock_twin(tiny_model("mistral"), "sdpa")(ids[None]).logits
    # the window matters: attending to everything gives other logits past the window
    assert (reference[0, 24:] - unwindowed[0, 24:]).abs().max() > 100 * ATOL
    torch.testing.assert_close(reference[0, :24], unwindowed[0, :24], atol=ATOL, rtol=0)
    cache, _ = block_prefill(model, ids, Full(), None, PrefillConfig(block=16))
    assert cache.tokens_seen == 64
    got = blockwise_logits(model, ids, 16, EpisodicCache(model.config.num_hidden_layers))
    torch.testing.assert_close(got, reference, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------
# Block prefill without eviction equals a full prefill
# --------------------------------------------------------------------------------------------

def assert_cache_equals_dynamic(cache: EpisodicCache, dynamic: DynamicCache, n: int):
    for layer, ref in zip(cache.layers, dynamic.layers):
        assert layer.keys.shape == ref.keys.shape  # [1, Hkv, n, d]: no padding, no patch
        torch.testing.assert_close(layer.keys, ref.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(layer.values, ref.values, atol=ATOL, rtol=0)
        assert layer.valid.all()
        assert torch.equal(layer.positions, torch.arange(n).expand_as(layer.positions))


@pytest.mark.parametrize("budgets", [None, "seq", "over"])
@pytest.mark.parametrize("scorer_kind", ["epicache", "full"])
def test_block_prefill_without_eviction_equals_full_prefill(models, budgets, scorer_kind):
    """budgets=None or >= the sequence length: the episodic cache holds exactly the keys and
    values of a stock full prefill (patch keys never stored), greedy generation from it equals
    greedy generation after a full prefill, and the cache is unchanged by generation."""
    model, twin = models
    n, block = 53, 16
    ids = random_ids(n, seed=3)
    n_layers = model.config.num_hidden_layers
    budget_list = {None: None, "seq": [n] * n_layers, "over": [n + 40] * n_layers}[budgets]
    scorer = EpiCache(patch=random_ids(9, seed=5)) if scorer_kind == "epicache" else Full()
    cache, stats = block_prefill(model, ids, scorer, budget_list, PrefillConfig(block=block))
    assert cache.tokens_seen == n and stats.tokens == n and stats.blocks == 4
    assert stats.patch_tokens == (9 * 4 if scorer_kind == "epicache" else 0)
    assert_cache_equals_dynamic(cache, stock_prefill(twin, ids), n)

    question = random_ids(5, seed=6)
    before = cache_state(cache)
    got = generate_from_cache(StandIn(model), cache, question, max_new_tokens=8)
    assert_same_state(before, cache_state(cache))
    expected = stock_generate(twin, torch.cat([ids, question]), 8)
    assert got.tolist() == expected.tolist()
    # The scratch rollback makes a second question see the same cache: same answer again.
    again = generate_from_cache(StandIn(model), cache, question, max_new_tokens=8)
    assert again.tolist() == got.tolist()
    assert_same_state(before, cache_state(cache))


# --------------------------------------------------------------------------------------------
# Eviction under a budget
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("selection", ["headwise", "perhead"])
@pytest.mark.parametrize("family", ["llama", "llama-mha"])
def test_budget_is_held_and_patch_is_never_stored(family, selection):
    """Sequence >= 4x the budget: per layer, peak entries <= budget + block, final entries ==
    budget exactly (head-wise: mean over heads; per-head: every head), patch tokens are never
    stored, and every kept layer-0 key is the full prefill's key at its recorded position."""
    model = tiny_model(family)
    twin = stock_twin(model)
    budget, block, n = 12, 8, 61
    ids = random_ids(n, seed=7)
    scorer = EpiCache(patch=random_ids(6, seed=8))
    cache, stats = block_prefill(model, ids, scorer, [budget] * 3,
                                 PrefillConfig(block=block, selection=selection))
    assert cache.tokens_seen == n == stats.tokens
    assert all(p <= budget + block for p in stats.peak_entries)
    assert max(stats.peak_entries) > budget  # the bound is exercised, not vacuous
    assert stats.final_entries == [budget] * 3 == cache.entries_per_layer()
    for layer in cache.layers:
        counts = layer.valid.sum(dim=1)
        if selection == "perhead":
            assert (counts == budget).all()
        else:
            assert counts.float().mean().item() == budget
        kept = layer.positions[layer.valid]
        assert (kept >= 0).all() and (kept < n).all()
        for h in range(layer.valid.shape[0]):  # no position stored twice in a head
            pos = layer.positions[h][layer.valid[h]]
            assert pos.unique().numel() == pos.numel()
            assert (pos[1:] > pos[:-1]).all()  # kept in token order
    # Layer-0 keys depend only on the token and its position: each kept one must be the full
    # prefill's key at the position recorded (a stored patch key would not be).
    ref = stock_prefill(twin, ids).layers[0].keys[0]
    layer0 = cache.layers[0]
    for h in range(layer0.valid.shape[0]):
        pos = layer0.positions[h][layer0.valid[h]]
        torch.testing.assert_close(layer0.keys[0, h][layer0.valid[h]], ref[h, pos],
                                   atol=ATOL, rtol=0)


class RecordingScorer(ShapedScorer):
    """EpiCache scoring that remembers, per layer, the last state and scores it saw."""

    def __init__(self, patch):
        super().__init__(EpiCache(patch=patch))
        self.seen = {}

    def score(self, layer):
        scores = self.inner.score(layer)
        self.seen[layer.layer_idx] = (layer.positions.clone(), layer.valid.clone(), scores.clone())
        return scores


@pytest.mark.parametrize("selection", ["headwise", "perhead"])
def test_eviction_keeps_the_highest_scored_entries(selection):
    """The last eviction of each layer keeps exactly the top-scored valid entries of that
    layer's patch scores (per head, or across heads), identified by token position."""
    model = tiny_model("qwen2")
    budget = 10
    scorer = RecordingScorer(random_ids(6, seed=15))
    cache, _ = block_prefill(model, random_ids(57, seed=16), scorer, [budget] * 3,
                             PrefillConfig(block=8, selection=selection))
    assert sorted(scorer.seen) == [0, 1, 2]
    for idx, layer in enumerate(cache.layers):
        positions, valid, scores = scorer.seen[idx]
        assert scores.shape == valid.shape and (scores[valid] > 0).all()
        n_heads = valid.shape[0]
        ranked = scores.masked_fill(~valid, float("-inf"))
        if selection == "perhead":
            expected = [set(positions[h][ranked[h].topk(budget).indices].tolist())
                        for h in range(n_heads)]
        else:
            top = ranked.reshape(-1).topk(budget * n_heads).indices
            expected = [set() for _ in range(n_heads)]
            for flat in top.tolist():
                h, slot = divmod(flat, valid.shape[1])
                expected[h].add(int(positions[h, slot]))
        got = [set(layer.positions[h][layer.valid[h]].tolist()) for h in range(n_heads)]
        assert got == expected


def test_headwise_selection_can_be_uneven_across_heads():
    """Head-wise (AdaKV) selection keeps budget x Hkv entries per layer, not budget per head:
    on a random model some layer ends with heads of different lengths."""
    model = tiny_model("llama")
    cache, _ = block_prefill(model, random_ids(61, seed=7), EpiCache(patch=random_ids(6, seed=8)),
                             [12] * 3, PrefillConfig(block=8, selection="headwise"))
    assert any(len(set(layer.valid.sum(dim=1).tolist())) > 1 for layer in cache.layers)


def test_per_layer_budgets_and_generation():
    """Different budgets per layer give different lengths per layer; generation still runs and
    leaves the cache as it was."""
    model = tiny_model("qwen2")
    budgets = [8, 16, 24]
    ids = random_ids(90, seed=9)
    cache, stats = block_prefill(model, ids, EpiCache(patch=random_ids(5, seed=10)), budgets,
                                 PrefillConfig(block=10, selection="perhead"))
    assert cache.entries_per_layer() == [8.0, 16.0, 24.0]
    assert [layer.valid.shape[1] for layer in cache.layers] == budgets
    assert all(p <= b + 10 for p, b in zip(stats.peak_entries, budgets))
    before = cache_state(cache)
    out = generate_from_cache(StandIn(model), cache, random_ids(4, seed=11), max_new_tokens=6)
    assert out.shape == (6,)
    assert ((out >= 0) & (out < model.config.vocab_size)).all()
    assert_same_state(before, cache_state(cache))


def test_a_view_without_tokens_reads_as_the_cache_with_those_entries_evicted():
    """`without_tokens` (a top-up read once) hides the entries of the given tokens for one read:
    a question over the view gives the logits of the cache with those entries evicted
    (`keep`), and the cache itself is left as it was."""
    model = tiny_model("llama")
    cache, _ = block_prefill(model, random_ids(70, seed=21), EpiCache(patch=random_ids(5, seed=22)),
                             [30] * 3, PrefillConfig(block=10, selection="headwise"))
    hidden = token_mask([(12, 30), (41, 44)], cache.tokens_seen)
    assert hidden.sum() == 21 and hidden[12] and not hidden[30] and hidden[43]
    before = cache_state(cache)
    view = cache.without_tokens(hidden)
    evicted = cache.without_tokens(torch.zeros(0, dtype=torch.bool))  # hides nothing
    assert evicted.entries_per_layer() == cache.entries_per_layer()
    for layer in evicted.layers:
        layer.keep(layer.valid & ~hidden[layer.positions])
    dropped = [c - v for c, v in zip(cache.entries_per_layer(), view.entries_per_layer())]
    assert all(d > 0 for d in dropped)
    assert view.entries_per_layer() == evicted.entries_per_layer()
    question = random_ids(6, seed=23)
    logits = []
    for c in (view, evicted, cache):
        with torch.no_grad(), c.scratch():
            logits.append(model(question[None], past_key_values=c, use_cache=True, position_ids=(
                torch.arange(c.next_position, c.next_position + 6)[None])).logits)
    torch.testing.assert_close(logits[0], logits[1], atol=ATOL, rtol=0)
    assert (logits[0] - logits[2]).abs().max() > 1e-3  # the hidden entries mattered
    assert_same_state(before, cache_state(cache))


def test_block_prefill_rejects_wrong_number_of_budgets():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="layer budgets"):
        block_prefill(model, random_ids(10), Full(), [8, 8])


@pytest.mark.parametrize("selection", ["headwise", "perhead"])
def test_streamingllm_keeps_sink_and_most_recent(selection):
    """StreamingLLM keeps the positions < sink and the most recent ones, in every head."""
    model = tiny_model("mistral")
    sink, budget, n = 4, 12, 60
    cache, _ = block_prefill(model, random_ids(n, seed=12), StreamingLLM(sink=sink),
                             [budget] * 3, PrefillConfig(block=8, selection=selection))
    expected = list(range(sink)) + list(range(n - (budget - sink), n))
    for layer in cache.layers:
        for h in range(layer.valid.shape[0]):
            assert layer.positions[h][layer.valid[h]].tolist() == expected


def streaming_kept_sets(n: int, block: int, sink: int, budget: int) -> list[set[int]]:
    """The positions a StreamingLLM block prefill holds after each block (simulated)."""
    kept, history = set(), []
    for start in range(0, n, block):
        kept |= set(range(start, min(start + block, n)))
        if len(kept) > budget:
            sinks = {p for p in kept if p < sink}
            kept = sinks | set(sorted(kept - sinks)[-(budget - len(sinks)):])
        history.append(set(kept))
    return history


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_evicted_cache_equals_masked_full_attention(family):
    """Eviction is exactly attention masking: after a StreamingLLM block prefill (same kept
    positions in every layer and head), the kept keys and greedy generation equal a stock eager
    model run on the whole sequence with a mask where each block (and then the question and the
    answer) sees only what the cache held before it, plus itself causally."""
    model = tiny_model(family)
    eager = stock_twin(model, "eager")
    n, block, sink, budget, n_new = 50, 8, 4, 12, 5
    ids, question = random_ids(n, seed=13), random_ids(4, seed=14)
    cache, _ = block_prefill(model, ids, StreamingLLM(sink=sink), [budget] * 3,
                             PrefillConfig(block=block, selection="perhead"))
    generated = generate_from_cache(StandIn(model), cache, question, max_new_tokens=n_new)

    kept = streaming_kept_sets(n, block, sink, budget)

    def visible(total: int) -> torch.Tensor:
        allowed = torch.ones(total, total, dtype=torch.bool).tril()
        for q in range(n, total):  # question and answer tokens: the final cache + themselves
            allowed[q, :n] = False
            allowed[q, sorted(kept[-1])] = True
        for j, start in enumerate(range(block, n, block)):  # block j+1 sees kept after block j
            end = min(start + block, n)
            allowed[start:end, :start] = False
            allowed[start:end, sorted(kept[j])] = True
        return torch.zeros(total, total).masked_fill(~allowed, float("-inf"))[None, None]

    sequence = torch.cat([ids, question])
    reference_cache = DynamicCache()
    with torch.no_grad():
        eager.model(ids[None], attention_mask=visible(n), past_key_values=reference_cache,
                    use_cache=True)
        for _ in range(n_new):  # greedy decoding by full re-forward under the mask
            logits = eager(sequence[None], attention_mask=visible(sequence.shape[0])).logits
            sequence = torch.cat([sequence, logits[0, -1].argmax()[None]])
    assert generated.tolist() == sequence[n + 4:].tolist()
    for layer, ref in zip(cache.layers, reference_cache.layers):
        for h in range(layer.valid.shape[0]):
            pos = layer.positions[h][layer.valid[h]]
            assert sorted(pos.tolist()) == sorted(kept[-1])
            torch.testing.assert_close(layer.keys[0, h][layer.valid[h]], ref.keys[0, h, pos],
                                       atol=ATOL, rtol=0)
            torch.testing.assert_close(layer.values[0, h][layer.valid[h]], ref.values[0, h, pos],
                                       atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernel", ["apart", "by_head"])
def test_heads_with_their_own_slots_attend_as_one_call_with_every_heads_mask(monkeypatch, kernel):
    """Where each KV head holds its own cached slots, attention never makes the mask of every
    query head: on CPU it attends over the cache and the new tokens apart and merges them
    (`_attend_apart`), elsewhere a call per KV head (`_attend_by_head`, run here by hiding the
    CPU kernel). Either gives one SDPA call's output with that mask, also where a head holds no
    cached entry at all, and the apart path the log-normalisers of that call."""
    from pipeline.kv import attention

    if kernel == "by_head":
        monkeypatch.setattr(attention, "_FLASH_CPU", None)
    torch.manual_seed(0)
    n_kv, group, n_new, n_past, dim = 3, 3, 6, 11, 8
    valid = torch.rand(n_kv, n_past) > 0.4
    valid[0], valid[1, :5], valid[2] = True, False, False  # the heads' slots differ; 2 has none
    query = torch.randn(1, n_kv * group, n_new, dim)
    key, value = (torch.randn(1, n_kv, n_past + n_new, dim) for _ in range(2))
    request = AttentionRequest(key=key, past_valid=valid,
                               past_positions=torch.arange(n_past).expand(n_kv, -1),
                               first_position=n_past)
    mask = episodic_mask(request, n_new, group)
    assert mask.shape[1] == n_kv * group  # a mask per query head: the heads differ
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=additive,
                                              enable_gqa=True)
    attended = _attend(query, key, value, request, None, None)
    assert attended.mask is None
    torch.testing.assert_close(attended.out, expected, atol=1e-6, rtol=0)
    if kernel == "apart":
        logits = query @ key.repeat_interleave(group, dim=1).transpose(-1, -2) * dim ** -0.5
        normalisers = (logits + additive).logsumexp(dim=-1)[0]
        torch.testing.assert_close(attended.logsumexp, normalisers, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------
# select_keep on hand-made tensors
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("selection, kept", [
    # head-wise: the top budget x Hkv scores across all heads, so one head may take most
    ("headwise", [[True, True, True, True, False], [False, False, False, False, False]]),
    # per head: the top budget of each head
    ("perhead", [[True, True, False, False, False], [False, False, False, True, True]]),
])
def test_select_keep_takes_the_top_scores_across_heads_or_per_head(selection, kept):
    scores = torch.tensor([[9., 8., 7., 6., 0.],
                           [1., 2., 3., 4., 5.]])
    valid = torch.ones(2, 5, dtype=torch.bool)
    assert select_keep(scores, valid, budget=2, selection=selection).tolist() == kept


@pytest.mark.parametrize("selection", ["headwise", "perhead"])
def test_select_keep_never_keeps_invalid_slots(selection):
    """Invalid (padding) slots are never kept, even with the highest scores or when the budget
    exceeds what a head holds."""
    scores = torch.tensor([[100., 1., 2., 50.],
                           [3., 100., 4., 5.]])
    valid = torch.tensor([[False, True, True, False],
                          [True, False, True, True]])
    keep = select_keep(scores, valid, budget=3, selection=selection)
    assert not (keep & ~valid).any()
    assert keep.tolist() == valid.tolist()  # budget 3 >= everything valid: all valid kept
    keep = select_keep(scores, valid, budget=1, selection=selection)
    assert not (keep & ~valid).any()
    if selection == "perhead":
        assert keep.tolist() == [[False, False, True, False], [False, False, False, True]]
    else:  # the top 2 valid scores overall: 5 (head 1) and 4 (head 1)
        assert keep.tolist() == [[False, False, False, False], [False, False, True, True]]


def test_two_joined_caches_hold_each_kept_token_once_and_a_cache_joined_with_itself_reads_same():
    """`EpisodicCache.joined`: a question the router is unsure of reads two episodes' caches
    as one; a token both kept is held once (the first cache's entry)."""
    model = tiny_model("llama")
    ids = random_ids(200, seed=21)
    a, b = (block_prefill(model, ids, EpiCache(patch=random_ids(8, seed=s)), [24] * 3,
                          PrefillConfig(block=32))[0] for s in (22, 23))
    joined = EpisodicCache.joined([a, b])
    assert joined.next_position == joined.tokens_seen == 200
    for la, lb, lj in zip(a.layers, b.layers, joined.layers):
        for h in range(lj.valid.shape[0]):
            kept = lj.positions[h][lj.valid[h]].tolist()
            assert len(kept) == len(set(kept))  # no token twice
            assert set(kept) == set(la.positions[h][la.valid[h]].tolist()) | \
                set(lb.positions[h][lb.valid[h]].tolist())
    question = random_ids(6, seed=24)
    itself = EpisodicCache.joined([a, a])
    assert continuation_nll(model, itself, question[:3], question[3:]) == pytest.approx(
        continuation_nll(model, a, question[:3], question[3:]), abs=1e-5)
