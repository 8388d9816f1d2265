"""The streamed chat answer's server-sent events, from a decoder's stream items."""

from __future__ import annotations

import asyncio
import json

from pipeline.serve import openai_chat
from pipeline.serve.schemas import ChatRequest

DONE = {"done": {"tokens": 3, "prompt_tokens": 41, "finish_reason": "length", "decode_ms": 5.0,
                 "queue_ms": 0.0}}


class FakeStream:
    """What a Serve stream handle gives the events: `__anext__` and `cancel`."""

    def __init__(self, items: list[dict]):
        self.items, self.cancelled = iter(items), False

    async def __anext__(self) -> dict:
        try:
            return next(self.items)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        self.cancelled = True


def _chunks(items: list[dict], include_usage: bool) -> list[dict | str]:
    async def collect() -> list[str]:
        base = openai_chat.completion_base("SmolLM2-135M-Instruct")
        return [event async for event in openai_chat._events(
            FakeStream(items), base, {"episode": 0}, {"embed": 1.0}, 5.0, include_usage)]
    events = asyncio.run(collect())
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    return [e[6:-2] if e == "data: [DONE]\n\n" else json.loads(e[6:-2]) for e in events]


def test_a_stream_with_include_usage_ends_with_a_usage_chunk_without_choices():
    """OpenAI's `stream_options.include_usage`: after the finish chunk, one more with the
    whole answer's usage (the prompt: every token prefilled after the cache) and no choices,
    then [DONE]; without it, no usage anywhere."""
    items = [{"text": "a"}, {"text": "b c"}, DONE]
    chunks = _chunks(items, include_usage=True)
    assert chunks[-1] == "[DONE]"
    *answer, last = chunks[:-1]
    assert last["choices"] == [] and last["object"] == "chat.completion.chunk"
    assert last["usage"] == {"prompt_tokens": 41, "completion_tokens": 3, "total_tokens": 44}
    assert answer[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in answer)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in answer) == "ab c"
    plain = _chunks(items, include_usage=False)
    assert plain[-1] == "[DONE]" and all("usage" not in c for c in plain[:-1])
    assert len(plain) == len(chunks) - 1


def test_a_stream_that_fails_sends_no_usage():
    """An error mid-stream is an error object, then [DONE]: no usage of an answer never made."""
    chunks = _chunks([{"text": "a"}, {"error": {"status": 503, "message": "replica gone"}}],
                     include_usage=True)
    assert chunks[-1] == "[DONE]" and "error" in chunks[-2]
    assert all("usage" not in c for c in chunks[:-1])


def test_stream_options_are_read_and_checked():
    """`include_usage` defaults to false; a value that is not a boolean is refused."""
    ask = {"conversation_id": "c", "messages": [{"role": "user", "content": "q"}], "stream": True}
    assert not ChatRequest.model_validate(ask).include_usage
    assert not ChatRequest.model_validate(ask | {"stream_options": {}}).include_usage
    assert ChatRequest.model_validate(
        ask | {"stream_options": {"include_usage": True}}).include_usage
    try:
        ChatRequest.model_validate(ask | {"stream_options": {"include_usage": "yes"}})
    except ValueError as e:
        assert "include_usage" in str(e)
    else:
        raise AssertionError("a string include_usage was accepted")
