"""The serving settings: what the CLI and `app_builder` build, and what the deployments read."""

from dataclasses import dataclass, field

AUTH_ENV = "EPICACHE_SERVE_TOKEN"


@dataclass
class ServeSettings:
    """Everything the two deployments need; built by the CLI or by `app_builder`."""
    store: str
    s3_endpoint: str | None = None
    model: str | None = None  # None: the model named in the store's manifests
    encoder: str | None = None  # None: the encoder named in the store's manifests
    auth_token: str | None = field(default=None, repr=False)
    router_replicas: int = 1
    router_cpus: float = 0.5
    decoder_replicas: int = 1
    decoder_autoscale: tuple[int, int] | None = None  # (min, max) replicas
    decoder_target_ongoing: float = 2.0  # autoscaling target per decoder replica
    decoder_cpus: float = 1.0
    decoder_gpus: float = 0.0
    decoder_max_ongoing: int = 16
    cache_bytes: int = 2 * 2**30  # the decoder's LRU of loaded caches, per replica
    manifest_ttl_s: float = 5.0  # how long a manifest is trusted before checking the store
    max_question_chars: int = 2000
    max_new_tokens_limit: int = 512
    default_max_new_tokens: int = 32
    torch_threads: int | None = None  # decoder torch threads (default: Ray's assignment)
    max_batch: int = 8  # requests decoded together per decoder replica
    max_batch_tokens: int = 32768  # tokens in flight per replica: cache slots + prompt + answer
    decoder_timeout_s: float = 300.0  # the router's wait for a decoder answer (or stream piece)
    disk_cache: str | None = None  # a local folder: the decoder's disk tier (None: no tier)
    disk_cache_bytes: int = 8 * 2**30  # the disk tier's bound, per folder
    prefetch_workers: int = 1  # decoder threads prefetching a conversation's other episodes

    def __post_init__(self) -> None:
        if self.decoder_autoscale is not None:
            lo, hi = self.decoder_autoscale
            if not 0 <= lo <= hi or hi < 1:
                raise ValueError(f"decoder autoscale needs 0 <= min <= max, max >= 1; got {lo}:{hi}")
        for name in ("router_replicas", "decoder_replicas", "max_question_chars",
                     "max_new_tokens_limit", "default_max_new_tokens", "decoder_max_ongoing",
                     "max_batch", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.decoder_timeout_s <= 0:
            raise ValueError(f"decoder_timeout_s must be > 0, got {self.decoder_timeout_s}")
        if self.cache_bytes < 0 or self.manifest_ttl_s < 0:
            raise ValueError("cache_bytes and manifest_ttl_s must be >= 0")
        if self.disk_cache_bytes < 0 or self.prefetch_workers < 0:
            raise ValueError("disk_cache_bytes and prefetch_workers must be >= 0")


def parse_autoscale(value: str | None) -> tuple[int, int] | None:
    """`MIN:MAX` (the CLI's --decoder-autoscale, the builder's decoder_autoscale) as a pair."""
    if not value:
        return None
    lo, sep, hi = str(value).partition(":")
    if not sep:
        raise ValueError(f"autoscale takes MIN:MAX, got {value!r}")
    return int(lo), int(hi)
