"""Property-based: the HTTP request schemas, given random and mutated bodies, raise only their
own errors: a body through `parse_body` is a request or an `ApiError` (400, 413, 415 or 422),
and a JSON value through a model is the model or a pydantic `ValidationError`."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from starlette.requests import Request

from pipeline.serve.errors import ApiError
from pipeline.serve.schemas import AnswerRequest, ChatRequest, parse_body
from pipeline.serve.settings import ServeSettings

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODELS = (AnswerRequest, ChatRequest)
MAX_BYTES = ServeSettings.__dataclass_fields__["max_body_bytes"].default  # the server's

TEXT = st.text(st.characters(exclude_categories=()), max_size=10)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(TEXT, kids, max_size=4), max_leaves=16)

VALID = {AnswerRequest: {"question": "Who?", "max_new_tokens": 8, "temperature": 0.5},
         ChatRequest: {"conversation_id": "c-1", "model": "m", "max_tokens": 8, "n": 1,
                       "temperature": 1.0, "stream": False,
                       "messages": [{"role": "user", "content": "Who?"},
                                    {"role": "user", "content": [{"type": "text",
                                                                  "text": "Who?"}]}]}}


@st.composite
def mutated(draw, model):
    """A valid body of `model` with one or two fields (or a message's) replaced or removed."""
    body = copy.deepcopy(VALID[model])
    for _ in range(draw(st.integers(1, 2))):
        target = body
        listed = body.get("messages")
        messages = [m for m in listed if isinstance(m, dict)] if isinstance(listed, list) else []
        if model is ChatRequest and messages and draw(st.booleans()):
            target = draw(st.sampled_from(messages))
        key = draw(st.sampled_from(sorted(target) + ["extra"]))
        if draw(st.booleans()):
            target[key] = draw(JSON)
        else:
            target.pop(key, None)
    return body


def _request(body: bytes, content_type: str = "application/json") -> Request:
    """A real Starlette request whose body arrives in one message."""
    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
             "headers": [(b"content-type", content_type.encode()),
                         (b"content-length", str(len(body)).encode())]}
    sent = []

    async def receive():
        if sent:
            return {"type": "http.disconnect"}
        sent.append(True)
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(scope, receive)


def _parse(body: bytes, model) -> None:
    try:
        got = asyncio.run(parse_body(_request(body), model, MAX_BYTES))
    except ApiError as e:
        assert e.status in (400, 413, 415, 422)
        return
    assert isinstance(got, model)


def _validate(value, model) -> None:
    try:
        model.model_validate(value)
    except ValidationError:
        pass


@FAST
@given(st.sampled_from(MODELS), st.data())
def test_mutated_bodies_are_a_request_or_a_422(model, data):
    body = data.draw(mutated(model))
    _validate(body, model)
    _parse(json.dumps(body).encode(), model)


@FAST
@given(st.sampled_from(MODELS), JSON)
def test_random_json_is_a_request_or_an_api_error(model, value):
    _validate(value, model)
    _parse(json.dumps(value).encode(), model)


@FAST
@given(st.sampled_from(MODELS), st.binary(max_size=200))
@example(AnswerRequest, b"[" * 100_000)  # deeper than the parser's recursion: a 400
@example(AnswerRequest, b'{"question": "\\ud800"}')  # a lone surrogate
def test_random_bytes_are_a_request_or_an_api_error(model, body):
    _parse(body, model)


@given(st.sampled_from(MODELS), st.sampled_from(["0.5", "1", True, False, [0.5], {"t": 1}]))
def test_a_number_field_refuses_text_and_booleans(model, value):
    """Strict types: "0.5" and true are not temperatures (a 422 naming the field), while an
    integer is (0 is 0.0)."""
    body = copy.deepcopy(VALID[model]) | {"temperature": value}
    try:
        model.model_validate(body)
    except ValidationError as e:
        assert [err["loc"] for err in e.errors()] == [("temperature",)]
    else:
        raise AssertionError(f"temperature {value!r} was accepted")
    assert model.model_validate(VALID[model] | {"temperature": 0}).temperature == 0.0


def test_a_content_part_that_is_not_text_is_refused_naming_it():
    """An image (or any part the model cannot read) is a 422 naming the part, never dropped
    unread from the question."""
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    body = copy.deepcopy(VALID[ChatRequest])
    body["messages"][1]["content"].append(image)
    with pytest.raises(ApiError) as refused:
        asyncio.run(parse_body(_request(json.dumps(body).encode()), ChatRequest, MAX_BYTES))
    assert refused.value.status == 422
    assert "messages.1.content" in str(refused.value)
