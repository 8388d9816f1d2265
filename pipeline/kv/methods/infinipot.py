"""InfiniPot: a fixed instruction as the patch; what it attends to is kept."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from pipeline.kv.methods.base import (BlockContext, LayerState, Method, MethodInputs, bound,
                                      patch_attention)


@dataclass(frozen=True)
class InfiniPot(Method):
    INSTRUCTION: ClassVar[str] = \
        "Summarize the previous context highlighting the most important parts."
    patch: torch.Tensor | None = bound()
    name: ClassVar[str] = "infinipot"

    def bind(self, inputs: MethodInputs) -> InfiniPot:
        return replace(self, patch=inputs.encode(self.INSTRUCTION))

    def patch_ids(self, block: BlockContext) -> torch.Tensor | None:
        return self.patch

    def score(self, layer: LayerState) -> torch.Tensor:
        return patch_attention(layer)
