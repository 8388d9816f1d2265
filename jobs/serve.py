"""The Ray Serve decode endpoint: route a question to its episode, fetch that cache, decode.

    python -m jobs.serve --store URI [--host 127.0.0.1] [--port 8000] [--auth-token T] ...
    serve run jobs.serve:app_builder store=URI [decoder_gpus=1 ...]

Two deployments. The *router* (the HTTP ingress, FastAPI) holds the encoder and, per
conversation, the manifest's routing embeddings (read on first use, re-read when the manifest
object changes, kept under --manifest-cache-bytes); it embeds the question, picks the episode
and renders a chat request's earlier messages, its live tail, with the model's chat template.
The *decoder* holds the model and a byte-bounded LRU of episodic caches fetched from the store
(checksum verified; the previous turn's cache always stays resident) and decodes, whole or
streamed. The router calls the decoder through a `DeploymentHandle`, so each scales on its own
(`--decoder-replicas`, `--decoder-autoscale MIN:MAX`, `--decoder-gpus`). The HTTP API is
documented in docs/serving.md.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import textwrap
import threading
from dataclasses import fields
from typing import Any

from pipeline.cli.numbers import port_number
from pipeline.cli.options import SERVE_OPTIONS, add_serve_options, settings_from_args
from pipeline.cli.parser import make_parser
from pipeline.serve.settings import AUTH_ENV, ServeSettings

__all__ = ["ServeSettings", "app_builder", "build_parser", "exposure_error", "is_loopback",
           "main", "parse_args", "settings_from_args"]

log = logging.getLogger("epicache.serve")


def app_builder(args: dict[str, str]) -> Any:
    """For `serve run jobs.serve:app_builder store=URI [key=value ...]`: the keys are the
    `ServeSettings` fields (`pipeline.serve.app.app_builder`)."""
    from pipeline.serve.app import app_builder as build  # start-up time: see `main`

    return build(args)


def _builder_help() -> str:
    """The `serve run` builder arguments, named from `ServeSettings` itself."""
    keys = ", ".join(f.name for f in fields(ServeSettings))
    renamed = ", ".join(f"{o.path} ({o.flag})" for o in SERVE_OPTIONS
                        if o.flag != "--" + o.path.replace("_", "-"))
    no_option = ", ".join(f.name for f in fields(ServeSettings) if not f.metadata.get("cli", True))
    return textwrap.fill(
        "Under Serve's own CLI, `serve run jobs.serve:app_builder store=URI [key=value ...]`, "
        f"the keys are the ServeSettings fields: {keys}. Each is the option of the same name "
        f"above (- for _), except {renamed}, and {no_option} (no option). auth_token defaults "
        f"to ${AUTH_ENV}, s3_endpoint to $EPICACHE_S3_ENDPOINT; --host, --port and "
        "--ray-address are this command's own.", width=88)


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.serve", __doc__, epilog=_builder_help())
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; any but loopback needs a bearer token (--auth-token or "
                        f"${AUTH_ENV}) or --insecure-no-auth")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve a non-loopback --host with no token: anyone who reaches the port "
                        "can read the store's conversations and drive decodes (a warning is "
                        "logged)")
    p.add_argument("--port", type=port_number, default=8000, help="HTTP port")
    p.add_argument("--metrics-port", type=port_number, default=None,
                   help="the local Ray's metrics export port (Prometheus text at "
                        "http://127.0.0.1:PORT/metrics; docs/serving.md#metrics) (default: a "
                        "free port Ray picks; a joined cluster's is the one its `ray start "
                        "--metrics-export-port` named)")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS; else a local Ray is started)")
    add_serve_options(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another host name: it may resolve to any interface
        return False


def exposure_error(host: str, settings: ServeSettings, insecure_no_auth: bool) -> str | None:
    """Why serving `host` as configured is refused (None: it is not). Beyond loopback, a
    request needs a bearer token, unless the operator says in so many words that it need not."""
    if is_loopback(host) or settings.auth_token:
        return None
    if insecure_no_auth:
        log.warning("serving %s with no bearer token (--insecure-no-auth): anyone who reaches "
                    "the port can read the store's conversations and drive decodes", host)
        return None
    return (f"--host {host} is not loopback and no bearer token is set: give --auth-token (or "
            f"${AUTH_ENV}), or --insecure-no-auth to serve it open")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    refused = exposure_error(a.host, settings, a.insecure_no_auth)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    # Start-up time: Ray Serve, torch and the models are imported once the arguments are
    # known good, so that --help and an argument error answer at once.
    import ray
    from ray import serve

    from pipeline.ray_runtime import init_ray
    from pipeline.serve.app import APP_NAME, build_app, resolve_models
    from pipeline.store.backends.base import StoreError
    from pipeline.store.backends.uri import open_store

    try:
        store = open_store(settings.store, settings.store_options, create=False)
        model, encoder = resolve_models(store, settings.model, settings.encoder)
    except (StoreError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    joined = bool(a.ray_address or os.environ.get("RAY_ADDRESS"))
    init_ray(a.ray_address, a.metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": a.host, "port": a.port})
        serve.run(build_app(settings, model, encoder), name=APP_NAME, route_prefix="/")
        print(f"serving {store.uri} on http://{a.host}:{a.port} (model {model}, encoder "
              f"{encoder}{', bearer token required' if settings.auth_token else ''}); "
              + (f"metrics on http://127.0.0.1:{a.metrics_port}/metrics; "
                 if a.metrics_port and not joined else "") + "Ctrl-C to stop", flush=True)
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
