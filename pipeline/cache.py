"""The episodic KV cache: a transformers `Cache` whose heads and layers hold different lengths.

Each layer stores keys and values as [1, Hkv, slots, d] with a per-head `valid` mask: after
head-wise (AdaKV-style) eviction a head may keep more entries than another, and the shorter
heads are padded. New tokens are appended after the slots; `keep()` evicts and re-packs.
`get_seq_length()` is the number of tokens the cache has *seen* (the next position), not the
number it holds, so `model.generate()` continues at the right RoPE positions.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from pipeline.attention import AttentionRequest, hand_off


class EpisodicLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = False

    def __init__(self) -> None:
        super().__init__()
        self.valid: torch.Tensor | None = None  # [Hkv, slots] bool
        self.positions: torch.Tensor | None = None  # [Hkv, slots] original token positions
        self.tokens_seen = 0
        self.n_patch = 0  # while > 0, that many trailing new tokens are a patch: scored, not kept
        self.last_request: AttentionRequest | None = None
        self.peak_entries = 0.0  # instrumentation: max valid entries per head seen
        self.peak_slots = 0  # instrumentation: max padded slots seen
        self.peak_bytes = 0  # instrumentation: max bytes of this layer's key + value tensors

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, n_heads, _, dim = key_states.shape
        self.keys = key_states.new_zeros(1, n_heads, 0, dim)
        self.values = value_states.new_zeros(1, n_heads, 0, value_states.shape[-1])
        self.valid = torch.zeros(n_heads, 0, dtype=torch.bool, device=key_states.device)
        self.positions = torch.zeros(n_heads, 0, dtype=torch.long, device=key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != 1:
            raise ValueError("an episodic cache holds one conversation: batch size must be 1")
        keys = torch.cat([self.keys, key_states.to(self.keys.dtype)], dim=-2)
        values = torch.cat([self.values, value_states.to(self.values.dtype)], dim=-2)
        self.last_request = AttentionRequest(key=keys, past_valid=self.valid,
                                             past_positions=self.positions,
                                             first_position=self.tokens_seen, n_patch=self.n_patch)
        hand_off(self.last_request)

        n_heads, slots = self.valid.shape
        n_store = key_states.shape[-2] - self.n_patch
        self.keys = keys[:, :, : slots + n_store]
        self.values = values[:, :, : slots + n_store]
        new_positions = torch.arange(self.tokens_seen, self.tokens_seen + n_store,
                                     device=self.valid.device)
        self.valid = torch.cat([self.valid, self.valid.new_ones(n_heads, n_store)], dim=1)
        self.positions = torch.cat([self.positions, new_positions.expand(n_heads, -1)], dim=1)
        self.tokens_seen += n_store
        self.peak_entries = max(self.peak_entries, self.entries)
        self.peak_slots = max(self.peak_slots, self.valid.shape[1])
        # The concatenation (held slots + block + patch) is the most this layer ever holds.
        self.peak_bytes = max(self.peak_bytes, keys.nbytes + values.nbytes)
        return keys, values

    @property
    def entries(self) -> float:
        """Valid entries per KV head, averaged over heads (what a layer budget counts)."""
        return 0.0 if self.valid is None else self.valid.sum().item() / self.valid.shape[0]

    def keep(self, keep: torch.Tensor) -> None:
        """Evict every slot not in `keep` ([Hkv, slots] bool), re-packing each head in order."""
        keep = keep & self.valid
        counts = keep.sum(dim=1)
        slots = int(counts.max().item()) if counts.numel() else 0
        # Kept slots first, in their original order (a stable sort on "not kept").
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :slots]
        index = order[None, :, :, None].expand(1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, index)
        self.values = self.values.gather(2, order[None, :, :, None].expand(1, -1, -1, self.values.shape[-1]))
        self.positions = self.positions.gather(1, order)
        self.valid = torch.arange(slots, device=keep.device)[None, :] < counts[:, None]

    def snapshot(self) -> tuple[int, int]:
        return (0 if self.valid is None else self.valid.shape[1], self.tokens_seen)

    def restore(self, snapshot: tuple[int, int]) -> None:
        slots, self.tokens_seen = snapshot
        if self.is_initialized:
            self.keys, self.values = self.keys[:, :, :slots], self.values[:, :, :slots]
            self.valid, self.positions = self.valid[:, :slots], self.positions[:, :slots]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The stock mask is not used by the episodic attention; keep it as small as the slots.
        return (0 if self.valid is None else self.valid.shape[1]) + query_length, 0

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__()


class EpisodicCache(Cache):
    """Per-layer, per-head ragged KV cache built by block prefill and read by `generate()`."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[EpisodicLayer() for _ in range(num_layers)])

    @classmethod
    def for_model(cls, config) -> "EpisodicCache":
        return cls(config.num_hidden_layers)

    @property
    def tokens_seen(self) -> int:
        return self.layers[0].tokens_seen

    def entries_per_layer(self) -> list[float]:
        return [layer.entries for layer in self.layers]

    def peak_entries_per_layer(self) -> list[float]:
        return [layer.peak_entries for layer in self.layers]

    def nbytes(self, element_size: int | None = None) -> int:
        """Bytes of the valid key and value entries (padding excluded), at `element_size`
        bytes per number (default: as held in memory)."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                n = int(layer.valid.sum().item())
                size = element_size or layer.keys.element_size()
                total += n * (layer.keys.shape[-1] + layer.values.shape[-1]) * size
        return total

    @contextmanager
    def patched(self, n_patch: int) -> Iterator[None]:
        """During this forward, the last `n_patch` tokens are a patch: scored, never stored."""
        for layer in self.layers:
            layer.n_patch = n_patch
        try:
            yield
        finally:
            for layer in self.layers:
                layer.n_patch = 0

    @contextmanager
    def scratch(self) -> Iterator[None]:
        """Whatever is appended inside (a question, generated tokens) is dropped on exit, so
        a resident cache answers the next question from the same state."""
        snapshots = [layer.snapshot() for layer in self.layers]
        try:
            yield
        finally:
            for layer, snap in zip(self.layers, snapshots):
                layer.restore(snap)
