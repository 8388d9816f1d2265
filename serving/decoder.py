"""The decoder deployment: the model and a byte-bounded LRU of episodic caches fetched from the
store (checksum verified; the previous turn's cache always stays resident; concurrent requests
for one cache fetch it once). It answers the router with plain dicts: an error is
{"error": {"status", "message"}}, classified here, never an exception across the handle."""

import logging
import threading
import time
from typing import Iterator

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
    """Holds the model and the resident caches; decodes one answer at a time per replica
    (a loaded cache is extended in place while decoding), fetching concurrently."""

    def __init__(self, store: str, s3_endpoint: str | None, model: str, cache_bytes: int,
                 torch_threads: int | None = None):
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
        self.decode_lock = threading.Lock()
        self.fetched_bytes = 0

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

    def answer(self, row: dict, question: str, max_new_tokens: int, temperature: float) -> dict:
        """{"answer", "tokens", "finish_reason", "cache_hit", "fetch_ms", "decode_ms"} or
        {"error": {"status", "message"}}."""
        from pipeline.answer import decode_answer

        try:
            cache, hit, fetch_ms = self._cache(row)
            t = time.perf_counter()
            with self.decode_lock:
                t_start = time.perf_counter()
                decoded = decode_answer(self.lm, cache, question, max_new_tokens, temperature)
            done = time.perf_counter()
        except Exception as e:
            return _decoder_error(e)
        return {"answer": decoded.text, "tokens": decoded.tokens,
                "finish_reason": decoded.finish_reason, "cache_hit": hit,
                "fetch_ms": round(fetch_ms, 3), "decode_ms": round((done - t_start) * 1000, 3),
                "queue_ms": round((t_start - t) * 1000, 3)}

    def stream(self, row: dict, question: str, max_new_tokens: int,
               temperature: float) -> Iterator[dict]:
        """First {"cache_hit", "fetch_ms"} (or {"error": ...}), then {"text": piece}s, then
        {"done": {"tokens", "finish_reason", "decode_ms"}} (or {"error": ...})."""
        from pipeline.answer import stream_answer

        try:
            cache, hit, fetch_ms = self._cache(row)
        except Exception as e:
            yield _decoder_error(e)
            return
        yield {"cache_hit": hit, "fetch_ms": round(fetch_ms, 3)}
        info: dict = {}
        t = time.perf_counter()
        try:
            for piece in stream_answer(self.lm, cache, question, max_new_tokens, temperature,
                                       lock=self.decode_lock, info=info):
                yield {"text": piece}
        except Exception as e:
            yield _decoder_error(e)
            return
        yield {"done": {**info, "decode_ms": round((time.perf_counter() - t) * 1000, 3)}}

    def stats(self) -> dict:
        return {"model": self.model_name, "device": self.device,
                "fetched_bytes": self.fetched_bytes, **self.caches.stats()}
