"""Where caches, manifests and calibration profiles live: a key-value interface over bytes.

Writes are atomic (a reader never sees half an object) and keys are built only from sanitised
ids (`cache_key`, `manifest_key`, `profile_key`). Each backend is one module behind `Store`
(`local`, `s3`, `memory`), registered by its URI scheme in `pipeline.store.backends.uri.BACKENDS`;
`open_store` picks one from a URI. What callers ask of a backend beyond bytes (where an outside
engine finds its objects, what that engine needs to reach them, how to open a sibling URI) is a
capability here, so nothing outside `pipeline/store/` tests a store's class.
"""

from __future__ import annotations

import io
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pipeline.corpus.schema import check_safe_id

_KEY_PART_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class StoreError(RuntimeError):
    """A store that cannot be opened, or an object that cannot be read or written."""


class ObjectNotFound(StoreError, KeyError):
    """A key the store does not hold; its message reads as a message (KeyError's own `str`
    would quote it, and quote it again when a reader adds to it)."""

    __str__ = StoreError.__str__


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


@dataclass(frozen=True)
class StoreOptions:
    """How to reach a store beyond its URI, passed through unread by callers: the endpoint of
    an S3-compatible server and the region (None: resolved by the S3 backend, from
    $EPICACHE_S3_ENDPOINT or the AWS chain). Never credentials: those come from the AWS chain
    when a client is made, so nothing that carries options can leak them."""
    endpoint: str | None = None
    region: str | None = None

    def __repr__(self) -> str:
        """Without any user:password@ part of the endpoint (options are logged and shipped)."""
        endpoint = re.sub(r"//[^/@]*@", "//", self.endpoint) if self.endpoint else None
        return f"StoreOptions(endpoint={endpoint!r}, region={self.region!r})"


class Store(ABC):
    """Bytes under safe keys. Stores pickle without credentials, so Ray tasks can take them."""
    uri: str
    # what it was opened with: a sibling URI (an s3:// corpus beside an S3 store) opens alike
    options: StoreOptions = StoreOptions()

    @classmethod
    def from_uri(cls, uri: str, options: StoreOptions, *, create: bool = True) -> Store:
        """The store a URI of this backend's scheme names (`open_store` calls it);
        `create=False` refuses one that does not exist."""
        raise NotImplementedError(f"{cls.__name__} is not opened from a URI")

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

    def sizes(self, keys: Iterable[str]) -> dict[str, int | None]:
        """The size of each object (None: missing), without reading any: a build's skip check
        confirms a manifest's objects with it. One `info` each here; a backend where a request
        is dear batches them (S3: one listing per folder)."""
        out: dict[str, int | None] = {}
        for key in keys:
            try:
                out[key] = self.info(key).size
            except ObjectNotFound:
                out[key] = None
        return out

    def list_partial(self) -> list[Partial]:
        """Writes that never finished (interrupted builds); none by default."""
        return []

    def delete_partial(self, partial: Partial) -> None:
        raise NotImplementedError

    # -- capabilities: what callers ask instead of testing the class ---------------------------
    def location(self, key: str) -> str | None:
        """Where an engine outside this process (delta-rs, DuckDB) reads the objects under `key`:
        a path or URL, or None when it cannot (an in-memory store). The manifest table needs one."""
        return None

    def storage_options(self, what: str) -> dict[str, str] | None:
        """What such an engine needs besides the location (delta-rs storage options, credentials
        read now and never kept); None when nothing. `what` names the reader in an error."""
        return None
