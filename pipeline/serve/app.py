"""Building the application: the models to serve, the router bound to the decoder, and the
builder `serve run` calls (`serve run jobs.serve:app_builder store=URI [key=value ...]`).

The replicas get the jobs' worker environment (`pipeline.ray_runtime.WORKER_ENV`: quiet, offline
model libraries) as their runtime environment, as every Ray worker the jobs start does.
"""

from __future__ import annotations

import logging

from ray.serve.config import RequestRouterConfig

from pipeline.kv.models import DEFAULT_ENCODER, DEFAULT_LLM
from pipeline.ray_runtime import WORKER_ENV
from pipeline.serve.affinity import ConversationAffinityRouter
from pipeline.serve.decoder import Decoder
from pipeline.serve.ingress import Router
from pipeline.serve.settings import ServeSettings
from pipeline.store.backends.base import Store
from pipeline.store.backends.uri import open_store
from pipeline.store.catalogue.manifest import ManifestError, list_conversations, read_manifest

APP_NAME = "epicache"
log = logging.getLogger("epicache.serve")


def resolve_models(store: Store, model: str | None, encoder: str | None) -> tuple[str, str]:
    """The model and encoder to serve: as given, else as named in the store's manifests (the
    first conversation's that reads: a corrupt one is logged and passed over, so one bad
    conversation does not keep the others from being served), else the packaged defaults for
    an empty store."""
    if model is None or encoder is None:
        for cid in list_conversations(store):
            try:
                records = read_manifest(store, cid) or []
            except ManifestError as e:
                log.warning("conversation %s: its manifest cannot be read (%s); its questions "
                            "will answer 503", cid, e.reason)
                continue
            if records:
                model = model or records[0].model_id
                encoder = encoder or records[0].encoder_id
                break
    return model or DEFAULT_LLM, encoder or DEFAULT_ENCODER


def build_app(settings: ServeSettings, model: str, encoder: str):
    """The Serve application: a router ingress bound to a decoder deployment (routed by
    conversation, `pipeline.serve.affinity`, unless `settings.affinity` is off)."""
    decoder_options: dict = {
        "ray_actor_options": {"num_cpus": settings.decoder_cpus,
                              "num_gpus": settings.decoder_gpus,
                              "runtime_env": {"env_vars": WORKER_ENV}},
        "max_ongoing_requests": settings.decoder_max_ongoing}
    if settings.affinity:
        decoder_options["request_router_config"] = RequestRouterConfig(
            request_router_class=ConversationAffinityRouter,
            request_router_kwargs={"max_imbalance": settings.affinity_max_imbalance})
    if settings.decoder_autoscale is not None:
        lo, hi = settings.decoder_autoscale
        decoder_options["autoscaling_config"] = {
            "min_replicas": lo, "initial_replicas": max(lo, 1), "max_replicas": hi,
            "target_ongoing_requests": settings.decoder_target_ongoing}
    else:
        decoder_options["num_replicas"] = settings.decoder_replicas
    decoder = Decoder.options(**decoder_options).bind(settings, model)
    return Router.options(
        num_replicas=settings.router_replicas, max_ongoing_requests=256,
        ray_actor_options={"num_cpus": settings.router_cpus,
                           "runtime_env": {"env_vars": WORKER_ENV}},
    ).bind(decoder, settings, model, encoder)


def app_builder(args: dict[str, str]):
    """For `serve run jobs.serve:app_builder store=URI [key=value ...]`: the keys are the
    `ServeSettings` fields, each value cast by its field's type (the bearer token defaults to
    $EPICACHE_SERVE_TOKEN)."""
    if "store" not in args:
        raise ValueError("serve run jobs.serve:app_builder needs store=URI")
    settings = ServeSettings.from_strings(args)
    store = open_store(settings.store, settings.store_options, create=False)
    model, encoder = resolve_models(store, settings.model, settings.encoder)
    return build_app(settings, model, encoder)
