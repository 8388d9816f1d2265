"""The decoder deployment: the model and a byte-bounded LRU of episodic caches fetched from the
store (checksum verified beside the parse; the previous turn's cache always stays resident;
concurrent requests for one cache fetch it once), with an optional bounded local-disk
tier under it (a restart or an eviction reads the disk, not the store), a background prefetch
of a conversation's other episodes, and a `DecodeBatcher` that decodes the requests in flight
together (continuous batching, `pipeline.answer.batcher`). It answers the router with plain dicts:
an error is {"error": {"status", "message"}}, classified here, never an exception across the
handle."""

import asyncio
import gc
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import torch
from ray import serve
from ray.serve.exceptions import RayServeException
from transformers import AsyncTextIteratorStreamer

from pipeline.allocator import retain_freed_memory
from pipeline.answer.batcher import DecodeBatcher
from pipeline.answer.decode import AnswerPieces
from pipeline.answer.fetch import resident_read
from pipeline.answer.lookup import check_models
from pipeline.answer.lru import CacheLRU
from pipeline.answer.topup import read_view
from pipeline.kv import models
from pipeline.serve.errors import classify, is_corrupt
from pipeline.serve.settings import ServeSettings
from pipeline.store.backends.uri import open_store
from pipeline.store.objects.cache_read import Verified, read_bytes, read_cache
from pipeline.store.objects.cache_ref import CacheRef
from pipeline.store.objects.disk_tier import DiskTier
from pipeline.telemetry import decoder_metrics

log = logging.getLogger("epicache.serve")


def _decoder_error(e: BaseException, ref: CacheRef | tuple[CacheRef, ...]) -> dict:
    """The error as the router relays it: a damaged cache names its conversation and is
    marked `corrupt` (the router counts such conversations in /healthz)."""
    cid = (ref if isinstance(ref, CacheRef) else ref[0]).conversation_id
    status, message = classify(e, cid)
    if status == 500:
        log.exception("decoder error")
    return {"error": {"status": status, "message": message, "corrupt": is_corrupt(e)}}


