"""A question's plan: the episode cache(s) it reads and its top-up, the one step that the
library's `Answerer` (`jobs.answer`, the evaluation) and the Serve router both take.

Manifest, embed, route, top-up: the conversation's manifest is read once and kept with its
route index (`lookup.route_index`) and what embeds its questions and counts their tokens
(`QuestionTools`, made and checked when the manifest is read); the question is embedded, routed
(`lookup.route_records`) and topped up from the conversation's turn index (`topup.TopUps`,
each index read once). A kept manifest is re-read when its object has changed, checked at most
every `manifest_ttl_s` (never, by default: the library's answerer reads a manifest once).

The plan trusts its question: the limits were checked at the entry that took it
(`AnswerLimits.checked`: `jobs.answer`'s arguments, the server's request body, `Answerer.answer`).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipeline.answer.lookup import load_manifest, route_index, route_records
from pipeline.answer.topup import TopUp, TopUps
from pipeline.config import RoutingConfig, TopUpConfig
from pipeline.corpus.schema import check_safe_id
from pipeline.routers import RouteIndex
from pipeline.store.backends.base import ObjectNotFound, Store, manifest_key
from pipeline.store.catalogue.manifest import ManifestRecord


@dataclass(frozen=True)
class QuestionTools:
    """What plans a conversation's questions: its encoder (`embed`: a unit-norm embedding in the
    space of its centroids) and its model's token count (`count_tokens`, the top-up's budget)."""
    embed: Callable[[str], np.ndarray]
    count_tokens: Callable[[str], int]


@dataclass
class KnownConversation:
    """A conversation's manifest as read, with what its questions are planned with."""
    records: list[ManifestRecord]
    index: RouteIndex
    tools: QuestionTools
    stamp: tuple[int, float] | None  # (size, modified) of the manifest object; None: not kept
    checked: float  # time.monotonic() of the last check against the store
    planned: bool = False  # a question was planned over it


@dataclass(frozen=True)
class QuestionPlan:
    """What a question reads: `read`, the manifest records of its episode (or the two read
    together when the router is unsure), its best route score, and its top-up; with the
    conversation's records, the question's embedding, timings (ms: manifest, embed, route,
    topup) and whether it is the first question planned over this manifest as read."""
    records: list[ManifestRecord]
    read: list[ManifestRecord]
    similarity: float
    embedding: np.ndarray
    topup: TopUp
    timings_ms: dict[str, float]
    first: bool


class QuestionPlanner:
    """Plans questions over the conversations of `store`, keeping their manifests (the one
    manifest cache of the answer path). `tools(records)` gives what embeds and counts for a
    conversation, or raises (`ModelMismatchError`) to refuse it: a refused manifest is not
    kept."""

    def __init__(self, store: Store, tools: Callable[[list[ManifestRecord]], QuestionTools],
                 routing: RoutingConfig = RoutingConfig(), topup: TopUpConfig = TopUpConfig(),
                 manifest_ttl_s: float = math.inf):
        self.store, self.tools, self.routing = store, tools, routing
        self.manifest_ttl_s = manifest_ttl_s
        self.topups = TopUps(store, topup)
        self._manifests: dict[str, KnownConversation] = {}
        self._lock = threading.Lock()

    @property
    def loaded(self) -> int:
        """The conversations whose manifests are kept."""
        return len(self._manifests)

    def _stamp(self, conversation_id: str) -> tuple[int, float]:
        """The manifest object's (size, modified); `ConversationNotFound` if it is gone."""
        try:
            info = self.store.info(manifest_key(conversation_id))
        except ObjectNotFound:
            self._manifests.pop(conversation_id, None)
            load_manifest(self.store, conversation_id)  # raises ConversationNotFound
            raise
        return info.size, info.modified

    def conversation(self, conversation_id: str) -> KnownConversation:
        """Blocking: the kept manifest, read (and its tools made) on first use and again when
        its object changed; `ConversationNotFound` if it was never built."""
        check_safe_id(conversation_id)
        now = time.monotonic()
        known = self._manifests.get(conversation_id)
        if known is not None and now - known.checked < self.manifest_ttl_s:
            return known
        stamp = None if math.isinf(self.manifest_ttl_s) else self._stamp(conversation_id)
        if known is not None and known.stamp == stamp:
            known.checked = now
            return known
        records = load_manifest(self.store, conversation_id)
        conv = KnownConversation(records, route_index(records), self.tools(records), stamp, now)
        self._manifests[conversation_id] = conv
        return conv

    def plan(self, conversation_id: str, question: str) -> QuestionPlan:
        """Blocking: the question's reads and top-up (its text counted with the conversation's
        tools). A turn index that cannot be used is the top-up's `unavailable`, never an
        error; the manifest's errors are raised."""
        t0 = time.perf_counter()
        conv = self.conversation(conversation_id)
        t1 = time.perf_counter()
        embedding = conv.tools.embed(question)
        t2 = time.perf_counter()
        read, similarity = route_records(embedding, conv.records, self.routing, conv.index)
        t3 = time.perf_counter()
        topup = self.topups.for_question(conv.records, read, embedding, conv.tools.count_tokens)
        t4 = time.perf_counter()
        with self._lock:
            first, conv.planned = not conv.planned, True
        timings = {"manifest": t1 - t0, "embed": t2 - t1, "route": t3 - t2, "topup": t4 - t3}
        return QuestionPlan(conv.records, read, similarity, embedding, topup,
                            {k: v * 1000 for k, v in timings.items()}, first)
