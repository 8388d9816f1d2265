"""Where caches, manifests and calibration profiles live: a key-value interface over bytes.

Writes are atomic (a reader never sees half an object) and keys are built only from sanitised
ids (`cache_key`, `manifest_key`, `profile_key`). The backends are `pipeline.store.local` and
`pipeline.store.s3`; `pipeline.store.uri.open_store` picks one from a URI.
"""

from __future__ import annotations

import io
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pipeline.corpus.schema import check_safe_id

_KEY_PART_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class StoreError(RuntimeError):
    """A store that cannot be opened, or an object that cannot be read or written."""


class ObjectNotFound(StoreError, KeyError):
    pass


def check_key(key: str) -> str:
    """Keys are '/'-joined parts of safe characters, never absolute, never '..'."""
    parts = key.split("/")
    if not key or any(not p or p in (".", "..") or set(p) - _KEY_PART_CHARS for p in parts):
        raise StoreError(f"unsafe object key {key!r}")
    return key


def cache_key(conversation_id: str, config_hash: str, episode: int,
              sha256: str | None = None) -> str:
    """Where an episode's cache object goes. With its content's SHA-256 the key names that
    version alone: a rebuild or an append writes a new object beside the one being served, and
    the new manifest names it (`jobs.gc` removes the old one once no manifest does)."""
    version = f"-{sha256[:16]}" if sha256 else ""
    return (f"caches/{check_safe_id(conversation_id)}/{config_hash}/"
            f"episode-{episode}{version}.safetensors")


def manifest_key(conversation_id: str) -> str:
    return f"manifests/{check_safe_id(conversation_id)}.parquet"


def profile_key(model_key: str, calibration_hash: str) -> str:
    return f"profiles/{check_safe_id(model_key, 'model key')}-{calibration_hash}.json"


@dataclass(frozen=True)
class Partial:
    """A write that never finished: a local temporary file or an incomplete multipart upload."""
    name: str  # what `delete_partial` takes
    key: str  # the object it was meant to become (best effort)
    age_seconds: float


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    modified: float  # seconds since the epoch


class Store(ABC):
    """Bytes under safe keys. Stores pickle without credentials, so Ray tasks can take them."""
    uri: str

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Write atomically: the object is either absent or complete."""

    @abstractmethod
    def get(self, key: str) -> bytes: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def download(self, key: str, path: str | Path) -> None:
        """Copy an object to a local file (backends stream it rather than hold it in memory)."""
        Path(path).write_bytes(self.get(key))

    def open(self, key: str) -> BinaryIO:
        """A buffered binary stream of the object, read as it is consumed (a large corpus object
        is never held whole; a cache object can be checksummed as it arrives). Close it: use
        `with store.open(key) as f`. A missing object raises `ObjectNotFound` here."""
        return io.BytesIO(self.get(key))

    @abstractmethod
    def info(self, key: str) -> ObjectInfo:
        """Size and modification time, without reading the object."""

    def list_partial(self) -> list[Partial]:
        """Writes that never finished (interrupted builds); none by default."""
        return []

    def delete_partial(self, partial: Partial) -> None:
        raise NotImplementedError
