"""InfiniPot: a fixed instruction as the patch; what it attends to is kept."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from pipeline.kv.methods.base import MethodInputs, PatchMethod


@dataclass(frozen=True)
class InfiniPot(PatchMethod):
    INSTRUCTION: ClassVar[str] = \
        "Summarize the previous context highlighting the most important parts."
    name: ClassVar[str] = "infinipot"

    def bind(self, inputs: MethodInputs) -> InfiniPot:
        return replace(self, patch=inputs.encode(self.INSTRUCTION))
