"""KVzip in the block setting: a repeat instruction followed by the block's own tokens, so what
the model needs to reconstruct the block is kept."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from pipeline.kv.methods.base import (
    BlockContext,
    LayerState,
    Method,
    MethodInputs,
    bound,
    patch_attention,
)


@dataclass(frozen=True)
class KVzip(Method):
    INSTRUCTION: ClassVar[str] = "Repeat the previous context exactly."
    instruction: torch.Tensor | None = bound()  # token ids of INSTRUCTION
    name: ClassVar[str] = "kvzip"

    def bind(self, inputs: MethodInputs) -> KVzip:
        return replace(self, instruction=inputs.encode(self.INSTRUCTION))

    def patch_ids(self, block: BlockContext) -> torch.Tensor | None:
        return torch.cat([self.instruction.to(block.block_ids.device), block.block_ids])

    def score(self, layer: LayerState) -> torch.Tensor:
        return patch_attention(layer)
