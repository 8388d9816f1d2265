"""Building the application: the models to serve, the router bound to the decoder, and the
builder `serve run` calls (`serve run jobs.serve:app_builder store=URI [key=value ...]`).

The replicas get the jobs' worker environment (`pipeline.ray_runtime.WORKER_ENV`: quiet, offline
model libraries) as their runtime environment, as every Ray worker the jobs start does.
"""

import os
from dataclasses import asdict

from pipeline.ray_runtime import WORKER_ENV
from pipeline.serve.decoder import Decoder
from pipeline.serve.router import Router
from pipeline.serve.settings import AUTH_ENV, ServeSettings, parse_autoscale

APP_NAME = "epicache"


def resolve_models(store, model: str | None, encoder: str | None) -> tuple[str, str]:
    """The model and encoder to serve: as given, else as named in the store's manifests (the
    first conversation's), else the packaged defaults for an empty store."""
    from pipeline.kv import models
    from pipeline.store.manifest import list_conversations, read_manifest

    if model is None or encoder is None:
        for cid in list_conversations(store)[:1]:
            rows = read_manifest(store, cid) or []
            if rows:
                model = model or rows[0]["model_id"]
                encoder = encoder or rows[0]["encoder_id"]
    return model or models.DEFAULT_LLM, encoder or models.DEFAULT_ENCODER


def build_app(settings: ServeSettings, model: str, encoder: str):
    """The Serve application: a router ingress bound to a decoder deployment."""
    decoder_options: dict = {
        "ray_actor_options": {"num_cpus": settings.decoder_cpus,
                              "num_gpus": settings.decoder_gpus,
                              "runtime_env": {"env_vars": WORKER_ENV}},
        "max_ongoing_requests": settings.decoder_max_ongoing}
    if settings.decoder_autoscale is not None:
        lo, hi = settings.decoder_autoscale
        decoder_options["autoscaling_config"] = {
            "min_replicas": lo, "initial_replicas": max(lo, 1), "max_replicas": hi,
            "target_ongoing_requests": settings.decoder_target_ongoing}
    else:
        decoder_options["num_replicas"] = settings.decoder_replicas
    decoder = Decoder.options(**decoder_options).bind(
        settings.store, settings.s3_endpoint, model, settings.cache_bytes, settings.torch_threads,
        settings.disk_cache, settings.disk_cache_bytes, settings.prefetch_workers,
        max_batch=settings.max_batch, max_batch_tokens=settings.max_batch_tokens)
    return Router.options(
        num_replicas=settings.router_replicas, max_ongoing_requests=256,
        ray_actor_options={"num_cpus": settings.router_cpus,
                           "runtime_env": {"env_vars": WORKER_ENV}},
    ).bind(decoder, asdict(settings), model, encoder)


def app_builder(args: dict[str, str]):
    """For `serve run jobs.serve:app_builder store=URI [key=value ...]` (keys as in
    `ServeSettings`; the bearer token from $EPICACHE_SERVE_TOKEN)."""
    from pipeline.store.uri import open_store

    casts = {"router_replicas": int, "decoder_replicas": int, "decoder_max_ongoing": int,
             "cache_bytes": int, "max_question_chars": int, "max_new_tokens_limit": int,
             "default_max_new_tokens": int, "torch_threads": int, "router_cpus": float,
             "decoder_cpus": float, "decoder_gpus": float, "decoder_target_ongoing": float,
             "manifest_ttl_s": float, "decoder_autoscale": parse_autoscale, "max_batch": int,
             "max_batch_tokens": int, "decoder_timeout_s": float,
             "disk_cache_bytes": int, "prefetch_workers": int}
    if "store" not in args:
        raise ValueError("serve run jobs.serve:app_builder needs store=URI")
    kwargs = {k: casts.get(k, str)(v) for k, v in args.items()}
    kwargs.setdefault("auth_token", os.environ.get(AUTH_ENV) or None)
    kwargs.setdefault("s3_endpoint", os.environ.get("EPICACHE_S3_ENDPOINT") or None)
    settings = ServeSettings(**kwargs)
    store = open_store(settings.store, endpoint_url=settings.s3_endpoint, create=False)
    model, encoder = resolve_models(store, settings.model, settings.encoder)
    return build_app(settings, model, encoder)
