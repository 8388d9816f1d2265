"""The episodic cache on disk: safetensors (never pickle) with a small JSON header.

Per layer: `layers.{i}.keys` and `.values` [entries, d] (the valid entries of every head,
head after head, in token order), `.lengths` [Hkv] entries per head and `.positions` [entries]
the original token positions. The header names the model, the build configuration hash, the
conversation and episode, and the tokens seen. Reading checks the SHA-256 recorded in the
manifest before parsing anything.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pipeline.cache import EpisodicCache

FORMAT = "epicache-kv/1"


class CacheCorruptError(RuntimeError):
    """A cache object that fails its checksum or cannot be parsed; names the object."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def serialize(cache: EpisodicCache, header: dict, dtype: torch.dtype = torch.float16) -> bytes:
    """Safetensors bytes of the cache's valid entries, stored as `dtype`."""
    tensors: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        valid = layer.valid
        tensors[f"layers.{i}.keys"] = layer.keys[0][valid].to(dtype).contiguous()
        tensors[f"layers.{i}.values"] = layer.values[0][valid].to(dtype).contiguous()
        tensors[f"layers.{i}.lengths"] = valid.sum(dim=1).to(torch.int32)
        tensors[f"layers.{i}.positions"] = layer.positions[valid].to(torch.int64)
    first = cache.layers[0]
    header = dict(header, format=FORMAT, tokens_seen=cache.tokens_seen, num_layers=len(cache.layers),
                  kv_heads=int(first.valid.shape[0]), head_dim=int(first.keys.shape[-1]),
                  dtype=str(dtype).removeprefix("torch."))
    return st_save({k: v.cpu() for k, v in tensors.items()}, metadata={"header": json.dumps(header)})


def read_header(data: bytes, name: str = "cache") -> dict:
    """The JSON header of a serialized cache, without loading tensors."""
    try:
        (size,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8:8 + size])["__metadata__"]
        header = json.loads(meta["header"])
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CacheCorruptError(f"cache object {name} is not a readable episodic cache ({e})") from None
    if header.get("format") != FORMAT:
        raise CacheCorruptError(f"cache object {name} has format {header.get('format')!r}, "
                                f"expected {FORMAT!r}")
    return header


def deserialize(data: bytes, expected_sha256: str | None, name: str = "cache",
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                ) -> tuple[EpisodicCache, dict]:
    """Verify, parse and rebuild an `EpisodicCache` (padded per head) from serialized bytes."""
    if expected_sha256 is not None and sha256(data) != expected_sha256:
        raise CacheCorruptError(f"cache object {name} failed its checksum (expected sha256 "
                                f"{expected_sha256[:12]}..., got {sha256(data)[:12]}...)")
    header = read_header(data, name)
    try:
        tensors = st_load(data)
    except Exception as e:  # safetensors raises its own error types for malformed data
        raise CacheCorruptError(f"cache object {name} cannot be parsed ({e})") from None
    try:
        cache = _rebuild(tensors, header, dtype, device)
    except (KeyError, RuntimeError, ValueError, IndexError, TypeError) as e:
        raise CacheCorruptError(f"cache object {name} is inconsistent ({type(e).__name__}: {e})") from None
    return cache, header


def _rebuild(tensors: dict[str, torch.Tensor], header: dict, dtype: torch.dtype,
             device: str | torch.device) -> EpisodicCache:
    cache = EpisodicCache(int(header["num_layers"]))
    for i, layer in enumerate(cache.layers):
        lengths = tensors[f"layers.{i}.lengths"].long()
        keys, values = tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]
        positions = tensors[f"layers.{i}.positions"]
        total = int(lengths.sum().item())
        if not keys.shape[0] == values.shape[0] == positions.shape[0] == total:
            raise ValueError(f"layer {i}: {total} entries by lengths, {keys.shape[0]} keys, "
                             f"{values.shape[0]} values, {positions.shape[0]} positions")
        n_heads, slots = lengths.shape[0], int(lengths.max().item()) if lengths.numel() else 0
        valid = torch.arange(slots)[None, :] < lengths[:, None]
        layer.keys = keys.new_zeros(1, n_heads, slots, keys.shape[-1])
        layer.values = values.new_zeros(1, n_heads, slots, values.shape[-1])
        layer.positions = torch.zeros(n_heads, slots, dtype=torch.long)
        layer.keys[0][valid], layer.values[0][valid] = keys, values
        layer.positions[valid] = positions
        layer.keys, layer.values = layer.keys.to(device, dtype), layer.values.to(device, dtype)
        layer.valid, layer.positions = valid.to(device), layer.positions.to(device)
        layer.tokens_seen = int(header["tokens_seen"])
        layer.is_initialized = True
    return cache
