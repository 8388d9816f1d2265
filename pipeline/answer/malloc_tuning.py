"""Keep freed memory in the process, for the next cache, instead of handing it back.

Loading a cache allocates tens of megabytes of tensors (hundreds for a full cache), and a
decode step or a request's private view of its cache allocates more. glibc's malloc hands
large freed blocks back to the kernel (blocks over its mmap threshold, and free space at the top
of a heap over its trim threshold), so the next load takes a page fault on every 4 KiB page it
writes. A serving process that loads and drops caches all day pays that on every cold turn:
measured with `python -m jobs.bench.decode` (SmolLM2, an 8,000-token conversation) against
`--return-freed-memory`, the cold load of a full cache in a turn takes 135 ms instead of 350,
an episodic one's 30 ms instead of 37. The cost: the process's resident
memory stays at its peak instead of shrinking after it (for a decoder replica, about its cache
budget plus a batch's working memory), which is the steady state of a server anyway.

Process-wide, so only entry points call it (the Serve decoder, `jobs.answer`, the decode
benchmark), never the library. A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger("epicache.allocator")

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks below it come from (and go back to) a heap
TRIM_THRESHOLD = 1 << 30  # free space kept at the top of a heap before any is handed back


def retain_freed_memory(mmap_threshold: int = MMAP_THRESHOLD,
                        trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Set glibc's thresholds so that freed blocks below `mmap_threshold` bytes stay in the
    process, up to `trim_threshold` bytes per heap; whether they were set."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        applied = (libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
                   and libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)) == 1)
    except (OSError, AttributeError) as e:
        log.info("malloc thresholds left as they are: %s", e)
        return False
    if not applied:
        log.info("malloc thresholds not accepted (mmap %d, trim %d)", mmap_threshold,
                 trim_threshold)
    return applied
