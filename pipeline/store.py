"""Where caches, manifests and calibration profiles live: a key-value interface over bytes.

Writes are atomic (a reader never sees half an object) and keys are built only from sanitised
ids. The local directory store is the default; `open_store` picks a backend from a URI.
"""

from __future__ import annotations

import os
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path

from pipeline.corpus import check_safe_id

_UMASK = os.umask(0)
os.umask(_UMASK)
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


def cache_key(conversation_id: str, config_hash: str, episode: int) -> str:
    return f"caches/{check_safe_id(conversation_id)}/{config_hash}/episode-{episode}.safetensors"


def manifest_key(conversation_id: str) -> str:
    return f"manifests/{check_safe_id(conversation_id)}.parquet"


def profile_key(model_key: str, calibration_hash: str) -> str:
    return f"profiles/{check_safe_id(model_key, 'model key')}-{calibration_hash}.json"


class Store(ABC):
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


class LocalStore(Store):
    """A directory; atomic writes by write-to-temporary then rename in the same folder."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        self.uri = str(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create store folder {self.root}: {e.strerror}") from None

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            os.fchmod(fd, 0o666 & ~_UMASK)  # as a plain open() would (mkstemp makes it 0600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in store {self.uri}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        keys = []
        for path in self.root.rglob("*"):
            if path.is_file() and not path.name.startswith(".tmp-"):
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


def open_store(uri: str) -> Store:
    """A store from a URI: a local folder (path or file://)."""
    if uri.startswith("file://"):
        return LocalStore(uri.removeprefix("file://"))
    if "://" in uri:
        raise StoreError(f"unsupported store URI {uri!r}: use a local folder")
    return LocalStore(uri)
