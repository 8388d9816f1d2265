"""The in-memory store (`memory://name`): objects in a dict of this process, for runs that keep
nothing on disk (an evaluation's build) and for tests.

Stores of one name share their objects within the process, as stores of one folder do; a write
replaces the whole object under one lock, so a reader never sees half of it. A copy unpickled in
another process (a Ray worker) finds no store of that name there and says so, rather than
writing where nobody reads: a build that writes from Ray tasks needs a folder or S3.
"""

from __future__ import annotations

import threading
import time

from pipeline.store.backends.base import (
    ObjectInfo,
    ObjectNotFound,
    Store,
    StoreError,
    StoreOptions,
    check_key,
)

_STORES: dict[str, dict[str, tuple[bytes, float]]] = {}  # name -> key -> (bytes, written at)
_LOCK = threading.Lock()


class MemoryStore(Store):
    """A named dict of objects in this process; thread-safe."""

    def __init__(self, name: str, *, create: bool = True):
        """`create=False` refuses a name nothing created in this process, as a read-only
        command refuses a folder that is not there."""
        self.name = check_key(name) if name else ""
        if not self.name:
            raise StoreError("a memory store needs a name: memory://<name>")
        self.uri = f"memory://{self.name}"
        with _LOCK:
            if self.name not in _STORES:
                if not create:
                    raise StoreError(f"memory store {self.uri} does not exist")
                _STORES[self.name] = {}

    @classmethod
    def from_uri(cls, uri: str, options: StoreOptions, *, create: bool = True) -> MemoryStore:
        return cls(uri.removeprefix("memory://").strip("/"), create=create)

    def _objects(self) -> dict[str, tuple[bytes, float]]:
        """This store's dict (call under `_LOCK`)."""
        try:
            return _STORES[self.name]
        except KeyError:
            raise StoreError(f"memory store {self.uri} is not in this process (dropped, or "
                             "this is another process: use a folder or S3 there)") from None

    def _read(self, key: str) -> tuple[bytes, float]:
        check_key(key)
        with _LOCK:
            found = self._objects().get(key)
        if found is None:
            raise ObjectNotFound(f"no object {key!r} in store {self.uri}")
        return found

    def put(self, key: str, data: bytes) -> None:
        check_key(key)
        data = bytes(data)  # a caller's bytearray or memoryview may change after the put
        with _LOCK:
            self._objects()[key] = (data, time.time())

    def get(self, key: str) -> bytes:
        return self._read(key)[0]

    def exists(self, key: str) -> bool:
        check_key(key)
        with _LOCK:
            return key in self._objects()

    def info(self, key: str) -> ObjectInfo:
        data, modified = self._read(key)
        return ObjectInfo(len(data), modified)

    def list(self, prefix: str = "") -> list[str]:
        with _LOCK:
            return sorted(k for k in self._objects() if k.startswith(prefix))

    def delete(self, key: str) -> None:
        check_key(key)
        with _LOCK:
            self._objects().pop(key, None)

    def drop(self) -> None:
        """Forget every object of this name (a run that kept nothing frees the memory)."""
        with _LOCK:
            _STORES.pop(self.name, None)
