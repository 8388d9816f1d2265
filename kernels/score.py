"""Patched-prompt scoring: how much attention each cached key receives from the patch queries.

score[h, n] = max over the patch queries and over the query heads of KV group h of the softmax
probability that key n receives, where the softmax runs over the valid cached keys and the
patch's own keys up to the query (causal). Two options: `reduce="mean"` averages over those
rows instead of taking the max, and `include_patch=False` normalises over the cached keys only
(the patch's own keys left out of the softmax, as apple/ml-epicache's head-wise scorer does). The
block-prefill loop calls only `patch_attention_scores`; it picks the implementation for the tensors'
device: the fused Triton kernel (`kernels.score_triton`, imported only when needed) on CUDA, the
torch reference on CPU. On CPU the attention call that scores a patch already has each patch
query's softmax normaliser from SDPA's kernel, and takes the max scores from it
(`patch_attention_scores_given_logsumexp`, the same scores without a second softmax).
"""

from __future__ import annotations

from typing import Iterator

import torch


def cached_key_mask(cached_valid: torch.Tensor | None, lengths: torch.Tensor | None,
                    n_kv_heads: int, n_cached: int) -> torch.Tensor | None:
    """[Hkv, N] bool: the slots a patch query may see, from a validity mask and/or per-head
    lengths (slot n of head h is valid when n < lengths[h]); None when every slot is valid."""
    if lengths is None:
        return cached_valid
    device = lengths.device
    within = torch.arange(n_cached, device=device)[None, :] < lengths.reshape(n_kv_heads, 1)
    return within if cached_valid is None else within & cached_valid


def patch_probability_chunks(patch_queries: torch.Tensor, cached_keys: torch.Tensor,
                             patch_keys: torch.Tensor, cached_valid: torch.Tensor | None,
                             scale: float, query_chunk: int = 256,
                             lengths: torch.Tensor | None = None,
                             include_patch: bool = True) -> Iterator[torch.Tensor]:
    """The softmax probabilities the cached keys receive, [Hkv, rows, N] float32 per chunk of
    rows (query head of the KV group, patch query), `query_chunk` rows at a time. Each chunk's
    mask is built for that chunk only, so the temporaries are O(Hkv x chunk x (N + P)), never
    O(Hq x P x N). Shapes as in `patch_attention_scores_reference`."""
    n_q_heads, n_patch, dim = patch_queries.shape
    n_kv_heads, n_cached, _ = cached_keys.shape
    group = n_q_heads // n_kv_heads
    device = patch_queries.device
    valid = cached_key_mask(cached_valid, lengths, n_kv_heads, n_cached)
    q = patch_queries.float().reshape(n_kv_heads, group * n_patch, dim)  # rows: (group, query)
    if not include_patch:
        patch_keys = patch_keys[:, :0]
    keys_t = torch.cat([cached_keys, patch_keys], dim=1).float().transpose(1, 2)  # [Hkv, d, N+P]
    # Additive masks: invalid cached slots per head; the patch's own keys causally.
    cached_bias = torch.zeros(n_kv_heads, 1, n_cached, dtype=torch.float32, device=device)
    if valid is not None:
        cached_bias.masked_fill_(~valid[:, None, :], float("-inf"))
    causal_bias = torch.full((n_patch, n_patch), float("-inf"), device=device).triu_(1)
    causal_bias = causal_bias[:, :patch_keys.shape[1]]
    n_rows = group * n_patch
    for start in range(0, n_rows, query_chunk):
        stop = min(start + query_chunk, n_rows)
        patch_pos = torch.arange(start, stop, device=device) % n_patch
        logits = torch.cat([cached_bias.expand(-1, stop - start, -1),
                            causal_bias[patch_pos].expand(n_kv_heads, -1, -1)], dim=2)
        logits.baddbmm_(q[:, start:stop], keys_t, alpha=scale)  # in place: one chunk buffer
        probs = torch.softmax(logits, dim=-1)[:, :, :n_cached]
        # without the patch's keys, a head with no valid cached key has an empty softmax
        yield probs if include_patch else probs.nan_to_num_(0.0)


