"""Patched-prompt scoring: how much attention each cached key receives from the patch queries.

score[h, n] = max over the patch queries and over the query heads of KV group h of the softmax
probability that key n receives, where the softmax runs over the valid cached keys and the
patch's own keys up to the query (causal). The block-prefill loop calls only
`patch_attention_scores`; it picks the implementation for the tensors' device.
"""

from __future__ import annotations

import torch


def patch_attention_scores_reference(patch_queries: torch.Tensor, cached_keys: torch.Tensor,
                                     patch_keys: torch.Tensor, cached_valid: torch.Tensor | None,
                                     scale: float, query_chunk: int = 256) -> torch.Tensor:
    """Torch implementation. Shapes: patch_queries [Hq, P, d] (after RoPE), cached_keys
    [Hkv, N, d], patch_keys [Hkv, P, d], cached_valid [Hkv, N] bool (None = all valid).
    Returns [Hkv, N] float32. Queries are processed in chunks to bound the P x N temporaries."""
    n_q_heads, n_patch, dim = patch_queries.shape
    n_kv_heads, n_cached, _ = cached_keys.shape
    group = n_q_heads // n_kv_heads
    q = patch_queries.float().reshape(n_kv_heads, group * n_patch, dim)
    keys = torch.cat([cached_keys, patch_keys], dim=1).float()  # [Hkv, N + P, d]
    # What each patch query may see: the valid cached keys, and the patch causally.
    visible = torch.ones(n_patch, n_cached + n_patch, dtype=torch.bool, device=q.device)
    visible[:, n_cached:] = torch.ones(n_patch, n_patch, dtype=torch.bool, device=q.device).tril()
    visible = visible[None].repeat(n_kv_heads, 1, 1)
    if cached_valid is not None:
        visible[:, :, :n_cached] &= cached_valid[:, None, :]
    visible = visible.repeat(1, group, 1)  # rows ordered (group, query) like q
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=q.device)
    bias.masked_fill_(~visible, float("-inf"))
    keys_t = keys.transpose(1, 2)
    scores = torch.zeros(n_kv_heads, n_cached, dtype=torch.float32, device=q.device)
    for start in range(0, group * n_patch, query_chunk):
        rows = slice(start, start + query_chunk)
        logits = torch.baddbmm(bias[:, rows], q[:, rows], keys_t, alpha=scale)
        probs = torch.softmax(logits, dim=-1)[:, :, :n_cached]
        scores = torch.maximum(scores, probs.amax(dim=1))
    return scores


def patch_attention_scores(patch_queries: torch.Tensor, cached_keys: torch.Tensor,
                           patch_keys: torch.Tensor, cached_valid: torch.Tensor | None,
                           scale: float) -> torch.Tensor:
    """Dispatch: the one entry point the block-prefill loop uses."""
    return patch_attention_scores_reference(patch_queries, cached_keys, patch_keys,
                                            cached_valid, scale)
