"""The operator's metrics: counters, gauges and histograms exported through Ray's metrics agent
(Prometheus text on each node's metrics export port, beside Ray's and Serve's own), so that a
fleet is watched in Prometheus and Grafana (docs/serving.md#metrics, docs/grafana/epicache.json).

Every metric is declared once here, in `SPECS` (its name, type, tags and meaning; the docs'
table and the dashboard's test read it), and made by one of three holders, once per process
(`router_metrics`, `decoder_metrics`, `build_metrics`): the two Serve replicas' metrics are
`ray.serve.metrics` classes (made in the replica, they add its `deployment`, `replica` and
`application` tags), the build driver's plain `ray.util.metrics`. Each call site is one method
call. Without Ray initialised (`jobs.answer`, an in-process evaluation, the unit tests) Ray's
metric objects record nothing, silently: the same calls are harmless there.

Ray exports a metric with a `ray_` prefix: a counter `epicache_x` as `ray_epicache_x_total`, a
gauge as `ray_epicache_x`, a histogram as `ray_epicache_x_bucket`, `_sum` and `_count` (`exported`;
Ray computes a histogram's `_sum` from its buckets' midpoints, so it is approximate).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ray.util import metrics as ray_metrics

MS_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)
# Halfway between row counts: Ray's exported `_sum` adds each observation's bucket midpoint, so
# a step of 1 to 4 rows is summed exactly, a larger one within half its bucket.
BATCH_BUCKETS = (0.5, 1.5, 2.5, 3.5, 4.5, 6.5, 8.5, 12.5, 16.5, 24.5, 32.5)


@dataclass(frozen=True)
class Spec:
    """One metric: its base name, type ("counter", "gauge" or "histogram"), tags and meaning."""
    name: str
    kind: str
    tags: tuple[str, ...]
    description: str
    boundaries: tuple[float, ...] = ()

    @property
    def exported(self) -> tuple[str, ...]:
        """The sample names Ray's Prometheus endpoint gives it."""
        base = f"ray_{self.name}"
        if self.kind == "counter":
            return (f"{base}_total",)
        if self.kind == "histogram":
            return tuple(f"{base}_{part}" for part in ("bucket", "sum", "count"))
        return (base,)


ROUTER_SPECS = (
    Spec("epicache_requests", "counter", ("route", "status"),
         "HTTP requests to the router by route (answer, chat, chat_stream, conversation, healthz, "
         "other) and HTTP status, errors included"),
    Spec("epicache_request_latency_ms", "histogram", ("route",),
         "The whole server-side turn of a request in ms (a streamed answer to its last byte)",
         MS_BUCKETS),
    Spec("epicache_route_reads", "counter", ("episodes",),
         "Questions routed, by episodes read: 1, or 2 when the router is unsure"),
    Spec("epicache_topup", "counter", ("status",),
         "Question-time top-ups by status: used, none (the episodes hold the nearest turns), "
         "unavailable (no usable turn index)"),
)
DECODER_SPECS = (
    Spec("epicache_cache_lookups", "counter", ("tier", "result"),
         "Cache lookups of requests: tier memory (one per question: hit when nothing was fetched)"
         " or disk (one per object not resident in memory), result hit or miss"),
    Spec("epicache_store_objects_fetched", "counter", ("reason",),
         "Cache objects read from the store (not the disk tier), for a request or a prefetch"),
    Spec("epicache_store_bytes_fetched", "counter", ("reason",),
         "Bytes of cache objects read from the store, for a request or a prefetch"),
    Spec("epicache_fetch_ms", "histogram", ("result",),
         "Time to get a question's cache in ms (~0 on a memory hit), by result hit or miss",
         MS_BUCKETS),
    Spec("epicache_decode_ms", "histogram", (),
         "Decode time of an answer in ms, from its prefill's start to its last token", MS_BUCKETS),
    Spec("epicache_batch_size", "histogram", (),
         "Rows (requests) in each decode step of the replica's batch", BATCH_BUCKETS),
    Spec("epicache_tokens_generated", "counter", (), "Answer tokens generated"),
    Spec("epicache_decoder_queue_depth", "gauge", (),
         "Requests queued or decoding in the replica's batcher"),
    Spec("epicache_resident_bytes", "gauge", (), "Bytes of the caches resident in the memory LRU"),
)
BUILD_SPECS = (
    Spec("epicache_build_conversations", "counter", ("outcome",),
         "Conversations of a build by outcome: built, appended, repaired, skipped (current), "
         "failed"),
    Spec("epicache_build_episodes", "counter", (), "Episode caches built or appended to"),
    Spec("epicache_build_tokens_prefilled", "counter", (),
         "Tokens prefilled into episode caches (an append counts its new tokens)"),
)
SPECS = ROUTER_SPECS + DECODER_SPECS + BUILD_SPECS


def _serve_classes() -> Any:
    # Imported on first use: Ray Serve is ~500 modules (0.6 s), which a build never needs.
    from ray.serve import metrics

    return metrics


def _make(specs: tuple[Spec, ...], classes: Any) -> dict[str, Any]:
    made = {}
    for s in specs:
        if s.kind == "histogram":
            made[s.name] = classes.Histogram(s.name, s.description, list(s.boundaries), s.tags)
        else:
            made[s.name] = getattr(classes, s.kind.title())(s.name, s.description, s.tags)
    return made


