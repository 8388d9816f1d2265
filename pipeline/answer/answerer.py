"""Answering questions about built conversations in one process: embed, route, load, decode.

The Serve application (`pipeline.serve`) splits the same steps over two deployments: a router
embeds and routes, a decoder fetches into a byte-bounded LRU and decodes the requests in flight
together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pipeline.answer.decode import decode_answer
from pipeline.answer.fetch import fetch_cache, resident_read
from pipeline.answer.lookup import check_models, embed_question, load_manifest, route_records
from pipeline.answer.lru import CacheLRU
from pipeline.answer.topup import TopUps
from pipeline.config import RoutingConfig, TopUpConfig
from pipeline.config.limits import DEFAULT_LIMITS, AnswerLimits
from pipeline.kv import models
from pipeline.kv.cache import EpisodicCache
from pipeline.store.backends.base import Store
from pipeline.store.catalogue.manifest import ManifestRecord
from pipeline.store.objects.disk_tier import DiskTier


@dataclass
class AnswerResult:
    conversation_id: str
    question: str
    answer: str
    episode: int
    similarity: float
    cache_hit: bool
    timings_ms: dict[str, float] = field(default_factory=dict)
    episodes: list[int] = field(default_factory=list)  # read (two when the router was unsure)
    # the question-time top-up (`TopUp.as_dict`): the turns prefilled after the cache, or why none
    topup: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class Answerer:
    """Answers questions about built conversations; keeps the last episode's cache resident
    (and more, up to `resident_bytes`). A question or parameter over `limits` (the server's
    limits too) is a `LimitError` before any model is loaded or any text tokenised."""

    def __init__(self, store: Store, model: str | None = None, encoder: str | None = None,
                 device: str = "cpu", resident_bytes: int = 0, disk: DiskTier | None = None,
                 limits: AnswerLimits = DEFAULT_LIMITS, routing: RoutingConfig = RoutingConfig(),
                 topup: TopUpConfig = TopUpConfig()):
        self.store, self.device, self.disk, self.limits = store, device, disk, limits
        self.routing = routing
        self.topups = TopUps(store, topup)
        self.model_name, self.encoder_name = model, encoder
        self._manifests: dict[str, list[ManifestRecord]] = {}
        self.caches = CacheLRU(resident_bytes)

    def manifest(self, conversation_id: str) -> list[ManifestRecord]:
        if conversation_id not in self._manifests:
            self._manifests[conversation_id] = load_manifest(self.store, conversation_id)
        return self._manifests[conversation_id]

    def _models(self, records: list[ManifestRecord]) -> tuple[models.LoadedModel, object]:
        """The model and encoder the conversation was built with, refused (before decoding)
        unless their files are the ones it was built with (`check_models`)."""
        first = records[0]
        check_models(records, self.model_name, self.encoder_name)  # names; no fingerprint
        lm = models.load_llm(first.model_id, self.device)
        encoder = models.load_encoder(first.encoder_id, self.device)
        check_models(records, None, None, model_fingerprint=lm.fingerprint,
                     encoder_fingerprint=models.encoder_fingerprint(first.encoder_id))
        return lm, encoder

    def load_caches(self, records: list[ManifestRecord]) -> tuple[EpisodicCache, bool]:
        """The cache a question reads: its episode's, or two episodes' joined (`resident_read`);
        refused unless the model loaded for them has the files they were built with."""
        refs = tuple(r.ref for r in records)
        lm = models.load_llm(refs[0].model_id, self.device)
        check_models(refs, None, None, model_fingerprint=lm.fingerprint)
        return resident_read(self.caches, refs, lambda ref: fetch_cache(
            self.store, ref, lm.model.dtype, self.device, self.disk))

    def answer(self, conversation_id: str, question: str, max_new_tokens: int = 32,
               temperature: float = 0.0) -> AnswerResult:
        self.limits.check_question(question)
        max_new_tokens, temperature = self.limits.check_sampling(max_new_tokens, temperature)
        records = self.manifest(conversation_id)
        lm, encoder = self._models(records)
        timings = {}
        t = time.perf_counter()
        q_emb = embed_question(encoder, question)
        timings["embed"] = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        read, similarity = route_records(q_emb, records, self.routing)
        timings["route"] = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        cache, hit = self.load_caches(read)
        timings["load"] = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        topup = self.topups.for_question(records, read, q_emb, lm.count_tokens)
        timings["topup"] = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        decoded = decode_answer(lm, cache, question, max_new_tokens, temperature, self.limits,
                                topup.text)
        timings["decode"] = (time.perf_counter() - t) * 1000
        return AnswerResult(conversation_id, question, decoded.text, read[0].episode,
                            similarity, hit, {k: round(v, 2) for k, v in timings.items()},
                            [r.episode for r in read], topup.as_dict())
