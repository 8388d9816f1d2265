"""EpiCache: an episode's cache keeps what the episode's patched prompt (its medoid windows,
rendered like the conversation) attends to.

Its parameters are `ScoringConfig` (torch-free, hashed into the build): `paper()` is the paper's
recipe (max attention over the patch queries, token by token, the whole medoid patch); the
default keeps the episode's own turns first (`focus`), whole (`utterance`), ranked by the
attention of the patch's first 256 tokens, and the first 4 tokens always (docs/quality.md).
`bind` shapes the patch attention as the parameters say (`pipeline.kv.methods.shaping`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from pipeline.config import ScoringConfig
from pipeline.kv.methods.base import MethodInputs, PatchMethod, Scorer, require_patch
from pipeline.kv.methods.shaping import FocusScorer, PooledScorer, ProtectedScorer, UtteranceScorer


@dataclass(frozen=True)
class EpiCache(ScoringConfig, PatchMethod):
    name: ClassVar[str] = "epicache"

    def bind(self, inputs: MethodInputs) -> Scorer:
        """The patch attention, shaped: pooled, by whole utterance (needs `line_ids`), focused
        on the episode's own turns (needs `member`), with protected sink and recent tokens."""
        patch = require_patch(self, inputs)
        if self.patch_tokens is not None:
            patch = patch[:self.patch_tokens]
        scorer: Scorer = replace(self, patch=patch)
        if self.pool:
            scorer = PooledScorer(scorer, self.pool)
        if self.utterance:
            if inputs.line_ids is None:
                raise ValueError("utterance scoring needs the token layout (line ids)")
            scorer = UtteranceScorer(scorer, inputs.line_ids)
        if self.focus:
            if inputs.member is None:
                raise ValueError("focus needs the episode's member tokens")
            scorer = FocusScorer(scorer, inputs.member, self.focus)
        if self.sink or self.recent:
            scorer = ProtectedScorer(scorer, self.sink, self.recent)
        return scorer
