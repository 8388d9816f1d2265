"""Where each turn of a rendered conversation sits in the model's token sequence.

Scorers that reason about utterances (whole-turn selection, an episode's own turns) and the
evaluation's diagnostics (how much of an evidence turn a cache still holds) need the token span
of every turn in the ids the cache was built from (`prompts.context_ids`). The fast tokenizer's
offset mapping gives it without a second tokenization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.corpus.render import render_conversation
from pipeline.corpus.schema import Conversation
from pipeline.kv import prompts


@dataclass(frozen=True)
class TokenLayout:
    n_tokens: int
    line_ids: torch.Tensor  # [N] long: the rendered line each token belongs to (a turn is a line)
    turn_spans: tuple[tuple[int, int], ...]  # per turn, [start, end) token indices
    turn_ids: tuple[str, ...]

    def span_of(self, turn_id: str) -> tuple[int, int]:
        return self.turn_spans[self.turn_ids.index(turn_id)]

    def turn_mask(self, turn_ids) -> torch.Tensor:
        """[N] bool: the tokens of the given turns."""
        wanted = set(turn_ids)
        return token_mask([span for tid, span in zip(self.turn_ids, self.turn_spans)
                           if tid in wanted], self.n_tokens)


def token_mask(spans, n_tokens: int) -> torch.Tensor:
    """[n_tokens] bool: the tokens of the [start, end) `spans` (a turn's, as `TokenLayout` or
    a turn index holds them)."""
    mask = torch.zeros(n_tokens, dtype=torch.bool)
    for start, end in spans:
        mask[max(start, 0):max(end, 0)] = True
    return mask


def token_layout(tokenizer, conv: Conversation) -> TokenLayout:
    """The layout of `prompts.context_ids(tokenizer, render_conversation(conv).text)`."""
    rendered = render_conversation(conv)
    prefix = prompts.prompt_format(tokenizer).prefix
    text = prefix + rendered.text
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)
    starts = offsets[:, 0].contiguous()
    # a token's line: how many newlines of the text precede its first character
    newline_at = torch.tensor([i for i, ch in enumerate(text) if ch == "\n"], dtype=torch.long)
    line_ids = torch.searchsorted(newline_at, starts, right=False)
    spans = []
    for char_start, char_end in rendered.turn_spans:
        lo, hi = char_start + len(prefix), char_end + len(prefix)
        inside = torch.nonzero((offsets[:, 1] > lo) & (offsets[:, 0] < hi)).flatten()
        spans.append((int(inside[0]), int(inside[-1]) + 1) if inside.numel() else (0, 0))
    return TokenLayout(n_tokens=len(enc["input_ids"]), line_ids=line_ids, turn_spans=tuple(spans),
                       turn_ids=tuple(t.turn_id for t in conv.turns))


def kept_share(cache, start: int, end: int) -> float:
    """Share of the token entries of positions [start, end) a cache still holds, averaged
    over layers and KV heads."""
    if end <= start:
        return float("nan")
    shares = []
    for layer in cache.layers:
        inside = layer.valid & (layer.positions >= start) & (layer.positions < end)
        shares.append(inside.sum().item() / ((end - start) * layer.valid.shape[0]))
    return float(sum(shares) / len(shares))
