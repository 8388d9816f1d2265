"""An upper bound that cannot be deployed: the patch is the question itself (one build per
question), so the cache keeps what the question attends to."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from pipeline.kv.methods.base import MethodInputs, PatchMethod, require_patch


@dataclass(frozen=True)
class Question(PatchMethod):
    name: ClassVar[str] = "question"

    def bind(self, inputs: MethodInputs) -> Question:
        return replace(self, patch=require_patch(self, inputs))
