"""StreamingLLM: keep the first `sink` tokens (attention sinks) and the most recent ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pipeline.kv.methods.base import LayerState, Method


@dataclass(frozen=True)
class StreamingLLM(Method):
    sink: int = 128
    name: ClassVar[str] = "streamingllm"

    def score(self, layer: LayerState) -> torch.Tensor:
        recency = layer.positions.float()
        return torch.where(layer.positions < self.sink, torch.full_like(recency, float("inf")),
                           recency)
