"""A cache object compressed whole (`CodeConfig.zstd`, `jobs.build --zstd`): fewer bytes stored and
fetched for the same caches, at a decompression when read (docs/benchmarks.md, "Stored bytes").

The stored object is `ZSTD_MAGIC`, the plain object's length as 8 little-endian bytes, then a
zstd frame of it (pyarrow's codec). Any format of `pipeline.store.objects.cache_format` can be
so wrapped; its reader unwraps first. The length a wrapped object claims is held to
`MAX_ZSTD_RATIO` times its own bytes, so a corrupt one is refused, never allocated; the
manifest's SHA-256 covers the stored bytes, so a damaged frame that still decodes fails it.
"""

from __future__ import annotations

import struct

import pyarrow as pa

# A wrapped object's first 8 bytes: read as a safetensors header length they would claim
# exabytes, so no plain object starts so
ZSTD_MAGIC = b"EPKVZSTD"
# what a wrapped object may claim to decompress to, times its bytes: a KV cache compresses to
# 0.77-0.92 of itself (docs/benchmarks.md), a zero-filled one further, never this far
MAX_ZSTD_RATIO = 64


def compressed(data: bytes, level: int) -> bytes:
    """`data` compressed at zstd `level`, after `ZSTD_MAGIC` and its length."""
    packed = pa.Codec("zstd", compression_level=level).compress(data, asbytes=True)
    return ZSTD_MAGIC + struct.pack("<Q", len(data)) + packed


def decompressed(data: bytes) -> bytes:
    """The plain object: `data` itself, or decompressed if `compressed` wrote it; ValueError
    saying what is wrong if its length or its frame is bad."""
    if data[:8] != ZSTD_MAGIC:
        return data
    if len(data) < 16:
        raise ValueError("is a truncated compressed object")
    (length,) = struct.unpack("<Q", data[8:16])
    if length > MAX_ZSTD_RATIO * len(data):
        raise ValueError(f"claims to decompress to {length:,} bytes from {len(data):,} (at most "
                         f"{MAX_ZSTD_RATIO}x are read)")
    try:
        out = pa.Codec("zstd").decompress(data[16:], decompressed_size=length, asbytes=True)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ValueError(f"cannot be decompressed ({e})") from None
    if len(out) != length:
        raise ValueError(f"decompressed to {len(out):,} bytes, its header says {length:,}")
    return out
