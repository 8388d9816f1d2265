"""One pass goes on past its first span over a context the episodes share (issue 61,
`PrefillConfig.one_pass_beyond="shared"`).

Past what one reading of the model's positions holds, "blocks" runs each episode on alone by
block prefill (about a prefill of the rest per episode) and "window" slides a window over the
rest (one prefill, but each later token is computed without the older context: less copy-free
evidence whole). Here the rest goes through the model once for all the episodes, span by span:

1. the span's keys and values are computed once, reading a context the episodes share
   (`shared_context`: the entries their caches keep, joined, each token once, at compact
   positions; capped, where they are too many, to those the most episodes keep, the latest
   first), as block prefill's tokens read their episode's cache, only with more of the past;
2. each episode then takes the span as block prefill takes a block (`_as_block`): the span's
   keys and values after its own cache, its patch reading both, its compression cutting back
   to the budget and compacting. So each episode keeps only its own entries and the span's,
   scored by its own patch over what block prefill's would read.

A span is half the model's positions (`PrefillConfig.shared_span_most`: fewer), or less where
an episode's cache and its patch leave less (where they leave less than a block the caller goes
on by "blocks"), or where the shared context holds more than the other half: the context takes
what the span leaves, down to `PrefillConfig.shared_span` tokens (0: half), capped there to the
entries the most episodes keep (spans cut evenly, fewer and longer, were measured and not kept:
docs/changelog.md). Memory: the span's keys and values in every layer and the shared context of
those it has not gone through yet (`_feed` goes layer by layer), at most the model's positions
per head, whatever the length; the span is fed a block at a time, each forward's attention
masked by KV head (`pipeline.kv.attention`: no mask holds a float per query and key); and each
episode holds the span in one layer at a time, the layer its patch's forward is in
(`_as_block`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch

from pipeline.allocator import release_freed_memory
from pipeline.config import PrefillConfig
from pipeline.kv.attention import AttentionRequest, hand_off
from pipeline.kv.cache import EpisodicCache, EpisodicLayer
from pipeline.kv.compression import compression_for
from pipeline.kv.eviction import Compression
from pipeline.kv.methods.base import Scorer
from pipeline.kv.positions import KeyRotation
from pipeline.kv.prefill import (
    PrefillStats,
    count_states,
    entry_bytes,
    layer_state,
    patch_after,
    through_layer,
)

log = logging.getLogger(__name__)


def shared_context(caches: Sequence[EpisodicCache], rotation: KeyRotation,
                   cap: int) -> EpisodicCache:
    """The caches (of the same tokens, one pass's episodes) as one: each head of each layer
    holds the tokens any of them keeps, once, in token order, at positions 0, 1, 2, ... (each
    key re-rotated from where its cache held it); at most `cap` of them, those the most caches
    keep, the latest first. A token's keys and values are the same in every cache that keeps
    it (the same pass made them), up to that rotation."""
    layers = []
    for parts in zip(*(c.layers for c in caches)):
        valid = torch.cat([p.valid for p in parts], dim=1)
        positions = torch.cat([p.positions for p in parts], dim=1)
        order = torch.argsort(positions.masked_fill(~valid, torch.iinfo(positions.dtype).max),
                              dim=1, stable=True)
        valid, positions = valid.gather(1, order), positions.gather(1, order)
        rope = torch.cat([p.rope_positions for p in parts], dim=1).gather(1, order)
        keys, values = (_gathered(torch.cat([getattr(p, name) for p in parts], dim=2), order)
                        for name in ("keys", "values"))
        again = torch.zeros_like(valid)
        again[:, 1:] = valid[:, 1:] & valid[:, :-1] & (positions[:, 1:] == positions[:, :-1])
        layer = EpisodicLayer.from_stored(keys, values, valid, positions, rope_positions=rope,
                                          tokens_seen=parts[0].tokens_seen,
                                          next_position=parts[0].next_position)
        layer.keep(_most_kept(layer.valid & ~again, positions, parts, cap))
        layers.append(layer)
    shared = EpisodicCache.from_layers(layers)
    shared.compact(rotation)
    return shared


def _gathered(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[1, Hkv, slots, d] gathered along the slots by `order` [Hkv, slots]."""
    return tensor.gather(2, order[None, :, :, None].expand(1, -1, -1, tensor.shape[-1]))


def _most_kept(candidates: torch.Tensor, positions: torch.Tensor,
               parts: Sequence[EpisodicLayer], cap: int) -> torch.Tensor:
    """[Hkv, slots] of the candidates, at most `cap` per head: those the most `parts` hold, the
    latest first."""
    if int(candidates.sum(dim=1).max()) <= cap:
        return candidates
    n = max(int(positions[candidates].max()) + 1, 1)
    held = torch.zeros(positions.shape[0], n, dtype=torch.long, device=positions.device)
    for part in parts:
        heads = torch.arange(part.valid.shape[0], device=positions.device)[:, None]
        held[heads.expand_as(part.positions)[part.valid], part.positions[part.valid]] += 1
    priority = held.gather(1, positions.clamp(0, n - 1)) * n + positions
    top = torch.topk(priority.masked_fill(~candidates, -1), cap, dim=1).indices
    return torch.zeros_like(candidates).scatter_(1, top, True) & candidates


@torch.inference_mode()
def shared_spans(model: torch.nn.Module, input_ids: torch.Tensor,
                 first: list[tuple[EpisodicCache, PrefillStats]], scorers: Sequence[Scorer],
                 budgets: list[int] | None, config: PrefillConfig, window: int,
                 original_element_size: int | None = None
                 ) -> tuple[list[tuple[EpisodicCache, PrefillStats]], int]:
    """The episodes' caches of `input_ids` ([N]) from those of its first tokens (`first`, one
    pass's, taken over: the list is emptied), span by span over their shared context
    (`shared_context`) while every episode's cache leaves a block of the `window` positions
    free. Returns the caches with their stats, and the tokens they have seen: N, or fewer (the
    caller goes on by blocks)."""
    start_time = time.perf_counter()
    caches, stats = [c for c, _ in first], [replace(s) for _, s in first]
    first.clear()  # each episode's older cache is freed once the next span has replaced it
    ids = input_ids.to(next(model.parameters()).device)
    n, begin = ids.shape[0], caches[0].tokens_seen
    rotation = KeyRotation.for_model(model)
    sizes = entry_bytes(model, original_element_size)
    compressions = [compression_for(config, model, sizes, budgets) for _ in scorers]
    longest = max((patch_after(s, ids[begin:], begin).shape[0] for s in scorers), default=0)
    most = min(config.shared_span_most or window // 2, window // 2)
    least = min(config.shared_span or most, most)
    release_freed_memory()  # the first span's pass: its pages are free, not yet handed back
    while begin < n:
        room = min([most] + [window - c.next_position - longest for c in caches])
        if room < config.block:
            log.debug("an episode's cache leaves %d of %d positions at token %d: the rest by "
                      "blocks", room, window, begin)
            break
        shared = shared_context(caches, rotation, window - min(room, least) - longest)
        stop = min(begin + min(room, window - shared.next_position - longest), n)
        log.debug("tokens %d-%d over a shared context of %d positions", begin, stop,
                  shared.next_position)
        at, peaks = shared.next_position, _sizes(shared, stop - begin)
        span = _feed(model, shared, ids[begin:stop], config.block)  # empties `shared`
        del shared
        release_freed_memory()
        for e, scorer in enumerate(scorers):
            patch = patch_after(scorer, ids[begin:stop], begin)
            caches[e] = _as_block(model, caches[e], span, (begin, at), patch, scorer,
                                  compressions[e], rotation, total=n, final=stop >= n)
            _count(stats[e], peaks, patch.shape[0], stop - begin, config.block)
            release_freed_memory()
        del span  # before the next span's context is made
        begin = stop
    seconds = (time.perf_counter() - start_time) / max(len(scorers), 1)
    for cache, s, compression in zip(caches, stats, compressions):
        s.tokens, s.seconds = begin, s.seconds + seconds
        s.final_entries = cache.entries_per_layer()
        count_states(s, cache, model, sizes)
        compression.report(s)
    return list(zip(caches, stats)), begin


def _feed(model: torch.nn.Module, shared: EpisodicCache, span: torch.Tensor,
          block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The span through the model after the shared context, layer by layer (`through_layer`),
    `block` tokens a forward (the same keys and values as one forward of it: attention is
    causal; each forward's mask a block's), into buffers made once (`_Growing`). Returns each
    layer's keys and values of the span ([1, Hkv, S, d] each, their own copies), the keys at the
    positions from the context's next one on (as it was before the span). `shared` is emptied
    as it goes: a layer's context is freed once the span has gone through it, so the context
    is held a layer at a time beside the span, never twice."""
    n, layers, decoder = span.shape[0], shared.layers, model.base_model
    first = shared.next_position
    positions = torch.arange(first, first + n, device=span.device)[None]
    hidden = decoder.embed_tokens(span[None])
    out = []
    for idx in range(len(layers)):
        layers[idx] = _Growing(layers[idx], n)  # the context's own tensors freed once copied
        for begin in range(0, n, block):
            stop = min(begin + block, n)
            hidden[:, begin:stop] = through_layer(decoder, idx, hidden[:, begin:stop],
                                                  positions[:, begin:stop], shared)
        out.append((layers[idx].keys[:, :, -n:].clone(), layers[idx].values[:, :, -n:].clone()))
        layers[idx] = None
    return out


class _Growing(EpisodicLayer):
    """A shared context's layer taking the span in place, in buffers made once for the context
    and the span: a layer grown block by block would copy itself at every block and leave the
    allocator a trail of sizes (the build's resident memory grew by a few hundred MiB a span)."""

    def __init__(self, layer: EpisodicLayer, room: int):
        super().__init__()
        self.used, capacity = layer.valid.shape[1], layer.valid.shape[1] + room
        self.buffers = tuple(t.new_empty(1, t.shape[1], capacity, t.shape[-1])
                             for t in (layer.keys, layer.values))
        self.slot_valid = layer.valid.new_ones(layer.valid.shape[0], capacity)
        self.slot_positions = layer.positions.new_empty(layer.valid.shape[0], capacity)
        self.slot_rope = layer.rope_positions.new_empty(layer.valid.shape[0], capacity)
        for buffer, held in ((self.buffers[0][0], layer.keys[0]),
                             (self.buffers[1][0], layer.values[0]),
                             (self.slot_valid, layer.valid), (self.slot_positions, layer.positions),
                             (self.slot_rope, layer.rope_positions)):
            buffer[:, :self.used] = held
        self.tokens_seen, self.next_position = layer.tokens_seen, layer.next_position
        self._show()
        self.is_initialized = True

    def _show(self) -> None:
        """The held slots as the layer's tensors (views of the buffers)."""
        self.keys, self.values = (b[:, :, :self.used] for b in self.buffers)
        self.valid, self.positions, self.rope_positions = (
            t[:, :self.used] for t in (self.slot_valid, self.slot_positions, self.slot_rope))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.n_patch:
            raise ValueError("a shared context takes the span only: patches read each episode's "
                             "own cache")
        start, n = self.used, key_states.shape[-2]
        for buffer, new in zip(self.buffers, (key_states, value_states)):
            buffer[:, :, start:start + n] = new
        keys, values = (b[:, :, :start + n] for b in self.buffers)
        self.last_request = AttentionRequest(key=keys, past_valid=self.valid,
                                             past_positions=self.rope_positions,
                                             first_position=self.next_position)
        hand_off(self.last_request)
        device = self.slot_valid.device
        self.slot_positions[:, start:start + n] = torch.arange(
            self.tokens_seen, self.tokens_seen + n, device=device)
        self.slot_rope[:, start:start + n] = torch.arange(
            self.next_position, self.next_position + n, device=device)
        self.used, self.tokens_seen, self.next_position = (
            start + n, self.tokens_seen + n, self.next_position + n)
        self._show()
        return keys, values


def _as_block(model: torch.nn.Module, cache: EpisodicCache,
              span: list[tuple[torch.Tensor, torch.Tensor]], where: tuple[int, int],
              patch: torch.Tensor, scorer: Scorer, compression: Compression,
              rotation: KeyRotation, *, total: int, final: bool) -> EpisodicCache:
    """An episode's cache after the span (`where`: its first token, and the position its keys
    start at), as block prefill makes it after a block: the span's keys and values, moved to
    follow the cache, appended; its patch's scores of both; its compression's cut and
    compaction. A layer takes the span as the patch's forward enters it and is cut as the
    forward leaves it (`_layer_by_layer`): the cut block prefill makes after the forward, since
    a layer's cut changes no other layer's attention, while the episode holds the span in one
    layer at a time. `cache` is taken over (its layers are replaced)."""
    begin, at = where
    moved, layers, n_span = cache.next_position - at, cache.layers, span[0][0].shape[2]
    positions = compression.patch_positions(cache.next_position + n_span, 0, patch.shape[0],
                                            total).to(patch.device)

    def take_span(idx: int) -> None:
        layers[idx] = _appended(layers[idx], *span[idx], begin, moved, rotation)
        layers[idx].n_patch = patch.shape[0]

    def cut(idx: int) -> None:
        layer = layers[idx]
        compression.step([layer], [layer_state(idx, layer, begin)], scorer, final=final)
        layer.last_request = None

    with cache.patched(patch.shape[0]), _layer_by_layer(model, take_span, cut):
        model.base_model(input_ids=patch[None], position_ids=positions[None],
                         past_key_values=cache, use_cache=True)
    compression.after_step(cache)
    return cache


@contextmanager
def _layer_by_layer(model: torch.nn.Module, entering: Callable[[int], None],
                    leaving: Callable[[int], None]) -> Iterator[None]:
    """During this forward, `entering(idx)` runs as it enters decoder layer idx's attention and
    `leaving(idx)` as it leaves it (forward hooks, as kvpress's presses run)."""
    handles = []
    for idx, layer in enumerate(model.base_model.layers):
        handles.append(layer.self_attn.register_forward_pre_hook(
            lambda *_, idx=idx: entering(idx)))
        handles.append(layer.self_attn.register_forward_hook(lambda *_, idx=idx: leaving(idx)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _appended(layer: EpisodicLayer, keys: torch.Tensor, values: torch.Tensor, begin: int,
              moved: int, rotation: KeyRotation) -> EpisodicLayer:
    """The layer with the span's keys and values [1, Hkv, S, d] (tokens from `begin`) after
    its entries, the keys moved by `moved` positions to follow them."""
    n_heads, n, dim = keys.shape[1], keys.shape[2], keys.shape[3]
    if moved:
        flat = keys.reshape(-1, dim)
        keys = rotation.rotate(flat, flat.new_full((flat.shape[0],), moved, dtype=torch.long)
                               ).view_as(keys)
    device = layer.valid.device
    return EpisodicLayer.from_stored(
        torch.cat([layer.keys, keys.to(layer.keys.dtype)], dim=2),
        torch.cat([layer.values, values.to(layer.values.dtype)], dim=2),
        torch.cat([layer.valid, layer.valid.new_ones(n_heads, n)], dim=1),
        torch.cat([layer.positions, torch.arange(begin, begin + n, device=device)
                   .expand(n_heads, -1)], dim=1),
        rope_positions=torch.cat([layer.rope_positions, torch.arange(
            layer.next_position, layer.next_position + n, device=device).expand(n_heads, -1)],
            dim=1),
        tokens_seen=begin + n, next_position=layer.next_position + n)


def _sizes(shared: EpisodicCache, n_span: int) -> dict[str, list]:
    """Per layer, the most a span's shared context holds: its entries per head, slots and
    bytes of keys and values with the span's `n_span` tokens."""
    def slot_bytes(layer: EpisodicLayer) -> int:
        return (layer.keys.nbytes + layer.values.nbytes) // max(layer.valid.shape[1], 1)
    return {"peak_entries": [layer.entries + n_span for layer in shared.layers],
            "peak_slots": [layer.valid.shape[1] + n_span for layer in shared.layers],
            "peak_bytes": [slot_bytes(layer) * (layer.valid.shape[1] + n_span)
                           for layer in shared.layers]}


def _count(stats: PrefillStats, peaks: dict[str, list], n_patch: int, n_span: int,
           block: int) -> None:
    """A span's share of an episode's stats: its patch and blocks, and the most its build
    held of a layer at once (`_sizes`)."""
    stats.patch_tokens += n_patch
    stats.blocks += -(-n_span // block)
    for name, sizes in peaks.items():
        setattr(stats, name, [max(a, b) for a, b in zip(getattr(stats, name), sizes)])
