"""One pass past its first span over a context the episodes share (`one_pass_beyond="shared"`):
the context is their entries joined (capped to those the most keep), each episode keeps only its
own older entries and the span's, one episode alone is block prefill of the rest, and caches too
large to leave a block of the model's positions hand the rest to block prefill."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.config import PrefillConfig
from pipeline.kv.cache import EpisodicLayer
from pipeline.kv.methods.epicache import EpiCache
from pipeline.kv.one_pass import first_span, one_pass_prefill
from pipeline.kv.positions import KeyRotation
from pipeline.kv.prefill import block_prefill, build_tokens, through_layer
from pipeline.kv.shared_spans import _appended, _feed, _Growing, shared_context
from tests.support.tiny_models import one_torch_thread, random_ids, tiny_model  # noqa: F401
from tests.unit.kv.test_one_pass import assert_same_cache

SMALL = [8, 12, 10]  # each cache leaves most of the 100 positions for a span
SHARED = PrefillConfig(block=16, compact_recent=16, one_pass_beyond="shared")


def scorers(count: int = 2):
    return [EpiCache(patch=random_ids(12, seed=s)) for s in range(3, 3 + count)]


@pytest.fixture
def model():
    return tiny_model("llama", max_position_embeddings=100)


def entries(layer: EpisodicLayer, head: int) -> dict[int, int]:
    """Token position -> slot of a head's valid entries."""
    slots = layer.valid[head].nonzero().flatten().tolist()
    return {int(layer.positions[head, s]): s for s in slots}


def test_the_shared_context_holds_every_entry_once_moved_to_compact_positions(model):
    caches = [c for c, _ in one_pass_prefill(model, random_ids(88, seed=11), scorers(),
                                             SMALL, SHARED)]
    rotation = KeyRotation.for_model(model)
    shared = shared_context(caches, rotation, cap=100)
    assert shared.tokens_seen == 88
    for idx, layer in enumerate(shared.layers):
        for head in range(layer.valid.shape[0]):
            got = entries(layer, head)
            assert list(got) == sorted(got)  # token order, each token once
            assert set(got) == set().union(*(entries(c.layers[idx], head) for c in caches))
            # packed from 0: the span that follows reads them at the shortest distances
            assert layer.rope_positions[head, list(got.values())].tolist() == list(range(len(got)))
            for cache in caches:
                mine = cache.layers[idx]
                for position, slot in entries(mine, head).items():
                    at = got[position]
                    shift = layer.rope_positions[head, at] - mine.rope_positions[head, slot]
                    moved = rotation.rotate(mine.keys[0, head, slot][None], shift[None])[0]
                    torch.testing.assert_close(layer.keys[0, head, at], moved, atol=1e-5,
                                               rtol=1e-4)
                    assert torch.equal(layer.values[0, head, at], mine.values[0, head, slot])


def test_a_capped_shared_context_keeps_what_the_most_episodes_keep_the_latest_first(model):
    caches = [c for c, _ in one_pass_prefill(model, random_ids(88, seed=11), scorers(3),
                                             SMALL, SHARED)]
    shared = shared_context(caches, KeyRotation.for_model(model), cap=10)
    for idx, layer in enumerate(shared.layers):
        for head in range(layer.valid.shape[0]):
            held = [entries(c.layers[idx], head) for c in caches]
            def rank(position):
                return (sum(position in h for h in held), position)
            got = set(entries(layer, head))
            union = set().union(*held)
            assert len(got) == min(10, len(union))
            assert all(rank(a) > rank(b) for a in got for b in union - got)


def test_one_episode_goes_on_as_block_prefill_of_the_rest_from_its_cache(model):
    """Alone (and every entry packed), the shared context is the episode's own cache: a span is
    a block of the rest."""
    ids, scorer = random_ids(120, seed=11), scorers(1)
    config = dataclasses.replace(SHARED, compact_recent=0)
    assert first_span(model, ids, scorer) == 88
    (cache, stats), = one_pass_prefill(model, ids, scorer, SMALL, config)
    (head, _), = one_pass_prefill(model, ids[:88], scorer, SMALL, config)
    want, _ = block_prefill(model, ids[88:], scorer[0], SMALL,
                            dataclasses.replace(config, block=32), cache=head)
    assert_same_cache(cache, want)
    assert (stats.tokens, stats.tokens_alone, stats.patch_tokens) == (120, 0, 24)


def test_past_the_model_positions_the_rest_is_read_once_and_each_episode_keeps_its_own(model):
    ids = random_ids(300, seed=11)
    built = one_pass_prefill(model, ids, scorers(), SMALL, SHARED)
    heads = one_pass_prefill(model, ids[:88], scorers(), SMALL, SHARED)
    for (cache, stats), (head, _) in zip(built, heads):
        for layer, first in zip(cache.layers, head.layers):
            for h in range(layer.valid.shape[0]):  # of the first span, only its own entries
                assert {p for p in entries(layer, h) if p < 88} <= set(entries(first, h))
        assert cache.entries_per_layer() == [float(b) for b in SMALL]
        assert max(stats.peak_slots) <= 100  # the shared cache, a span and a patch
        for layer in cache.layers:
            assert int(layer.rope_positions[layer.valid].max()) < cache.next_position <= 100
        # the text once for both episodes, then each its patch after the first span and each
        # later one
        assert (stats.tokens, stats.tokens_alone, stats.shared_by) == (300, 0, 2)
        spans = stats.patch_tokens // 12
        assert spans > 2 and build_tokens(stats) == 300 / 2 + 12 * spans


