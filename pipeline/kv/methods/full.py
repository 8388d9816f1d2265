"""The full cache: never asked to evict (the loop evicts nothing without a budget); every
entry scores the same where a caller asks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pipeline.kv.methods.base import LayerState, Method


@dataclass(frozen=True)
class Full(Method):
    name: ClassVar[str] = "full"

    def score(self, layer: LayerState) -> torch.Tensor:
        return torch.ones_like(layer.positions, dtype=torch.float32)
