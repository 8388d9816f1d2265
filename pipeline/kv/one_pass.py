"""One pass builds every episode of a conversation (issue 61): within the model's positions,
the build at the cost of about one prefill.

Block prefill (`pipeline.kv.prefill`) runs the whole conversation once per episode, each block
with the episode's patch. Offline the whole conversation is known before the first block, and a
token's keys and values never depend on the patch that follows it, so here the conversation
goes through the model layer by layer, once for all the episodes:

1. a layer reads the hidden states of every token (the first `pass_window` tokens in one
   causal forward, as a plain prefill runs them; the rest in `PrefillConfig.block`-token
   chunks, each reading the keys of the window up to its last token, and the first tokens:
   the sinks) and holds that one layer's keys and values;
2. each episode's patch (its own hidden states, carried layer to layer) follows the whole
   conversation in that layer: its queries score every key, as the patch of a block scores
   the cache in block prefill;
3. each episode keeps its top entries of that layer under its method and compression, exactly
   as block prefill cuts a layer (`Compression.step`), and the layer's keys and values go.

So every kept entry is computed with the full context, and an episode is block prefill with the
whole conversation as its one block (the equivalence `tests/unit/kv/test_one_pass.py` checks).
After the last layer each cache is compacted (`Compression.after_step`) as block prefill
compacts after its last block.

Past its first span (`first_span`: what one reading of the model's positions holds, the longest
patch after it), by `PrefillConfig.one_pass_beyond`:

- "blocks" (the default): the pass covers the first span, then each episode goes on from its
  cache by block prefill over the rest, as the append of the rest would (`_then_blocks`): each
  later token reads its episode's cache, as in block prefill, and whole conversations keep
  block prefill's copy-free evidence; the cost of the rest is block prefill's, per episode;
- "shared": the rest goes through the model once for all the episodes, span by span, each span
  reading a context the episodes share (their caches' entries joined), and each episode takes a
  span as block prefill takes a block, its patch scoring its own cache and the span: about a
  prefill of the rest and the patches (`pipeline.kv.shared_spans`);
- "window": the pass goes on over every token, no query reading further back than the model's
  positions, as in a sliding-window model. A forward whose window has left the first tokens
  behind reads the first `PrefillConfig.pass_sinks` too, moved to sit just before its window
  (StreamingLLM's attention sinks, the window shorter by as many): without them the keys and
  values of every later token came out different enough to halve a whole conversation's
  copy-free evidence. A patch scores keys further back than that span by span, its queries
  re-rotated to sit right after each span (`span_scores`), as they would after a block;
  `PrefillConfig.score_span` asks for shorter spans, and `score_span_share` mixes those scores
  with the plain pass's (`mixed_scores`). About one prefill whole, but the caches hold less
  copy-free evidence than block prefill's (docs/changelog.md).

Memory: the model, one layer's keys and values (in buffers made once per layer) and the hidden
states of every token the pass covers, in and out of the layer (N x (2 x kv_dim + 2 x hidden)
numbers: 6 KiB a token for SmolLM2 in float32), one forward's activations (at most the model's
positions: the first window), and the kept caches; no layer but the current one is held whole,
and its pages go back to the kernel when it is done (`pipeline.allocator.release_freed_memory`).
With "blocks" the pass covers the first span at most, so it is bounded for any length (block
prefill's after it is flat), and "shared" holds after it a span and its shared context, at most
the model's positions per head; with "window" it grows with the length by that small constant.

Tri-state compression plans every layer's byte split from all the layers' attention at once,
which one layer at a time cannot: it builds block by block.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kernels.score import patch_attention_scores
from pipeline.allocator import release_freed_memory
from pipeline.config import PrefillConfig
from pipeline.config.stages import ONE_PASS_NOT_TRISTATE
from pipeline.kv.attention import AttentionRequest, hand_off
from pipeline.kv.cache import EpisodicCache, EpisodicLayer
from pipeline.kv.compression import compression_for
from pipeline.kv.methods.base import LayerState, Scorer
from pipeline.kv.methods.shaping import refocused
from pipeline.kv.positions import KeyRotation
from pipeline.kv.prefill import (
    PrefillStats,
    block_prefill,
    check_layer_budgets,
    count_states,
    entry_bytes,
    patch_after,
    through_layer,
)
from pipeline.kv.shared_spans import shared_spans


def pass_window(model: torch.nn.Module) -> int:
    """How far back any query of the pass reads: the model's positions, so every distance the
    pass makes is one the model was trained on."""
    return getattr(model.config, "max_position_embeddings", None) or 2**31


def span_scores(queries: torch.Tensor, keys: torch.Tensor, patch_keys: torch.Tensor,
                span: int, rotation: KeyRotation, scale: float) -> torch.Tensor:
    """The patch's scores of keys [Hkv, N, d] (at positions 0..N-1) by spans of `span`: for
    each span the patch queries [Hq, P, d] and keys [Hkv, P, d] (made at positions N, N+1, ...)
    are re-rotated to follow the span directly, so no distance exceeds span + P. One span when
    N <= span: the patch's plain attention. Returns [Hkv, N] float32."""
    n = keys.shape[1]
    scores = []
    for begin in range(0, n, span):
        stop = min(begin + span, n)
        q, pk = (_moved(t, stop - n, rotation) for t in (queries, patch_keys))
        scores.append(patch_attention_scores(q, keys[:, begin:stop], pk, None, scale))
    return torch.cat(scores, dim=1)