def test_an_episode_holds_the_span_in_one_layer_at_a_time(model, monkeypatch):
    """Memory: a layer takes the span as the patch's forward reaches it, and every layer that
    took it before has been cut back to its budget by then (the next episode's included)."""
    took, budgets = [], {}

    def appending(layer, keys, values, begin, moved, rotation):
        assert all(earlier.entries <= budgets[id(earlier)] for earlier in took)
        grown = _appended(layer, keys, values, begin, moved, rotation)
        took.append(grown)
        budgets[id(grown)] = SMALL[(len(took) - 1) % len(SMALL)]
        assert grown.entries > budgets[id(grown)]
        return grown
    monkeypatch.setattr("pipeline.kv.shared_spans._appended", appending)
    built = one_pass_prefill(model, random_ids(300, seed=11), scorers(), SMALL, SHARED)
    assert len(took) % (2 * len(SMALL)) == 0 and len(took) > 2 * len(SMALL)
    assert all(cache.entries_per_layer() == [float(b) for b in SMALL] for cache, _ in built)


def test_the_span_goes_through_the_shared_context_a_layer_at_a_time(model, monkeypatch):
    """Memory: while the span goes through a layer, the layers it has been through hold no
    context (only the span's keys and values, returned), those it has not reached hold theirs
    as they were (`test_one_episode_goes_on_as_block_prefill_of_the_rest_from_its_cache`
    checks the caches it makes)."""
    seen = []

    def layer_alone(decoder, idx, hidden, positions, cache):
        held = cache.layers
        assert all(layer is None for layer in held[:idx])
        assert isinstance(held[idx], _Growing)
        assert all(type(layer) is EpisodicLayer for layer in held[idx + 1:])
        seen.append(idx)
        return through_layer(decoder, idx, hidden, positions, cache)
    monkeypatch.setattr("pipeline.kv.shared_spans.through_layer", layer_alone)
    built = one_pass_prefill(model, random_ids(300, seed=11), scorers(), SMALL, SHARED)
    assert set(seen) == set(range(len(SMALL)))
    assert all(cache.entries_per_layer() == [float(b) for b in SMALL] for cache, _ in built)


def test_a_shared_cache_too_large_for_the_positions_goes_on_by_blocks(model):
    """Caches of 40 entries leave fewer of the positions for a span than a block of 48."""
    ids, budgets, config = random_ids(300, seed=11), [40, 40, 40], dataclasses.replace(SHARED,
                                                                                      block=48)
    shared = one_pass_prefill(model, ids, scorers(3), budgets, config)
    blocks = one_pass_prefill(model, ids, scorers(3), budgets,
                              dataclasses.replace(config, one_pass_beyond="blocks"))
    for (cache, stats), (want, want_stats) in zip(shared, blocks):
        assert_same_cache(cache, want)
        assert (stats.tokens_alone, stats.patch_tokens) == (212, want_stats.patch_tokens)


def test_original_positions_are_refused(model):
    with pytest.raises(ValueError, match="compact positions"):
        one_pass_prefill(model, random_ids(300), scorers(1), SMALL,
                         dataclasses.replace(SHARED, positions="original"))


def test_a_shorter_least_span_leaves_the_shared_context_the_entries_half_would_cut(model,
                                                                                   monkeypatch):
    """Three episodes of 20 entries join to more than the 38 positions half a span leaves: by
    default the context is cut to fit; with `shared_span` 16 it keeps every joined entry and the
    span takes the positions left, at least 16 tokens, within the model's 100."""
    def contexts(config: PrefillConfig) -> list[tuple[int, int]]:
        seen = []

        def recorded(caches, rotation, cap):
            held = shared_context(caches, rotation, cap)
            seen.append((held.next_position,
                         shared_context(caches, rotation, 10**6).next_position))
            return held
        monkeypatch.setattr("pipeline.kv.shared_spans.shared_context", recorded)
        built = one_pass_prefill(model, random_ids(300, seed=11), scorers(3), [20, 20, 20],
                                 config)
        assert all(cache.entries_per_layer() == [20.0] * 3 for cache, _ in built)
        return seen

    halves = contexts(SHARED)
    assert any(held < whole for held, whole in halves)
    least = contexts(dataclasses.replace(SHARED, shared_span=16))
    assert all(held == whole for held, whole in least) and any(held > 38 for held, _ in least)
    assert all(100 - held - 12 >= 16 for held, _ in least)  # room for a span of 16 at least
    with pytest.raises(ValueError, match="shared_span"):
        PrefillConfig(shared_span=16)


def test_a_most_span_cuts_the_rest_into_spans_no_longer(model, monkeypatch):
    """`shared_span_most` 20: every span 20 tokens or fewer (half the positions by default), the
    rest read once all the same, each episode still held to its budget."""
    def spans(config: PrefillConfig) -> list[int]:
        seen = []

        def recorded(model, shared, span, block):
            seen.append(span.shape[0])
            return _feed(model, shared, span, block)
        monkeypatch.setattr("pipeline.kv.shared_spans._feed", recorded)
        built = one_pass_prefill(model, random_ids(300, seed=11), scorers(), SMALL, config)
        assert all(cache.entries_per_layer() == [float(b) for b in SMALL] for cache, _ in built)
        return seen

    halves, short = spans(SHARED), spans(dataclasses.replace(SHARED, shared_span_most=20))
    assert max(halves) > 20 and max(short) <= 20 and sum(short) == sum(halves)
    with pytest.raises(ValueError, match="shared_span_most"):  # spans are the shared path's
        PrefillConfig(shared_span_most=20)
    with pytest.raises(ValueError, match="shared_span_most"):  # shorter than a block
        dataclasses.replace(SHARED, shared_span_most=8)
