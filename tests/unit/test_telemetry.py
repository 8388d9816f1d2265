"""The metrics of `pipeline.telemetry` without a Ray cluster: every call is a silent no-op where
Ray is not initialised, the router's middleware counts every request by route and status (errors
included), the decoder records its cache reads by tier, its store reads by reason and its
decodes, the decode batcher its steps' rows and its queue depth, and the Grafana
dashboard and the docs name only metrics the code defines, all of them. Their export through a
real Ray is tests/integration/test_metrics.py."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import subprocess
import sys
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pipeline import telemetry
from pipeline.answer.batcher import DecodeBatcher
from pipeline.kv import models
from pipeline.kv.methods.epicache import EpiCache
from pipeline.kv.prefill import PrefillConfig, block_prefill
from pipeline.serve import decoder as decoder_module
from pipeline.serve import ingress
from pipeline.serve.errors import ApiError, add_exception_handlers, classify
from pipeline.serve.settings import ServeSettings
from pipeline.store.backends.base import cache_key
from pipeline.store.backends.local import LocalStore
from pipeline.store.objects.cache_format import serialize, sha256
from pipeline.store.objects.cache_ref import CacheRef
from pipeline.telemetry import SPECS, RequestMetrics, name_route
from tests.support.paths import REPO
from tests.support.tiny_models import StandIn, one_torch_thread, random_ids, tiny_model  # noqa: F401

EXPORTED = {name for spec in SPECS for name in spec.exported}

def test_every_call_is_a_silent_no_op_without_ray():
    """A fresh interpreter (no Ray session in it): each holder made the way its process makes
    it, each method called, with no warning (Ray Serve's own import-time deprecations aside) and
    nothing logged; Ray is never started."""
    script = """
import warnings
import ray
import ray.serve.metrics  # its import warns of pydantic deprecations: not ours
from pipeline import telemetry
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    r, d, b = telemetry.router_metrics(), telemetry.decoder_metrics(), telemetry.build_metrics()
    assert telemetry.router_metrics() is r and telemetry.build_metrics() is b  # one a process
    r.request("answer", 200, 12.5); r.routed(2); r.topup("used")
    d.cache_read(False, 30.0, 1 << 20); d.object_read(False, 4096, "request", True)
    d.object_read(True, 4096, "request", True); d.object_read(False, 4096, "prefetch", False)
    d.resident(0); d.decoded(800.0, 0); d.decoded(800.0, 14); d.batch_step(3); d.queue_depth(0)
    b.conversation("built"); b.episode(0); b.episode(2048)
assert not caught, [str(w.message) for w in caught]
assert not ray.is_initialized()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert done.stderr == "", done.stderr[-3000:]


def test_specs_are_prometheus_names_with_their_exported_forms():
    assert len({s.name for s in SPECS}) == len(SPECS)
    for spec in SPECS:
        assert re.fullmatch(r"epicache_[a-z0-9_]+", spec.name) and spec.description
        assert spec.kind in ("counter", "gauge", "histogram")
        assert bool(spec.boundaries) == (spec.kind == "histogram")
        assert list(spec.boundaries) == sorted(spec.boundaries)
    assert telemetry.Spec("epicache_x", "counter", (), "x").exported == ("ray_epicache_x_total",)
    assert telemetry.Spec("epicache_x", "gauge", (), "x").exported == ("ray_epicache_x",)


# ---------------------------------------------------------------------------------------------
# The router's middleware, over ASGI (no HTTP server, no Ray)
# ---------------------------------------------------------------------------------------------

class _Recorder:
    def __init__(self):
        self.requests: list[tuple[str, int]] = []

    def request(self, route: str, status: int, ms: float) -> None:
        assert ms >= 0
        self.requests.append((route, status))


def _app() -> FastAPI:
    app = FastAPI()
    add_exception_handlers(app)
    app.add_middleware(RequestMetrics, routes={"/v1/a/{x}": "answer", "/s": "chat"},
                       status_of=lambda e: classify(e)[0])

    @app.get("/v1/a/{x}")
    async def answer(x: str) -> dict:
        if x == "gone":
            raise ApiError(404, "no such conversation")
        if x == "boom":
            raise RuntimeError("unexpected")
        return {"x": x}

    @app.post("/s")
    async def stream():
        async def pieces():
            yield b"data: 1\n\n"
            yield b"data: [DONE]\n\n"
        return StreamingResponse(pieces(), media_type="text/event-stream")

    @app.get("/named")
    async def named(request: Request) -> dict:
        name_route(request.scope, "chat_stream")
        raise ApiError(503, "cache unavailable")

    return app


def _call(app, method: str, path: str) -> tuple[int, bytes]:
    sent: list[dict] = []
    asked = []

    async def receive() -> dict:  # the body, then nothing (a client that stays connected)
        asked.append(1)
        if len(asked) == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    try:
        asyncio.run(app(scope, receive, send))
    except RuntimeError:  # the outer error handler answers, then re-raises
        pass
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], b"".join(m.get("body", b"") for m in sent
                                     if m["type"] == "http.response.body")