def mixed_scores(whole: torch.Tensor, spans: torch.Tensor, share: float) -> torch.Tensor:
    """A layer's scores as the spans read them (`share`) and as the plain pass reads them (the
    rest), each first summed to 1 over the layer, so neither reading's scale outweighs the
    other's and the heads keep their relative weights."""
    def unit(scores: torch.Tensor) -> torch.Tensor:
        return scores / scores.sum().clamp_min(torch.finfo(scores.dtype).tiny)
    return (1 - share) * unit(whole) + share * unit(spans)


def _moved(vectors: torch.Tensor, shift: int, rotation: KeyRotation) -> torch.Tensor:
    if shift == 0:
        return vectors
    flat = vectors.reshape(-1, vectors.shape[-1])
    moved = rotation.rotate(flat, torch.full((flat.shape[0],), shift, device=flat.device))
    return moved.view_as(vectors)


def first_span(model: torch.nn.Module, input_ids: torch.Tensor,
               scorers: Sequence[Scorer]) -> int:
    """The tokens one reading of the model's positions holds with the longest patch after."""
    longest = max((patch_after(s, input_ids).shape[0] for s in scorers), default=0)
    return max(pass_window(model) - longest, 1)


@torch.inference_mode()
def one_pass_prefill(model: torch.nn.Module, input_ids: torch.Tensor, scorers: Sequence[Scorer],
                     budgets: list[int] | None, config: PrefillConfig = PrefillConfig(), *,
                     original_element_size: int | None = None
                     ) -> list[tuple[EpisodicCache, PrefillStats]]:
    """Each scorer's cache of `input_ids` ([N]) under `budgets` (entries per layer and KV head;
    None: the full cache), all from one pass: within the first span (`first_span`), what
    `block_prefill` with one block of the whole input would make for each. Past it, as
    `config.one_pass_beyond` says: each episode goes on by block prefill ("blocks",
    `_then_blocks`), the rest goes through once over a context the episodes share ("shared",
    `pipeline.kv.shared_spans`, then by blocks where their caches leave too few positions), or
    the pass slides a window ("window"). The stats' seconds are the pass's, shared out equally, and
    each episode's own blocks'."""
    if config.tristate.enabled:
        raise ValueError(ONE_PASS_NOT_TRISTATE)
    if config.one_pass_beyond == "shared" and config.position_mode != "compact":
        raise ValueError(SHARED_NEEDS_COMPACT)
    head = first_span(model, input_ids, scorers)
    cutting = scorers if config.pass_focus is None else [
        refocused(s, config.pass_focus) for s in scorers]  # the pass's cut: at its own focus
    if config.one_pass_beyond == "window" or input_ids.shape[0] <= head:
        return _one_pass(model, input_ids, cutting, budgets, config, original_element_size)
    built = _one_pass(model, input_ids[:head], cutting, budgets, config, original_element_size)
    if config.one_pass_beyond == "shared":
        built, head = shared_spans(model, input_ids, built, scorers, budgets, config,
                                   pass_window(model), original_element_size)
    if head == input_ids.shape[0]:
        return built
    return _then_blocks(model, input_ids[head:], built, scorers, budgets, config,
                        original_element_size)