def patch_attention_scores_reference(patch_queries: torch.Tensor, cached_keys: torch.Tensor,
                                     patch_keys: torch.Tensor, cached_valid: torch.Tensor | None,
                                     scale: float, query_chunk: int = 256,
                                     lengths: torch.Tensor | None = None, reduce: str = "max",
                                     include_patch: bool = True) -> torch.Tensor:
    """Torch implementation. Shapes: patch_queries [Hq, P, d] (after RoPE), cached_keys
    [Hkv, N, d], patch_keys [Hkv, P, d], cached_valid [Hkv, N] bool (None = all valid), lengths
    [Hkv] (optional: only the first lengths[h] slots of head h are valid). Returns [Hkv, N]
    float32, computed chunk by chunk (`patch_probability_chunks`)."""
    if reduce not in ("max", "mean"):
        raise ValueError(f"reduce must be 'max' or 'mean', got {reduce!r}")
    n_kv_heads, n_cached, _ = cached_keys.shape
    scores = torch.zeros(n_kv_heads, n_cached, dtype=torch.float32, device=cached_keys.device)
    for probs in patch_probability_chunks(patch_queries, cached_keys, patch_keys, cached_valid,
                                          scale, query_chunk, lengths, include_patch):
        if reduce == "max":
            torch.maximum(scores, probs.amax(dim=1), out=scores)
        else:
            scores += probs.sum(dim=1)
    if reduce == "mean":
        scores /= max(patch_queries.shape[0] // n_kv_heads * patch_queries.shape[1], 1)
    return scores


def patch_attention_scores_given_logsumexp(patch_queries: torch.Tensor,
                                           cached_keys: torch.Tensor, logsumexp: torch.Tensor,
                                           cached_valid: torch.Tensor | None, scale: float,
                                           key_chunk: int = 2048) -> torch.Tensor:
    """The "max" scores of `patch_attention_scores_reference` when the attention that ran has
    already given each patch query's log-normaliser (`logsumexp` [Hq, P], over the keys the
    scores' softmax runs over: the valid cached keys and the patch's own, causal). A key's
    score is then exp(max over rows of (scale q.k - lse)): one matmul (the lse folded in as one
    more dimension) and a max, no softmax over every key: about half the reference's time on
    CPU. Keys `key_chunk` at a time, so the temporaries are O(Hkv x chunk x rows). Shapes as
    there; returns [Hkv, N] float32, invalid slots 0."""
    n_q_heads, n_patch, dim = patch_queries.shape
    n_kv_heads, n_cached, _ = cached_keys.shape
    rows = n_q_heads // n_kv_heads * n_patch
    queries = torch.cat([patch_queries.float() * scale, -logsumexp.float()[..., None]], dim=-1)
    queries = queries.reshape(n_kv_heads, rows, dim + 1).transpose(1, 2)  # [Hkv, d + 1, rows]
    scores = torch.empty(n_kv_heads, n_cached, dtype=torch.float32, device=cached_keys.device)
    for start in range(0, n_cached, key_chunk):
        keys = cached_keys[:, start:start + key_chunk].float()
        keys = torch.cat([keys, keys.new_ones(keys.shape[:2] + (1,))], dim=2)
        scores[:, start:start + keys.shape[1]] = torch.bmm(keys, queries).amax(dim=2)
    scores.exp_()
    return scores if cached_valid is None else scores.masked_fill_(~cached_valid, 0.0)


def patch_attention_scores(patch_queries: torch.Tensor, cached_keys: torch.Tensor,
                           patch_keys: torch.Tensor, cached_valid: torch.Tensor | None,
                           scale: float, lengths: torch.Tensor | None = None,
                           reduce: str = "max", include_patch: bool = True) -> torch.Tensor:
    """Dispatch: the one entry point the block-prefill loop uses. CUDA tensors take the fused
    Triton kernel (never materialises the P x N attention); CPU tensors the torch reference
    (Triton's CPU interpreter is for tests only, far too slow for builds)."""
    if patch_queries.is_cuda:
        from kernels.score_triton import patch_attention_scores_triton
        return patch_attention_scores_triton(patch_queries, cached_keys, patch_keys,
                                             cached_valid, scale, lengths=lengths, reduce=reduce,
                                             include_patch=include_patch)
    return patch_attention_scores_reference(patch_queries, cached_keys, patch_keys,
                                            cached_valid, scale, lengths=lengths, reduce=reduce,
                                            include_patch=include_patch)
