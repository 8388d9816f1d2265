"""Decoding several conversations in one forward (continuous batching), each from its own
episodic cache.

A `DecodeRow` is one request's private view of a resident cache: the cache's entries are copied
once into buffers with room for the question and the answer, so the shared cache is never
written (two requests may route to the same resident object) and the answer's tokens are
written in place (the single-request path, `generate()`, concatenates the whole cache again at
every token). `packed_step` runs one forward over the new tokens of every row, one segment per
row (a question prompt, or one token): the projections, MLPs, norms and LM head run once over
all of them (one read of the weights), while the episodic attention
(`pipeline.kv.attention.PackedRequest`) gives each segment its own row's keys, values and valid
entries, exactly as if it were decoded alone.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from pipeline.kv.attention import AttentionRequest, PackedRequest, RowAttention, hand_off
from pipeline.kv.cache import EpisodicCache


class _RowLayer:
    """One layer of a `DecodeRow`: the cached entries, then room for `extra` new tokens.

    Each head's entries are moved to the right, against the new tokens' slots (their order
    kept; attention does not depend on the keys' order), so that from its first entry on every
    slot of a head holds an entry: a one-token step then attends over each head's own entries
    only, with no mask, instead of over every head padded to the layer's longest (about half
    of SmolLM2's slots were padding at budget 256)."""

    def __init__(self, layer, extra: int) -> None:
        if not layer.is_initialized:
            raise ValueError("the episodic cache has an empty layer: it was never prefilled")
        _, n_heads, width, dim = layer.keys.shape
        lengths = layer.valid.sum(dim=1)
        slots = int(lengths.max())
        # a stable sort of the valid flags puts each head's invalid slots first, then its
        # entries in their order: the last `slots` of that order, right-aligned
        order = torch.sort(layer.valid.to(torch.int8), dim=1, stable=True).indices
        order = order[:, width - slots:]
        flat = (order + width * torch.arange(n_heads, device=order.device)[:, None]).reshape(-1)
        capacity = slots + extra
        self.keys = layer.keys.new_empty(1, n_heads, capacity, dim)
        self.values = layer.values.new_empty(1, n_heads, capacity, layer.values.shape[-1])
        for mine, theirs in ((self.keys, layer.keys), (self.values, layer.values)):
            # index_select over [heads x slots, dim] rows: ~5x faster than gather here
            picked = theirs.reshape(n_heads * width, -1).index_select(0, flat)
            mine[0, :, :slots] = picked.view(n_heads, slots, theirs.shape[-1])
        self.valid = torch.ones(n_heads, capacity, dtype=torch.bool, device=layer.valid.device)
        self.valid[:, :slots] = layer.valid.gather(1, order)
        self.rope_positions = torch.zeros(n_heads, capacity, dtype=torch.long,
                                          device=layer.valid.device)
        self.rope_positions[:, :slots] = layer.rope_positions.gather(1, order)
        self.first_entries = (slots - lengths).tolist()  # per head: its first slot with an entry
        self.slots = slots

    def append(self, keys: torch.Tensor, values: torch.Tensor, first_position: int,
               start: int) -> RowAttention:
        n, q = self.slots, keys.shape[2]
        if n + q > self.keys.shape[2]:
            raise ValueError(f"a decode row has room for {self.keys.shape[2]} slots, not {n + q}")
        self.keys[:, :, n:n + q] = keys
        self.values[:, :, n:n + q] = values
        if q == 1:
            self.rope_positions[:, n].fill_(first_position)
        else:
            self.rope_positions[:, n:n + q] = torch.arange(first_position, first_position + q,
                                                           device=self.rope_positions.device)
        self.slots = n + q
        request = AttentionRequest(key=self.keys, past_valid=self.valid[:, :n],
                                   past_positions=self.rope_positions[:, :n],
                                   first_position=first_position)
        return RowAttention(request, self.keys[:, :, :n + q], self.values[:, :, :n + q], start, q,
                            self.first_entries if q == 1 else None)


class Prefix:
    """The cache entries of tokens that open every prompt over one cache (the question
    instruction), computed once and copied into each row over that cache."""

    def __init__(self, model: torch.nn.Module, cache: EpisodicCache, ids: torch.Tensor) -> None:
        row = DecodeRow(cache, len(ids))
        start = [layer.slots for layer in row.layers]
        packed_step(model, [row], [ids])
        self.ids = ids
        self.keys = [layer.keys[:, :, s:].clone() for layer, s in zip(row.layers, start)]
        self.values = [layer.values[:, :, s:].clone() for layer, s in zip(row.layers, start)]


class DecodeRow:
    """One request's private view of an episodic cache, with room for `extra` new tokens.

    Copies the cache's entries once (it is never written), then `prefix`'s if given (which
    then counts in `extra`); holds `slots + extra` key and value slots per layer, the memory a
    request costs while it decodes."""

    def __init__(self, cache: EpisodicCache, extra: int, prefix: Prefix | None = None) -> None:
        self.layers = [_RowLayer(layer, extra) for layer in cache.layers]
        self.next_position = cache.next_position
        if prefix is not None:
            for i, layer in enumerate(self.layers):
                layer.append(prefix.keys[i], prefix.values[i], self.next_position, 0)
            self.next_position += len(prefix.ids)

    @staticmethod
    def slots_needed(cache: EpisodicCache, extra: int) -> int:
        """Key/value slots a row over `cache` holds per layer at most (its tokens in flight):
        the most entries of any head, plus `extra`."""
        return max((int(layer.valid.sum(dim=1).max()) for layer in cache.layers
                    if layer.valid is not None), default=0) + extra

    def snapshot(self) -> tuple[int, list[int]]:
        return self.next_position, [layer.slots for layer in self.layers]

    def restore(self, snapshot: tuple[int, list[int]]) -> None:
        """Forget what a failed step appended (its slots are simply overwritten later)."""
        self.next_position, slots = snapshot
        for layer, n in zip(self.layers, slots):
            layer.slots = n


class _PackedLayer(CacheLayerMixin):
    """A layer of `PackedCache`: appends each segment to its row, hands the attention the rows."""
    is_sliding = False
    is_compileable = False

    def __init__(self, cache: "PackedCache", index: int) -> None:
        super().__init__()
        self.cache, self.index, self.is_initialized = cache, index, True

    def lazy_initialization(self, key_states, value_states) -> None:  # rows hold the tensors
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rows, starts, lengths = self.cache.rows, self.cache.starts, self.cache.lengths
        segments = [row.layers[self.index].append(key_states[:, :, s:s + q],
                                                  value_states[:, :, s:s + q],
                                                  row.next_position, s)
                    for row, s, q in zip(rows, starts, lengths)]
        hand_off(PackedRequest(key=key_states, rows=segments))
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # the stock mask is not used; keep it as small as possible

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class PackedCache(Cache):
    """The cache of one packed forward: segment i (of `lengths[i]` tokens) belongs to rows[i]."""

    def __init__(self, rows: list[DecodeRow], lengths: list[int]) -> None:
        self.rows, self.lengths = rows, lengths
        self.starts = [sum(lengths[:i]) for i in range(len(lengths))]
        super().__init__(layers=[_PackedLayer(self, i) for i in range(len(rows[0].layers))])


@torch.inference_mode()
def packed_step(model: torch.nn.Module, rows: list[DecodeRow],
                new_ids: list[torch.Tensor]) -> torch.Tensor:
    """One forward over the new tokens of every row (each continuing its own cache at its own
    positions); returns the float32 next-token logits of each row, [rows, vocab]."""
    lengths = [int(ids.shape[0]) for ids in new_ids]
    device = model.device
    input_ids = torch.cat(new_ids).to(device)[None]
    positions = torch.cat([torch.arange(r.next_position, r.next_position + q)
                           for r, q in zip(rows, lengths)]).to(device)[None]
    last = torch.tensor(lengths, device=device).cumsum(0) - 1
    hidden = model.get_decoder()(input_ids=input_ids, position_ids=positions,
                                 past_key_values=PackedCache(rows, lengths),
                                 use_cache=True).last_hidden_state[0, last]
    for row, q in zip(rows, lengths):
        row.next_position += q
    return lm_head_rows(model.get_output_embeddings(), hidden).to(dtype=torch.float32)


def lm_head_rows(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head over a few rows of hidden states, [rows, vocab], as `weight @ hidden.T`:
    for 2 to 8 rows, MKL's GEMM in `linear`'s layout streamed SmolLM2's [49152, 576] head 1.4
    to 4x more slowly than in this one (one row takes the same GEMV either way)."""
    logits = (head.weight @ hidden.T).T
    return logits + head.bias if head.bias is not None else logits
