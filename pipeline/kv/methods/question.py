"""An upper bound that cannot be deployed: the patch is the question itself (one build per
question), so the cache keeps what the question attends to."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from pipeline.kv.methods.base import (BlockContext, LayerState, Method, MethodInputs, bound,
                                      patch_attention, require_patch)


@dataclass(frozen=True)
class Question(Method):
    patch: torch.Tensor | None = bound()
    name: ClassVar[str] = "question"

    def bind(self, inputs: MethodInputs) -> Question:
        return replace(self, patch=require_patch(self, inputs))

    def patch_ids(self, block: BlockContext) -> torch.Tensor | None:
        return self.patch

    def score(self, layer: LayerState) -> torch.Tensor:
        return patch_attention(layer)
