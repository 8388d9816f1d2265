"""The "episodic" attention function, registered with transformers' `AttentionInterface`.

An episodic cache holds a different number of entries per KV head and per layer, so the mask
transformers builds once per forward (one length for all layers, one pattern for all heads)
cannot describe it. Instead, each `EpisodicLayer.update` hands the attention call that follows
it in the same layer an `AttentionRequest`: which cached slots are valid per head, and how many
trailing queries are patch queries whose attention must be scored. The attention builds its own
mask from that (valid cached slots + causal over the new tokens). Any other cache falls through
to transformers' stock SDPA path with the stock mask, so one model serves both.

A batched decode (`pipeline.answer.packed`) packs several conversations' new tokens into one
forward: its cache hands a `PackedRequest` instead, and each segment attends over its own
conversation's keys, values and mask exactly as it would alone, while the projections, MLPs and
the LM head run once over all the tokens.

Attention weights are computed only for the patch queries, through `kernels.score`.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F

from kernels.score import (
    patch_attention_scores,
    patch_attention_scores_given_logsumexp,
    patch_probability_chunks,
)

EPISODIC_ATTENTION = "episodic"

_handoff = threading.local()


@dataclass(frozen=True)
class Packing:
    """Several sequences in one forward, each continuing the cache on its own: `segments` [q]
    segment ids (non-decreasing); `parents` [q] a segment each token also sees whole, -1 for
    none (a shared head: a question's top-up, read once before each of its probes); `offsets`
    [q] each token's position after the cache's next position."""
    segments: torch.Tensor
    parents: torch.Tensor
    offsets: torch.Tensor


@dataclass
class AttentionRequest:
    """What a cache layer tells the attention call that immediately follows its update."""
    key: torch.Tensor  # the key tensor the layer returned; identifies the matching attention call
    past_valid: torch.Tensor  # [Hkv, L_past] bool: which cached slots hold entries
    past_positions: torch.Tensor  # [Hkv, L_past] token positions of the cached slots
    first_position: int  # position of the first new token (the new tokens are consecutive)
    n_patch: int = 0  # trailing queries that are patch queries (scored, never stored)
    scores: torch.Tensor | None = None  # filled in: [Hkv, L_past + n_block] patch attention scores
    moments: bool = False  # also fill in the sum and sum of squares below (ARKV statistics)
    patch_sum: torch.Tensor | None = None  # [Hkv, L_past + n_block]
    patch_sumsq: torch.Tensor | None = None
    patch_count: int = 0  # rows summed: (query heads of a KV group) x (patch queries)
    # filled in: the patch's queries [Hq, P, d] after RoPE (one pass scores far keys with them)
    patch_queries: torch.Tensor | None = None
    score_patch: bool = True  # False: the caller scores from `patch_queries` itself
    # Packed sequences (batched probes): the new tokens are several independent sequences
    # (`Packing`). A new token sees the cache, the earlier tokens of its own segment and, if it
    # has one, its parent segment whole.
    packing: Packing | None = None


@dataclass
class RowAttention:
    """One conversation's segment of a packed forward (continuous batching): its queries are
    `length` tokens from `start`, its keys and values its own cache's, request as alone."""
    request: AttentionRequest
    keys: torch.Tensor  # [1, Hkv, slots + length, d]
    values: torch.Tensor
    start: int
    length: int
    # for a one-token step: per KV head, the first slot of its entries, every slot from there
    # on holding one (the row's heads are right-aligned), so that no mask is needed
    first_entries: list[int] | None = None


@dataclass
class PackedRequest:
    """What a batched cache layer hands the attention: the new tokens are the segments of
    several conversations, one after another, each attending over its own cache only."""
    key: torch.Tensor  # the key tensor the layer returned; identifies the matching attention call
    rows: list[RowAttention]


def patch_attention_moments(patch_queries: torch.Tensor, cached_keys: torch.Tensor,
                            patch_keys: torch.Tensor, cached_valid: torch.Tensor | None,
                            scale: float, query_chunk: int = 256
                            ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sum and sum of squares, over the patch queries and the query heads of each KV group,
    of the softmax probability every cached key receives (same softmax as
    `kernels.score.patch_attention_scores`: valid cached keys + the patch's own keys, causal).
    Shapes as there; returns ([Hkv, N], [Hkv, N], group x P). The same chunked probabilities
    as the scoring reference (`patch_probability_chunks`); torch on every device."""
    n_kv_heads, n_cached, _ = cached_keys.shape
    total = torch.zeros(n_kv_heads, n_cached, dtype=torch.float32, device=cached_keys.device)
    total_sq = torch.zeros_like(total)
    for probs in patch_probability_chunks(patch_queries, cached_keys, patch_keys, cached_valid,
                                          scale, query_chunk):
        total += probs.sum(dim=1)
        total_sq += (probs * probs).sum(dim=1)
    n_rows = patch_queries.shape[0] // n_kv_heads * patch_queries.shape[1]
    return total, total_sq, n_rows


_probe = threading.local()


@contextmanager
def attention_column_sums() -> Iterator[dict[int, torch.Tensor]]:
    """While inside, a forward without an episodic cache (one causal pass over a whole text)
    records per layer the attention every key receives, summed over the queries and averaged
    over the query heads ([N] per layer index): D2O's cumulative attention (§4.1)."""
    sums: dict[int, torch.Tensor] = {}
    _probe.sums = sums
    try:
        yield sums
    finally:
        _probe.sums = None


def _probed_attention(module, query, key, value, scaling, sums, chunk: int = 256):
    n_q_heads, n_kv_heads, n = query.shape[1], key.shape[1], query.shape[2]
    if key.shape[2] != n:
        raise ValueError("attention_column_sums needs one forward over the whole text, no cache")
    group = n_q_heads // n_kv_heads
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    k = key[0].float().repeat_interleave(group, dim=0)  # [Hq, N, d]
    v = value[0].float().repeat_interleave(group, dim=0)
    columns = torch.zeros(n, dtype=torch.float32, device=query.device)
    out = torch.empty(n_q_heads, n, value.shape[-1], dtype=torch.float32, device=query.device)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        logits = query[0, :, start:stop].float() @ k.transpose(1, 2) * scale  # [Hq, c, N]
        future = torch.arange(n, device=query.device)[None, :] > \
            torch.arange(start, stop, device=query.device)[:, None]
        probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
        columns += probs.sum(dim=(0, 1))
        out[:, start:stop] = probs @ v
    sums[module.layer_idx] = columns / n_q_heads
    return out.to(query.dtype)[None].transpose(1, 2).contiguous(), None


def hand_off(request: AttentionRequest | PackedRequest) -> None:
    _handoff.request = request


def _take_request(key: torch.Tensor) -> AttentionRequest | PackedRequest | None:
    request = getattr(_handoff, "request", None)
    if request is not None and request.key is key:
        _handoff.request = None
        return request
    return None


def _heads_differ(past_valid: torch.Tensor) -> bool:
    """Whether the KV heads hold different cached slots (headwise selection)."""
    return bool((past_valid != past_valid[:1]).any())


def episodic_mask(request: AttentionRequest, q_len: int, group: int,
                  sliding_window: int | None = None) -> torch.Tensor:
    """[1, Hq, q, L_past + q] bool: valid cached slots per head, causal over the new tokens,
    and, for sliding-window layers, only keys less than `sliding_window` positions back. When
    every head holds the same cached slots (a full cache, a uniform one, one pass's window) the
    heads share one mask: [1, 1, q, L_past + q], broadcast over them (a probe over a long full
    cache would otherwise write a mask per query head)."""
    past_valid = request.past_valid
    n_heads, n_past = past_valid.shape
    device = past_valid.device
    q_pos = torch.arange(request.first_position, request.first_position + q_len, device=device)
    causal = q_pos[None, :] <= q_pos[:, None]
    packing = request.packing
    if packing is not None:  # packed: block-diagonal (and parents), positions per segment
        seg = packing.segments.to(device)
        parents = packing.parents.to(device)
        causal = causal & ((seg[None, :] == seg[:, None]) | (seg[None, :] == parents[:, None]))
        q_pos = request.first_position + packing.offsets.to(device)
    if sliding_window is None and not _heads_differ(past_valid):
        past = past_valid[:1, None, :].expand(1, q_len, n_past)
        return torch.cat([past, causal[None]], dim=-1)[None]
    past = past_valid[:, None, :].expand(n_heads, q_len, n_past)
    new = causal[None].expand(n_heads, q_len, q_len)
    if sliding_window is not None:
        past = past & (q_pos[None, :, None] - request.past_positions[:, None, :] < sliding_window)
        new = new & (q_pos[:, None] - q_pos[None, :] < sliding_window)
    mask = torch.cat([past, new], dim=-1)
    return mask.repeat_interleave(group, dim=0)[None]


# SDPA's fused CPU kernel, called directly for what SDPA drops: each query's softmax
# log-normaliser (None in a torch without it: `_attend` then masks every query and key)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class Attended(NamedTuple):
    """`_attend`'s output [1, Hq, q, d], the boolean mask it used (None: none was made) and,
    where the kernel gave them, each query's softmax log-normaliser [Hq, q]."""
    out: torch.Tensor
    mask: torch.Tensor | None
    logsumexp: torch.Tensor | None = None


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            request: AttentionRequest, scaling: float | None,
            sliding_window: int | None) -> Attended:
    """SDPA of one conversation's queries [1, Hq, q, d] over its keys and values: without a
    mask where it is plain causal attention over the new tokens alone (SDPA's causal kernel
    runs it with half the work), on CPU the cache and the new tokens apart (`_attend_apart`,
    which gives the log-normalisers too), elsewhere with the mask `episodic_mask` makes."""
    group = query.shape[1] // key.shape[1]
    plain = request.packing is None and sliding_window is None
    if request.past_valid.shape[1] == 0 and plain:
        return Attended(F.scaled_dot_product_attention(query, key, value, is_causal=True,
                                                       scale=scaling, enable_gqa=group > 1), None)
    if plain and _FLASH_CPU is not None and query.device.type == "cpu":
        return _attend_apart(query, key, value, request.past_valid, scaling)
    if plain and _heads_differ(request.past_valid):
        return Attended(_attend_by_head(query, key, value, request, scaling), None)
    mask = episodic_mask(request, query.shape[2], group, sliding_window)
    # An additive float mask takes SDPA's fused CPU kernel (a boolean one is ~1.7x slower).
    additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
    additive.masked_fill_(~mask, float("-inf"))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=additive, scale=scaling,
                                         enable_gqa=group > 1)
    return Attended(out, mask)


def _attend_apart(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  past_valid: torch.Tensor, scaling: float | None) -> Attended:
    """The new tokens' attention over the cache and over themselves, computed apart by SDPA's
    CPU kernel and merged by their log-normalisers (as flash-decoding merges its splits). The
    cached part's only mask is each KV head's valid slots, broadcast over the queries, and the
    new part is plain causal attention, so no mask holds a float per query and key (one with
    the queries of a block and its patch took as long to make as the attention, and ~150 MiB a
    layer for a shared span's block). Each KV group's query heads are folded into one head's
    rows over the cache (a view), which reads each KV head once. Each query's log-normaliser
    is over both parts; no mask is made."""
    n_q_heads, q_len, dim = query.shape[1:]
    n_kv_heads, n_past = past_valid.shape
    group, rows = n_q_heads // n_kv_heads, n_q_heads // n_kv_heads * q_len
    some_invalid, bias = not bool(past_valid.all()), None
    if some_invalid:
        bias = query.new_zeros(1, n_kv_heads, 1, n_past).masked_fill_(
            ~past_valid[None, :, None], float("-inf")).expand(-1, -1, rows, -1)
    cached, cached_lse = _FLASH_CPU(query.reshape(1, n_kv_heads, rows, dim), key[:, :, :n_past],
                                    value[:, :, :n_past], 0.0, False, attn_mask=bias,
                                    scale=scaling)
    if some_invalid:  # a head with no cached entry: the kernel gives 0 for both; it weighs 0
        cached_lse = cached_lse.masked_fill(~past_valid.any(dim=1)[None, :, None], float("-inf"))
    new, new_lse = _FLASH_CPU(query, *(t[:, :, n_past:].repeat_interleave(group, dim=1)
                                       for t in (key, value)), 0.0, True, scale=scaling)
    cached_lse = cached_lse.reshape(1, n_q_heads, q_len)
    lse = torch.logaddexp(cached_lse, new_lse)
    out = (cached.reshape(1, n_q_heads, q_len, dim) * (cached_lse - lse).exp()[..., None]
           + new * (new_lse - lse).exp()[..., None])
    return Attended(out.to(query.dtype), None, lse[0])


def _attend_by_head(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    request: AttentionRequest, scaling: float | None) -> torch.Tensor:
    """`_attend` where each KV head holds its own cached slots and `_attend_apart` does not
    run (off CPU): one SDPA call per KV head, its additive mask [q, L] shared by the head's
    query group. The same output as one call with the mask of every query head, which would
    hold a float per query head, query and key (the shared spans' forwards, a block over a
    context of the model's positions: ~150 MiB a layer for SmolLM2, against ~17 here)."""
    n_kv, n_past = request.past_valid.shape
    group, q_len = query.shape[1] // n_kv, query.shape[2]
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
    additive = query.new_zeros(q_len, n_past + q_len)  # the causal part the heads share
    additive[:, n_past:].masked_fill_(~causal, float("-inf"))
    blocked = query.new_full((n_past,), float("-inf"))
    outs = []
    for h in range(n_kv):  # only the cached part is the head's own
        additive[:, :n_past] = torch.where(request.past_valid[h], 0.0, blocked)
        outs.append(F.scaled_dot_product_attention(
            query[:, h * group:(h + 1) * group], key[:, h:h + 1], value[:, h:h + 1],
            attn_mask=additive[None, None], scale=scaling, enable_gqa=group > 1))
    return torch.cat(outs, dim=1)


def _attend_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  first_entries: list[int], scaling: float | None) -> torch.Tensor:
    """One token's attention, KV head by KV head, over each head's entries only (no mask,
    nothing read for the slots another head's longer list needs): [1, Hq, 1, d]."""
    group = query.shape[1] // key.shape[1]
    return torch.cat([F.scaled_dot_product_attention(
        query[:, h * group:(h + 1) * group], key[:, h:h + 1, first:], value[:, h:h + 1, first:],
        scale=scaling, enable_gqa=group > 1) for h, first in enumerate(first_entries)], dim=1)