class _Metrics:
    """Metric objects by name, with Ray's checks kept out of the call sites: a counter is
    never incremented by 0 (Ray refuses it), values are plain numbers, tag values strings."""

    def __init__(self, specs: tuple[Spec, ...], classes: Any):
        self._m = _make(specs, classes)

    def _inc(self, name: str, value: float = 1, **tags: str) -> None:
        if value > 0:
            self._m[name].inc(float(value), tags or None)

    def _observe(self, name: str, value: float, **tags: str) -> None:
        self._m[name].observe(float(value), tags or None)

    def _set(self, name: str, value: float) -> None:
        self._m[name].set(float(value))


class RouterMetrics(_Metrics):
    """The router replica's: requests (by `RequestMetrics`), routes and top-ups."""

    def __init__(self, classes: Any = None):
        super().__init__(ROUTER_SPECS, classes or _serve_classes())

    def request(self, route: str, status: int, ms: float) -> None:
        self._inc("epicache_requests", route=route, status=str(status))
        self._observe("epicache_request_latency_ms", ms, route=route)

    def routed(self, episodes: int) -> None:
        self._inc("epicache_route_reads", episodes=str(episodes))

    def topup(self, status: str) -> None:
        self._inc("epicache_topup", status=status)


class DecoderMetrics(_Metrics):
    """The decoder replica's: its cache tiers, store reads, batch and decodes."""

    def __init__(self, classes: Any = None):
        super().__init__(DECODER_SPECS, classes or _serve_classes())

    def cache_read(self, hit: bool, ms: float, resident_bytes: int) -> None:
        """A question's cache got from the memory LRU (hit) or loaded into it."""
        result = "hit" if hit else "miss"
        self._inc("epicache_cache_lookups", tier="memory", result=result)
        self._observe("epicache_fetch_ms", ms, result=result)
        self.resident(resident_bytes)

    def object_read(self, from_disk: bool, nbytes: int, reason: str, disk_tier: bool) -> None:
        """A verified object read: from the disk tier (a hit) or the store (a miss when there is
        a tier; fetched bytes). Disk lookups count requests only (a prefetch to disk always
        misses)."""
        if disk_tier and reason == "request":
            self._inc("epicache_cache_lookups", tier="disk", result="hit" if from_disk else "miss")
        if not from_disk:
            self._inc("epicache_store_objects_fetched", reason=reason)
            self._inc("epicache_store_bytes_fetched", nbytes, reason=reason)

    def resident(self, nbytes: int) -> None:
        self._set("epicache_resident_bytes", nbytes)

    def decoded(self, decode_ms: float, tokens: int) -> None:
        self._observe("epicache_decode_ms", decode_ms)
        self._inc("epicache_tokens_generated", tokens)

    def batch_step(self, rows: int) -> None:
        self._observe("epicache_batch_size", rows)

    def queue_depth(self, requests: int) -> None:
        self._set("epicache_decoder_queue_depth", requests)


class BuildMetrics(_Metrics):
    """The build driver's: conversations by outcome, episodes and tokens prefilled (counted
    where the driver learns them, once each)."""

    def __init__(self, classes: Any = ray_metrics):
        super().__init__(BUILD_SPECS, classes)

    def conversation(self, outcome: str) -> None:
        self._inc("epicache_build_conversations", outcome=outcome)

    def episode(self, tokens: int) -> None:
        self._inc("epicache_build_episodes")
        self._inc("epicache_build_tokens_prefilled", tokens)


# One of each per process (a Serve replica is a process), made on first use: in the replica.
@functools.cache
def router_metrics() -> RouterMetrics:
    return RouterMetrics()


@functools.cache
def decoder_metrics() -> DecoderMetrics:
    return DecoderMetrics()


@functools.cache
def build_metrics() -> BuildMetrics:
    return BuildMetrics()

ROUTE_STATE = "epicache_route"  # an endpoint may name its route in the request's state


def name_route(scope: dict, route: str) -> None:
    """Tag the request (an ASGI scope, `request.scope`) with `route` instead of its path's."""
    scope.setdefault("state", {})[ROUTE_STATE] = route


class RequestMetrics:
    """ASGI middleware: every HTTP request counted by route and status and its whole turn timed
    (a streamed response until its last byte), errors included. `routes` maps the matched path
    template to the route tag (`other`: no endpoint); `status_of` gives the status an exception
    that escapes the app is answered with (by the outer error handler); a request cancelled
    before its answer started (the client went away) counts as 499."""

    def __init__(self, app: Callable, routes: Mapping[str, str],
                 status_of: Callable[[BaseException], int]):
        self.app, self.routes, self.status_of = app, routes, status_of

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [0]

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as e:
            status[0] = status[0] or self.status_of(e)
            raise
        finally:  # nothing sent and no exception: cancelled, the client went away (499)
            route = scope.get("state", {}).get(ROUTE_STATE) or \
                self.routes.get(getattr(scope.get("route"), "path", None), "other")
            router_metrics().request(route, status[0] or 499,
                                     (time.perf_counter() - start) * 1000)
