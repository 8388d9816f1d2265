"""A request's JSON body, read under limits before any of it is trusted.

- The media type must be `application/json` (415): a web page can make a browser send a
  `text/plain` body cross-site without asking first, but not a JSON one.
- The size is bounded (413) by the Content-Length and, for a chunked body, by counting the bytes
  as they stream in: a body over the limit is refused before it is read whole.
- The nesting depth is bounded (400) before the parser sees the body: the parser recurses once
  per level, and 100,000 `[` would exhaust the interpreter's stack.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from fastapi import Request

from pipeline.serve.errors import ApiError

JSON_MEDIA_TYPE = "application/json"
MAX_JSON_DEPTH = 32  # the request schemas need 4 levels; OpenAI clients' extras a few more
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[list(b"[{")] = 1
_DEPTH_STEP[list(b"]}")] = -1


def check_media_type(content_type: str | None) -> None:
    """`application/json`, with parameters such as `charset` allowed; anything else is a 415."""
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        raise ApiError(415, f"the request body must be {JSON_MEDIA_TYPE} (Content-Type: "
                            f"{media_type or 'none'})")


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is over the limit of {max_bytes:,} bytes")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body's bytes, or a 413 as soon as they (or the Content-Length) pass `max_bytes`."""
    declared = request.headers.get("content-length", "")  # the HTTP server checked its form
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def json_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in `raw`, brackets inside strings not counted, in a
    few vectorised passes (no Python loop over the bytes, no recursion); for a body that is not
    JSON, a bound good enough to refuse it by."""
    data = np.frombuffer(raw, dtype=np.uint8)
    if not data.size:
        return 0
    index = np.arange(data.size)
    # a quote is escaped when an odd run of backslashes ends just before it
    last_other = np.maximum.accumulate(np.where(data != ord("\\"), index, -1))
    backslashes_before = np.concatenate(([0], index[:-1] - last_other[:-1]))
    quote = (data == ord('"')) & (backslashes_before % 2 == 0)
    in_string = (np.cumsum(quote) % 2 == 1) | quote
    steps = np.where(in_string, 0, _DEPTH_STEP[data]).astype(np.int64)
    return max(0, int(np.cumsum(steps).max()))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The parsed body: 400 if it nests deeper than `max_depth` or is not JSON (NaN and
    Infinity included: they are Python's, not JSON's)."""
    if json_depth(raw) > max_depth:
        raise ApiError(400, f"the request body nests deeper than {max_depth} levels")
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
