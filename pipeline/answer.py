"""Answering a question from an episodic cache (stage 7): embed, route, load, decode.

The question goes to the episode whose centroid is nearest (cosine); that episode's cache is
fetched, checksum-verified and kept resident, so a follow-up question routed to the same
episode decodes at once. Nothing of the history is prefilled: only the question is.

The steps are separate functions so that one process can do them all (`Answerer`, the CLI)
while the Serve application (`serving/`) splits them: a router embeds and routes, a
decoder fetches into a byte-bounded LRU (`CacheLRU`) and decodes the requests in flight
together (`serving.batcher`, whose greedy answers are `decode_answer`'s; its stream is cut into
pieces as `stream_answer`'s, by `AnswerPieces`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch

from pipeline import cache_io, models, prompts
from pipeline.cache import EpisodicCache
from pipeline.corpus import check_safe_id
from pipeline.disk_tier import DiskTier
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


# ---------------------------------------------------------------------------------------------
# Manifest lookup, model check, routing
# ---------------------------------------------------------------------------------------------

def load_manifest(store: Store, conversation_id: str) -> list[dict]:
    """The manifest rows of a conversation; `ConversationNotFound` if it was never built."""
    check_safe_id(conversation_id)
    rows = read_manifest(store, conversation_id)
    if not rows:
        raise ConversationNotFound(f"conversation {conversation_id!r} has no manifest in "
                                   f"store {store.uri} (not built yet?)")
    return rows


def check_models(rows: list[dict], model: str | None, encoder: str | None) -> None:
    """A cache only makes sense with the model that built it, and routing only with the encoder
    whose space the centroids live in: anything else is an error, never a silent answer."""
    for row in rows:
        for wanted, column, what in ((model, "model_id", "model"), (encoder, "encoder_id", "encoder")):
            built = row.get(column) if wanted is not None else None
            if wanted is not None and wanted != built:
                raise ModelMismatchError(f"conversation {row['conversation_id']!r} was built with "
                                         f"{what} {built!r}, not {wanted!r}")


def centroid_matrix(rows: list[dict]) -> np.ndarray:
    """[episodes, dim] centroids of the manifest rows, in row order."""
    return np.stack([np.asarray(r["centroid"], dtype=np.float32) for r in rows])


def embed_question(encoder, question: str) -> np.ndarray:
    """The question's unit-norm embedding in the encoder's space (the centroids' space)."""
    return encoder.encode([question], normalize_embeddings=True, show_progress_bar=False)[0]


def route_question(question_embedding: np.ndarray, rows: list[dict],
                   centroids: np.ndarray | None = None) -> tuple[dict, float]:
    """The manifest row of the episode nearest the question, and its cosine similarity."""
    index, similarity = route(question_embedding,
                              centroid_matrix(rows) if centroids is None else centroids)
    return rows[index], similarity


# ---------------------------------------------------------------------------------------------
# Fetching caches into a byte-bounded LRU
# ---------------------------------------------------------------------------------------------

class Fetched(NamedTuple):
    data: bytes  # the object, verified against the manifest's SHA-256
    parsed: object  # what the fetch's `parse` made of it (None without one)
    from_disk: bool  # read from the local disk tier, not the store


def fetch_object(store: Store, row: dict, disk: DiskTier | None = None,
                 parse: Callable[[bytes], object] | None = None) -> Fetched:
    """An episode's object from the local disk tier if it holds it, else from the store (then
    kept in the tier), with `parse` run on it while its SHA-256 is checked against the manifest
    (`cache_io.read_parsed`). A bad object raises `CacheCorruptError` naming it; a bad disk file
    is fetched again."""
    key, expected = row["object_key"], row["sha256"]

    def from_store() -> tuple[bytes, object]:
        with store.open(key) as f:
            return cache_io.read_parsed(f, expected, key, row.get("object_bytes") or None, parse)

    if disk is None:
        return Fetched(*from_store(), False)
    return Fetched(*disk.load(expected, key, from_store, parse))


def cache_parser(row: dict, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> Callable[[bytes], EpisodicCache]:
    """The `parse` of `fetch_object` that rebuilds an episode's `EpisodicCache`."""
    return lambda data: cache_io.parse(data, row["object_key"], dtype=dtype, device=device)[0]


def fetch_cache(store: Store, row: dict, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", disk: DiskTier | None = None) -> EpisodicCache:
    """An episode's cache (from the disk tier if given and holding it), its object's SHA-256
    checked against the manifest while it is parsed; a bad object raises `CacheCorruptError`
    naming it."""
    return fetch_object(store, row, disk, cache_parser(row, dtype, device)).parsed


def resident_bytes(cache: EpisodicCache) -> int:
    """Bytes a loaded cache holds in memory (padded slots, masks and positions included)."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None), layer.valid,
                  layer.positions):
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total


class CacheLRU:
    """Loaded episodic caches under a byte budget, least recently used evicted first.

    The most recently used entry is never evicted, whatever its size, so the cache of the
    previous turn is always resident (a budget of 0 keeps exactly that one). Concurrent
    requests for the same key load it once: the others wait and count as hits. Thread-safe.
    """

    def __init__(self, max_bytes: int, sizeof: Callable[[object], int] = resident_bytes):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes, self._sizeof = max_bytes, sizeof
        self._entries: OrderedDict[object, tuple[object, int]] = OrderedDict()
        self._loading: dict[object, threading.Event] = {}
        self._lock = threading.Lock()
        self.bytes = self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get_or_load(self, key: object, loader: Callable[[], object]) -> tuple[object, bool]:
        """(value, True) if resident, else (loader(), False) after inserting it."""
        while True:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                    self.hits += 1
                    return entry[0], True
                pending = self._loading.get(key)
                owner = pending is None
                if owner:
                    pending = self._loading[key] = threading.Event()
            if not owner:
                pending.wait()
                continue  # now resident (a hit), or that load failed and this thread tries
            try:
                value = loader()
                size = int(self._sizeof(value))
            except BaseException:
                with self._lock:
                    del self._loading[key]
                pending.set()
                raise
            with self._lock:
                self.misses += 1
                self._entries[key] = (value, size)
                self.bytes += size
                while self.bytes > self.max_bytes and len(self._entries) > 1:
                    _, (_, freed) = self._entries.popitem(last=False)
                    self.bytes -= freed
                    self.evictions += 1
                del self._loading[key]
            pending.set()
            return value, False

    def offer(self, key: object, value: object) -> bool:
        """Insert `value` as the least recently used entry if it fits in the budget without
        evicting anything (a speculative load, e.g. a prefetch); False if it does not fit or
        the key is resident or loading."""
        size = int(self._sizeof(value))
        with self._lock:
            if key in self._entries or key in self._loading or self.bytes + size > self.max_bytes:
                return False
            self._entries[key] = (value, size)
            self._entries.move_to_end(key, last=False)
            self.bytes += size
            return True

    def stats(self) -> dict:
        with self._lock:
            lookups = self.hits + self.misses
            return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                    "hit_rate": round(self.hits / lookups, 4) if lookups else None}


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------

@torch.inference_mode()
def generate_from_cache(lm: models.LoadedModel, cache: EpisodicCache, question_ids: torch.Tensor,
                        max_new_tokens: int = 32, temperature: float = 0.0,
                        streamer=None) -> torch.Tensor:
    """Generated token ids after `question_ids`, decoding from `cache` (left unchanged).
    A transformers `streamer` receives the tokens as they come (its first put is the prompt)."""
    tokenizer = lm.tokenizer
    # generate() expects ids for the cached history too; it only feeds the uncached tail.
    filler = torch.full((cache.next_position,), tokenizer.pad_token_id or 0, dtype=torch.long)
    input_ids = torch.cat([filler, question_ids])[None].to(lm.model.device)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else \
        {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    extra = {"streamer": streamer} if streamer is not None else {}
    with cache.scratch():
        out = lm.model.generate(input_ids, past_key_values=cache, max_new_tokens=max_new_tokens,
                                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                                **sampling, **extra)
    return out[0, input_ids.shape[1]:]


@dataclass
class Decoded:
    text: str
    tokens: int
    finish_reason: str  # "stop" (end of sequence) or "length" (max_new_tokens reached)


def finish_reason(lm: models.LoadedModel, ids: torch.Tensor, max_new_tokens: int) -> str:
    """"stop" if the answer ended with an end-of-sequence token (or early), else "length"."""
    eos = lm.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    if len(ids) >= max_new_tokens and not (len(ids) and int(ids[-1]) in eos):
        return "length"
    return "stop"


def decode_answer(lm: models.LoadedModel, cache: EpisodicCache, question: str,
                  max_new_tokens: int = 32, temperature: float = 0.0) -> Decoded:
    """The answer text to `question` from `cache` (the cache is left as it was)."""
    ids = generate_from_cache(lm, cache, prompts.question_ids(lm.tokenizer, question),
                              max_new_tokens, temperature)
    text = lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
    return Decoded(text, int(len(ids)), finish_reason(lm, ids, max_new_tokens))


class AnswerPieces:
    """Turns a streamer's text into the pieces of an answer that join to `decode_answer`'s
    stripped text: leading whitespace dropped, trailing whitespace held back until more text
    follows it."""

    def __init__(self) -> None:
        self.pending, self.started = "", False

    def feed(self, text: str) -> str:
        """The next piece to send ("" for none yet)."""
        if not self.started:
            text = text.lstrip()
        text = self.pending + text
        body = text.rstrip()
        if body:
            self.started = True
        self.pending = text[len(body):]
        return body


def stream_answer(lm: models.LoadedModel, cache: EpisodicCache, question: str,
                  max_new_tokens: int = 32, temperature: float = 0.0,
                  lock: threading.Lock | None = None, info: dict | None = None) -> Iterator[str]:
    """Yield the answer in pieces as it is generated; the pieces join to `decode_answer`'s text.

    Generation runs in a helper thread (holding `lock`, if given, for its whole duration);
    `info` receives `tokens` and `finish_reason` once the stream ends. An error in generation
    is raised here, after the pieces already yielded.
    """
    from transformers import TextIteratorStreamer

    streamer = TextIteratorStreamer(lm.tokenizer, skip_prompt=True, skip_special_tokens=True)
    outcome: dict = {}

    def run() -> None:
        try:
            with lock if lock is not None else contextlib.nullcontext():
                ids = generate_from_cache(lm, cache, prompts.question_ids(lm.tokenizer, question),
                                          max_new_tokens, temperature, streamer=streamer)
            outcome["ids"] = ids
        except BaseException as e:  # handed to the consuming thread
            outcome["error"] = e
            streamer.end()

    thread = threading.Thread(target=run, name="stream-answer", daemon=True)
    thread.start()
    pieces = AnswerPieces()
    try:
        for text in streamer:
            piece = pieces.feed(text)
            if piece:
                yield piece
    finally:
        thread.join()
    if "error" in outcome:
        raise outcome["error"]
    if info is not None:
        ids = outcome["ids"]
        info.update(tokens=int(len(ids)), finish_reason=finish_reason(lm, ids, max_new_tokens))


# ---------------------------------------------------------------------------------------------
# All in one process
# ---------------------------------------------------------------------------------------------

class Answerer:
    """Answers questions about built conversations; keeps the last episode's cache resident
    (and more, up to `resident_bytes`)."""

    def __init__(self, store: Store, model: str | None = None, encoder: str | None = None,
                 device: str = "cpu", resident_bytes: int = 0, disk: DiskTier | None = None):
        self.store, self.device, self.disk = store, device, disk
        self.model_name, self.encoder_name = model, encoder
        self._manifests: dict[str, list[dict]] = {}
        self.caches = CacheLRU(resident_bytes)

    def manifest(self, conversation_id: str) -> list[dict]:
        if conversation_id not in self._manifests:
            self._manifests[conversation_id] = load_manifest(self.store, conversation_id)
        return self._manifests[conversation_id]

    def _models(self, row: dict) -> tuple[models.LoadedModel, object]:
        check_models([row], self.model_name, self.encoder_name)
        return (models.load_llm(row["model_id"], self.device),
                models.load_encoder(row["encoder_id"], self.device))

    def load_cache(self, row: dict) -> tuple[EpisodicCache, bool]:
        """The episode's cache, from residency (True) or fetched and verified (False)."""
        lm = models.load_llm(row["model_id"], self.device)
        return self.caches.get_or_load(
            (row["object_key"], row["sha256"]),
            lambda: fetch_cache(self.store, row, lm.model.dtype, self.device, self.disk))

    def answer(self, conversation_id: str, question: str, max_new_tokens: int = 32,
               temperature: float = 0.0) -> AnswerResult:
        if not question or not question.strip():
            raise ValueError("the question is empty")
        rows = self.manifest(conversation_id)
        lm, encoder = self._models(rows[0])
        timings = {}
        t = time.perf_counter()
        q_emb = embed_question(encoder, question)
        timings["embed"] = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        row, similarity = route_question(q_emb, rows)
        timings["route"] = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        cache, hit = self.load_cache(row)
        timings["load"] = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        decoded = decode_answer(lm, cache, question, max_new_tokens, temperature)
        timings["decode"] = (time.perf_counter() - t) * 1000
        return AnswerResult(conversation_id, question, decoded.text, int(row["episode"]),
                            similarity, hit, {k: round(v, 2) for k, v in timings.items()})
