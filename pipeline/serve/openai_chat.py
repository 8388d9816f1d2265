"""The OpenAI chat wire format: the text of a chat request's messages (the last is the question,
the earlier ones its live tail), the completion object, and the server-sent event chunks of a
streamed answer (each object with an `epicache` extra: episode, similarity, top-up, live tokens,
cache hit, timings; with `stream_options.include_usage`, a last chunk with the usage and no
choices, as OpenAI sends it)."""

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

from pipeline.serve.errors import classify, error_body
from pipeline.serve.schemas import ChatMessage


def message_text(message: ChatMessage) -> str:
    if isinstance(message.content, list):
        return "".join(p.text for p in message.content)
    return message.content or ""


def completion_base(model: str) -> dict:
    """The fields the completion object, or every chunk of a stream, shares."""
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    return {"id": ident, "created": created, "model": model}


def _rounded(timings: dict) -> dict:
    return {k: round(v, 3) for k, v in timings.items()}


def usage(decoded: dict) -> dict:
    """OpenAI's `usage` of a decoder's answer (its result, or a stream's done item): the
    prompt is every token the decoder prefilled after the cache (top-up, live tail, question)."""
    prompt_tokens = decoded["prompt_tokens"]
    return {"prompt_tokens": prompt_tokens, "completion_tokens": decoded["tokens"],
            "total_tokens": prompt_tokens + decoded["tokens"]}


def completion(base: dict, result: dict, meta: dict, timings: dict) -> dict:
    """The `chat.completion` object of a decoder's whole answer."""
    return {**base, "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": result["finish_reason"],
                         "message": {"role": "assistant", "content": result["answer"]}}],
            "usage": usage(result),
            "epicache": {**meta, "cache_hit": result["cache_hit"],
                         "timings_ms": _rounded(timings)}}


def chunk(base: dict, delta: dict | None, finish: str | None = None, **extra) -> str:
    """One `chat.completion.chunk` as a server-sent event (no `delta`: no choices)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    obj = {**base, "object": "chat.completion.chunk", "choices": choices, **extra}
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error_args(err: dict) -> dict:
    return {"status": err["status"], "message": err["message"]}


async def _items(gen, timeout: float | None) -> AsyncIterator[dict]:
    """The decoder's stream, each item awaited at most `timeout` s; a failure (the replica
    died, no piece in time) ends it with an error item."""
    while True:
        try:
            item = await asyncio.wait_for(gen.__anext__(), timeout)
        except StopAsyncIteration:
            return
        except Exception as e:
            gen.cancel()
            status, message = classify(e)
            yield {"error": {"status": status, "message": message}}
            return
        yield item


async def _events(gen, base: dict, meta: dict, timings: dict, timeout: float | None,
                  include_usage: bool) -> AsyncIterator[str]:
    yield chunk(base, {"role": "assistant", "content": ""}, epicache=meta)
    async for item in _items(gen, timeout):
        if "text" in item:
            yield chunk(base, {"content": item["text"]})
        elif "done" in item:
            done = item["done"]
            timings["decode"] = done["decode_ms"]
            yield chunk(base, {}, done.get("finish_reason", "stop"),
                        epicache={**meta, "timings_ms": _rounded(timings)})
            if include_usage:
                yield chunk(base, None, usage=usage(done))
        elif "error" in item:
            yield f"data: {json.dumps(error_body(**_error_args(item['error'])))}\n\n"
            break
    yield "data: [DONE]\n\n"


def stream_response(gen, base: dict, meta: dict, timings: dict, timeout: float | None = None,
                    include_usage: bool = False) -> StreamingResponse:
    """The decoder's stream (`gen`, past its first item, the fetch) as server-sent events: a
    first chunk with the role, a chunk per piece, a last one with the finish reason and the
    timings (an error mid-stream, or no piece within `timeout` s, is an error object), with
    `include_usage` one more with the usage and no choices, then `[DONE]`."""
    return StreamingResponse(_events(gen, base, meta, timings, timeout, include_usage),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
