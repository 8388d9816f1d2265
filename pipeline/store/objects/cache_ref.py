"""CacheRef: what a reader needs of an episode to fetch and check its cache object (a manifest
record's `ref`). Its own module so that the catalogue names it without loading torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CacheRef:
    """What a reader needs of an episode to fetch and check its cache object: where it is, the
    bytes to expect, and the models it belongs to (small: it crosses Ray handles)."""
    conversation_id: str
    episode: int
    object_key: str
    sha256: str
    object_bytes: int | None
    model_id: str
    encoder_id: str
    model_fingerprint: str | None  # None: built before caches were bound to their model
    encoder_fingerprint: str | None