SHARED_NEEDS_COMPACT = ("one pass over a shared context past the model's positions "
                        "(one_pass_beyond='shared') needs compact positions")


def _then_blocks(model: torch.nn.Module, rest: torch.Tensor,
                 built: list[tuple[EpisodicCache, PrefillStats]], scorers: Sequence[Scorer],
                 budgets: list[int] | None, config: PrefillConfig,
                 original_element_size: int | None) -> list[tuple[EpisodicCache, PrefillStats]]:
    """Each episode goes on from its cache (`built`, the pass's) by block prefill over the
    `rest` of the ids, as the append of the rest would: every token after the pass reads its
    episode's cache (block prefill's context) instead of a window of the conversation."""
    results = []
    for (cache, first), scorer in zip(built, scorers):
        cache, rest_stats = block_prefill(model, rest, scorer, budgets, config,
                                          original_element_size=original_element_size,
                                          cache=cache)
        results.append((cache, _joined(first, rest_stats)))
    return results


def _joined(first: PrefillStats, rest: PrefillStats) -> PrefillStats:
    """A cache's stats over the shared pass (`first`) and the blocks it ran alone (`rest`: the
    state counts and final entries are the finished cache's)."""
    return replace(
        rest, tokens=first.tokens + rest.tokens, tokens_alone=rest.tokens,
        shared_by=first.shared_by, blocks=first.blocks + rest.blocks,
        patch_tokens=first.patch_tokens + rest.patch_tokens, seconds=first.seconds + rest.seconds,
        **{name: [max(a, b) for a, b in zip(getattr(first, name), getattr(rest, name))]
           for name in ("peak_entries", "peak_slots", "peak_bytes")})


