"""A diagnostic floor: keep the first tokens of the conversation (score = -position)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pipeline.kv.methods.base import LayerState, Method


@dataclass(frozen=True)
class Oldest(Method):
    name: ClassVar[str] = "oldest"

    def score(self, layer: LayerState) -> torch.Tensor:
        return -layer.positions.float()
