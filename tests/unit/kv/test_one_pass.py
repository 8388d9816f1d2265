"""One pass builds every episode: each episode's cache is what block prefill makes with the
whole conversation as its one block, for every kind of scorer and compression it takes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.score import patch_attention_scores
from pipeline.config import BuildConfig, MergeConfig, PrefillConfig, TriStateConfig
from pipeline.kv.methods.epicache import EpiCache
from pipeline.kv.methods.keydiff import KeyDiff
from pipeline.kv.methods.shaping import FocusScorer
from pipeline.kv.methods.snapkv import SnapKV
from pipeline.kv.methods.streamingllm import StreamingLLM
from pipeline.kv.one_pass import (
    first_span,
    mixed_scores,
    one_pass_prefill,
    pass_window,
    span_scores,
)
from pipeline.kv.positions import KeyRotation
from pipeline.kv.prefill import block_prefill, build_tokens
from tests.support.tiny_models import one_torch_thread, random_ids, tiny_model  # noqa: F401

N = 150
BUDGETS = [24, 40, 32]


def assert_same_cache(got, want, atol=2e-5):
    assert got.tokens_seen == want.tokens_seen and got.next_position == want.next_position
    for a, b in zip(got.layers, want.layers):
        assert torch.equal(a.valid, b.valid)
        assert torch.equal(a.positions[a.valid], b.positions[b.valid])
        assert torch.equal(a.rope_positions[a.valid], b.rope_positions[b.valid])
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            torch.testing.assert_close(x[0][a.valid], y[0][b.valid], atol=atol, rtol=1e-4)


def episode_scorers():
    return [EpiCache(patch=random_ids(12, seed=s)) for s in (3, 4, 5)]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("prefill", [
    PrefillConfig(positions="original", compact_recent=0),
    PrefillConfig(),  # the default: compact positions with a recent window
    PrefillConfig(selection="perhead", positions="original"),
    PrefillConfig(merge=MergeConfig(enabled=True), positions="original"),
    PrefillConfig(decode_positions=True),
], ids=["original", "compact", "perhead", "d2o", "dapq"])
def test_each_episode_is_block_prefill_with_one_block(family, prefill):
    model = tiny_model(family)
    ids = random_ids(N, seed=2)
    scorers = episode_scorers()
    recent = dataclasses.replace(prefill, compact_recent=min(prefill.compact_recent, 40),
                                 block=32)
    built = one_pass_prefill(model, ids, scorers, BUDGETS, recent)
    assert len(built) == len(scorers)
    for scorer, (cache, stats) in zip(scorers, built):
        want, want_stats = block_prefill(model, ids, scorer, BUDGETS,
                                         dataclasses.replace(recent, block=N))
        assert_same_cache(cache, want)
        assert stats.final_entries == want_stats.final_entries
        assert (stats.original_entries, stats.evicted_entries) == \
            (want_stats.original_entries, want_stats.evicted_entries)
        assert stats.merged_entries == want_stats.merged_entries
        # the text ran through the model once for all the episodes: each pays a third of it
        assert build_tokens(stats) == N / 3 + 12 and build_tokens(want_stats) == N + 12


@pytest.mark.parametrize("scorer", [StreamingLLM(sink=4), KeyDiff(), SnapKV()],
                         ids=["streamingllm", "keydiff", "snapkv"])
def test_baselines_one_pass_as_one_block(scorer):
    model = tiny_model("llama")
    ids = random_ids(N, seed=7)
    prefill = PrefillConfig(positions="original", compact_recent=0, block=48)
    (cache, _), = one_pass_prefill(model, ids, [scorer], BUDGETS, prefill)
    want, _ = block_prefill(model, ids, scorer, BUDGETS, dataclasses.replace(prefill, block=N))
    assert_same_cache(cache, want)


def test_the_full_cache_in_one_pass_is_the_stock_prefill():
    model = tiny_model("llama")
    ids = random_ids(N, seed=9)
    (cache, stats), = one_pass_prefill(model, ids, [StreamingLLM()], None,
                                       PrefillConfig(positions="original", block=40))
    want, _ = block_prefill(model, ids, StreamingLLM(), None, PrefillConfig(positions="original"))
    assert_same_cache(cache, want)
    assert stats.final_entries == [float(N)] * 3


def test_a_span_of_everything_is_the_patch_attention():
    torch.manual_seed(0)
    q, keys, pk = torch.randn(6, 5, 16), torch.randn(2, 40, 16), torch.randn(2, 5, 16)
    rotation = KeyRotation(1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
    want = patch_attention_scores(q, keys, pk, None, 0.25)
    torch.testing.assert_close(span_scores(q, keys, pk, 40, rotation, 0.25), want)
    # shorter spans: the last span is read from where the patch is, the others moved
    got = span_scores(q, keys, pk, 16, rotation, 0.25)
    torch.testing.assert_close(got[:, 32:], patch_attention_scores(q, keys[:, 32:], pk, None,
                                                                   0.25))
    moved = [rotation.rotate(t.reshape(-1, 16), torch.full((t.numel() // 16,), 16 - 40))
             .view_as(t) for t in (q, pk)]
    torch.testing.assert_close(got[:, :16], patch_attention_scores(moved[0], keys[:, :16],
                                                                   moved[1], None, 0.25))


@pytest.mark.parametrize("beyond", ["blocks", "window"])
def test_past_the_model_positions_every_distance_stays_within_them(beyond):
    """A conversation longer than the model's positions is built: past the first span each
    episode goes on by block prefill, or each token reads only the window behind it and the
    patch scores every span; the caches hold the budget."""
    model = tiny_model("llama", max_position_embeddings=100)
    assert pass_window(model) == 100
    ids = random_ids(300, seed=11)
    built = one_pass_prefill(model, ids, episode_scorers()[:2], BUDGETS,
                             PrefillConfig(block=32, compact_recent=16, one_pass_beyond=beyond))
    for cache, stats in built:
        assert stats.tokens == 300
        assert cache.entries_per_layer() == [float(b) for b in BUDGETS]
        for layer in cache.layers:
            assert int(layer.rope_positions[layer.valid].max()) < 100
        assert bool(torch.cat([layer.positions[layer.valid] for layer in cache.layers]
                              ).lt(150).any())  # entries from the first half are kept too


def test_past_the_first_span_each_episode_goes_on_by_block_prefill():
    """"blocks" (the default): one pass over what one reading of the model's positions holds
    (100 positions less the 12-token patch), then each episode's cache goes on by block prefill
    over the rest, as its append would; the stats count the pass once for all the episodes and
    the blocks once for each."""
    model = tiny_model("llama", max_position_embeddings=100)
    ids, scorers = random_ids(300, seed=11), episode_scorers()[:2]
    config = PrefillConfig(block=32, compact_recent=16)
    assert first_span(model, ids, scorers) == 88
    built = one_pass_prefill(model, ids, scorers, BUDGETS, config)
    heads = one_pass_prefill(model, ids[:88], scorers, BUDGETS, config)
    for (cache, stats), (head, _), scorer in zip(built, heads, scorers):
        want, _ = block_prefill(model, ids[88:], scorer, BUDGETS, config, cache=head)
        assert_same_cache(cache, want)
        assert (stats.tokens, stats.tokens_alone, stats.shared_by) == (300, 212, 2)
        assert build_tokens(stats) == 88 / 2 + 212 + stats.patch_tokens
        assert stats.patch_tokens == 12 + 12 * 7  # the pass's patch, then each block's


def test_the_pass_cuts_at_its_own_focus_and_every_later_cut_at_the_scorers():
    """`pass_focus`: the first span's cut weights the episode's own turns by 31 here, the
    blocks after it by the scorer's 3, as a pass at focus 30 then an append at focus 2 would;
    a scorer with no focus is refused, and a build of one before it starts."""
    model = tiny_model("llama", max_position_embeddings=100)
    ids, member = random_ids(300, seed=11), torch.arange(300) % 3 == 0
    def focused(weight):
        return [FocusScorer(s, member, weight) for s in episode_scorers()[:2]]
    config = PrefillConfig(block=32, compact_recent=16, one_pass=True, pass_focus=30.0)
    plain = dataclasses.replace(config, pass_focus=None)
    built = one_pass_prefill(model, ids, focused(2.0), BUDGETS, config)
    heads = one_pass_prefill(model, ids[:88], focused(30.0), BUDGETS, plain)
    for (cache, _), (head, _), scorer in zip(built, heads, focused(2.0)):
        want, _ = block_prefill(model, ids[88:], scorer, BUDGETS, plain, cache=head)
        assert_same_cache(cache, want)
    unfocused = one_pass_prefill(model, ids, focused(2.0), BUDGETS, plain)
    assert any(not torch.equal(a.positions[a.valid], b.positions[b.valid])
               for (x, _), (y, _) in zip(built, unfocused) for a, b in zip(x.layers, y.layers))
    with pytest.raises(ValueError, match="pass_focus"):
        one_pass_prefill(model, ids, episode_scorers(), BUDGETS, config)
    with pytest.raises(ValueError, match="pass_focus"):
        PrefillConfig(pass_focus=30.0)  # the pass's own
    with pytest.raises(ValueError, match="pass_focus"):  # a build is refused before it starts
        BuildConfig(scorer="snapkv", prefill=config)


def test_each_forward_reads_the_window_up_to_its_last_token(monkeypatch):
    """What a forward of the pass reads: the first `window` tokens in one forward with no
    earlier key (the causal attention of a plain prefill), then each chunk, and each patch, the
    keys of the `window` positions up to its last token: none further back, none left out (the
    attention is handed only those, nothing computed and masked away), the first four of them
    the conversation's first four tokens moved there (the sinks), and the pages freed after
    every layer go back to the kernel."""
    from pipeline.kv import one_pass

    reads, keys, released = [], [], []
    hand_off = one_pass.hand_off

    def recording(request):
        n_keys, n_new = request.key.shape[2], request.n_patch
        reads.append((request.first_position, n_keys, n_new, bool(request.past_valid.all())))
        keys.append(request.key[0, :, :4].clone())
        hand_off(request)

    monkeypatch.setattr(one_pass, "hand_off", recording)
    monkeypatch.setattr(one_pass, "release_freed_memory", lambda: released.append(1))
    model = tiny_model("llama", max_position_embeddings=100)
    one_pass_prefill(model, random_ids(300, seed=11), episode_scorers()[:1], BUDGETS,
                     PrefillConfig(block=32, compact_recent=16, one_pass_beyond="window"))
    per_layer = len(reads) // 3
    assert len(reads) == 3 * per_layer and len(released) == 3
    context, patch = reads[:per_layer - 1], reads[per_layer - 1]
    assert context[0] == (0, 100, 0, True)  # tokens 0-99 in one forward, no earlier key
    # then 32 at a time, each reading the 100 positions up to its last token, all valid
    assert context[1:] == [(first, 100, 0, True) for first in range(100, 300, 32)]
    assert patch[:3] == (300, 100, 12)  # the patch: tokens 212-299 and its own 12
    # each later forward's first slots: tokens 0-3 (as the first forward made them at
    # positions 0-3) moved to the first positions its window reads
    rotation = KeyRotation.for_model(model)
    sinks = keys[0].reshape(-1, keys[0].shape[-1])
    for (begin, n_keys, n_patch, _), got in zip(reads[1:per_layer], keys[1:per_layer]):
        stop = 300 + n_patch if n_patch else min(begin + 32, 300)
        first = stop - n_keys
        moved = rotation.rotate(sinks, torch.full((sinks.shape[0],), first))
        torch.testing.assert_close(got, moved.view_as(got))


def test_without_sinks_a_window_reads_its_own_tokens_only(monkeypatch):
    """`pass_sinks=0`: the plain sliding window, its first slots its oldest tokens'."""
    from pipeline.kv import one_pass

    firsts = []
    read = one_pass._Sinks.read

    def recording(self, buffers, first, stop):
        got = read(self, buffers, first, stop)
        assert torch.equal(got[0], buffers[0][:, :, first:stop])
        assert torch.equal(got[1], buffers[1][:, :, first:stop])
        firsts.append(first)
        return got

    monkeypatch.setattr(one_pass._Sinks, "read", recording)
    one_pass_prefill(tiny_model("llama", max_position_embeddings=100), random_ids(300, seed=11),
                     episode_scorers()[:1], BUDGETS,
                     PrefillConfig(block=32, compact_recent=16, pass_sinks=0,
                                   one_pass_beyond="window"))
    assert max(firsts) == 212  # windows past the first tokens were read (the patch's)


