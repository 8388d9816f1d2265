"""Run by tests/integration/test_metrics.py as a script (`python metrics_probe.py METRICS_PORT
HTTP_PORT STORE_DIR`): a local Ray of its own exporting metrics on METRICS_PORT, where every
metric of `pipeline.telemetry` is recorded the way production records it:

- the build's, by the real build driver (`run_build`) over three synthetic conversations (one
  failing), run twice (the second run skips what the first built);
- the Serve replicas', in a real Serve deployment whose FastAPI ingress counts its requests with
  the router's middleware (`RequestMetrics`) and whose requests record the router's and the
  decoder's metrics (made in the replica, so tagged with its deployment, replica, application).

It prints "ready" once everything is recorded, then keeps Ray up until its stdin closes, and
shuts Ray down. Its own classes live in `__main__`, so Ray ships them by value (and their
annotations are not strings: FastAPI reads `Request` from them in the replica).
"""

import logging
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import ray
from fastapi import FastAPI, Request
from ray import serve

from lab.rehearsal import SYNTHETIC_CONFIG, SYNTHETIC_STAGES, write_synthetic_corpus
from pipeline import telemetry
from pipeline.builder.driver import run_build
from pipeline.config import DriverOptions
from pipeline.ray_runtime import WORKER_ENV
from pipeline.serve.errors import ApiError, add_exception_handlers, classify
from pipeline.store.backends.local import LocalStore

app = FastAPI()
add_exception_handlers(app)
app.add_middleware(telemetry.RequestMetrics, routes={"/answer": "answer"},
                   status_of=lambda e: classify(e)[0])


@serve.deployment(name="MetricsProbe")
@serve.ingress(app)
class Probe:
    """Records every serve metric once per request, as the router and the decoder do."""

    def __init__(self):
        self.router, self.decoder = telemetry.router_metrics(), telemetry.decoder_metrics()

    @app.get("/answer")
    async def answer(self) -> dict:
        self.router.routed(1)
        self.router.routed(2)
        self.router.topup("used")
        d = self.decoder
        d.cache_read(False, 42.0, 1 << 20)
        d.object_read(False, 4096, "request", True)
        d.object_read(False, 4096, "prefetch", True)
        d.resident(2 << 20)
        d.decoded(800.0, 14)
        d.batch_step(3)
        d.queue_depth(1)
        return {"ok": True}

    @app.get("/chat")
    async def chat(self, request: Request) -> dict:
        telemetry.name_route(request.scope, "chat_stream")
        raise ApiError(503, "cache unavailable")


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def main(metrics_port: int, http_port: int, store_dir: Path) -> None:
    t0 = time.monotonic()
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             logging_level=logging.WARNING, runtime_env={"env_vars": WORKER_ENV},
             _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    print(f"ray up in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
    try:
        corpus = store_dir / "corpus.jsonl"
        write_synthetic_corpus(corpus, 3, failures={1: "raise"})
        store = LocalStore(store_dir / "store")
        options = DriverOptions(max_in_flight=2, max_retries=0, progress=False)
        for _ in range(2):
            run_build(str(corpus), store, SYNTHETIC_CONFIG, options, stages=SYNTHETIC_STAGES)
        telemetry.build_metrics().conversation("appended")  # a grown conversation's outcome
        print(f"built in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)

        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(Probe.bind(), name="probe", route_prefix="/")
        statuses = [_get(f"http://127.0.0.1:{http_port}{path}")
                    for path in ("/answer", "/chat", "/nowhere")]
        assert statuses == [200, 503, 404], statuses
        print(f"served in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
        print("ready", flush=True)
        sys.stdin.read()  # until the test closes it
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