def _seen_by_last_query(request: AttentionRequest, mask: torch.Tensor | None, group: int,
                        n_cached: int) -> torch.Tensor:
    """[Hkv, n_cached] bool: the cached slots and new block tokens the last patch query sees,
    every one a patch query may see (without a sliding window the patch queries see the same
    ones), so the slots its scores cover."""
    if mask is not None:
        return mask[0, ::group, -1, :n_cached].expand(request.past_valid.shape[0], -1)
    past = request.past_valid
    return torch.cat([past, past.new_ones(past.shape[0], n_cached - past.shape[1])], dim=1)


def _packed_attention(query: torch.Tensor, request: PackedRequest, scaling: float | None,
                      sliding_window: int | None):
    """Each segment of the packed queries attends over its own conversation's cache, exactly
    as it would alone (same keys, values and mask); the outputs are packed back in order."""
    outs = []
    for row in request.rows:
        segment = query[:, :, row.start:row.start + row.length]
        if row.first_entries is not None and sliding_window is None:
            outs.append(_attend_heads(segment, row.keys, row.values, row.first_entries, scaling))
        else:
            outs.append(_attend(segment, row.keys, row.values, row.request, scaling,
                                sliding_window).out)
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def episodic_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: torch.Tensor | None,
                       scaling: float | None = None, dropout: float = 0.0,
                       sliding_window: int | None = None, **kwargs):
    request = _take_request(key)
    sums = getattr(_probe, "sums", None)
    if request is None and sums is not None:  # D2O calibration: attention column sums
        return _probed_attention(module, query, key, value, scaling, sums)
    if request is None:  # not an episodic cache: the stock path, with the stock mask
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    if isinstance(request, PackedRequest):
        return _packed_attention(query, request, scaling, sliding_window)
    if query.shape[0] != 1:
        raise ValueError("episodic caches hold one conversation: batch size must be 1")
    group = query.shape[1] // key.shape[1]
    scored = bool(request.n_patch and request.score_patch)
    out, mask, logsumexp = _attend(query, key, value, request, scaling, sliding_window)
    if request.n_patch:
        request.patch_queries = query[0, :, -request.n_patch:]
    if scored:
        p = request.n_patch
        n_cached = key.shape[2] - p  # cached slots plus the new block: all that may be kept
        valid = _seen_by_last_query(request, mask, group, n_cached)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        queries, cached, patch_keys = query[0, :, -p:], key[0, :, :n_cached], key[0, :, n_cached:]
        if logsumexp is None:
            request.scores = patch_attention_scores(queries, cached, patch_keys, valid, scale)
        else:  # SDPA's normalisers (no sliding window: the patch queries see the same slots)
            request.scores = patch_attention_scores_given_logsumexp(
                queries, cached, logsumexp[:, -p:], valid, scale)
        if request.moments:
            request.patch_sum, request.patch_sumsq, request.patch_count = patch_attention_moments(
                queries, cached, patch_keys, valid, scale)
    return out.transpose(1, 2).contiguous(), None


_registered = False


def register_episodic_attention() -> None:
    """Register the attention function and, as transformers 5 requires, a mask function."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(EPISODIC_ATTENTION, episodic_attention)
    AttentionMaskInterface.register(EPISODIC_ATTENTION, sdpa_mask)
    _registered = True
