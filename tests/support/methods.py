"""Registered methods bound as a build binds them, for tests that score by hand."""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable

import torch

from pipeline.config import ScoringConfig
from pipeline.kv import methods
from pipeline.kv.methods.base import MethodInputs, Scorer
from pipeline.kv.methods.epicache import EpiCache


def bound_method(name: str, encode: Callable[[str], torch.Tensor], patch_text: str | None = None,
                 line_ids: torch.Tensor | None = None, member: torch.Tensor | None = None,
                 **parameters) -> Scorer:
    """The method `name` with `parameters`, bound to a patch text and a token layout."""
    return methods.create(name, **parameters).bind(
        MethodInputs(encode, patch_text, line_ids, member))


def episodic(patch: torch.Tensor, scoring: ScoringConfig, line_ids: torch.Tensor | None = None,
             member: torch.Tensor | None = None) -> Scorer:
    """EpiCache with `scoring`'s parameters, bound to an already encoded patch."""
    inputs = MethodInputs(lambda _text: patch, "patch", line_ids, member)
    return EpiCache(**asdict(scoring)).bind(inputs)
