"""The Ray Serve decode endpoint: route a question to its episode, fetch that cache, decode.

    python -m jobs.serve --store URI [--host 127.0.0.1] [--port 8000] [--auth-token T] ...
    serve run jobs.serve:app_builder store=URI [decoder_gpus=1 ...]

Two deployments. The *router* (the HTTP ingress, FastAPI) holds the encoder and, per
conversation, the manifest's centroids (read on first use, re-read when the manifest object
changes); it embeds the question and picks the episode. The *decoder* holds the model and a
byte-bounded LRU of episodic caches fetched from the store (checksum verified; the previous
turn's cache always stays resident) and decodes, whole or streamed. The router calls the
decoder through a `DeploymentHandle`, so each scales on its own (`--decoder-replicas`,
`--decoder-autoscale MIN:MAX`, `--decoder-gpus`). The HTTP API is documented in the README
("Serving").
"""

import argparse
import logging
import os
import signal
import sys
import textwrap
import threading
from dataclasses import fields

from ray import serve

from pipeline.cli.parser import make_parser

# The serving code lives in `pipeline/serve/`; these names stay importable from here (the tests, the
# README and `serve run jobs.serve:app_builder` use them).
from pipeline.serve.app import APP_NAME, app_builder, build_app, resolve_models
from pipeline.serve.errors import classify
from pipeline.serve.settings import AUTH_ENV, ServeSettings, parse_autoscale

__all__ = ["APP_NAME", "ServeSettings", "app_builder", "build_app", "build_parser", "classify",
           "main", "parse_args", "resolve_models", "settings_from_args"]


