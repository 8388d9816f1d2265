"""Knorm (Devoto et al. 2024, kvpress's KnormPress): keys with a low L2 norm draw high
attention, so an entry scores minus its key's norm. No patch: the cheapest attention-free
baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pipeline.kv.methods.base import LayerState, Method


@dataclass(frozen=True)
class Knorm(Method):
    name: ClassVar[str] = "knorm"

    def score(self, layer: LayerState) -> torch.Tensor:
        return -layer.keys.float().norm(dim=-1)
