"""The decoder deployment: the model and a byte-bounded LRU of episodic caches fetched from the
store (checksum verified; the previous turn's cache always stays resident; concurrent requests
for one cache fetch it once), and a `DecodeBatcher` that decodes the requests in flight together
(continuous batching, `serving.batcher`). It answers the router with plain dicts: an error is
{"error": {"status", "message"}}, classified here, never an exception across the handle."""

import asyncio
import logging
import os
import time
from typing import AsyncIterator

from ray import serve

from serving.errors import classify

log = logging.getLogger("epicache.serve")


def _decoder_error(e: BaseException) -> dict:
    status, message = classify(e)
    if status == 500:
        log.exception("decoder error")
    return {"error": {"status": status, "message": message}}


@serve.deployment(name="EpiCacheDecoder")
class Decoder:
    """Holds the model and the resident caches; fetches concurrently and decodes the requests in
    flight in one batch (each from its own view of its cache: a resident cache is never written)."""

    def __init__(self, store: str, s3_endpoint: str | None, model: str, cache_bytes: int,
                 torch_threads: int | None = None, max_batch: int = 8,
                 max_batch_tokens: int = 32768):
        import torch

        from pipeline import models
        from pipeline.answer import CacheLRU
        from pipeline.store import open_store

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.store = open_store(store, endpoint_url=s3_endpoint, create=False)
        self.model_name = model
        self.lm = models.load_llm(model, self.device)
        self.caches = CacheLRU(cache_bytes)
        self.fetched_bytes = 0
        from serving.batcher import DecodeBatcher

        self.batcher = DecodeBatcher(self.lm, max_batch, max_batch_tokens)

    def _cache(self, row: dict):
        from pipeline.answer import check_models, fetch_cache

        check_models([row], self.model_name, None)

        def load():
            cache = fetch_cache(self.store, row, self.lm.model.dtype, self.device)
            self.fetched_bytes += int(row.get("object_bytes") or 0)
            return cache

        t = time.perf_counter()
        cache, hit = self.caches.get_or_load((row["object_key"], row["sha256"]), load)
        return cache, hit, (time.perf_counter() - t) * 1000

    async def answer(self, row: dict, question: str, max_new_tokens: int,
                     temperature: float) -> dict:
        """{"answer", "tokens", "finish_reason", "cache_hit", "fetch_ms", "decode_ms",
        "queue_ms"} or {"error": {"status", "message"}}."""
        try:
            cache, hit, fetch_ms = await asyncio.to_thread(self._cache, row)
            job = self.batcher.submit(cache, question, max_new_tokens, temperature)
        except Exception as e:
            return _decoder_error(e)
        try:
            decoded = await asyncio.wrap_future(job.future)
        except Exception as e:
            return _decoder_error(e)
        finally:
            job.cancel()  # no-op once done; a request the router cancelled leaves the batch
        return {"answer": decoded.text, "tokens": decoded.tokens,
                "finish_reason": decoded.finish_reason, "cache_hit": hit,
                "fetch_ms": round(fetch_ms, 3), "decode_ms": round(job.decode_ms, 3),
                "queue_ms": round(job.queue_ms, 3)}

    async def stream(self, row: dict, question: str, max_new_tokens: int,
                     temperature: float) -> AsyncIterator[dict]:
        """First {"cache_hit", "fetch_ms"} (or {"error": ...}), then {"text": piece}s, then
        {"done": {"tokens", "finish_reason", "decode_ms", "queue_ms"}} (or {"error": ...})."""
        from transformers import AsyncTextIteratorStreamer

        from pipeline.answer import AnswerPieces

        try:
            cache, hit, fetch_ms = await asyncio.to_thread(self._cache, row)
        except Exception as e:
            yield _decoder_error(e)
            return
        yield {"cache_hit": hit, "fetch_ms": round(fetch_ms, 3)}
        streamer = AsyncTextIteratorStreamer(self.lm.tokenizer, skip_prompt=True,
                                             skip_special_tokens=True)
        pieces = AnswerPieces()
        try:
            job = self.batcher.submit(cache, question, max_new_tokens, temperature, streamer)
        except Exception as e:
            yield _decoder_error(e)
            return
        try:
            async for text in streamer:  # ends when the job ends, answered or failed
                piece = pieces.feed(text)
                if piece:
                    yield {"text": piece}
            decoded = await asyncio.wrap_future(job.future)
        except Exception as e:
            yield _decoder_error(e)
            return
        finally:
            job.cancel()  # no-op once done; a client that went away leaves the batch
        yield {"done": {"tokens": decoded.tokens, "finish_reason": decoded.finish_reason,
                        "decode_ms": round(job.decode_ms, 3), "queue_ms": round(job.queue_ms, 3)}}

    def stats(self) -> dict:
        return {"model": self.model_name, "device": self.device, "pid": os.getpid(),
                "fetched_bytes": self.fetched_bytes, **self.caches.stats(),
                "batch": self.batcher.stats()}
