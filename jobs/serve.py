"""The Ray Serve decode endpoint: route a question to its episode, fetch that cache, decode.

    python -m jobs.serve --store URI [--host 127.0.0.1] [--port 8000] [--auth-token T] ...
    serve run jobs.serve:app_builder store=URI [decoder_gpus=1 ...]

Two deployments. The *router* (the HTTP ingress, FastAPI) holds the encoder and, per
conversation, the manifest's centroids (read on first use, re-read when the manifest object
changes); it embeds the question and picks the episode. The *decoder* holds the model and a
byte-bounded LRU of episodic caches fetched from the store (checksum verified; the previous
turn's cache always stays resident) and decodes, whole or streamed. The router calls the
decoder through a `DeploymentHandle`, so each scales on its own (`--decoder-replicas`,
`--decoder-autoscale MIN:MAX`, `--decoder-gpus`). The HTTP API is documented in the README
("Serving").
"""

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import sys
import threading
import textwrap
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any, AsyncIterator, Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from pydantic import ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from jobs.cli import make_parser
from jobs.environment import WORKER_ENV

log = logging.getLogger("epicache.serve")

AUTH_ENV = "EPICACHE_SERVE_TOKEN"
APP_NAME = "epicache"


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------

@dataclass
class ServeSettings:
    """Everything the two deployments need; built by the CLI or by `app_builder`."""
    store: str
    s3_endpoint: str | None = None
    model: str | None = None  # None: the model named in the store's manifests
    encoder: str | None = None  # None: the encoder named in the store's manifests
    auth_token: str | None = field(default=None, repr=False)
    router_replicas: int = 1
    router_cpus: float = 0.5
    decoder_replicas: int = 1
    decoder_autoscale: tuple[int, int] | None = None  # (min, max) replicas
    decoder_target_ongoing: float = 2.0  # autoscaling target per decoder replica
    decoder_cpus: float = 1.0
    decoder_gpus: float = 0.0
    decoder_max_ongoing: int = 16
    cache_bytes: int = 2 * 2**30  # the decoder's LRU of loaded caches, per replica
    manifest_ttl_s: float = 5.0  # how long a manifest is trusted before checking the store
    max_question_chars: int = 2000
    max_new_tokens_limit: int = 512
    default_max_new_tokens: int = 32
    torch_threads: int | None = None  # decoder torch threads (default: Ray's assignment)

    def __post_init__(self) -> None:
        if self.decoder_autoscale is not None:
            lo, hi = self.decoder_autoscale
            if not 0 <= lo <= hi or hi < 1:
                raise ValueError(f"decoder autoscale needs 0 <= min <= max, max >= 1; got {lo}:{hi}")
        for name in ("router_replicas", "decoder_replicas", "max_question_chars",
                     "max_new_tokens_limit", "default_max_new_tokens", "decoder_max_ongoing"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.cache_bytes < 0 or self.manifest_ttl_s < 0:
            raise ValueError("cache_bytes and manifest_ttl_s must be >= 0")


# ---------------------------------------------------------------------------------------------
# Errors: every failure is a status and a one-line JSON message, never a traceback
# ---------------------------------------------------------------------------------------------

class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.kind = kind or _KINDS.get(status, "error")


_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "model_mismatch_error",
          422: "invalid_request_error", 500: "internal_error", 503: "cache_unavailable_error"}


def error_body(status: int, message: str, kind: str | None = None) -> dict:
    """OpenAI-style error object, so OpenAI clients show the message."""
    return {"error": {"message": message, "type": kind or _KINDS.get(status, "error"),
                      "code": status}}


def _error_response(status: int, message: str, kind: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(status, message, kind), status_code=status, headers=headers)


