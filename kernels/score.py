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
    q = patch_queries.float().reshape(n_kv_heads, group, n_patch, dim)
    kc, kp = cached_keys.float(), patch_keys.float()
    causal = torch.ones(n_patch, n_patch, dtype=torch.bool, device=q.device).tril()
    scores = torch.zeros(n_kv_heads, n_cached, dtype=torch.float32, device=q.device)
    for start in range(0, n_patch, query_chunk):
        qc = q[:, :, start:start + query_chunk]  # [Hkv, G, c, d]
        logits_cached = torch.einsum("hgqd,hnd->hgqn", qc, kc) * scale
        if cached_valid is not None:
            logits_cached = logits_cached.masked_fill(~cached_valid[:, None, None, :], float("-inf"))
        logits_patch = torch.einsum("hgqd,hpd->hgqp", qc, kp) * scale
        logits_patch = logits_patch.masked_fill(~causal[start:start + query_chunk], float("-inf"))
        normaliser = torch.logsumexp(torch.cat([logits_cached, logits_patch], dim=-1), dim=-1,
                                     keepdim=True)
        probs = torch.exp(logits_cached - normaliser)  # [Hkv, G, c, N]
        scores = torch.maximum(scores, probs.amax(dim=(1, 2)))
    return scores


def patch_attention_scores(patch_queries: torch.Tensor, cached_keys: torch.Tensor,
                           patch_keys: torch.Tensor, cached_valid: torch.Tensor | None,
                           scale: float) -> torch.Tensor:
    """Dispatch: the one entry point the block-prefill loop uses."""
    return patch_attention_scores_reference(patch_queries, cached_keys, patch_keys,
                                            cached_valid, scale)
