"""A bounded local-disk tier of cache objects between the store and the in-memory LRU.

LMCache's idea: a replica restart, or a cache evicted from memory, reads the object from a local
folder instead of going back to S3. Files are content-addressed (`<sha256>.safetensors`, the
manifest's checksum, so no name comes from a request), written to a temporary file and renamed
into place (a reader never sees half a file), and evicted least recently read first (a read
touches the file's mtime) so that the folder never holds more than `max_bytes`. The tier keeps
bytes; the read path (`pipeline.store.objects.cache_read`) verifies every read against the checksum
(beside its parse), touches what it served and discards a corrupt or truncated file, which is
then a miss, never served. Eviction and renames run under an exclusive `flock` on the folder's
lock file, so replicas sharing one folder on a host keep the bound together; in one process,
concurrent loads of one object fetch it once (`fetching`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

log = logging.getLogger("epicache.disk_tier")

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
SUFFIX = ".safetensors"
_LOCK = ".lock"
_STALE_TEMP_S = 600.0  # a temporary file this old belongs to a writer that died


class DiskTier:
    """Verified cache objects in `root`, at most `max_bytes` of them. Thread-safe."""

    def __init__(self, root: str | Path, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"disk cache bytes must be >= 0, got {max_bytes}")
        self.root, self.max_bytes = Path(root).expanduser().resolve(), int(max_bytes)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create disk cache folder {self.root}: {e.strerror}") from None
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Event] = {}
        self.hits = self.misses = self.corrupt = self.writes = self.evictions = 0
        self._remove_stale_temporaries()

    # -- reading -------------------------------------------------------------------------------
    def _path(self, sha256: str) -> Path:
        if not _SHA256.match(sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / f"{sha256}{SUFFIX}"

    def __contains__(self, sha256: str) -> bool:
        return self._path(sha256).is_file()

    def read(self, sha256: str) -> bytes | None:
        """The stored file's bytes, not yet verified (the reader checks them beside its parse,
        then calls `touch` or `discard`); None, a miss, when there is none."""
        try:
            return self._path(sha256).read_bytes()
        except FileNotFoundError:
            self._count("misses")
            return None

    def touch(self, sha256: str) -> None:
        """A verified read served: the file becomes the most recently read (the LRU order,
        shared with every replica on the folder)."""
        try:
            os.utime(self._path(sha256))
        except FileNotFoundError:  # evicted meanwhile by another replica: the bytes are read
            pass
        self._count("hits")

    def discard(self, sha256: str, error: Exception) -> None:
        """A file that failed its checksum: deleted, and the read is a miss (fetched again)."""
        log.warning("%s: deleted, fetching again", error)
        self._path(sha256).unlink(missing_ok=True)
        self._count("corrupt", "misses")

    @contextmanager
    def fetching(self, sha256: str) -> Iterator[bool]:
        """Whether this thread fetches the object the tier missed: True for the first (the
        others wait until its block ends), False for one that waited (the tier holds the object
        now, or that fetch failed and this thread tries: read the tier again)."""
        with self._lock:
            pending = self._loading.get(sha256)
            first = pending is None
            if first:
                pending = self._loading[sha256] = threading.Event()
        if not first:
            pending.wait()
            yield False
            return
        try:
            yield True
        finally:
            with self._lock:
                del self._loading[sha256]
            pending.set()

    # -- writing and eviction ------------------------------------------------------------------
    def put(self, sha256: str, data: bytes) -> None:
        """Store verified bytes (the caller checked them against `sha256`); an object larger than
        the whole budget is not stored. Failures are logged: the tier is an optimisation."""
        path = self._path(sha256)
        if len(data) > self.max_bytes:
            return
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=SUFFIX)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            with self._exclusive():
                self._make_room(len(data), keep=path.name)
                os.replace(tmp, path)
                tmp = None
            self._count("writes")
        except OSError as e:
            log.warning("disk tier %s: cannot store %s (%s)", self.root, path.name, e)
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of the stored objects, least recently read first."""
        out = []
        for entry in os.scandir(self.root):
            if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                out.append((st.st_mtime, st.st_size, Path(entry.path)))
        return sorted(out)

    def _make_room(self, size: int, keep: str) -> None:
        """Evict least recently read objects until `size` more bytes fit (under the lock)."""
        entries = [e for e in self._entries() if e[2].name != keep]
        total = sum(s for _, s, _ in entries)
        for _, freed, path in entries:
            if total + size <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= freed
            self._count("evictions")

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """This process's threads and every process on the folder, one at a time."""
        with self._lock_file() as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _lock_file(self) -> BinaryIO:
        return (self.root / _LOCK).open("ab")

    def _remove_stale_temporaries(self) -> None:
        now = time.time()
        for path in self.root.glob(f".tmp-*{SUFFIX}"):
            try:
                if now - path.stat().st_mtime > _STALE_TEMP_S:
                    path.unlink(missing_ok=True)
            except FileNotFoundError:
                pass

    # -- figures -------------------------------------------------------------------------------
    def _count(self, *names: str) -> None:
        with self._lock:
            for name in names:
                setattr(self, name, getattr(self, name) + 1)

    @property
    def bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def stats(self) -> dict:
        entries = self._entries()
        with self._lock:
            return {"dir": str(self.root), "entries": len(entries),
                    "bytes": sum(s for _, s, _ in entries), "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "corrupt": self.corrupt,
                    "writes": self.writes, "evictions": self.evictions}
