"""Answering a question from an episodic cache (stage 7): embed, route, load, decode.

The question goes to the episode whose centroid is nearest (cosine); that episode's cache is
fetched, checksum-verified and kept resident, so a follow-up question routed to the same
episode decodes at once. Nothing of the history is prefilled: only the question is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline import cache_io, models, prompts
from pipeline.cache import EpisodicCache
from pipeline.corpus import check_safe_id
from pipeline.episodes import route
from pipeline.manifest import read_manifest
from pipeline.store import Store


class ConversationNotFound(LookupError):
    pass


class ModelMismatchError(ValueError):
    pass


@dataclass
class AnswerResult:
    conversation_id: str
    question: str
    answer: str
    episode: int
    similarity: float
    cache_hit: bool
    timings_ms: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@torch.inference_mode()
def generate_from_cache(lm: models.LoadedModel, cache: EpisodicCache, question_ids: torch.Tensor,
                        max_new_tokens: int = 32, temperature: float = 0.0) -> torch.Tensor:
    """Generated token ids after `question_ids`, decoding from `cache` (left unchanged)."""
    tokenizer = lm.tokenizer
    # generate() expects ids for the cached history too; it only feeds the uncached tail.
    filler = torch.full((cache.tokens_seen,), tokenizer.pad_token_id or 0, dtype=torch.long)
    input_ids = torch.cat([filler, question_ids])[None].to(lm.model.device)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else \
        {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    with cache.scratch():
        out = lm.model.generate(input_ids, past_key_values=cache, max_new_tokens=max_new_tokens,
                                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                                **sampling)
    return out[0, input_ids.shape[1]:]


class Answerer:
    """Answers questions about built conversations; keeps the last episode's cache resident."""

    def __init__(self, store: Store, model: str | None = None, encoder: str | None = None,
                 device: str = "cpu"):
        self.store, self.device = store, device
        self.model_name, self.encoder_name = model, encoder
        self._manifests: dict[str, list[dict]] = {}
        self._resident: tuple[str, str, EpisodicCache] | None = None  # (object key, sha, cache)

    def manifest(self, conversation_id: str) -> list[dict]:
        check_safe_id(conversation_id)
        if conversation_id not in self._manifests:
            rows = read_manifest(self.store, conversation_id)
            if not rows:
                raise ConversationNotFound(f"conversation {conversation_id!r} has no manifest in "
                                           f"store {self.store.uri} (not built yet?)")
            self._manifests[conversation_id] = rows
        return self._manifests[conversation_id]

    def _models(self, row: dict) -> tuple[models.LoadedModel, object]:
        for wanted, built, what in ((self.model_name, row["model_id"], "model"),
                                    (self.encoder_name, row["encoder_id"], "encoder")):
            if wanted is not None and wanted != built:
                raise ModelMismatchError(f"conversation {row['conversation_id']!r} was built with "
                                         f"{what} {built!r}, not {wanted!r}")
        return (models.load_llm(row["model_id"], self.device),
                models.load_encoder(row["encoder_id"], self.device))

    def load_cache(self, row: dict) -> tuple[EpisodicCache, bool]:
        """The episode's cache, from residency (True) or fetched and verified (False)."""
        key = row["object_key"]
        if self._resident is not None and self._resident[:2] == (key, row["sha256"]):
            return self._resident[2], True
        data = self.store.get(key)
        lm = models.load_llm(row["model_id"], self.device)
        cache, _ = cache_io.deserialize(data, row["sha256"], key, dtype=lm.model.dtype,
                                        device=self.device)
        self._resident = (key, row["sha256"], cache)
        return cache, False

    def answer(self, conversation_id: str, question: str, max_new_tokens: int = 32,
               temperature: float = 0.0) -> AnswerResult:
        if not question or not question.strip():
            raise ValueError("the question is empty")
        rows = self.manifest(conversation_id)
        lm, encoder = self._models(rows[0])
        timings = {}
        t = time.perf_counter()
        q_emb = encoder.encode([question], normalize_embeddings=True, show_progress_bar=False)[0]
        timings["embed"] = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        index, similarity = route(q_emb, np.stack([np.asarray(r["centroid"]) for r in rows]))
        row = rows[index]
        timings["route"] = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        cache, hit = self.load_cache(row)
        timings["load"] = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        ids = generate_from_cache(lm, cache, prompts.question_ids(lm.tokenizer, question),
                                  max_new_tokens, temperature)
        text = lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
        timings["decode"] = (time.perf_counter() - t) * 1000
        return AnswerResult(conversation_id, question, text, int(row["episode"]), similarity,
                            hit, {k: round(v, 2) for k, v in timings.items()})
