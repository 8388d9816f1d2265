"""The episodic KV cache: a transformers `Cache` whose heads and layers hold different lengths.

Each layer stores keys and values as [1, Hkv, slots, d] with a per-head `valid` mask: after
head-wise (AdaKV-style) eviction a head may keep more entries than another, and the shorter
heads are padded. New tokens are appended after the slots; `keep()` evicts and re-packs.
`get_seq_length()` is the number of tokens the cache has *seen* (the next position), not the
number it holds, so `model.generate()` continues at the right RoPE positions.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kernels.quant import dequantize, quantize_fp8, quantize_int8
from pipeline.kv.attention import AttentionRequest, Packing, hand_off
from pipeline.kv.positions import KeyRotation


@dataclass(frozen=True)
class QuantizedTier:
    """A layer's Quantized entries (tri-state, ARKV), as `EpisodicLayer` holds them: which slots
    [Hkv, slots], the codes' dtype, the codes as raw bytes [Hkv, slots, d] (int8, or uint8 for
    float8_e4m3fn) and the per-token, per-head float32 scales [Hkv, slots]."""
    mask: torch.Tensor
    code_dtype: torch.dtype
    key_codes: torch.Tensor
    value_codes: torch.Tensor
    key_scales: torch.Tensor
    value_scales: torch.Tensor


class EpisodicLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = False

    def __init__(self) -> None:
        super().__init__()
        self.valid: torch.Tensor | None = None  # [Hkv, slots] bool
        self.positions: torch.Tensor | None = None  # [Hkv, slots] original token positions
        # [Hkv, slots] the positions the keys are rotated at: the original ones, unless the
        # cache was compacted (`compact()`), which re-rotates its entries to 0, 1, 2, ...
        self.rope_positions: torch.Tensor | None = None
        # after compact(): tokens from `compact_cut` on keep their spacing from `compact_base`
        self.compact_cut: int | None = None
        self.compact_base = 0
        self.tokens_seen = 0  # tokens fed so far
        self.next_position = 0  # the position the next token takes (tokens_seen unless compacted)
        self.n_patch = 0  # while > 0, that many trailing new tokens are a patch: scored, not kept
        self.packing: Packing | None = None  # while set: the new tokens are packed sequences
        self.last_request: AttentionRequest | None = None
        self.peak_entries = 0.0  # instrumentation: max valid entries per head seen
        self.peak_slots = 0  # instrumentation: max padded slots seen
        self.peak_bytes = 0  # instrumentation: max bytes of this layer's key + value tensors
        self.moments = False  # ask the attention for the patch attention's moments (ARKV)
        # Tri-state (ARKV): which slots hold Quantized entries, and their codes and per-token,
        # per-head scales. `keys`/`values` hold the dequantized values at those slots (what
        # the attention sees, in token order); None while nothing is quantized.
        self.quantized: torch.Tensor | None = None  # [Hkv, slots] bool
        # Codes are held as raw bytes (int8, or uint8 for float8_e4m3fn: CPU gathers do not
        # take fp8); `code_dtype` says how to read them (`codes()`).
        self.code_dtype: torch.dtype | None = None
        self.key_codes: torch.Tensor | None = None  # [Hkv, slots, d]
        self.value_codes: torch.Tensor | None = None
        self.key_scales: torch.Tensor | None = None  # [Hkv, slots] float32
        self.value_scales: torch.Tensor | None = None

    @classmethod
    def from_stored(cls, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                    positions: torch.Tensor, *, rope_positions: torch.Tensor, tokens_seen: int,
                    next_position: int, quantized: QuantizedTier | None = None) -> EpisodicLayer:
        """A layer as a stored cache reads back (`pipeline.store.objects.cache_format`): keys
        and values [1, Hkv, slots, d] (Quantized slots dequantized), `valid`, the original
        `positions` and the positions the keys are rotated at [Hkv, slots], the tokens seen and
        the next position, and the Quantized tier if it has one."""
        layer = cls()
        layer.keys, layer.values, layer.valid, layer.positions = keys, values, valid, positions
        layer.rope_positions = rope_positions
        layer.tokens_seen, layer.next_position = tokens_seen, next_position
        if quantized is not None:
            layer.quantized, layer.code_dtype = quantized.mask, quantized.code_dtype
            layer.key_codes, layer.value_codes = quantized.key_codes, quantized.value_codes
            layer.key_scales, layer.value_scales = quantized.key_scales, quantized.value_scales
        layer.is_initialized = True
        return layer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, n_heads, _, dim = key_states.shape
        self.keys = key_states.new_zeros(1, n_heads, 0, dim)
        self.values = value_states.new_zeros(1, n_heads, 0, value_states.shape[-1])
        self.valid = torch.zeros(n_heads, 0, dtype=torch.bool, device=key_states.device)
        self.positions = torch.zeros(n_heads, 0, dtype=torch.long, device=key_states.device)
        self.rope_positions = self.positions
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != 1:
            raise ValueError("an episodic cache holds one conversation: batch size must be 1")
        keys = torch.cat([self.keys, key_states.to(self.keys.dtype)], dim=-2)
        values = torch.cat([self.values, value_states.to(self.values.dtype)], dim=-2)
        self.last_request = AttentionRequest(key=keys, past_valid=self.valid,
                                             past_positions=self.rope_positions,
                                             first_position=self.next_position,
                                             n_patch=self.n_patch, moments=self.moments,
                                             packing=self.packing)
        hand_off(self.last_request)

        n_heads, slots = self.valid.shape
        n_store = key_states.shape[-2] - self.n_patch
        self.keys = keys[:, :, : slots + n_store]
        self.values = values[:, :, : slots + n_store]
        new_positions = torch.arange(self.tokens_seen, self.tokens_seen + n_store,
                                     device=self.valid.device)
        self.valid = torch.cat([self.valid, self.valid.new_ones(n_heads, n_store)], dim=1)
        self.positions = torch.cat([self.positions, new_positions.expand(n_heads, -1)], dim=1)
        self.rope_positions = torch.cat([self.rope_positions, (new_positions + self.next_position
                                         - self.tokens_seen).expand(n_heads, -1)], dim=1)
        if self.quantized is not None:  # new tokens arrive Original
            self.quantized = torch.cat([self.quantized,
                                        self.quantized.new_zeros(n_heads, n_store)], 1)
            for name in ("key_codes", "value_codes", "key_scales", "value_scales"):
                t = getattr(self, name)
                setattr(self, name, torch.cat([t, t.new_zeros(n_heads, n_store, *t.shape[2:])], 1))
        self.tokens_seen += n_store
        self.next_position += n_store
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
        self.values = self.values.gather(
            2, order[None, :, :, None].expand(1, -1, -1, self.values.shape[-1]))
        self.positions = self.positions.gather(1, order)
        self.rope_positions = self.rope_positions.gather(1, order)
        self.valid = torch.arange(slots, device=keep.device)[None, :] < counts[:, None]
        if self.quantized is not None:
            self.quantized = self.quantized.gather(1, order) & self.valid
            self.key_scales = self.key_scales.gather(1, order)
            self.value_scales = self.value_scales.gather(1, order)
            self.key_codes = self.key_codes.gather(
                1, order[:, :, None].expand(-1, -1, self.key_codes.shape[-1]))
            self.value_codes = self.value_codes.gather(
                1, order[:, :, None].expand(-1, -1, self.value_codes.shape[-1]))

    def without_tokens(self, hidden: torch.Tensor) -> EpisodicLayer:
        """A view of the layer whose entries of the tokens in `hidden` ([N] bool over original
        positions; a token past N is kept) are invalid. Keys, values and codes are shared,
        never written: appends concatenate and `restore` slices, so the layer stays as it was."""
        view = copy.copy(self)
        if self.is_initialized and self.valid.numel() and len(hidden):
            hidden = hidden.to(self.positions.device)
            hit = (self.positions < len(hidden)) & hidden[self.positions.clamp(max=len(hidden) - 1)]
            view.valid = self.valid & ~hit
        return view

    def quantized_mask(self) -> torch.Tensor:
        """[Hkv, slots] bool: the slots holding Quantized entries."""
        if self.quantized is None:
            return torch.zeros_like(self.valid)
        return self.quantized & self.valid

    def state_counts(self) -> tuple[int, int]:
        """(Original entries, Quantized entries) held, summed over heads."""
        if self.valid is None:
            return 0, 0
        quantized = int(self.quantized_mask().sum().item())
        return int(self.valid.sum().item()) - quantized, quantized

    def quantize(self, mask: torch.Tensor, fp8: bool = False) -> None:
        """Turn the Original entries in `mask` ([Hkv, slots] bool) into Quantized ones:
        per-token, per-head codes and scales (`kernels.quant` dispatch), and the attention view
        replaced by their dequantized values. Entries already quantized are left as they are
        (never re-quantized from their dequantized values)."""
        new = mask & self.valid & ~self.quantized_mask()
        if not bool(new.any()):
            return
        code_dtype = torch.float8_e4m3fn if fp8 else torch.int8
        raw = torch.uint8 if fp8 else torch.int8
        if self.quantized is None:
            n_heads, slots = self.valid.shape
            self.quantized = torch.zeros_like(self.valid)
            self.code_dtype = code_dtype
            self.key_codes = torch.zeros(n_heads, slots, self.keys.shape[-1], dtype=raw,
                                         device=self.keys.device)
            self.value_codes = torch.zeros(n_heads, slots, self.values.shape[-1], dtype=raw,
                                           device=self.values.device)
            self.key_scales = torch.zeros(n_heads, slots, dtype=torch.float32,
                                          device=self.keys.device)
            self.value_scales = torch.zeros_like(self.key_scales)
        elif self.code_dtype != code_dtype:
            raise ValueError(f"layer holds {self.code_dtype} codes, asked for {code_dtype}")
        for tensor, codes, scales in ((self.keys, self.key_codes, self.key_scales),
                                      (self.values, self.value_codes, self.value_scales)):
            c, sc = self._encode(tensor[0][new])
            codes[new], scales[new] = c.view(codes.dtype), sc
            tensor[0][new] = dequantize(c, sc, dtype=tensor.dtype)
        self.quantized |= new

    def _encode(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [n, d] in this layer's code (`kernels.quant` dispatch): codes and scales."""
        fp8 = self.code_dtype == torch.float8_e4m3fn
        return (quantize_fp8 if fp8 else quantize_int8)(rows)

    def codes(self, which: str) -> torch.Tensor:
        """The key or value codes [Hkv, slots, d] in their code dtype (a view)."""
        raw = self.key_codes if which == "keys" else self.value_codes
        return raw.view(self.code_dtype)

    def compact(self, rotation: KeyRotation, cut: int | None = None, base: int = 0) -> None:
        """Move every head's entries to positions 0, 1, 2, ... in token order, re-rotating
        the keys that move, so the cache reads a history of any length within the model's
        positions (StreamingLLM, kvpress's KeyRerotationPress). With `cut`, only the entries
        of tokens before it are packed; the later ones keep their spacing from `base` on
        (`base + position - cut`). `next_position` is left to the cache, which must keep it
        equal across layers.

        A Quantized key is held as its codes' dequantized value: that value is rotated like any
        key, and its codes are made anew from it (a second rounding, never compounded: the next
        move rotates the held value again, not the codes), so the codes always hold the key at
        the position the object records."""
        cut = self.tokens_seen if cut is None else cut
        self.compact_cut, self.compact_base = (cut, base) if cut < self.tokens_seen else (None, 0)
        older = self.valid & (self.positions < cut)
        target = torch.where(older, torch.cumsum(older, dim=1) - 1, base + self.positions - cut)
        target = torch.where(self.valid, target, self.rope_positions)
        shift = target - self.rope_positions
        moved = shift != 0
        if bool(moved.any()):
            keys = self.keys[0]
            keys[moved] = rotation.rotate(keys[moved], shift[moved])
            recoded = moved & self.quantized_mask()
            if bool(recoded.any()):
                codes, scales = self._encode(keys[recoded])
                self.key_codes[recoded] = codes.view(self.key_codes.dtype)
                self.key_scales[recoded] = scales
        self.rope_positions = target

    def older_entries(self, cut: int) -> int:
        """The most valid entries any head holds of tokens before `cut`."""
        return (int((self.valid & (self.positions < cut)).sum(dim=1).max().item())
                if self.valid.numel() else 0)

    def snapshot(self) -> tuple[int, int, int]:
        return (0 if self.valid is None else self.valid.shape[1], self.tokens_seen,
                self.next_position)

    def restore(self, snapshot: tuple[int, int, int]) -> None:
        slots, self.tokens_seen, self.next_position = snapshot
        if self.is_initialized:
            self.keys, self.values = self.keys[:, :, :slots], self.values[:, :, :slots]
            self.valid, self.positions = self.valid[:, :slots], self.positions[:, :slots]
            self.rope_positions = self.rope_positions[:, :slots]
            if self.quantized is not None:
                self.quantized = self.quantized[:, :slots]
                self.key_codes, self.value_codes = (self.key_codes[:, :slots],
                                                    self.value_codes[:, :slots])
                self.key_scales, self.value_scales = (self.key_scales[:, :slots],
                                                      self.value_scales[:, :slots])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The stock mask is not used by the episodic attention; keep it as small as the slots.
        return (0 if self.valid is None else self.valid.shape[1]) + query_length, 0

    def get_seq_length(self) -> int:
        return self.next_position

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__()