def classify(e: BaseException) -> tuple[int, str]:
    """(HTTP status, message) of an error raised while answering."""
    from pipeline.answer import ConversationNotFound, ModelMismatchError
    from pipeline.cache_io import CacheCorruptError
    from pipeline.corpus import UnsafeIdError
    from pipeline.manifest import ManifestError
    from pipeline.store import ObjectNotFound, StoreError

    if isinstance(e, ApiError):
        return e.status, e.message
    if isinstance(e, ConversationNotFound):
        return 404, str(e)
    if isinstance(e, UnsafeIdError):
        return 400, f"invalid conversation id: {e}"
    if isinstance(e, ModelMismatchError):
        return 409, str(e)
    if isinstance(e, CacheCorruptError):
        return 503, f"{e}; not answering from it"
    if isinstance(e, ObjectNotFound):
        return 503, f"the manifest names a cache object that is missing: {e}"
    if isinstance(e, ManifestError):  # the store answers; what it holds for this id is bad
        return 503, f"{e}; not answering from it (jobs.gc --verify lists such faults)"
    if isinstance(e, StoreError):
        return 503, f"store unavailable: {e}"
    return 500, "internal error while answering (the server log has the details)"


app = FastAPI(title="EpiCache decode endpoint", docs_url=None, redoc_url=None)


@app.exception_handler(ApiError)
async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    return _error_response(e.status, e.message, e.kind)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    return _error_response(e.status_code, str(e.detail))


@app.exception_handler(RequestValidationError)
async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
    return _error_response(422, _describe(list(e.errors())))


@app.exception_handler(Exception)
async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return _error_response(*classify(e))


# ---------------------------------------------------------------------------------------------
# Request bodies
# ---------------------------------------------------------------------------------------------

class AnswerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    question: StrictStr
    max_new_tokens: StrictInt | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields this server ignores
    conversation_id: StrictStr
    messages: list[ChatMessage] = Field(min_length=1)
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    stream: StrictBool = False
    n: StrictInt | None = None


def _describe(errors: list[dict]) -> str:
    parts = []
    for err in errors[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"field '{where}': {err.get('msg', 'invalid')}")
    return "; ".join(parts)


async def parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The JSON body as `model`: 400 if it is not JSON, 422 naming the fields if it does not fit."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ApiError(422, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(422, _describe(e.errors())) from None


def message_text(message: ChatMessage) -> str:
    if isinstance(message.content, list):
        return "".join(p.text or "" for p in message.content if p.type == "text")
    return message.content or ""


# ---------------------------------------------------------------------------------------------
# Decoder: the model and the LRU of loaded caches
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Router: the HTTP ingress, the encoder and the manifests
# ---------------------------------------------------------------------------------------------

@dataclass
class _Conversation:
    rows: list[dict]
    centroids: Any  # np.ndarray [episodes, dim]
    stamp: tuple[int, float]  # (size, modified) of the manifest object when read
    checked: float  # time.monotonic() of the last check against the store