def test_every_request_is_counted_by_route_and_status_errors_included(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(telemetry, "router_metrics", lambda: recorder)
    app = _app()
    assert _call(app, "GET", "/v1/a/q")[0] == 200
    assert _call(app, "GET", "/v1/a/gone")[0] == 404  # ApiError, through its handler
    assert _call(app, "GET", "/v1/a/boom")[0] == 500  # escapes to the outer handler
    assert _call(app, "GET", "/nowhere")[0] == 404  # no endpoint
    status, body = _call(app, "POST", "/s")
    assert status == 200 and body.endswith(b"[DONE]\n\n")  # timed to its last byte
    assert _call(app, "GET", "/named")[0] == 503
    assert recorder.requests == [("answer", 200), ("answer", 404), ("answer", 500),
                                 ("other", 404), ("chat", 200), ("chat_stream", 503)]


def test_the_routers_routes_are_the_ones_tagged():
    """Every endpoint of the router's app has its `route` tag (a renamed path would be
    `other`), and the app counts through the middleware."""
    paths = set()
    for route in ingress.app.routes:
        inner = getattr(getattr(route, "original_router", None), "routes", [route])
        paths |= {r.path for r in inner if getattr(r, "methods", None)} - {"/openapi.json"}
    assert paths == set(ingress.METRIC_ROUTES)
    assert [m.cls for m in ingress.app.user_middleware] == [RequestMetrics]


class _BatchRecorder:
    def __init__(self):
        self.rows: list[int] = []
        self.depths: list[int] = []

    def batch_step(self, rows: int) -> None:
        self.rows.append(rows)

    def queue_depth(self, requests: int) -> None:
        self.depths.append(requests)


def test_the_batcher_reports_each_decode_steps_rows_and_its_queue_depth():
    model = tiny_model("llama")
    cache, _ = block_prefill(model, random_ids(40, seed=7), EpiCache(patch=random_ids(6, seed=8)),
                             [9, 12, 7], PrefillConfig(block=8))
    recorder = _BatchRecorder()
    batcher = DecodeBatcher(StandIn(model), max_batch=4, metrics=recorder)
    try:
        with batcher._wake:  # (reentrant) the threads admit none until all three are queued
            jobs = [batcher.submit(cache, q, 6) for q in ("Where?", "Who cooked?", "What pet?")]
        for job in jobs:
            job.future.result(timeout=60)
        deadline = time.monotonic() + 10
        while recorder.depths[-1] != 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # the decode thread reports after the step that ended them
        steps, rows = batcher.decodes.steps, batcher.decodes.rows
    finally:
        batcher.close()
    assert len(recorder.rows) == steps and sum(recorder.rows) == rows
    assert 1 <= max(recorder.rows) <= 3
    assert recorder.depths[:3] == [1, 2, 3] and recorder.depths[-1] == 0


class _Calls:
    """Any metrics holder: records each call as (method, args)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args: self.calls.append((name, *args))

    def of(self, name: str) -> list[tuple]:
        return [c[1:] for c in self.calls if c[0] == name]


def _refs(store: LocalStore, model) -> list[CacheRef]:
    refs = []
    for episode in range(2):
        cache, _ = block_prefill(model, random_ids(50, seed=episode), EpiCache(patch=random_ids(5)),
                                 [10, 12, 14], PrefillConfig(block=8))
        data = serialize(cache, {"conversation_id": "conv-1", "episode": episode})
        key = cache_key("conv-1", "abcd", episode)
        store.put(key, data)
        refs.append(CacheRef(conversation_id="conv-1", episode=episode, object_key=key,
                             sha256=sha256(data), object_bytes=len(data), model_id="tiny",
                             encoder_id="enc", model_fingerprint=StandIn(None).fingerprint,
                             encoder_fingerprint="enc-files"))
    return refs


def test_the_decoder_records_its_tiers_store_reads_and_decodes(tmp_path, monkeypatch):
    """A decoder replica made directly (a tiny model): a cold read (memory miss, disk miss, a
    store read for the request), a hit, an answer, a prefetch, and a restart served from disk."""
    model = tiny_model("llama")
    store = LocalStore(tmp_path / "store")
    refs = _refs(store, model)
    monkeypatch.setattr(models, "load_llm", lambda name, device=None, dtype=None: StandIn(model))
    monkeypatch.setattr(gc, "freeze", lambda: None)  # a replica's process, not pytest's
    settings = ServeSettings(store=str(tmp_path / "store"), disk_cache=str(tmp_path / "disk"),
                             disk_cache_bytes=10**9, cache_bytes=10**9, prefetch_workers=1)

    def decoder(calls: _Calls):
        monkeypatch.setattr(decoder_module, "decoder_metrics", lambda: calls)
        return decoder_module.Decoder.func_or_class(settings, "tiny")

    calls = _Calls()
    first = decoder(calls)
    try:
        first._cache(refs[0])
        first._cache(refs[0])
        reply = asyncio.run(first.answer(refs[0], "Who cooked?", 3, 0.0))
        assert first.prefetch(refs[1:]) == 1
        deadline = time.monotonic() + 20
        while not first.stats()["prefetch_fetched"] and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        first.batcher.close()
    size = refs[0].object_bytes
    assert calls.of("object_read") == [(False, size, "request", True),
                                       (False, refs[1].object_bytes, "prefetch", True)]
    assert [c[0] for c in calls.of("cache_read")] == [False, True, True]  # the answer's: a hit
    assert all(ms >= 0 and resident > 0 for _, ms, resident in calls.of("cache_read"))
    assert calls.of("resident")[-1][0] > calls.of("cache_read")[-1][2]  # the prefetch's too
    [(decode_ms, tokens)] = calls.of("decoded")
    assert decode_ms > 0 and tokens == reply["tokens"] >= 1
    assert calls.of("batch_step") and calls.of("queue_depth")[-1] == (0,)

    warm = _Calls()
    restarted = decoder(warm)
    try:
        restarted._cache(refs[0])
    finally:
        restarted.batcher.close()
    assert warm.of("object_read") == [(True, size, "request", True)]  # a disk hit


# ---------------------------------------------------------------------------------------------
# The dashboard and the docs
# ---------------------------------------------------------------------------------------------

PROMQL_WORDS = {"sum", "max", "min", "avg", "count", "rate", "increase", "irate",
                "histogram_quantile", "by", "without", "on", "ignoring", "and", "or", "unless",
                "le"}


def _expressions(node) -> list[str]:
    if isinstance(node, dict):
        return ([node["expr"]] if isinstance(node.get("expr"), str) else []) + \
            [e for v in node.values() for e in _expressions(v)]
    if isinstance(node, list):
        return [e for v in node for e in _expressions(v)]
    return []


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its identifiers once label matchers, range
    selectors, grouping clauses, strings and numbers are taken out, less PromQL's own words."""
    bare = re.sub(r'"[^"]*"', "", expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", bare)
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", bare)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare))
    return words - PROMQL_WORDS


def test_the_dashboard_reads_only_metrics_the_code_defines_and_all_of_them():
    dashboard = json.loads((REPO / "docs/grafana/epicache.json").read_text(encoding="utf-8"))
    assert "${datasource}" in json.dumps(dashboard["panels"][1]["datasource"])
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    expressions = _expressions(dashboard["panels"])
    assert expressions
    read = set()
    for expr in expressions:
        names = metric_names(expr)
        assert names and names <= EXPORTED, (expr, names - EXPORTED)
        read |= names
    families = {spec.name: set(spec.exported) for spec in SPECS}
    assert [name for name, exported in families.items() if not exported & read] == []


def test_the_docs_table_lists_every_metric_by_its_exported_name():
    doc = (REPO / "docs/serving.md").read_text(encoding="utf-8")
    section = doc[doc.index("## Metrics"):]
    for spec in SPECS:
        assert f"`{spec.exported[0].removesuffix('_bucket')}" in section, spec.name
        for tag in spec.tags:
            assert f"`{tag}`" in section, (spec.name, tag)


@pytest.mark.parametrize("expr, names", [
    ('sum by (route, status) (rate(ray_epicache_requests_total{status=~"5.."}[5m]))',
     {"ray_epicache_requests_total"}),
    ("histogram_quantile(0.95, sum by (le) (rate(ray_epicache_fetch_ms_bucket[$__rate_interval])))",
     {"ray_epicache_fetch_ms_bucket"}),
    ("max by (replica) (ray_epicache_resident_bytes) / on (replica) ray_x", {
        "ray_epicache_resident_bytes", "ray_x"}),
])
def test_metric_names_are_parsed_out_of_promql(expr, names):
    assert metric_names(expr) == names