_TIER = ("quantized", "key_codes", "value_codes", "key_scales", "value_scales")


def _join_tiers(layer: EpisodicLayer, parts: list[EpisodicLayer]) -> None:
    """`layer`'s Quantized tier: the parts' tiers side by side, slot for slot as their entries
    are joined (a part without one adds no Quantized slot); `keep()` then packs it with them."""
    codes = {p.code_dtype for p in parts if p.quantized is not None}
    if len(codes) > 1:
        raise ValueError(f"caches of different codes ({sorted(map(str, codes))}) cannot be "
                         "joined")
    layer.code_dtype = codes.pop()
    for name in _TIER:
        held = next(getattr(p, name) for p in parts if p.quantized is not None)
        setattr(layer, name, torch.cat([
            getattr(p, name) if p.quantized is not None else
            held.new_zeros(*p.valid.shape, *held.shape[2:]) for p in parts], dim=1))


def _repeated(positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[Hkv, slots] whether a valid slot's token was held by an earlier valid slot of its head."""
    same = (positions[:, :, None] == positions[:, None, :]) & valid[:, None, :] & valid[:, :, None]
    return torch.tril(same, diagonal=-1).any(dim=2)


class EpisodicCache(Cache):
    """Per-layer, per-head ragged KV cache built by block prefill and read by `generate()`."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[EpisodicLayer() for _ in range(num_layers)])

    @classmethod
    def for_model(cls, config) -> EpisodicCache:
        return cls(config.num_hidden_layers)

    @classmethod
    def from_layers(cls, layers: list[EpisodicLayer]) -> EpisodicCache:
        """A cache of layers made whole elsewhere (`EpisodicLayer.from_stored`)."""
        cache = cls(0)
        cache.layers.extend(layers)
        return cache

    @property
    def tokens_seen(self) -> int:
        return self.layers[0].tokens_seen

    @property
    def next_position(self) -> int:
        """The position the next token takes: `tokens_seen`, or less once compacted."""
        return self.layers[0].next_position

    def compact(self, rotation: KeyRotation, recent: int = 0) -> None:
        """Every layer's entries at positions 0, 1, 2, ... (`EpisodicLayer.compact`), except
        those of the last `recent` tokens, which follow at their original spacing; the next
        token goes after the longest head of any layer, since all layers share its position."""
        cut = max(self.tokens_seen - recent, 0)
        base = max(layer.older_entries(cut) for layer in self.layers)
        for layer in self.layers:
            layer.compact(rotation, cut, base)
        for layer in self.layers:
            layer.next_position = base + self.tokens_seen - cut

    @classmethod
    def joined(cls, caches: list[EpisodicCache]) -> EpisodicCache:
        """One cache that reads several (a question the router is unsure of reads two
        episodes): each head holds the entries of all of them, each entry at its own position,
        a token both hold once (the first cache's entry), and the next token goes after the
        furthest. Quantized entries stay Quantized, their codes with them."""
        out = cls(len(caches[0].layers))
        for i, layer in enumerate(out.layers):
            parts = [c.layers[i] for c in caches]
            if any(p.quantized is not None for p in parts):
                _join_tiers(layer, parts)
            layer.keys = torch.cat([p.keys for p in parts], dim=2)
            layer.values = torch.cat([p.values for p in parts], dim=2)
            layer.valid = torch.cat([p.valid for p in parts], dim=1)
            layer.positions = torch.cat([p.positions for p in parts], dim=1)
            layer.rope_positions = torch.cat([p.rope_positions for p in parts], dim=1)
            layer.tokens_seen = max(p.tokens_seen for p in parts)
            layer.next_position = max(p.next_position for p in parts)
            layer.is_initialized = True
            layer.keep(layer.valid & ~_repeated(layer.positions, layer.valid))
        return out

    def without_tokens(self, hidden: torch.Tensor) -> EpisodicCache:
        """The cache as a question reads it with the entries of the tokens in `hidden` ([N]
        bool over token positions) hidden: a view (`EpisodicLayer.without_tokens`), the
        cache itself unchanged. A top-up with `read_once` reads its turns as text alone."""
        return EpisodicCache.from_layers([layer.without_tokens(hidden) for layer in self.layers])

    def entries_per_layer(self) -> list[float]:
        return [layer.entries for layer in self.layers]

    def peak_entries_per_layer(self) -> list[float]:
        return [layer.peak_entries for layer in self.layers]

    def nbytes(self, element_size: int | None = None) -> int:
        """Bytes of the valid key and value entries (padding excluded): Original entries at
        `element_size` bytes per number (default: as held in memory), Quantized ones at their
        codes (1 byte per number) plus a float32 scale for the key row and one for the value
        row (what a tri-state object stores)."""
        return sum(self.state_bytes(element_size))

    def state_bytes(self, element_size: int | None = None) -> tuple[int, int]:
        """(bytes of the Original entries, bytes of the Quantized entries), as in `nbytes`."""
        original = quantized = 0
        for layer in self.layers:
            if layer.is_initialized:
                n_original, n_quantized = layer.state_counts()
                dims = layer.keys.shape[-1] + layer.values.shape[-1]
                original += n_original * dims * (element_size or layer.keys.element_size())
                quantized += n_quantized * (dims + 2 * 4)
        return original, quantized

    def state_counts(self) -> tuple[int, int]:
        """(Original entries, Quantized entries), summed over layers and KV heads."""
        counts = [layer.state_counts() for layer in self.layers]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def collect_moments(self, on: bool = True) -> None:
        """Have patch forwards also return the patch attention's moments (ARKV)."""
        for layer in self.layers:
            layer.moments = on

    @contextmanager
    def patched(self, n_patch: int) -> Iterator[None]:
        """During this forward, the last `n_patch` tokens are a patch: scored (the max of their
        attention to each entry), never stored."""
        for layer in self.layers:
            layer.n_patch = n_patch
        try:
            yield
        finally:
            for layer in self.layers:
                layer.n_patch = 0

    @contextmanager
    def packed(self, packing: Packing) -> Iterator[None]:
        """During this forward (inside `scratch()`), the new tokens are independent sequences
        (`Packing`: each may also read a parent segment whole), each continuing the cache on its
        own: a block-diagonal causal mask over them. The caller gives each token its position
        (`position_ids`) from the next position on, as `packing.offsets` says."""
        for layer in self.layers:
            layer.packing = packing
        try:
            yield
        finally:
            for layer in self.layers:
                layer.packing = None

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
