"""The serving settings: what the deployments read, and the one description of each setting.

`jobs.serve` makes its options from these fields (each field's help is its metadata; the
option is the field's name with `-` for `_` unless the metadata names another flag), and `serve
run jobs.serve:app_builder key=value ...` casts its text by the field's type (`from_strings`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import RoutingConfig, TopUpConfig
from pipeline.config.fields import parser_of
from pipeline.config.limits import CHARS_PER_TOKEN, DEFAULT_LIMITS, AnswerLimits
from pipeline.store.backends.base import StoreOptions
from pipeline.store.backends.s3 import s3_endpoint

AUTH_ENV = "EPICACHE_SERVE_TOKEN"
# affinity: how many requests longer than the shortest queue a conversation's replica may be
DEFAULT_MAX_IMBALANCE = 4


def parse_autoscale(value: str | None) -> tuple[int, int] | None:
    """`MIN:MAX` (the CLI's --decoder-autoscale, the builder's decoder_autoscale) as a pair."""
    if not value:
        return None
    lo, sep, hi = str(value).partition(":")
    if not sep:
        raise ValueError(f"autoscale takes MIN:MAX, got {value!r}")
    return int(lo), int(hi)


def setting(default: Any, help: str, **metadata: Any) -> Any:
    """A field with its help (and `flag`, `metavar`, `parse`, or `cli=False`) in its metadata."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class ServeSettings:
    """Everything the two deployments need; built by the CLI or by `app_builder`."""
    store: str = field(metadata={"help": "local folder or s3://bucket/prefix"})
    s3_endpoint: str | None = setting(
        None, "S3-compatible endpoint URL (default: $EPICACHE_S3_ENDPOINT, else "
              "$AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL, else AWS)")
    s3_region: str | None = setting(None, "S3 region (default: the AWS chain)")
    model: str | None = setting(None, "LLM (default: the model named in the store's manifests)")
    encoder: str | None = setting(
        None, "sentence encoder (default: the encoder named in the store's manifests)")
    auth_token: str | None = field(default=None, repr=False, metadata={
        "help": f"require 'Authorization: Bearer <token>' on /v1 (default: ${AUTH_ENV}, else "
                "no token)"})
    route_by: str = setting(RoutingConfig.router,
                          "how a question picks its episode: window (the nearest window's "
                          "episode) or centroid (the paper's) (docs/serving.md#routing)")
    two_below: float = setting(
        RoutingConfig.two_below, "read the best two episodes together when their route scores "
                                 "differ by less than this (0: one episode always)")
    topup: bool = setting(
        TopUpConfig.enabled, "top up each question: after routing, prefill the question's nearest "
                             "turns of the whole conversation (its turn index) after the cache, "
                             "right before the question (docs/serving.md#top-up)")
    topup_turns: int | None = setting(
        TopUpConfig.turns, "top-up: the question's nearest turns searched (0: every turn, as "
                           "many as --topup-max-tokens holds)", zero_is_none=True,
        parse=lambda text: None if text.strip().lower() in ("0", "none") else int(text))
    topup_max_tokens: int = setting(
        TopUpConfig.max_tokens, "top-up: its text's tokens at most (turns past it are left out)")
    topup_skip_held: bool = setting(
        TopUpConfig.skip_held, "top-up: skip the turns the episodes read hold (their windows)")
    topup_nearer_than_held: bool = setting(
        TopUpConfig.nearer_than_held, "top-up: only the turns nearer the question than every "
                                      "turn the episodes read hold (with --topup-skip-held)")
    topup_read_once: bool = setting(
        TopUpConfig.read_once, "top-up: read its turns once, as the text: the cache read hides "
                               "its entries of them (needs a turn index with token spans: "
                               "built from turn index format 2 on)")
    router_replicas: int = setting(1, "router (HTTP ingress) replicas")
    router_cpus: float = setting(0.5, "Ray CPUs per router replica")
    decoder_replicas: int = setting(1, "decoder replicas (fixed; see --decoder-autoscale)")
    decoder_autoscale: tuple[int, int] | None = setting(
        None, "autoscale the decoder between MIN and MAX replicas instead (default: fixed "
              "--decoder-replicas)", metavar="MIN:MAX", parse=parse_autoscale)
    decoder_target_ongoing: float = setting(
        2.0, "autoscaling target: ongoing requests per decoder replica")
    affinity: bool = setting(
        True, "send a conversation's questions to the decoder replica that holds its caches "
              "(rendezvous hashing on the conversation, bounded by --affinity-max-imbalance; "
              "off: Serve's power of two choices on queue length) (docs/serving.md#many-replicas)")
    affinity_max_imbalance: int = setting(
        DEFAULT_MAX_IMBALANCE, "affinity: a replica whose queue is more than this many requests "
                               "longer than the shortest is passed over for the next one")
    decoder_cpus: float = setting(1.0, "Ray CPUs per decoder replica")
    decoder_gpus: float = setting(0.0, "Ray GPUs per decoder replica, e.g. 1 to decode on a GPU")
    decoder_max_ongoing: int = setting(
        16, "requests queued or running per decoder replica (up to --max-batch of them decode "
            "together; fetches overlap)")
    cache_bytes: int = setting(
        2 * 2**30, "bytes of resident caches per decoder replica, its LRU (default: 2 GiB)")
    manifest_ttl_s: float = setting(
        5.0, "seconds a manifest is trusted before the store is checked for changes",
        flag="--manifest-ttl")
    manifest_cache_bytes: int = setting(
        256 * 2**20,  # pipeline.answer.plan's default (not imported here: slow to import)
        "bytes of conversation manifests (their routing embeddings) a router replica keeps, "
        "least recently used evicted first; an evicted one is read again at its next question "
        "(default: 256 MiB, about a thousand long conversations)")
    max_question_tokens: int = setting(
        DEFAULT_LIMITS.max_question_tokens,
        f"longest question accepted, in the model's tokens (longer: 422; one over "
        f"{CHARS_PER_TOKEN} characters a token is refused before it is tokenised)")
    max_new_tokens_limit: int = setting(
        DEFAULT_LIMITS.max_new_tokens, "largest max_new_tokens a request may ask for (larger: 422)")
    max_live_tokens: int = setting(
        DEFAULT_LIMITS.max_live_tokens,
        f"longest live tail accepted (a chat request's messages before its question, the "
        f"answer body's 'live'), in the model's tokens as the chat template renders them "
        f"(longer: 422; over {CHARS_PER_TOKEN} characters a token is refused before it is "
        f"tokenised)")
    max_body_bytes: int = setting(
        2**20, "largest request body in bytes (larger: 413, refused before it is read whole)")
    default_max_new_tokens: int = setting(
        32, "the answer length when a request names none", cli=False)
    torch_threads: int | None = setting(
        None, "decoder torch threads (default: Ray's assignment)")
    max_batch: int = setting(
        8, "requests a decoder replica decodes together (continuous batching; 1: one at a time)")
    max_batch_tokens: int = setting(
        32768, "tokens in flight per decoder replica, summed over the batch: each request's "
               "cache slots + prompt + max_new_tokens (bounds the memory of the batch; a larger "
               "request runs alone)")
    decoder_timeout_s: float = setting(
        300.0, "seconds the router waits for a decoder answer or the next streamed piece "
               "before answering 504", flag="--decoder-timeout")
    disk_cache: str | None = setting(
        None, "a local folder for a bounded disk tier of verified cache objects under the "
              "decoder's memory LRU (a restart or an eviction reads it, not the store); "
              "replicas on one host may share it (default: no disk tier)", metavar="DIR")
    disk_cache_bytes: int = setting(
        8 * 2**30, "bytes the --disk-cache folder may hold; least recently read objects are "
                   "evicted (default: 8 GiB)")
    prefetch_workers: int = setting(
        1, "decoder threads that load a conversation's other episodes in the background when "
           "it is first asked about (0: no prefetch)")

    def __post_init__(self) -> None:
        self.s3_endpoint = s3_endpoint(self.s3_endpoint)
        self.auth_token = self.auth_token or os.environ.get(AUTH_ENV) or None
        if self.decoder_autoscale is not None:
            lo, hi = self.decoder_autoscale
            if not 0 <= lo <= hi or hi < 1:
                raise ValueError(
                    f"decoder autoscale needs 0 <= min <= max, max >= 1; got {lo}:{hi}")
        for name in ("router_replicas", "decoder_replicas", "max_question_tokens",
                     "max_new_tokens_limit", "max_live_tokens", "default_max_new_tokens",
                     "decoder_max_ongoing",
                     "max_batch", "max_batch_tokens", "max_body_bytes", "topup_turns",
                     "topup_max_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(f"default_max_new_tokens ({self.default_max_new_tokens}) is over "
                             f"max_new_tokens_limit ({self.max_new_tokens_limit})")
        if self.decoder_timeout_s <= 0:
            raise ValueError(f"decoder_timeout_s must be > 0, got {self.decoder_timeout_s}")
        if not self.store.strip():
            raise ValueError(f"store must name a folder or s3://bucket/prefix, got {self.store!r}")
        try:  # a router by name, two_below >= 0
            self.routing_config
        except ValueError as e:
            raise ValueError(f"route_by / two_below: {e}") from None
        try:  # nearer_than_held only with skip_held
            self.topup_config
        except ValueError as e:
            raise ValueError(f"topup: {e}") from None
        for name in ("router_cpus", "decoder_cpus", "decoder_gpus"):  # 0: Ray's 0-CPU actors
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not (math.isfinite(self.decoder_target_ongoing) and self.decoder_target_ongoing > 0):
            raise ValueError(f"decoder_target_ongoing must be > 0, got "
                             f"{self.decoder_target_ongoing}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be at least 1, got {self.torch_threads}")
        if self.affinity_max_imbalance < 0:
            raise ValueError(f"affinity_max_imbalance must be >= 0, got "
                             f"{self.affinity_max_imbalance}")
        if self.cache_bytes < 0 or self.manifest_ttl_s < 0 or self.manifest_cache_bytes < 0:
            raise ValueError("cache_bytes, manifest_ttl_s and manifest_cache_bytes must be >= 0")
        if self.disk_cache_bytes < 0 or self.prefetch_workers < 0:
            raise ValueError("disk_cache_bytes and prefetch_workers must be >= 0")

    @property
    def store_options(self) -> StoreOptions:
        """How the deployments reach the store: the endpoint resolved here, where the command
        runs, so that every replica uses the one the operator's environment named, and the
        region given (None: each replica's AWS chain)."""
        return StoreOptions(endpoint=self.s3_endpoint, region=self.s3_region)

    @property
    def limits(self) -> AnswerLimits:
        """The limits on one answer, as `jobs.answer` and the library's `Answerer` hold them."""
        return AnswerLimits(max_question_tokens=self.max_question_tokens,
                            max_new_tokens=self.max_new_tokens_limit,
                            max_live_tokens=self.max_live_tokens)

    @property
    def routing_config(self) -> RoutingConfig:
        """How the router picks a question's episode(s) (`pipeline.routers`)."""
        return RoutingConfig(self.route_by, self.two_below)

    @property
    def topup_config(self) -> TopUpConfig:
        """The question-time top-up the router computes (`pipeline.answer.topup`)."""
        return TopUpConfig(self.topup, self.topup_turns, self.topup_max_tokens,
                           self.topup_nearer_than_held, self.topup_skip_held,
                           self.topup_read_once)

    @classmethod
    def from_strings(cls, args: dict[str, str], **defaults: Any) -> "ServeSettings":
        """Settings from `key=value` text (Serve's builder arguments), each value cast by its
        field's type; `defaults` fill the keys not given. An unknown key is a ValueError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - names)
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}; the settings are: "
                             f"{', '.join(sorted(names))}")
        values = {name: parser_of(cls, name)(text) for name, text in args.items()}
        return cls(**(defaults | values))
