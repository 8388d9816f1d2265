"""KeyDiff (the paper's and kvpress's anchor): keep keys unlike the mean of all the keys being
compressed, the kept ones and the block's (score = -cosine similarity to that mean)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pipeline.kv.methods.base import LayerState, Method


def anchor_distance(keys: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """-cosine similarity of every key to the mean of the `members` keys, per head."""
    keys = keys.float()
    anchor = (keys * members[..., None]).sum(1) / members.sum(1, keepdim=True).clamp(min=1)
    return -torch.nn.functional.cosine_similarity(keys, anchor[:, None, :], dim=-1)


@dataclass(frozen=True)
class KeyDiff(Method):
    name: ClassVar[str] = "keydiff"

    def score(self, layer: LayerState) -> torch.Tensor:
        return anchor_distance(layer.keys, layer.valid)
