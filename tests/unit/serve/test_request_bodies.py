"""The request body read under its limits (`pipeline.serve.body`, through `parse_body` and the
app's error handlers), over real HTTP on 127.0.0.1: a small FastAPI app served by uvicorn, as
the router reads its bodies (the served app itself: tests/e2e/test_serve.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.seaweedfs import free_ports
from pipeline.serve.body import MAX_JSON_DEPTH, json_depth, load_json
from pipeline.serve.errors import ApiError, add_exception_handlers
from pipeline.serve.schemas import AnswerRequest, parse_body
from tests.support import raw_http

MAX_BYTES = 2**20
JSON = {"Content-Type": "application/json"}


def _app() -> FastAPI:
    app = FastAPI()
    add_exception_handlers(app)

    @app.post("/answer")
    async def answer(request: Request) -> dict:
        body = await parse_body(request, AnswerRequest, MAX_BYTES)
        return {"question": body.question}

    return app


@pytest.fixture(scope="module")
def port():
    port = free_ports(1)[0]
    server = uvicorn.Server(uvicorn.Config(_app(), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield port
    server.should_exit = True
    thread.join(10)


def _post(port: int, body: bytes, headers: dict = JSON) -> tuple[int, dict]:
    status, text = raw_http.request(port, "/answer", headers | {"Content-Length": str(len(body))},
                                    [body])
    return status, json.loads(text)


def _message(answer: dict) -> str:
    return answer["error"]["message"]


def test_a_json_body_within_the_limits_is_read(port):
    body = json.dumps({"question": "Who?"}).encode()
    assert _post(port, body) == (200, {"question": "Who?"})
    assert _post(port, body, {"Content-Type": "Application/JSON; charset=utf-8"})[0] == 200


def test_a_body_of_100_mb_is_refused_from_its_content_length_before_it_is_read(port):
    headers = JSON | {"Content-Length": str(100 * 10**6)}
    status, text = raw_http.request(port, "/answer", headers, [b"[" * 65536], timeout=20)
    assert status == 413 and "1,048,576 bytes" in _message(json.loads(text))


def test_a_chunked_body_is_refused_once_its_bytes_pass_the_limit_with_no_end_sent(port):
    parts = raw_http.chunked([b" " * 65536] * (MAX_BYTES // 65536 + 1))
    status, text = raw_http.request(port, "/answer", JSON | {"Transfer-Encoding": "chunked"},
                                    parts, timeout=20)
    assert status == 413 and "over the limit" in _message(json.loads(text))


def test_100_000_nested_brackets_are_a_400_naming_the_depth(port):
    status, answer = _post(port, b"[" * 100_000)
    assert status == 400 and f"deeper than {MAX_JSON_DEPTH}" in _message(answer)
    status, answer = _post(port, b"[" * 50_000 + b"]" * 50_000)  # balanced: deep all the same
    assert status == 400 and "deeper" in _message(answer)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_not_declared_json_is_a_415(port, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    status, answer = _post(port, json.dumps({"question": "Who?"}).encode(), headers)
    assert status == 415 and "application/json" in _message(answer)


def test_nan_and_infinity_are_not_json(port):
    for constant in (b"NaN", b"Infinity", b"-Infinity"):
        status, answer = _post(port, b'{"question": "Who?", "temperature": ' + constant + b"}")
        assert status == 400 and "not valid JSON" in _message(answer)


# -- the depth bound itself ------------------------------------------------------------------

def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab'),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(alphabet='[]{}"\\ab', max_size=4), inner, max_size=3),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_json_depth_is_the_nesting_of_the_parsed_value(value):
    """Brackets and escaped quotes inside strings and keys never count."""
    raw = json.dumps(value).encode()
    assert json_depth(raw) == _depth(value)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_load_or_raise_a_400(raw):
    try:
        load_json(raw)
    except ApiError as e:
        assert e.status == 400
