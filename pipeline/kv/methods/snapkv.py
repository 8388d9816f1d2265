"""SnapKV in the block setting: the patch is the last `window` tokens of the block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pipeline.kv.methods.base import BlockContext, LayerState, Method, patch_attention


@dataclass(frozen=True)
class SnapKV(Method):
    window: int = 64
    name: ClassVar[str] = "snapkv"

    def patch_ids(self, block: BlockContext) -> torch.Tensor | None:
        return block.block_ids[-self.window:]

    def score(self, layer: LayerState) -> torch.Tensor:
        return patch_attention(layer)
