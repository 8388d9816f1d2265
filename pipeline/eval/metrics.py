"""Quality measures of a cache (see the brief, "How quality is measured").

- Evidence recall: after the cache, the line prefix `<speaker> said, "<first k words>` of an
  evidence turn; the mean NLL of the next (up to 32) tokens of that turn. Retention normalises
  it between no history (0%) and the full cache (100%).
- Answer NLL: teacher-forced NLL of the gold answer after the question prompt.
- F1: generated answer vs gold, LoCoMo normalisation (lower case, no punctuation or articles).
"""

from __future__ import annotations

import re
import string
from collections import Counter

import torch

from pipeline.corpus.schema import Question, Turn
from pipeline.kv.attention import Packing
from pipeline.kv.cache import EpisodicCache

TEMPORAL_CATEGORY = 2
ADVERSARIAL_CATEGORY = 5
TEMPORAL_SUFFIX = " Use DATE of CONVERSATION to answer with an approximate date."


@torch.inference_mode()
def continuation_nll(model: torch.nn.Module, cache: EpisodicCache, prefix: torch.Tensor,
                     target: torch.Tensor) -> float:
    """Mean NLL of `target` ([T] ids) after `prefix` ([P] ids, P >= 1), read from `cache`
    (left unchanged)."""
    if prefix.numel() == 0 or target.numel() == 0:
        raise ValueError("continuation_nll needs a non-empty prefix and target")
    device = next(model.parameters()).device
    ids = torch.cat([prefix, target]).to(device)
    seen = cache.next_position
    with cache.scratch():
        logits = model(input_ids=ids[None], past_key_values=cache, use_cache=True,
                       position_ids=torch.arange(seen, seen + ids.shape[0], device=device)[None],
                       logits_to_keep=target.shape[0] + 1).logits[0]
    # predicts target[0], ..., target[-1]
    log_probs = torch.log_softmax(logits[:-1].float(), dim=-1)
    return float(-log_probs.gather(1, target.to(device)[:, None]).mean())


Pair = tuple[torch.Tensor, torch.Tensor]  # (prefix ids, target ids)


@torch.inference_mode()
def continuation_nlls(model: torch.nn.Module, cache: EpisodicCache, pairs: list[Pair],
                      pack_tokens: int = 1024) -> list[float]:
    """`continuation_nll` of every (prefix, target) pair, several pairs per forward: the pairs
    are packed into one sequence, each its own segment (block-diagonal causal mask) with
    positions from the cache's next position, so each reads the cache exactly as alone. A pack
    holds about `pack_tokens` new tokens (a longer pair goes alone)."""
    return [nll for group in headed_continuation_nlls(model, cache, [(None, [p]) for p in pairs],
                                                      pack_tokens) for nll in group]


@torch.inference_mode()
def headed_continuation_nlls(model: torch.nn.Module, cache: EpisodicCache,
                             groups: list[tuple[torch.Tensor | None, list[Pair]]],
                             pack_tokens: int = 1024) -> list[list[float]]:
    """Per group (head ids or None, pairs): each pair's `continuation_nll` read after the
    cache and then the group's head (a question's top-up), as if the head began its prefix.
    The head is in the forward once, each pair its own segment that also sees the head whole
    (`Packing.parents`), at the positions it would have after it; groups are packed about
    `pack_tokens` new tokens a forward (a longer group goes alone)."""
    if any(p.numel() == 0 or t.numel() == 0 for _, pairs in groups for p, t in pairs):
        raise ValueError("continuation_nlls needs non-empty prefixes and targets")
    device = next(model.parameters()).device
    seen = cache.next_position
    packs: list[list[int]] = []
    size = 0
    for g, (head, pairs) in enumerate(groups):
        n = (0 if head is None else head.numel()) + sum(p.numel() + t.numel() for p, t in pairs)
        if not packs or size + n > pack_tokens:
            packs.append([])
            size = 0
        packs[-1].append(g)
        size += n
    nlls: list[list[float]] = [[float("nan")] * len(pairs) for _, pairs in groups]
    for pack in packs:
        ids, segments, parents, offsets, rows = [], [], [], [], []
        start = 0

        def add(tokens: torch.Tensor, parent: int, first: int) -> None:
            ids.append(tokens)
            segments.append(torch.full((tokens.numel(),), len(segments)))
            parents.append(torch.full((tokens.numel(),), parent))
            offsets.append(torch.arange(first, first + tokens.numel()))

        for g in pack:
            head, pairs = groups[g]
            parent, after = -1, 0
            if head is not None and head.numel():
                parent, after = len(segments), head.numel()
                add(head, -1, 0)
                start += after
            for j, (prefix, target) in enumerate(pairs):
                add(torch.cat([prefix, target]), parent, after)
                rows.append((g, j, start + prefix.numel() - 1, start + prefix.numel() +
                             target.numel() - 1, target))
                start += prefix.numel() + target.numel()
        packing = Packing(torch.cat(segments).to(device), torch.cat(parents).to(device),
                          torch.cat(offsets).to(device))
        with cache.scratch(), cache.packed(packing):
            logits = model(input_ids=torch.cat(ids).to(device)[None], past_key_values=cache,
                           use_cache=True, position_ids=(seen + packing.offsets)[None]).logits[0]
        for g, j, first, last, target in rows:
            # the logits at the last prefix token .. the next-to-last target token predict it
            log_probs = torch.log_softmax(logits[first:last].float(), dim=-1)
            nlls[g][j] = float(-log_probs.gather(1, target.to(device)[:, None]).mean())
    return nlls


def evidence_probe(turn: Turn, max_words: int = 4) -> tuple[str, str]:
    """(line prefix, continuation) of an evidence turn: k = min(max_words, a third of the words)."""
    words = turn.text.split()
    k = max(1, min(max_words, len(words) // 3))
    return f'\n{turn.speaker} said, "{" ".join(words[:k])}', " " + " ".join(words[k:])


def question_text(q: Question) -> str:
    return q.question + (TEMPORAL_SUFFIX if q.category == TEMPORAL_CATEGORY else "")


def normalize_answer(text: str) -> str:
    """LoCoMo / SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = str(text).lower().replace(",", "")
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the|and)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if not pred or not ref or common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def retention(nll_none: float, nll_method: float, nll_full: float) -> float:
    """(NLL_none - NLL_method) / (NLL_none - NLL_full): 1 = as good as the full cache,
    0 = as good as no history. NaN when the full cache is no better than no history."""
    gap = nll_none - nll_full
    return (nll_none - nll_method) / gap if gap > 0 else float("nan")