def test_tristate_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="block by block"):
        PrefillConfig(one_pass=True, tristate=TriStateConfig(enabled=True))
    with pytest.raises(ValueError, match="block by block"):
        one_pass_prefill(tiny_model("llama"), random_ids(20), episode_scorers()[:1], BUDGETS,
                         PrefillConfig(tristate=TriStateConfig(enabled=True)))


def test_the_pass_holds_one_layer_whole_at_a_time(monkeypatch):
    """Memory: while a layer runs, no other layer's keys and values are held by the pass, and
    what it holds is that layer's keys and values of the text and the longest patch."""
    from pipeline.kv import one_pass

    held_layers = []
    context = one_pass._Pass.context

    def counting(self, idx, hidden):
        held_layers.append(sum(layer.is_initialized for layer in self.cache.layers))
        return context(self, idx, hidden)

    monkeypatch.setattr(one_pass._Pass, "context", counting)
    model = tiny_model("llama")
    built = one_pass_prefill(model, random_ids(N, seed=3), episode_scorers(), BUDGETS,
                             PrefillConfig(block=32))
    assert held_layers == [0, 0, 0]  # each layer's buffers are made by its own first chunk
    kv_bytes = 2 * 2 * (N + 12) * 16 * 4  # keys and values, 2 KV heads, head dim 16, float32
    assert all(stats.peak_bytes == [kv_bytes] * 3 for _, stats in built)


