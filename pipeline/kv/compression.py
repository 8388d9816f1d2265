"""A `PrefillConfig` composed into the strategies the block-prefill loop runs
(`pipeline.kv.eviction.Compression`): the one place that reads tri-state, D2O merging, DapQ and
compact positions from the configuration; the loop itself names none of them."""

from __future__ import annotations

import torch

from pipeline.config import PrefillConfig
from pipeline.kv.eviction import Compression, TokenEviction
from pipeline.kv.merging import Merging
from pipeline.kv.positions import CompactPositions, DecodePositions, KeyRotation
from pipeline.kv.tristate import EntryBytes, TriStateEviction


def token_byte_budgets(budgets: list[int], kv_heads: int, sizes: EntryBytes) -> list[int]:
    """Per layer, the bytes of `budgets[layer]` Original tokens in every KV head."""
    return [b * kv_heads * sizes.original for b in budgets]


def compression_for(config: PrefillConfig, model: torch.nn.Module, sizes: EntryBytes,
                    budgets: list[int] | None,
                    byte_budgets: list[int] | None = None) -> Compression:
    """The strategies `config` asks for, for `model` under `budgets` entries per layer and KV
    head (None: the full cache) or, with tri-state, `byte_budgets` bytes per layer (default:
    the bytes of `budgets[layer]` Original entries)."""
    compression = _eviction(config, model, sizes, budgets, byte_budgets)
    if config.merge.enabled:
        compression = Merging(compression, config.merge)
    if config.decode_positions:
        compression = DecodePositions(compression)
    if config.position_mode == "compact":
        compression = CompactPositions(compression, KeyRotation.for_model(model),
                                       config.compact_recent)
    return compression


def _eviction(config: PrefillConfig, model: torch.nn.Module, sizes: EntryBytes,
              budgets: list[int] | None, byte_budgets: list[int] | None) -> Compression:
    if config.tristate.enabled:
        if byte_budgets is None and budgets is not None:
            byte_budgets = token_byte_budgets(budgets, model.config.num_key_value_heads, sizes)
        if byte_budgets is None:
            return Compression()
        return TriStateEviction(byte_budgets, config.selection, config.tristate, sizes)
    if byte_budgets is not None:
        raise ValueError("byte budgets need tri-state compression (PrefillConfig.tristate)")
    if budgets is None:
        return Compression()
    return TokenEviction(budgets, config.selection, config.head_floor)
