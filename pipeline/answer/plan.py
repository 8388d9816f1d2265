"""A question's plan: the episode cache(s) it reads and its top-up, the one step that the
library's `Answerer` (`jobs.answer`, the evaluation) and the Serve router both take.

Manifest, embed, route, top-up: the conversation's manifest is read once and kept with its
route index (`lookup.route_index`) and what embeds its questions and counts their tokens
(`QuestionTools`, made and checked when the manifest is read); the question is embedded, routed
(`lookup.route_records`) and topped up from the conversation's turn index (`topup.TopUps`,
each index read once). A kept manifest is re-read when its object has changed, checked at most
every `manifest_ttl_s` (never, by default: the library's answerer reads a manifest once).

A service runs for months over a corpus larger than its memory, so the kept manifests are a
byte-bounded LRU (`manifest_cache_bytes`, `CacheLRU`): an evicted conversation is read again
at its next question. A kept manifest's embeddings are numpy arrays, one copy (the records'
`centroid` and `window_embeddings` are read-only views of the route index's rows): as Python
float lists a long conversation's windows took about a megabyte, 3.5 times what is kept. Two
first questions about one conversation read its manifest once: the second waits for the first
one's read.

The plan trusts its question: the limits were checked at the entry that took it
(`AnswerLimits.checked`: `jobs.answer`'s arguments, the server's request body, `Answerer.answer`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipeline.answer.lookup import load_manifest, route_index, route_records
from pipeline.answer.lru import CacheLRU
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


# the router's kept manifests: about a thousand long conversations (~250 KiB each kept)
DEFAULT_MANIFEST_CACHE_BYTES = 256 * 2**20


@dataclass
class KnownConversation:
    """A conversation's manifest as read, with what its questions are planned with."""
    records: list[ManifestRecord]  # embeddings as views of `index` (`compact_records`)
    index: RouteIndex
    tools: QuestionTools
    stamp: tuple[int, float] | None  # (size, modified) of the manifest object; None: not kept
    checked: float  # time.monotonic() of the last check against the store
    planned: bool = False  # a question was planned over it
    nbytes: int = 0  # what it holds in memory, about (`kept_bytes`): its size in the LRU


def compact_records(records: list[ManifestRecord]) -> tuple[list[ManifestRecord], RouteIndex]:
    """The records and their route index, each record's `centroid` and `window_embeddings`
    (None stays None) a read-only view of the index's rows: one numpy copy of the embeddings
    instead of the float lists the manifest is read as (unit norm, float64: the index's)."""
    index = route_index(records)
    for array in (index.centroids, index.windows, index.window_episode):
        array.flags.writeable = False
    kept, start = [], 0
    for e, record in enumerate(records):
        windows = None
        if index.has_windows:
            n = len(record.window_embeddings)
            windows, start = index.windows[start:start + n], start + n
        kept.append(dataclasses.replace(record, centroid=index.centroids[e],
                                        window_embeddings=windows))
    return kept, index


def _object_bytes(value: object) -> int:
    """Bytes of a manifest field's value, about: an array's own (a view's header only), a
    list's items with the list."""
    if isinstance(value, (list, tuple)):
        return sys.getsizeof(value) + sum(_object_bytes(v) for v in value)
    return sys.getsizeof(value)


def kept_bytes(records: list[ManifestRecord], index: RouteIndex) -> int:
    """What a kept manifest holds in memory, about: the route index's arrays and each record's
    fields (the embeddings in it are views of the index)."""
    total = sum(sys.getsizeof(a) for a in (index.centroids, index.windows, index.window_episode))
    for record in records:
        total += sys.getsizeof(record) + sys.getsizeof(record.__dict__)
        total += sum(_object_bytes(getattr(record, f.name)) for f in dataclasses.fields(record))
    return total


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
    manifest cache of the answer path) under `manifest_cache_bytes`, least recently used
    evicted first. `tools(records)` gives what embeds and counts for a conversation, or raises
    (`ModelMismatchError`) to refuse it: a refused manifest is not kept."""

    def __init__(self, store: Store, tools: Callable[[list[ManifestRecord]], QuestionTools],
                 routing: RoutingConfig = RoutingConfig(), topup: TopUpConfig = TopUpConfig(),
                 manifest_ttl_s: float = math.inf,
                 manifest_cache_bytes: int = DEFAULT_MANIFEST_CACHE_BYTES):
        self.store, self.tools, self.routing = store, tools, routing
        self.manifest_ttl_s = manifest_ttl_s
        self.topups = TopUps(store, topup)
        self._manifests = CacheLRU(manifest_cache_bytes,
                                   sizeof=lambda conv: conv.nbytes)  # of KnownConversation
        self._lock = threading.Lock()

    @property
    def loaded(self) -> int:
        """The conversations whose manifests are kept."""
        return len(self._manifests)

    def manifest_stats(self) -> dict:
        """The kept manifests: entries, bytes, max_bytes, hits, misses (reads), evictions."""
        return self._manifests.stats()

    def _stamp(self, conversation_id: str) -> tuple[int, float]:
        """The manifest object's (size, modified); `ConversationNotFound` if it is gone."""
        try:
            info = self.store.info(manifest_key(conversation_id))
        except ObjectNotFound:
            self._manifests.discard(conversation_id)
            load_manifest(self.store, conversation_id)  # raises ConversationNotFound
            raise
        return info.size, info.modified

    def _read(self, conversation_id: str) -> KnownConversation:
        """The manifest read, its tools made (or the conversation refused), kept compact."""
        stamp = None if math.isinf(self.manifest_ttl_s) else self._stamp(conversation_id)
        read = load_manifest(self.store, conversation_id)
        tools = self.tools(read)
        records, index = compact_records(read)
        return KnownConversation(records, index, tools, stamp, time.monotonic(),
                                 nbytes=kept_bytes(records, index))

    def conversation(self, conversation_id: str) -> KnownConversation:
        """Blocking: the kept manifest, read (and its tools made) on first use, after an
        eviction, and again when its object changed; `ConversationNotFound` if it was never
        built. Concurrent first uses read it once (the others wait for that read)."""
        check_safe_id(conversation_id)
        while True:
            known, kept = self._manifests.get_or_load(conversation_id,
                                                      lambda: self._read(conversation_id))
            now = time.monotonic()
            if not kept or now - known.checked < self.manifest_ttl_s:
                return known
            if known.stamp == self._stamp(conversation_id):
                known.checked = now
                return known
            self._manifests.discard(conversation_id, known)  # changed: read again, once

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