def _builder_help() -> str:
    """The `serve run` builder arguments, named from `ServeSettings` itself."""
    keys = ", ".join(f.name for f in fields(ServeSettings))
    return textwrap.fill(
        "Under Serve's own CLI, `serve run jobs.serve:app_builder store=URI [key=value ...]`, "
        f"the keys are the ServeSettings fields: {keys}. Each is the option of the same name "
        "above (- for _), except manifest_ttl_s (--manifest-ttl), decoder_timeout_s "
        "(--decoder-timeout) and default_max_new_tokens (the "
        "answer length when a request names none; no option). auth_token defaults to "
        f"${AUTH_ENV}, s3_endpoint to $EPICACHE_S3_ENDPOINT; --host, --port and --ray-address "
        "are this command's own.", width=88)


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.serve", __doc__, epilog=_builder_help())
    p.add_argument("--store", required=True, help="local folder or s3://bucket/prefix")
    p.add_argument("--s3-endpoint", default=os.environ.get("EPICACHE_S3_ENDPOINT") or None,
                   help="S3-compatible endpoint URL (default: $EPICACHE_S3_ENDPOINT, else AWS)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (loopback only; bind elsewhere only behind your own "
                        "proxy)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--model", help="LLM (default: the model named in the store's manifests)")
    p.add_argument("--encoder", help="sentence encoder (default: the encoder named in the store's "
                                     "manifests)")
    p.add_argument("--auth-token", default=None,
                   help=f"require 'Authorization: Bearer <token>' on /v1 (default: ${AUTH_ENV}, "
                        "else no token)")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS; else a local Ray is started)")
    p.add_argument("--router-replicas", type=int, default=1, help="router (HTTP ingress) replicas")
    p.add_argument("--router-cpus", type=float, default=0.5, help="Ray CPUs per router replica")
    p.add_argument("--decoder-replicas", type=int, default=1,
                   help="decoder replicas (fixed; see --decoder-autoscale)")
    p.add_argument("--decoder-autoscale", default=None, metavar="MIN:MAX",
                   help="autoscale the decoder between MIN and MAX replicas instead (default: "
                        "fixed --decoder-replicas)")
    p.add_argument("--decoder-target-ongoing", type=float, default=2.0,
                   help="autoscaling target: ongoing requests per decoder replica")
    p.add_argument("--decoder-cpus", type=float, default=1.0, help="Ray CPUs per decoder replica")
    p.add_argument("--decoder-gpus", type=float, default=0.0,
                   help="Ray GPUs per decoder replica, e.g. 1 to decode on a GPU")
    p.add_argument("--decoder-max-ongoing", type=int, default=16,
                   help="requests queued or running per decoder replica (up to --max-batch of "
                        "them decode together; fetches overlap)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="requests a decoder replica decodes together (continuous batching; 1: "
                        "one at a time)")
    p.add_argument("--max-batch-tokens", type=int, default=32768,
                   help="tokens in flight per decoder replica, summed over the batch: each "
                        "request's cache slots + prompt + max_new_tokens (bounds the memory of "
                        "the batch; a larger request runs alone)")
    p.add_argument("--decoder-timeout", type=float, default=300.0,
                   help="seconds the router waits for a decoder answer or the next streamed "
                        "piece before answering 504")
    p.add_argument("--cache-bytes", type=int, default=2 * 2**30,
                   help="bytes of resident caches per decoder replica (default: 2 GiB)")
    p.add_argument("--disk-cache", default=None, metavar="DIR",
                   help="a local folder for a bounded disk tier of verified cache objects under "
                        "the decoder's memory LRU (a restart or an eviction reads it, not the "
                        "store); replicas on one host may share it (default: no disk tier)")
    p.add_argument("--disk-cache-bytes", type=int, default=8 * 2**30,
                   help="bytes the --disk-cache folder may hold; least recently read objects "
                        "are evicted (default: 8 GiB)")
    p.add_argument("--prefetch-workers", type=int, default=1,
                   help="decoder threads that load a conversation's other episodes in the "
                        "background when it is first asked about (0: no prefetch)")
    p.add_argument("--manifest-ttl", type=float, default=5.0,
                   help="seconds a manifest is trusted before the store is checked for changes")
    p.add_argument("--max-question-chars", type=int, default=2000,
                   help="longest question accepted (longer: 422)")
    p.add_argument("--max-new-tokens-limit", type=int, default=512,
                   help="largest max_new_tokens a request may ask for (larger: 422)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="decoder torch threads (default: Ray's assignment)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def settings_from_args(a: argparse.Namespace) -> ServeSettings:
    return ServeSettings(
        store=a.store, s3_endpoint=a.s3_endpoint, model=a.model, encoder=a.encoder,
        auth_token=a.auth_token or os.environ.get(AUTH_ENV) or None,
        router_replicas=a.router_replicas, router_cpus=a.router_cpus,
        decoder_replicas=a.decoder_replicas,
        decoder_autoscale=parse_autoscale(a.decoder_autoscale),
        decoder_target_ongoing=a.decoder_target_ongoing, decoder_cpus=a.decoder_cpus,
        decoder_gpus=a.decoder_gpus, decoder_max_ongoing=a.decoder_max_ongoing,
        cache_bytes=a.cache_bytes, manifest_ttl_s=a.manifest_ttl,
        max_question_chars=a.max_question_chars, max_new_tokens_limit=a.max_new_tokens_limit,
        torch_threads=a.torch_threads, max_batch=a.max_batch,
        max_batch_tokens=a.max_batch_tokens, decoder_timeout_s=a.decoder_timeout,
        disk_cache=a.disk_cache, disk_cache_bytes=a.disk_cache_bytes,
        prefetch_workers=a.prefetch_workers)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from pipeline.store.base import StoreError
    from pipeline.store.uri import open_store

    try:
        settings = settings_from_args(a)
        store = open_store(settings.store, endpoint_url=settings.s3_endpoint, create=False)
        model, encoder = resolve_models(store, settings.model, settings.encoder)
    except (StoreError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray

    from pipeline.ray_runtime import init_ray

    joined = bool(a.ray_address or os.environ.get("RAY_ADDRESS"))
    init_ray(a.ray_address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": a.host, "port": a.port})
        serve.run(build_app(settings, model, encoder), name=APP_NAME, route_prefix="/")
        print(f"serving {store.uri} on http://{a.host}:{a.port} (model {model}, encoder "
              f"{encoder}{', bearer token required' if settings.auth_token else ''}); "
              "Ctrl-C to stop", flush=True)
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