def _replica_id() -> str:
    """This replica's Serve id ("local" outside a replica: the class built directly)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:
        return "local"


@serve.deployment(name="EpiCacheDecoder")
class Decoder:
    """Holds the model and the resident caches; fetches concurrently and decodes the requests in
    flight in one batch (each from its own view of its cache: a resident cache is never written)."""

    def __init__(self, settings: ServeSettings, model: str):
        """`model`: the model to serve, `settings.model` resolved (`pipeline.serve.app`)."""
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.store = open_store(settings.store, settings.store_options, create=False)
        self.model_name = model
        self.lm = models.load_llm(model, self.device)
        self.caches = CacheLRU(settings.cache_bytes)
        self.disk = DiskTier(settings.disk_cache, settings.disk_cache_bytes) \
            if settings.disk_cache else None
        workers = settings.prefetch_workers
        self.prefetcher = ThreadPoolExecutor(workers, thread_name_prefix="prefetch") \
            if workers > 0 else None
        self._figures_lock = threading.Lock()
        self.metrics = decoder_metrics()  # pipeline.telemetry: exported through Ray
        self.batcher = DecodeBatcher(self.lm, settings.max_batch, settings.max_batch_tokens,
                                     settings.limits, metrics=self.metrics)
        gc.freeze()  # the model's objects leave the collector: no 100+ ms pauses in a turn
        retain_freed_memory()  # a cold load reuses freed memory instead of faulting pages in
        # which replica answered: the fleet's affinity is seen (and tested) in the answers
        self.replica = _replica_id()
        self.figures = {"fetched_bytes": 0, "store_reads": 0, "disk_reads": 0,
                        "prefetch_requested": 0, "prefetch_skipped": 0, "prefetch_fetched": 0,
                        "prefetch_resident": 0, "prefetch_failed": 0}

    def _count(self, **increments: int) -> None:
        with self._figures_lock:
            for name, n in increments.items():
                self.figures[name] += n

    def _counted(self, read: Verified, reason: str = "request") -> Verified:
        """A verified read (the store's `cache_read`: the disk tier, else the store, then kept
        in the tier), counted; `reason`: request or prefetch."""
        self._count(**({"disk_reads": 1} if read.from_disk else
                       {"store_reads": 1, "fetched_bytes": len(read.data)}))
        self.metrics.object_read(read.from_disk, len(read.data), reason, self.disk is not None)
        return read

    def _load(self, ref: CacheRef, reason: str = "request"):
        """The episode's cache, verified against the manifest beside its parse."""
        return self._counted(read_cache(self.store, ref, self.disk, self.lm.model.dtype,
                                        self.device), reason).cache

    def _check(self, ref: CacheRef) -> None:
        """`ModelMismatchError` (409) unless the episode was built with this model's files."""
        check_models([ref], self.model_name, None, model_fingerprint=self.lm.fingerprint)

    def _cache(self, refs: CacheRef | tuple[CacheRef, ...], hidden=()):
        """The cache a question reads, (cache, hit, ms): its episode's, or two episodes'
        joined (`resident_read`), less the entries of `hidden` spans (`read_view`)."""
        refs = refs if isinstance(refs, tuple) else (refs,)
        for ref in refs:
            self._check(ref)
        t = time.perf_counter()
        cache, hit = resident_read(self.caches, refs, self._load)
        cache = read_view(cache, hidden)
        ms = (time.perf_counter() - t) * 1000
        self.metrics.cache_read(hit, ms, self.caches.bytes)
        return cache, hit, ms

    async def answer(self, ref: CacheRef | tuple[CacheRef, ...], question: str, max_new_tokens: int,
                     temperature: float, topup: str = "", live: str = "",
                     hidden: tuple[tuple[int, int], ...] = ()) -> dict:
        """{"answer", "tokens", "prompt_tokens", "finish_reason", "cache_hit", "replica",
        "fetch_ms", "decode_ms", "queue_ms"} or {"error": {"status", "message"}}; `topup`: the
        question's top-up text (the router's, `pipeline.answer.topup`), read after the cache;
        `live`: the request's live tail as the router rendered it
        (`pipeline.kv.prompts.live_text`), read after the top-up; `hidden`: the token spans
        a top-up read once hides from the cache (`pipeline.answer.topup.read_view`)."""
        try:
            cache, hit, fetch_ms = await asyncio.to_thread(self._cache, ref, hidden)
            job = await asyncio.to_thread(self.batcher.submit, cache, question, max_new_tokens,
                                          temperature, None, topup, live)
        except Exception as e:
            return _decoder_error(e, ref)
        try:
            decoded = await asyncio.wrap_future(job.future)
        except Exception as e:
            return _decoder_error(e, ref)
        finally:
            job.cancel()  # no-op once done; a request the router cancelled leaves the batch
        self.metrics.decoded(job.decode_ms, decoded.tokens)
        return {"answer": decoded.text, "tokens": decoded.tokens,
                "prompt_tokens": decoded.prompt_tokens,
                "finish_reason": decoded.finish_reason, "cache_hit": hit,
                "replica": self.replica, "fetch_ms": round(fetch_ms, 3),
                "decode_ms": round(job.decode_ms, 3), "queue_ms": round(job.queue_ms, 3)}

    async def stream(self, ref: CacheRef | tuple[CacheRef, ...], question: str, max_new_tokens: int,
                     temperature: float, topup: str = "", live: str = "",
                     hidden: tuple[tuple[int, int], ...] = ()) -> AsyncIterator[dict]:
        """First {"cache_hit", "fetch_ms"} (or {"error": ...}: a bad cache or a request over
        the limits is an HTTP status, not a stream), then {"text": piece}s, then
        {"done": {"tokens", "prompt_tokens", "finish_reason", "decode_ms", "queue_ms"}} (or
        {"error": ...}); `topup`, `live` and `hidden` as for `answer`."""
        streamer = AsyncTextIteratorStreamer(self.lm.tokenizer, skip_prompt=True,
                                             skip_special_tokens=True)
        try:
            cache, hit, fetch_ms = await asyncio.to_thread(self._cache, ref, hidden)
            job = await asyncio.to_thread(self.batcher.submit, cache, question, max_new_tokens,
                                          temperature, streamer, topup, live)
        except Exception as e:
            yield _decoder_error(e, ref)
            return
        yield {"cache_hit": hit, "replica": self.replica, "fetch_ms": round(fetch_ms, 3)}
        pieces = AnswerPieces()
        try:
            async for text in streamer:  # ends when the job ends, answered or failed
                piece = pieces.feed(text)
                if piece:
                    yield {"text": piece}
            decoded = await asyncio.wrap_future(job.future)
        except Exception as e:
            yield _decoder_error(e, ref)
            return
        finally:
            job.cancel()  # no-op once done; a client that went away leaves the batch
        self.metrics.decoded(job.decode_ms, decoded.tokens)
        yield {"done": {"tokens": decoded.tokens, "prompt_tokens": decoded.prompt_tokens,
                        "finish_reason": decoded.finish_reason,
                        "decode_ms": round(job.decode_ms, 3), "queue_ms": round(job.queue_ms, 3)}}

    def prefetch(self, refs: list[CacheRef]) -> int:
        """Load these episodes in the background (a follow-up question often routes to another
        episode of the conversation): into the disk tier, and into memory when the LRU has room
        without evicting anything. Returns at once with the number queued; never raises."""
        if self.prefetcher is None:
            return 0
        queued = 0
        for ref in refs:
            try:
                self._check(ref)
                self.prefetcher.submit(self._prefetch_one, ref)
                queued += 1
            except Exception as e:  # noqa: BLE001 - a prefetch is best effort
                log.warning("prefetch of %s not queued: %s", ref.object_key, e)
                self._count(prefetch_failed=1)
        self._count(prefetch_requested=queued)
        return queued

    def _prefetch_one(self, ref: CacheRef) -> None:
        key = (ref.object_key, ref.sha256)
        try:
            if key in self.caches:
                self._count(prefetch_skipped=1)
            elif self.caches.bytes < self.caches.max_bytes:  # room in memory: load and offer
                cache = self._load(ref, "prefetch")
                self._count(prefetch_fetched=1,
                            prefetch_resident=int(self.caches.offer(key, cache)))
                self.metrics.resident(self.caches.bytes)
            elif self.disk is not None and ref.sha256 not in self.disk:  # to disk only
                self._counted(read_bytes(self.store, ref, self.disk), "prefetch")
                self._count(prefetch_fetched=1)
            else:
                self._count(prefetch_skipped=1)
        except Exception as e:  # noqa: BLE001 - logged, never raised: no request waits on it
            log.warning("prefetch of %s failed: %s", ref.object_key, e)
            self._count(prefetch_failed=1)

    @property
    def fetched_bytes(self) -> int:
        return self.figures["fetched_bytes"]

    def stats(self) -> dict:
        with self._figures_lock:
            figures = dict(self.figures)
        return {"model": self.model_name, "model_fingerprint": self.lm.fingerprint,
                "device": self.device, "pid": os.getpid(), "replica": self.replica, **figures,
                **self.caches.stats(), "disk": self.disk.stats() if self.disk else None,
                "batch": self.batcher.stats()}