def test_scores_by_spans_are_each_spans_patch_attention():
    """`score_span`: each span of keys scored as if the patch followed it; a span of the whole
    text is the plain pass."""
    model = tiny_model("llama")
    ids = random_ids(N, seed=4)
    scorers = episode_scorers()[:1]
    plain = PrefillConfig(one_pass=True, positions="original", block=32)
    (whole, _), = one_pass_prefill(model, ids, scorers, BUDGETS, plain)
    (same, _), = one_pass_prefill(model, ids, scorers, BUDGETS,
                                  dataclasses.replace(plain, score_span=N))
    (spans, _), = one_pass_prefill(model, ids, scorers, BUDGETS,
                                   dataclasses.replace(plain, score_span=50))
    assert_same_cache(same, whole)
    assert any(not torch.equal(a.valid, b.valid) or not torch.equal(a.positions, b.positions)
               for a, b in zip(spans.layers, whole.layers))  # other entries kept
    assert spans.entries_per_layer() == whole.entries_per_layer()
    with pytest.raises(ValueError, match="needs one_pass"):
        PrefillConfig(score_span=50)


def test_a_share_of_span_scores_mixes_the_two_readings():
    """`score_span_share`: 1 is the spans' reading alone, 0 the plain pass's (its scores only
    rescaled), in between each reading summed to 1 over the layer and weighed by its share."""
    model = tiny_model("llama")
    ids = random_ids(N, seed=5)
    scorers = episode_scorers()[:1]
    plain = PrefillConfig(one_pass=True, positions="original", block=32)
    spans = dataclasses.replace(plain, score_span=50)
    (want_plain, _), = one_pass_prefill(model, ids, scorers, BUDGETS, plain)
    (want_spans, _), = one_pass_prefill(model, ids, scorers, BUDGETS, spans)
    (all_spans, _), = one_pass_prefill(model, ids, scorers, BUDGETS,
                                       dataclasses.replace(spans, score_span_share=1.0))
    (no_spans, _), = one_pass_prefill(model, ids, scorers, BUDGETS,
                                      dataclasses.replace(spans, score_span_share=0.0))
    assert_same_cache(all_spans, want_spans)
    assert_same_cache(no_spans, want_plain)

    whole = torch.tensor([[1.0, 3.0], [0.0, 4.0]])
    by_spans = torch.tensor([[2.0, 2.0], [2.0, 2.0]])
    torch.testing.assert_close(mixed_scores(whole, by_spans, 0.25),
                               0.75 * whole / 8 + 0.25 * by_spans / 8)
    with pytest.raises(ValueError, match="needs score_span"):
        PrefillConfig(one_pass=True, score_span_share=0.5)
