"""Where a cache's entries sit in the model's positions, and conversations longer than them.

A model reads a limited number of positions (SmolLM2: 8,192). By default a cache keeps every
entry at its original token position, so a conversation must fit in those positions
(`check_fits`), or be cut at a session boundary (`max_context_tokens`). With compact positions
the block prefill moves the kept entries to positions 0, 1, 2, ... after every eviction,
re-rotating their keys (`KeyRotation`), as StreamingLLM and kvpress's KeyRerotationPress do: the
cache then spans at most its budget plus a block, whatever the history's length.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import rotate_half

from pipeline.kv.eviction import Wrapper

# Positions kept free after the history for the question, the answer and the scoring patch.
RESERVED_POSITIONS = 512


class ContextTooLongError(ValueError):
    """A conversation longer than the model's positions, built without a way to fit it."""


def check_fits(conversation_id: str, tokens: int, max_positions: int,
               reserved: int = RESERVED_POSITIONS, cannot_compact: str | None = None) -> None:
    """Refuse a history that leaves fewer than `reserved` of the model's positions free. The
    message offers compact positions only where the build could use them (`cannot_compact`:
    why it cannot, `PrefillConfig.cannot_compact`)."""
    room = max_positions - reserved
    if tokens > room:
        compact = (f"compact positions are not possible here ({cannot_compact})" if cannot_compact
                   else "--positions compact to keep the cache within the model's positions "
                   "(keys re-rotated)")
        raise ContextTooLongError(
            f"conversation {conversation_id!r} is {tokens:,} tokens and the model reads "
            f"{max_positions:,} positions ({room:,} for the history, {reserved} kept for the "
            f"question and answer): pass --max-context-tokens {room} to cut it at a session "
            f"boundary, or {compact}")


class KeyRotation:
    """Re-rotates RoPE keys by a position shift: rotating a key made at position p by s gives
    the key the model makes at p + s (RoPE angles are linear in the position; any attention
    scaling the rotary embedding applies is already in the key and is left alone). Follows the
    half-split layout of Llama, Qwen2 and Mistral (`rotate_half`)."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.float()

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "KeyRotation":
        rotary = getattr(model.base_model, "rotary_emb", None)
        if rotary is None or not hasattr(rotary, "inv_freq"):
            raise ValueError(f"{type(model).__name__} has no rotary embedding to re-rotate "
                             "keys with: compact positions need a RoPE model")
        return cls(rotary.inv_freq)

    def rotate(self, keys: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """`keys` [n, d] moved by `shift` [n] positions (computed in float32)."""
        angles = shift.float()[:, None] * self.inv_freq.to(keys.device)[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        k = keys.float()
        return (k * angles.cos() + rotate_half(k) * angles.sin()).to(keys.dtype)


class CompactPositions(Wrapper):
    """After every block's eviction the kept entries move to positions 0, 1, 2, ... (keys
    re-rotated), the last `recent` tokens at their original spacing (`EpisodicCache.compact`)."""

    def __init__(self, inner, rotation: KeyRotation, recent: int):
        super().__init__(inner)
        self.rotation, self.recent = rotation, recent

    def after_step(self, cache) -> None:
        self.inner.after_step(cache)
        cache.compact(self.rotation, self.recent)


class DecodePositions(Wrapper):
    """DapQ: the patch queries sit at the positions where decoding will start (after the whole
    input), so they score the cache as a question will read it."""

    def patch_positions(self, first: int, n_block: int, n_patch: int, total: int) -> torch.Tensor:
        return torch.cat([torch.arange(first, first + n_block),
                          torch.arange(total, total + n_patch)])
