"""Errors: every failure is a status and a one-line JSON message, never a traceback.

`ApiError` is what the endpoints raise; `classify` maps the library's exceptions to a status and
a message; `add_exception_handlers` makes every error on the app an OpenAI-style error body. A
message says what a client needs and no more: never a server path, a store URI or an object key
(the library's own message, which may name them, is logged here instead).
"""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.answer.lookup import ConversationNotFound, ModelMismatchError, NeedsRebuildError
from pipeline.config.limits import LimitError
from pipeline.corpus.schema import UnsafeIdError
from pipeline.store.backends.base import ObjectNotFound, StoreError
from pipeline.store.catalogue.manifest import ManifestError
from pipeline.store.objects.cache_format import CacheCorruptError, ChecksumError

log = logging.getLogger("epicache.serve")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.kind = kind or _KINDS.get(status, "error")


_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "model_mismatch_error",
          413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 500: "internal_error", 503: "cache_unavailable_error",
          504: "timeout_error"}


def error_body(status: int, message: str, kind: str | None = None) -> dict:
    """OpenAI-style error object, so OpenAI clients show the message."""
    return {"error": {"message": message, "type": kind or _KINDS.get(status, "error"),
                      "code": status}}


def _error_response(status: int, message: str, kind: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(status, message, kind), status_code=status, headers=headers)


# Faults whose library message may name a path, a store URI or an object key: the client gets
# the fixed message, the log gets the library's. The first match answers (subclasses first).
_SERVER_SIDE_FAULTS: tuple[tuple[type[BaseException], int, str], ...] = (
    (NeedsRebuildError, 409, (
        "this conversation was built before caches were bound to their model's files; it needs "
        "a rebuild (python -m jobs.build --force) before it is served")),
    (ModelMismatchError, 409, (
        "this conversation was built with another model or encoder, or other files of them, "
        "than the ones this server runs (the server log names both): rebuild it, or serve the "
        "model it was built with")),
    (ChecksumError, 503, (
        "the episode's cache failed its checksum; not answering from it (the server log names "
        "the object; the build run again with --verify repairs it)")),
    (CacheCorruptError, 503, (
        "the episode's cache is not a readable episodic cache; not answering from it (the "
        "server log names the object; the build run again with --verify repairs it)")),
    (ObjectNotFound, 503, (
        "a cache object the manifest names is missing from the store (the server log names it; "
        "the build run again repairs it)")),
    (ManifestError, 503, (
        "this conversation's manifest is unreadable; not answering from it (the build run "
        "again rebuilds it; jobs.gc --verify lists such faults)")),
    (StoreError, 503, "the store is unavailable (the server log has the details): retry later"),
)


# A conversation's own stored data that is damaged (its other conversations are served)
CORRUPT_FAULTS = (CacheCorruptError, ObjectNotFound, ManifestError)


def is_corrupt(e: BaseException) -> bool:
    return isinstance(e, CORRUPT_FAULTS)


def classify(e: BaseException, conversation_id: str | None = None) -> tuple[int, str]:
    """(HTTP status, message) of an error raised while answering; a fault of a conversation's
    stored data names the conversation (given), never the object."""
    if isinstance(e, ApiError):
        return e.status, e.message
    if isinstance(e, LimitError):  # the request's own values, bounded
        return 422, str(e)
    if isinstance(e, RayActorError):  # died or unreachable (ActorDiedError, ActorUnavailable...)
        return 503, ("the decoder replica answering this request died or is unreachable; Serve "
                     "replaces it: retry shortly")
    if isinstance(e, (BackPressureError, DeploymentUnavailableError)):
        return 503, f"the decoder is unavailable or overloaded ({type(e).__name__}): retry shortly"
    if isinstance(e, TimeoutError):
        return 504, "the decoder did not answer in time (the server's --decoder-timeout)"
    if isinstance(e, ConversationNotFound):
        return 404, (f"conversation {e.conversation_id!r} has no manifest in this store (not "
                     "built yet?)")
    if isinstance(e, UnsafeIdError):  # the message quotes the client's own id
        return 400, f"invalid conversation id: {e}"
    for kind, status, message in _SERVER_SIDE_FAULTS:
        if isinstance(e, kind):
            log.warning("answered %d for %s: %s", status, type(e).__name__, e)
            if conversation_id is not None and is_corrupt(e):
                message = f"conversation {conversation_id!r}: {message}"
            return status, message
    return 500, "internal error while answering (the server log has the details)"


def describe(errors: list[dict]) -> str:
    """Up to five validation errors (pydantic's) as one line naming their fields."""
    parts = []
    for err in errors[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"field '{where}': {err.get('msg', 'invalid')}")
    return "; ".join(parts)


async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    return _error_response(e.status, e.message, e.kind)


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    return _error_response(e.status_code, str(e.detail))


async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
    return _error_response(422, describe(list(e.errors())))


async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return _error_response(*classify(e))


def add_exception_handlers(app: FastAPI) -> None:
    """Every error on `app` answered as `error_body`: ours, HTTP ones (404, 405), invalid
    requests (422) and unexpected ones (classified; 500 logs the trace)."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(Exception, _unexpected)
