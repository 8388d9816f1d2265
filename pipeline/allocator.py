"""The C library's allocator, told what a process wants of freed memory: a server keeps it
for the next cache, a build hands it back between layers.

Keeping it (`retain_freed_memory`). Loading a cache allocates tens of megabytes of tensors
(hundreds for a full cache), and a decode step or a request's private view of its cache
allocates more. glibc's malloc hands large freed blocks back to the kernel (blocks over its mmap
threshold, and free space at the top of a heap over its trim threshold), so the next load takes
a page fault on every 4 KiB page it writes. A serving process that loads and drops caches all
day pays that on every cold turn: measured with `python -m jobs.bench.decode` (SmolLM2, an
8,000-token conversation) against `--return-freed-memory`, the cold load of a full cache in a
turn takes 135 ms instead of 350, an episodic one's 30 ms instead of 37. The cost: the process's
resident memory stays at its peak instead of shrinking after it (for a decoder replica, about
its cache budget plus a batch's working memory), which is the steady state of a server anyway.
Process-wide, so only entry points call it (the Serve decoder, `jobs.answer`, the decode
benchmark), never the library.

Handing it back (`release_freed_memory`). One pass (`pipeline.kv.one_pass`) frees a layer's
keys, values and copies, each the conversation's length, after every layer, while the small
kept entries it made in between stay; glibc keeps the freed space inside its heaps, pinned by
those, so the build's resident memory grew layer by layer with the conversation's length.
`malloc_trim` after each layer hands every wholly free page back, for about 10 ms a layer
(`jobs.bench.full_length`: 1.14x whole LoCoMo 30 against its 7,600-token cut,
docs/benchmarks.md).

Both are no-ops where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import platform

log = logging.getLogger("epicache.allocator")

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks below it come from (and go back to) a heap
TRIM_THRESHOLD = 1 << 30  # free space kept at the top of a heap before any is handed back


def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return _c_library()


@functools.cache
def _c_library() -> ctypes.CDLL | None:
    """Looked up once: `find_library` may run a program."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError as e:
        log.info("the C library is not reachable: %s", e)
        return None


def retain_freed_memory(mmap_threshold: int = MMAP_THRESHOLD,
                        trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Set glibc's thresholds so that freed blocks below `mmap_threshold` bytes stay in the
    process, up to `trim_threshold` bytes per heap; whether they were set."""
    libc = _glibc()
    if libc is None:
        return False
    try:
        applied = (libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
                   and libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)) == 1)
    except AttributeError as e:
        log.info("malloc thresholds left as they are: %s", e)
        return False
    if not applied:
        log.info("malloc thresholds not accepted (mmap %d, trim %d)", mmap_threshold,
                 trim_threshold)
    return applied


def release_freed_memory() -> bool:
    """Hand every wholly free page of glibc's heaps back to the kernel (`malloc_trim(0)`);
    whether any was. Safe at any time and from any thread; a no-op elsewhere."""
    libc = _glibc()
    if libc is None:
        return False
    try:
        return libc.malloc_trim(0) == 1
    except AttributeError:
        return False
