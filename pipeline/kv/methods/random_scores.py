"""A floor for the others (kvpress's RandomPress): uniform random scores, reproducible from the
seed, the layer and the block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pipeline.kv.methods.base import LayerState, Method


@dataclass(frozen=True)
class Random(Method):
    seed: int = 0
    name: ClassVar[str] = "random"

    def score(self, layer: LayerState) -> torch.Tensor:
        generator = torch.Generator().manual_seed(
            self.seed + 1_000_003 * layer.layer_idx + layer.block_start)
        return torch.rand(layer.positions.shape, generator=generator).to(layer.positions.device)
