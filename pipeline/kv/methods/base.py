"""What a compression method is, and what the block-prefill loop shows it.

A method (kvpress's press) is a frozen dataclass of its parameters with one scoring function:
after each block, `score` says how worth keeping every cached entry of a layer is. A method may
also ask for a *patched prompt* (`patch_ids`) to ride after each block: its queries attend to
the cache and their attention (`LayerState.patch_scores`) is what attention-based methods
score with. Some methods need the build's inputs (the episode's medoid text, the question, the
conversation's token layout): `bind` returns the method with those attached, and the loop only
ever sees bound methods. The loop (`pipeline.kv.prefill`) is the only place that evicts and it
knows no method by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ClassVar

import torch

from pipeline.config import BuildConfig
from pipeline.kv.methods import Registered, registered


@dataclass(frozen=True)
class BlockContext:
    """What a method may look at when choosing the patch for a block."""
    block_ids: torch.Tensor  # [T] token ids of the block just fed
    tokens_seen: int  # tokens fed before this block


@dataclass(frozen=True)
class LayerState:
    """What a method sees of one layer after a block (and its patch) went through."""
    layer_idx: int
    keys: torch.Tensor  # [Hkv, slots, d] after RoPE
    values: torch.Tensor  # [Hkv, slots, d]
    valid: torch.Tensor  # [Hkv, slots] bool
    positions: torch.Tensor  # [Hkv, slots] original token positions
    patch_scores: torch.Tensor | None  # [Hkv, slots]: max softmax attention from the patch
    block_start: int = 0  # position of the first token of the block just fed
    # Moments of the patch attention over the patch queries and the query heads of each KV
    # group (ARKV statistics; None without a patch): sum and sum of squares [Hkv, slots], and
    # how many (query head, patch query) rows they sum.
    patch_sum: torch.Tensor | None = None
    patch_sumsq: torch.Tensor | None = None
    patch_count: int = 0


@dataclass(frozen=True)
class MethodInputs:
    """What a build offers a method to bind: the tokenizer (as `encode`, text to patch ids),
    the text its patch is made of (the episode's medoid windows, or the question), and the
    conversation's token layout: the line (turn) of each token and the episode's own tokens."""
    encode: Callable[[str], torch.Tensor]
    patch_text: str | None = None
    line_ids: torch.Tensor | None = None  # [N] long
    member: torch.Tensor | None = None  # [N] bool


def bound(**kwargs: Any) -> Any:
    """A field that `bind` fills from the build's inputs: not a parameter (left out of equality,
    hash and repr)."""
    return field(default=None, compare=False, repr=False, metadata={"bound": True}, **kwargs)


class Scorer(ABC):
    """What the loop calls: higher score = more worth keeping (invalid slots are ignored)."""

    def patch_ids(self, block: BlockContext) -> torch.Tensor | None:
        """Token ids of the patched prompt to score with after this block, or None."""
        return None

    @abstractmethod
    def score(self, layer: LayerState) -> torch.Tensor: ...


@dataclass(frozen=True)
class Method(Scorer):
    """A registered compression method (`pipeline.kv.methods.REGISTRY`): its parameters are its
    fields; `name` is its registry name, and its registry line says what it is."""
    name: ClassVar[str]

    @classmethod
    def registration(cls) -> Registered:
        """What this method is: per episode or per conversation, per question, whether it
        evicts, its configuration section (`pipeline.kv.methods.Registered`)."""
        return registered(cls.name)

    @classmethod
    def from_config(cls, config: BuildConfig) -> Method:
        """This method as a build configures it: its parameters are the fields of its own
        section of `config` (hashed into the build), or its defaults when it has none."""
        section = cls.registration().section
        return cls(**asdict(getattr(config, section))) if section else cls()

    def bind(self, inputs: MethodInputs) -> Scorer:
        """This method ready for one build (by default it needs nothing from it)."""
        return self


def patch_attention(layer: LayerState) -> torch.Tensor:
    """The attention the patch's queries pay to each cached entry: an attention method's score."""
    if layer.patch_scores is None:
        raise RuntimeError("patch scores missing: the model is not using episodic attention")
    return layer.patch_scores


def require_patch(method: Method, inputs: MethodInputs) -> torch.Tensor:
    """The encoded patch text of a method that scores with a text patch."""
    if not inputs.patch_text:
        raise ValueError(f"method {method.name!r} needs a patch text")
    return inputs.encode(inputs.patch_text)


@dataclass(frozen=True)
class PatchMethod(Method):
    """Keeps what a fixed patched prompt attends to (EpiCache's medoid patch, InfiniPot's
    instruction, the question itself): `bind` encodes the patch, the loop runs it after every
    block, and the score is its attention."""
    patch: torch.Tensor | None = bound()  # [P] token ids

    def patch_ids(self, block: BlockContext) -> torch.Tensor | None:
        return self.patch

    def score(self, layer: LayerState) -> torch.Tensor:
        return patch_attention(layer)