@serve.deployment(name="EpiCacheRouter")
@serve.ingress(app)
class Router:
    """Embeds the question, routes it to an episode, and asks the decoder for the answer."""

    def __init__(self, decoder, settings: dict, model: str, encoder: str):
        from pipeline import models
        from pipeline.store import open_store

        self.decoder = decoder
        self.settings = ServeSettings(**settings)
        self.model_name, self.encoder_name = model, encoder
        self.store = open_store(self.settings.store, endpoint_url=self.settings.s3_endpoint,
                                create=False)
        self.encoder = models.load_encoder(encoder, "cpu")
        self.encoder_lock = threading.Lock()  # a tokenizer is not safe across threads
        self._conversations: dict[str, _Conversation] = {}
        token = self.settings.auth_token
        self._token = token.encode() if token else None

    # -- helpers ------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self._token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 self._token):
            raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer <token>)")

    def _load_conversation(self, conversation_id: str) -> _Conversation:
        """Blocking: the cached manifest, re-read if the object changed since it was read."""
        from pipeline.answer import centroid_matrix, check_models, load_manifest
        from pipeline.corpus import check_safe_id
        from pipeline.store import ObjectNotFound, manifest_key

        check_safe_id(conversation_id)
        now = time.monotonic()
        known = self._conversations.get(conversation_id)
        if known is not None and now - known.checked < self.settings.manifest_ttl_s:
            return known
        try:
            info = self.store.info(manifest_key(conversation_id))
        except ObjectNotFound:
            self._conversations.pop(conversation_id, None)
            load_manifest(self.store, conversation_id)  # raises ConversationNotFound
            raise
        stamp = (info.size, info.modified)
        if known is not None and known.stamp == stamp:
            known.checked = now
            return known
        rows = load_manifest(self.store, conversation_id)
        check_models(rows, self.model_name, self.encoder_name)
        conv = _Conversation(rows, centroid_matrix(rows), stamp, now)
        self._conversations[conversation_id] = conv
        return conv

    def _embed(self, question: str):
        from pipeline.answer import embed_question

        with self.encoder_lock:
            return embed_question(self.encoder, question)

    def _check_question(self, question: str) -> str:
        if not question.strip():
            raise ApiError(422, "the question is empty")
        if len(question) > self.settings.max_question_chars:
            raise ApiError(422, f"the question is {len(question)} characters long; the limit is "
                                f"{self.settings.max_question_chars}")
        return question

    def _max_new_tokens(self, value: int | None, name: str) -> int:
        value = self.settings.default_max_new_tokens if value is None else value
        if not 1 <= value <= self.settings.max_new_tokens_limit:
            raise ApiError(422, f"field '{name}': must be between 1 and "
                                f"{self.settings.max_new_tokens_limit}, got {value}")
        return value

    async def _route(self, conversation_id: str, question: str) -> tuple[dict, float, dict]:
        """(manifest row, similarity, timings) for a question; manifest lookup counts as route."""
        from pipeline.answer import route_question

        t0 = time.perf_counter()
        conv = await asyncio.to_thread(self._load_conversation, conversation_id)
        t1 = time.perf_counter()
        emb = await asyncio.to_thread(self._embed, question)
        t2 = time.perf_counter()
        row, similarity = route_question(emb, conv.rows, conv.centroids)
        t3 = time.perf_counter()
        return row, similarity, {"embed": (t2 - t1) * 1000, "route": (t1 - t0 + t3 - t2) * 1000}

    @staticmethod
    def _decoder_row(row: dict) -> dict:
        keys = ("conversation_id", "episode", "object_key", "sha256", "object_bytes", "model_id",
                "encoder_id")
        return {k: row[k] for k in keys}

    @staticmethod
    def _raise_if_error(result: dict) -> None:
        if "error" in result:
            raise ApiError(result["error"]["status"], result["error"]["message"])

    # -- endpoints ----------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz(self) -> dict:
        stats = await self.decoder.stats.remote()
        return {"status": "ok", "model": self.model_name, "encoder": self.encoder_name,
                "conversations_loaded": len(self._conversations), "decoder": stats}

    @app.get("/v1/conversations/{conversation_id}")
    async def conversation(self, conversation_id: str, request: Request) -> dict:
        self._authorize(request)
        try:
            conv = await asyncio.to_thread(self._load_conversation, conversation_id)
        except Exception as e:
            raise ApiError(*classify(e)) from None
        first = conv.rows[0]
        return {
            "conversation_id": conversation_id, "model_id": first["model_id"],
            "encoder_id": first["encoder_id"], "config_hash": first["config_hash"],
            "scorer": first["scorer"], "tokens": first["tokens"],
            "episodes_requested": first["episodes_requested"],
            "episodes_built": first["episodes_built"], "episode_note": first["episode_note"],
            "episodes": [{
                "episode": r["episode"], "medoid_text": r["medoid_text"],
                "medoid_turn_ids": r["medoid_turn_ids"], "n_windows": r["n_windows"],
                "layer_budgets": r["layer_budgets"],
                "mean_budget": sum(r["layer_budgets"]) / max(1, len(r["layer_budgets"])),
                "object_key": r["object_key"], "object_bytes": r["object_bytes"],
                "kv_bytes": r["kv_bytes"], "built_at": r["built_at"]} for r in conv.rows]}

    @app.post("/v1/conversations/{conversation_id}/answer")
    async def answer(self, conversation_id: str, request: Request) -> dict:
        self._authorize(request)
        body = await parse_body(request, AnswerRequest)
        question = self._check_question(body.question)
        max_new = self._max_new_tokens(body.max_new_tokens, "max_new_tokens")
        try:
            row, similarity, timings = await self._route(conversation_id, question)
        except ApiError:
            raise
        except Exception as e:
            raise ApiError(*classify(e)) from None
        result = await self.decoder.answer.remote(self._decoder_row(row), question, max_new,
                                                  body.temperature or 0.0)
        self._raise_if_error(result)
        timings |= {"fetch": result["fetch_ms"], "decode": result["decode_ms"]}
        return {"conversation_id": conversation_id, "answer": result["answer"],
                "episode": int(row["episode"]), "similarity": round(similarity, 6),
                "cache_hit": result["cache_hit"], "tokens": result["tokens"],
                "finish_reason": result["finish_reason"],
                "decoder_queue_ms": result["queue_ms"],
                "timings_ms": {k: round(timings[k], 3)
                               for k in ("embed", "route", "fetch", "decode")}}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        self._authorize(request)
        body = await parse_body(request, ChatRequest)
        if body.n not in (None, 1):
            raise ApiError(422, "field 'n': only n=1 is supported")
        users = [m for m in body.messages if m.role == "user"]
        if not users:
            raise ApiError(422, "field 'messages': no message with role 'user' (the last one is "
                                "the question)")
        question = self._check_question(message_text(users[-1]))
        max_new = self._max_new_tokens(
            body.max_completion_tokens if body.max_completion_tokens is not None
            else body.max_tokens, "max_tokens")
        temperature = body.temperature or 0.0
        try:
            row, similarity, timings = await self._route(body.conversation_id, question)
        except ApiError:
            raise
        except Exception as e:
            raise ApiError(*classify(e)) from None
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        meta = {"conversation_id": body.conversation_id, "episode": int(row["episode"]),
                "similarity": round(similarity, 6)}
        base = {"id": ident, "created": created, "model": self.model_name}
        if not body.stream:
            result = await self.decoder.answer.remote(self._decoder_row(row), question, max_new,
                                                      temperature)
            self._raise_if_error(result)
            timings |= {"fetch": result["fetch_ms"], "decode": result["decode_ms"]}
            prompt_tokens = len(question.split())  # approximate: the router has no tokenizer
            return {**base, "object": "chat.completion",
                    "choices": [{"index": 0, "finish_reason": result["finish_reason"],
                                 "message": {"role": "assistant", "content": result["answer"]}}],
                    "usage": {"prompt_tokens": prompt_tokens,
                              "completion_tokens": result["tokens"],
                              "total_tokens": prompt_tokens + result["tokens"]},
                    "epicache": {**meta, "cache_hit": result["cache_hit"],
                                 "timings_ms": {k: round(v, 3) for k, v in timings.items()}}}

        gen = self.decoder.options(stream=True).stream.remote(
            self._decoder_row(row), question, max_new, temperature)
        first = await gen.__anext__()  # the fetch: a bad cache is an HTTP error, not a stream
        if "error" in first:
            gen.cancel()
            raise ApiError(first["error"]["status"], first["error"]["message"])
        timings["fetch"] = first["fetch_ms"]
        meta |= {"cache_hit": first["cache_hit"]}

        def chunk(delta: dict, finish: str | None = None, **extra) -> str:
            obj = {**base, "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        async def events() -> AsyncIterator[str]:
            yield chunk({"role": "assistant", "content": ""}, epicache=meta)
            async for item in gen:
                if "text" in item:
                    yield chunk({"content": item["text"]})
                elif "done" in item:
                    done = item["done"]
                    timings["decode"] = done["decode_ms"]
                    yield chunk({}, done.get("finish_reason", "stop"),
                                epicache={**meta, "timings_ms": {k: round(v, 3)
                                                                 for k, v in timings.items()}})
                elif "error" in item:
                    yield f"data: {json.dumps(error_body(**_error_args(item['error'])))}\n\n"
                    break
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


def _error_args(err: dict) -> dict:
    return {"status": err["status"], "message": err["message"]}


# ---------------------------------------------------------------------------------------------
# Building the application
# ---------------------------------------------------------------------------------------------

def resolve_models(store, model: str | None, encoder: str | None) -> tuple[str, str]:
    """The model and encoder to serve: as given, else as named in the store's manifests (the
    first conversation's), else the packaged defaults for an empty store."""
    from pipeline import models
    from pipeline.manifest import list_conversations, read_manifest

    if model is None or encoder is None:
        for cid in list_conversations(store)[:1]:
            rows = read_manifest(store, cid) or []
            if rows:
                model = model or rows[0]["model_id"]
                encoder = encoder or rows[0]["encoder_id"]
    return model or models.DEFAULT_LLM, encoder or models.DEFAULT_ENCODER


def build_app(settings: ServeSettings, model: str, encoder: str):
    """The Serve application: a router ingress bound to a decoder deployment."""
    decoder_options: dict = {
        "ray_actor_options": {"num_cpus": settings.decoder_cpus,
                              "num_gpus": settings.decoder_gpus,
                              "runtime_env": {"env_vars": WORKER_ENV}},
        "max_ongoing_requests": settings.decoder_max_ongoing}
    if settings.decoder_autoscale is not None:
        lo, hi = settings.decoder_autoscale
        decoder_options["autoscaling_config"] = {
            "min_replicas": lo, "initial_replicas": max(lo, 1), "max_replicas": hi,
            "target_ongoing_requests": settings.decoder_target_ongoing}
    else:
        decoder_options["num_replicas"] = settings.decoder_replicas
    decoder = Decoder.options(**decoder_options).bind(
        settings.store, settings.s3_endpoint, model, settings.cache_bytes, settings.torch_threads)
    return Router.options(
        num_replicas=settings.router_replicas, max_ongoing_requests=256,
        ray_actor_options={"num_cpus": settings.router_cpus,
                           "runtime_env": {"env_vars": WORKER_ENV}},
    ).bind(decoder, asdict(settings), model, encoder)


def _parse_autoscale(value: str | None) -> tuple[int, int] | None:
    if not value:
        return None
    lo, sep, hi = str(value).partition(":")
    if not sep:
        raise ValueError(f"autoscale takes MIN:MAX, got {value!r}")
    return int(lo), int(hi)


def app_builder(args: dict[str, str]):
    """For `serve run jobs.serve:app_builder store=URI [key=value ...]` (keys as in
    `ServeSettings`; the bearer token from $EPICACHE_SERVE_TOKEN)."""
    from pipeline.store import open_store

    casts = {"router_replicas": int, "decoder_replicas": int, "decoder_max_ongoing": int,
             "cache_bytes": int, "max_question_chars": int, "max_new_tokens_limit": int,
             "default_max_new_tokens": int, "torch_threads": int, "router_cpus": float,
             "decoder_cpus": float, "decoder_gpus": float, "decoder_target_ongoing": float,
             "manifest_ttl_s": float, "decoder_autoscale": _parse_autoscale}
    if "store" not in args:
        raise ValueError("serve run jobs.serve:app_builder needs store=URI")
    kwargs = {k: casts.get(k, str)(v) for k, v in args.items()}
    kwargs.setdefault("auth_token", os.environ.get(AUTH_ENV) or None)
    kwargs.setdefault("s3_endpoint", os.environ.get("EPICACHE_S3_ENDPOINT") or None)
    settings = ServeSettings(**kwargs)
    store = open_store(settings.store, endpoint_url=settings.s3_endpoint, create=False)
    model, encoder = resolve_models(store, settings.model, settings.encoder)
    return build_app(settings, model, encoder)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _builder_help() -> str:
    """The `serve run` builder arguments, named from `ServeSettings` itself."""
    keys = ", ".join(f.name for f in fields(ServeSettings))
    return textwrap.fill(
        "Under Serve's own CLI, `serve run jobs.serve:app_builder store=URI [key=value ...]`, "
        f"the keys are the ServeSettings fields: {keys}. Each is the option of the same name "
        "above (- for _), except manifest_ttl_s (--manifest-ttl) and default_max_new_tokens (the "
        "answer length when a request names none; no option). auth_token defaults to "
        f"${AUTH_ENV}, s3_endpoint to $EPICACHE_S3_ENDPOINT; --host, --port and --ray-address "
        "are this command's own.", width=88)


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.serve", __doc__, epilog=_builder_help())
    p.add_argument("--store", required=True, help="local folder or s3://bucket/prefix")
    p.add_argument("--s3-endpoint", default=os.environ.get("EPICACHE_S3_ENDPOINT") or None,
                   help="S3-compatible endpoint URL (default: $EPICACHE_S3_ENDPOINT, else AWS)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (loopback only; bind elsewhere only behind your own "
                        "proxy)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--model", help="LLM (default: the model named in the store's manifests)")
    p.add_argument("--encoder", help="sentence encoder (default: the encoder named in the store's "
                                     "manifests)")
    p.add_argument("--auth-token", default=None,
                   help=f"require 'Authorization: Bearer <token>' on /v1 (default: ${AUTH_ENV}, "
                        "else no token)")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS; else a local Ray is started)")
    p.add_argument("--router-replicas", type=int, default=1, help="router (HTTP ingress) replicas")
    p.add_argument("--router-cpus", type=float, default=0.5, help="Ray CPUs per router replica")
    p.add_argument("--decoder-replicas", type=int, default=1,
                   help="decoder replicas (fixed; see --decoder-autoscale)")
    p.add_argument("--decoder-autoscale", default=None, metavar="MIN:MAX",
                   help="autoscale the decoder between MIN and MAX replicas instead (default: "
                        "fixed --decoder-replicas)")
    p.add_argument("--decoder-target-ongoing", type=float, default=2.0,
                   help="autoscaling target: ongoing requests per decoder replica")
    p.add_argument("--decoder-cpus", type=float, default=1.0, help="Ray CPUs per decoder replica")
    p.add_argument("--decoder-gpus", type=float, default=0.0,
                   help="Ray GPUs per decoder replica, e.g. 1 to decode on a GPU")
    p.add_argument("--decoder-max-ongoing", type=int, default=16,
                   help="requests queued or running per decoder replica (decoding itself is one "
                        "at a time; fetches overlap)")
    p.add_argument("--cache-bytes", type=int, default=2 * 2**30,
                   help="bytes of resident caches per decoder replica (default: 2 GiB)")
    p.add_argument("--manifest-ttl", type=float, default=5.0,
                   help="seconds a manifest is trusted before the store is checked for changes")
    p.add_argument("--max-question-chars", type=int, default=2000,
                   help="longest question accepted (longer: 422)")
    p.add_argument("--max-new-tokens-limit", type=int, default=512,
                   help="largest max_new_tokens a request may ask for (larger: 422)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="decoder torch threads (default: Ray's assignment)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def settings_from_args(a: argparse.Namespace) -> ServeSettings:
    return ServeSettings(
        store=a.store, s3_endpoint=a.s3_endpoint, model=a.model, encoder=a.encoder,
        auth_token=a.auth_token or os.environ.get(AUTH_ENV) or None,
        router_replicas=a.router_replicas, router_cpus=a.router_cpus,
        decoder_replicas=a.decoder_replicas,
        decoder_autoscale=_parse_autoscale(a.decoder_autoscale),
        decoder_target_ongoing=a.decoder_target_ongoing, decoder_cpus=a.decoder_cpus,
        decoder_gpus=a.decoder_gpus, decoder_max_ongoing=a.decoder_max_ongoing,
        cache_bytes=a.cache_bytes, manifest_ttl_s=a.manifest_ttl,
        max_question_chars=a.max_question_chars, max_new_tokens_limit=a.max_new_tokens_limit,
        torch_threads=a.torch_threads)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from pipeline.store import StoreError, open_store

    try:
        settings = settings_from_args(a)
        store = open_store(settings.store, endpoint_url=settings.s3_endpoint, create=False)
        model, encoder = resolve_models(store, settings.model, settings.encoder)
    except (StoreError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray

    from jobs.environment import init_ray

    joined = bool(a.ray_address or os.environ.get("RAY_ADDRESS"))
    init_ray(a.ray_address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": a.host, "port": a.port})
        serve.run(build_app(settings, model, encoder), name=APP_NAME, route_prefix="/")
        print(f"serving {store.uri} on http://{a.host}:{a.port} (model {model}, encoder "
              f"{encoder}{', bearer token required' if settings.auth_token else ''}); "
              "Ctrl-C to stop", flush=True)
        while not stop.wait(1.0):
            pass
    except Exception as e:  # a deployment that failed to start: one line, not a trace
        print(f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        return 1
    finally:
        try:
            if joined:
                serve.delete(APP_NAME)
            else:
                serve.shutdown()
                ray.shutdown()
        except Exception:
            pass
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
