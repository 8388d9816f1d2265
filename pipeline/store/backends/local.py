"""The local-directory store (the default): atomic writes by temporary file, fsync and rename."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

from pipeline.store.backends.base import (
    ObjectInfo,
    ObjectNotFound,
    Partial,
    Store,
    StoreError,
    StoreOptions,
    check_key,
)

_UMASK = os.umask(0)
os.umask(_UMASK)


class LocalStore(Store):
    """A directory; atomic writes by write-to-temporary then rename in the same folder."""

    def __init__(self, root: str | Path, *, create: bool = True):
        """`create=False` refuses a folder that does not exist: a reader given a mistyped path
        must fail, not create an empty store and report nothing built."""
        self.root = Path(root).expanduser().resolve()
        self.uri = str(self.root)
        if not create:
            if not self.root.exists():
                raise StoreError(f"store folder {self.root} does not exist")
            if not self.root.is_dir():
                raise StoreError(f"store {self.root} is not a folder")
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create store folder {self.root}: {e.strerror}") from None

    @classmethod
    def from_uri(cls, uri: str, options: StoreOptions, *, create: bool = True) -> LocalStore:
        """A folder path or `file://` URI (the options are S3's: nothing here)."""
        return cls(uri.removeprefix("file://"), create=create)

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def location(self, key: str) -> str:
        return str(self._path(key))

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

    def download(self, key: str, path: str | Path) -> None:
        try:
            shutil.copyfile(self._path(key), path)
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in store {self.uri}") from None

    def open(self, key: str) -> BinaryIO:
        try:
            return self._path(key).open("rb")
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in store {self.uri}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def info(self, key: str) -> ObjectInfo:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in store {self.uri}") from None
        return ObjectInfo(st.st_size, st.st_mtime)

    def list(self, prefix: str = "") -> list[str]:
        folder = prefix.rpartition("/")[0]  # walk only under it, not a million caches
        try:
            base = self._path(folder) if folder else self.root
        except StoreError:  # not a key's folder: no key has this prefix
            return []
        keys = []
        for path in base.rglob("*"):
            if path.is_file() and not path.name.startswith(".tmp-"):
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list_partial(self) -> list[Partial]:
        now, out = time.time(), []
        for path in self.root.rglob(".tmp-*"):
            try:
                age = now - path.stat().st_mtime
            except FileNotFoundError:  # renamed into place meanwhile
                continue
            rel = path.relative_to(self.root).as_posix()
            out.append(Partial(name=rel, key=rel.rsplit("/", 1)[0], age_seconds=age))
        return sorted(out, key=lambda p: p.name)

    def delete_partial(self, partial: Partial) -> None:
        path = self.root / partial.name
        if not path.name.startswith(".tmp-") or self.root not in path.resolve().parents:
            raise StoreError(f"{partial.name!r} is not a temporary file of store {self.uri}")
        path.unlink(missing_ok=True)