def _one_pass(model: torch.nn.Module, input_ids: torch.Tensor, scorers: Sequence[Scorer],
              budgets: list[int] | None, config: PrefillConfig,
              original_element_size: int | None) -> list[tuple[EpisodicCache, PrefillStats]]:
    """The pass itself, over every token, a window sliding past the model's positions."""
    start_time = time.perf_counter()
    n_layers = check_layer_budgets(model, budgets)
    sizes = entry_bytes(model, original_element_size)
    compressions = [compression_for(config, model, sizes, budgets) for _ in scorers]
    decoder = model.base_model
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    n = ids.shape[0]
    patches = [patch_after(scorer, ids) for scorer in scorers]
    window = pass_window(model)
    longest = max((p.shape[0] for p in patches), default=0)
    reach = max(window - longest, 1)  # the keys a patch can score at once within the positions
    span = min(config.score_span, reach) if config.score_span else reach
    beyond = n > span or n + longest > window  # keys re-rotated: spans, or sinks moved
    rotation = KeyRotation.for_model(model) if beyond else None
    passing = _Pass(decoder, n_layers, config.block, window, n + longest, span, reach,
                    config.score_span_share, _Sinks(config.pass_sinks, rotation))
    hidden = decoder.embed_tokens(ids[None])
    patch_hidden = [decoder.embed_tokens(p[None]) for p in patches]
    patch_positions = [c.patch_positions(0, n, p.shape[0], n)[n:].to(device)[None]
                       for c, p in zip(compressions, patches)]
    caches = [EpisodicCache(n_layers) for _ in scorers]
    for idx in range(n_layers):
        hidden = passing.context(idx, hidden)
        held = passing.held(idx)
        for e, scorer in enumerate(scorers):
            patch_hidden[e], scores = passing.patch(idx, patch_hidden[e], patch_positions[e],
                                                    rotation)
            kept = _copy(held)
            state = LayerState(layer_idx=idx, keys=kept.keys[0], values=kept.values[0],
                               valid=kept.valid, positions=kept.positions, patch_scores=scores)
            compressions[e].step([kept], [state], scorer, final=True)
            caches[e].layers[idx] = kept
        passing.drop(idx)
    results = []
    seconds = (time.perf_counter() - start_time) / max(len(scorers), 1)
    for cache, compression, patch in zip(caches, compressions, patches):
        compression.after_step(cache)
        stats = PrefillStats(tokens=n, blocks=-(-n // config.block), patch_tokens=patch.shape[0],
                             seconds=seconds, shared_by=len(scorers),
                             peak_entries=[float(n)] * n_layers, peak_slots=[n] * n_layers,
                             peak_bytes=passing.peak_bytes, final_entries=cache.entries_per_layer())
        count_states(stats, cache, model, sizes)
        compression.report(stats)
        results.append((cache, stats))
    return results


def _copy(layer: EpisodicLayer) -> EpisodicLayer:
    """An episode's own copy of the pass's layer (its cut and compaction change it in place)."""
    return EpisodicLayer.from_stored(
        layer.keys.clone(), layer.values.clone(), layer.valid.clone(), layer.positions.clone(),
        rope_positions=layer.rope_positions.clone(), tokens_seen=layer.tokens_seen,
        next_position=layer.next_position)


@dataclass(frozen=True)
class _Sinks:
    """The conversation's first `count` tokens, which every forward whose window has left them
    behind still reads: moved (keys re-rotated) into the window's first slots, in place of as
    many of its oldest tokens, so no distance grows."""
    count: int
    rotation: KeyRotation | None  # needed once a window starts past the first token

    def read(self, buffers: tuple[torch.Tensor, torch.Tensor], first: int, stop: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values at positions first..stop-1 ([1, Hkv, stop - first, d] each):
        the held tokens', the first slots the sinks' where `first` is past them."""
        keys, values = (b[:, :, first:stop] for b in buffers)
        count = min(self.count, stop - first) if first else 0
        if not count:
            return keys, values
        moved = _moved(buffers[0][:, :, :count], first, self.rotation)
        keys = torch.cat([moved, keys[:, :, count:]], dim=2)
        values = torch.cat([buffers[1][:, :, :count], values[:, :, count:]], dim=2)
        return keys, values


class _PassLayer(EpisodicLayer):
    """The pass's layer: every token's keys and values written in place into buffers made once
    for the conversation and its longest patch (a layer grown chunk by chunk would copy itself
    at every chunk and leave the allocator a trail of sizes). A patch is written after the
    tokens and never kept, as in `EpisodicLayer`; the caller sets `first_key` before each
    forward: the new tokens read the held keys from there on, no earlier ones (the attention
    never computes what a mask would throw away), but the sinks (`_Sinks`)."""

    def __init__(self, capacity: int, sinks: _Sinks):
        super().__init__()
        self.capacity, self.sinks = capacity, sinks
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.first_key = 0
        self.score_patch = True  # False: the pass scores the patch span by span itself

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n_new, start, first = key_states.shape[-2], self.tokens_seen, self.first_key
        n_heads, device = key_states.shape[1], key_states.device
        if self.buffers is None:
            self.buffers = tuple(t.new_empty(1, n_heads, self.capacity, t.shape[-1])
                                 for t in (key_states, value_states))
            self.is_initialized = True
        for buffer, new in zip(self.buffers, (key_states, value_states)):
            buffer[:, :, start:start + n_new] = new
        keys, values = self.sinks.read(self.buffers, first, start + n_new)
        past = torch.arange(first, start, device=device).expand(n_heads, -1)
        self.last_request = AttentionRequest(
            key=keys, past_valid=torch.ones(past.shape, dtype=torch.bool, device=device),
            past_positions=past, first_position=start, n_patch=self.n_patch,
            score_patch=self.score_patch)
        hand_off(self.last_request)
        self.tokens_seen = self.next_position = start + n_new - self.n_patch
        self.keys, self.values = (b[:, :, :self.tokens_seen] for b in self.buffers)
        self.positions = self.rope_positions = torch.arange(
            self.tokens_seen, device=device).expand(n_heads, -1)
        self.valid = torch.ones(self.positions.shape, dtype=torch.bool, device=device)
        return keys, values


class _Pass:
    """The pass's own cache: one `EpisodicCache` whose current layer holds every token's keys
    and values (`_PassLayer`), run through the model's decoder layers one at a time."""

    def __init__(self, decoder: torch.nn.Module, n_layers: int, chunk: int, window: int,
                 capacity: int, span: int, reach: int, span_share: float, sinks: _Sinks):
        self.decoder, self.chunk, self.window = decoder, chunk, window
        self.capacity, self.span, self.reach = capacity, span, reach
        # the plain pass's scores are needed where spans are shorter than the reach and share
        self.plain_share = 1 - span_share if span < reach else 0.0
        self.span_share = span_share
        self.sinks = sinks
        self.cache = EpisodicCache(n_layers)
        self.cache.layers[0] = _PassLayer(capacity, sinks)
        self.peak_bytes = [0] * n_layers

    def held(self, idx: int) -> EpisodicLayer:
        return self.cache.layers[idx]

    def _layer(self, idx: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return through_layer(self.decoder, idx, hidden, positions, self.cache)

    def context(self, idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """Every token through layer `idx`: the first `window` tokens in one causal forward
        (no mask: the stock prefill's attention), the rest chunk by chunk, each chunk reading
        the keys of the `window` positions up to its last token (the first of them the sinks,
        `_Sinks`, once past them); the layer's keys and values stay held."""
        held, n = self.held(idx), hidden.shape[1]
        out = torch.empty_like(hidden)
        first = min(n, self.window)
        bounds = [(0, first)] if first else []
        bounds += [(b, min(b + self.chunk, n)) for b in range(first, n, self.chunk)]
        for begin, stop in bounds:
            held.first_key = max(0, stop - self.window)
            positions = torch.arange(begin, stop, device=hidden.device)[None]
            out[:, begin:stop] = self._layer(idx, hidden[:, begin:stop], positions)
        self.peak_bytes[idx] = sum(b.nbytes for b in held.buffers)
        return out

    def patch(self, idx: int, hidden: torch.Tensor, positions: torch.Tensor,
              rotation: KeyRotation | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A patch through layer `idx` after every token: its hidden states for the next layer
        and its scores of every held entry ([Hkv, N]; None without a patch). Its own hidden
        states read the last `window` tokens; its scores are taken span by span
        (`span_scores`, `rotation` needed) where the keys are more than a span, and mixed with
        the plain pass's (`mixed_scores`) where the spans take only a share."""
        held = self.held(idx)
        n_patch = hidden.shape[1]
        if n_patch == 0:
            return hidden, None
        n = held.tokens_seen
        held.first_key = max(0, n + n_patch - self.window)
        # every key within what one reading scores: the patch's own attention gives its scores
        held.score_patch = n <= (self.reach if self.plain_share else self.span)
        with self.cache.patched(n_patch):
            out = self._layer(idx, hidden, positions)
        request = held.last_request
        held.last_request = None
        if held.score_patch and n <= self.span:
            return out, request.scores
        scale = self.decoder.layers[idx].self_attn.scaling
        def read(span: int) -> torch.Tensor:
            return span_scores(request.patch_queries, held.keys[0], request.key[0, :, -n_patch:],
                               span, rotation, scale)
        spans = read(self.span)
        if not self.plain_share:
            return out, spans
        whole = request.scores if held.score_patch else read(self.reach)
        return out, mixed_scores(whole, spans, self.span_share)

    def drop(self, idx: int) -> None:
        """Layer `idx` is done: its keys and values go (their pages back to the kernel: the
        kept entries made in between would otherwise hold the heap at its largest,
        `pipeline.allocator`), the next layer's buffers come."""
        self.cache.layers[idx] = EpisodicLayer()
        release_freed_memory()
        if idx + 1 < len(self.cache.layers):
            self.cache.layers[idx + 1] = _PassLayer(self.capacity, self.sinks)
