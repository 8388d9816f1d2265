"""The episodic cache on disk: safetensors (never pickle) with a small JSON header.

Per layer: `layers.{i}.keys` and `.values` [entries, d] (the valid entries of every head,
head after head, in token order), `.lengths` [Hkv] entries per head and `.positions` [entries]
the original token positions. The header names the model, the build configuration hash, the
conversation and episode, the tokens seen, the next position and the position mode
(`positions`: "original", or "compact": each head's keys rotated at 0, 1, 2, ... and decoding
continues at `next_position`; with `compact_cut`, the entries of tokens from it on are rotated at
`compact_base` + their distance from it). Reading checks the SHA-256 recorded in the
manifest: the read path (`pipeline.store.objects.cache_read`) reads an object once (from the store
or the local disk tier) and hashes it on a second thread while this one parses it (`verifying`;
hashlib releases the GIL), and a parse of bytes that fail the checksum is dropped, never
returned. Parsing unverified bytes is safe: safetensors never executes anything, and every size
comes from the object itself.

Format 2 (tri-state caches, ARKV): the tensors above hold the Original entries only; the
Quantized entries are `layers.{i}.qkeys` / `.qvalues` [entries, d] codes (int8 or
float8_e4m3fn, header `quant`), `.qkey_scales` / `.qvalue_scales` [entries] float32 (one scale
per token and head), `.qlengths` [Hkv] and `.qpositions` [entries], in the same order. A plain
cache writes no q-tensors and `quant: null`; format 1 objects are still read.

Format 3 (low-bit codes, `BuildConfig.code`, header `code: {"bits", "group"}`): format 2 with
`.keys` and `.values` replaced by their codes (`pipeline.store.objects.low_bit`):
`layers.{i}.kcodes` uint8, `.ksteps` and `.kmins` float16 (keys per channel over `group`
entries of a head), `.vcodes`, `.vsteps` and `.vmins` (values per token over `group`
channels), and `.positions` as int16 where every position fits, else int32 (the reader widens any
integer type). The reader decodes them to floats.

Format 4 (header `code` also `{"float_sinks", "float_recent"}`): format 3 with each head's first
`float_sinks` and last `float_recent` entries kept as floats at `dtype` beside the codes,
`layers.{i}.kfloats` and `.vfloats` [entries, d] head after head (`low_bit.float_entries`); the
codes hold the rest.

Format 5 (header `code` also `{"value_bits"}`): format 3 or 4 with the values coded at
`value_bits` and the keys at `bits`.

Format 6 (header `code` also `{"rotate": "hadamard"}`): format 3, 4 or 5 with the coded keys
turned by a Hadamard matrix before coding (`low_bit.turned`); the reader turns them back. The
float entries are stored as they are.

Format 8: format 3 to 6 with `bits` or `value_bits` of 3, 5 or 6 (each code packed in two
parts, its high bits first: `kernels.quant_reference.part_shifts`), or with header `code` also
`{"key_axis": "token"}`: the keys coded per token as the values are
(`low_bit.encode_per_token`), or `{"double_quant": 256}`: each step and minimum an 8-bit code
in blocks of 256 rows (`low_bit.stored_scales`). Format 7 (read, no longer written) is
format 8 with a split code's low bits packed first; the reader reorders its codes
(`quant_reference.high_bits_first`).

Format 9 (header `code` also `{"rotate_values": "hadamard"}`): format 8 with the values turned
as format 6 turns the keys; the reader turns them back.

Compressed (`CodeConfig.zstd`): an object of any format above, compressed whole
(`pipeline.store.objects.zstd_object`); the reader decompresses it first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import struct
import threading
from contextlib import contextmanager
from typing import BinaryIO, Iterator, NamedTuple

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kernels.quant import dequantize
from kernels.quant_reference import code_parts, high_bits_first
from pipeline.config.format_version import (
    CODED_FORMAT,
    FLOATS_CODED_FORMAT,
    FORMAT,
    LOW_FIRST_SPLIT_FORMAT,
    MIXED_BITS_FORMAT,
    READABLE_FORMATS,
    ROTATED_FORMAT,
    SPLIT_FORMAT,
    TURNED_VALUES_FORMAT,
)
from pipeline.config.stages import CodeConfig
from pipeline.kv.cache import EpisodicCache, EpisodicLayer, QuantizedTier
from pipeline.store.objects import low_bit, zstd_object

_SERIAL_ELEMENTS = 32767  # a copy this small runs on the calling thread (grain: 32,768)


class CacheCorruptError(RuntimeError):
    """A cache object that fails its checksum or cannot be parsed; names the object."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ChecksumError(CacheCorruptError):
    """Bytes that are not the object the manifest names: the wrong length or SHA-256."""


def read_object(stream: BinaryIO, name: str = "cache", size: int | None = None) -> bytes:
    """The whole of `stream` in one read (straight into the bytes object for a file);
    `ChecksumError` naming the object if it is not `size` bytes long. The recorded size is
    never what is allocated: a manifest claiming 2**40 bytes is a corrupt object, not a
    `MemoryError`."""
    data = stream.read()
    if size is not None and len(data) < size:
        raise ChecksumError(f"cache object {name} is truncated ({len(data)} of {size} bytes)")
    if size is not None and len(data) > size:
        raise ChecksumError(f"cache object {name} is longer than its recorded {size} bytes")
    return data


@contextmanager
def verifying(data: bytes, expected_sha256: str | None, name: str = "cache") -> Iterator[None]:
    """Hash `data` on a second thread while the block runs; on leaving, `ChecksumError` unless
    it is the expected SHA-256, whatever the block did, so nothing made from bad bytes leaves
    the block. `expected_sha256=None` checks nothing."""
    if expected_sha256 is None:
        yield
        return
    digest: list[str] = []
    hasher = threading.Thread(target=lambda: digest.append(sha256(data)), daemon=True,
                              name="epicache-sha256")
    hasher.start()
    try:
        yield
    finally:
        hasher.join()
        check_sha256(digest[0] if digest else "", expected_sha256, name)


def check_sha256(got: str, expected: str | None, name: str = "cache") -> None:
    """`ChecksumError` naming the object unless its SHA-256 is the expected one (or none is
    expected)."""
    if expected is not None and got != expected:
        raise ChecksumError(f"cache object {name} failed its checksum (expected sha256 "
                            f"{expected[:12]}..., got {got[:12]}...)")


def serialize(cache: EpisodicCache, header: dict, dtype: torch.dtype = torch.float16,
              code: CodeConfig = CodeConfig()) -> bytes:
    """Safetensors bytes of the cache's valid entries, stored as `dtype`, or in `code`'s
    low-bit codes (format 3; 4 with entries kept as floats beside them; 5 with the values at
    another width) when it has bits."""
    tensors: dict[str, torch.Tensor] = {}
    quant = None
    if code.bits and any(layer.quantized is not None for layer in cache.layers):
        raise ValueError("a cache holding Quantized entries cannot be coded again")
    for i, layer in enumerate(cache.layers):
        quantized = layer.quantized_mask()
        original = layer.valid & ~quantized
        lengths = original.sum(dim=1)
        keys, values = layer.keys[0][original], layer.values[0][original]
        if code.bits:
            tensors |= _coded(i, keys, values, lengths.tolist(), code, dtype)
            tensors[f"layers.{i}.positions"] = _narrowest(layer.positions[original])
        else:
            tensors[f"layers.{i}.keys"] = keys.to(dtype).contiguous()
            tensors[f"layers.{i}.values"] = values.to(dtype).contiguous()
            tensors[f"layers.{i}.positions"] = layer.positions[original].to(torch.int64)
        tensors[f"layers.{i}.lengths"] = lengths.to(torch.int32)
        if layer.quantized is not None:
            quant = str(layer.code_dtype).removeprefix("torch.")
            tensors[f"layers.{i}.qkeys"] = layer.key_codes[quantized].view(layer.code_dtype)
            tensors[f"layers.{i}.qvalues"] = layer.value_codes[quantized].view(layer.code_dtype)
            tensors[f"layers.{i}.qkey_scales"] = layer.key_scales[quantized].contiguous()
            tensors[f"layers.{i}.qvalue_scales"] = layer.value_scales[quantized].contiguous()
            tensors[f"layers.{i}.qlengths"] = quantized.sum(dim=1).to(torch.int32)
            tensors[f"layers.{i}.qpositions"] = layer.positions[quantized].to(torch.int64)
    first = cache.layers[0]
    compacted = any(not torch.equal(layer.rope_positions, layer.positions)
                    for layer in cache.layers)
    header = dict(header, format=_format(code),
                  tokens_seen=cache.tokens_seen,
                  next_position=cache.next_position,
                  positions="compact" if compacted else "original", num_layers=len(cache.layers),
                  **({"compact_cut": first.compact_cut, "compact_base": first.compact_base}
                     if compacted and first.compact_cut is not None else {}),
                  kv_heads=int(first.valid.shape[0]), head_dim=int(first.keys.shape[-1]),
                  dtype=str(dtype).removeprefix("torch."), quant=quant,
                  **({"code": low_bit.code_header(code)} if code.bits else {}))
    data = st_save({k: v.cpu() for k, v in tensors.items()},
                   metadata={"header": json.dumps(header)})
    return data if code.zstd is None else zstd_object.compressed(data, code.zstd)


def _narrowest(positions: torch.Tensor) -> torch.Tensor:
    """Positions as int16 where all fit (as int32, ~5% of a coded entry's bytes), else int32."""
    fits = positions.numel() == 0 or int(positions.max()) <= torch.iinfo(torch.int16).max
    return positions.to(torch.int16 if fits else torch.int32)


def as_stored(cache: EpisodicCache, code: CodeConfig) -> EpisodicCache:
    """The cache as a reader gets it back from an object in `code`'s low-bit codes (the cache
    itself when it has none), at the dtype it is held in: what an evaluation measures."""
    if not code.bits:
        return cache
    code = dataclasses.replace(code, zstd=None)  # lossless: the same cache back
    return parse(serialize(cache, {}, code=code), dtype=cache.layers[0].keys.dtype,
                 device=cache.layers[0].keys.device)[0]


def coded_kv_bytes(cache: EpisodicCache, code: CodeConfig) -> int:
    """Bytes of the cache's keys and values in `code`'s low-bit codes, as an object stores them
    (`low_bit.coded_bytes` per layer)."""
    return sum(low_bit.coded_bytes(layer.valid.sum(dim=1).tolist(), layer.keys.shape[-1], code)
               for layer in cache.layers)


def _format(code: CodeConfig) -> str:
    if not code.bits:
        return FORMAT
    if code.rotate_values:
        return TURNED_VALUES_FORMAT
    if code.key_axis == "token" or code.double_quant or any(
            len(code_parts(bits)) > 1 for bits in (code.bits, code.value_width)):
        return SPLIT_FORMAT
    if code.rotate:
        return ROTATED_FORMAT
    if code.mixed_bits:
        return MIXED_BITS_FORMAT
    return FLOATS_CODED_FORMAT if code.keeps_floats else CODED_FORMAT


def _coded(i: int, keys: torch.Tensor, values: torch.Tensor, lengths: list[int],
           code: CodeConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Layer `i`'s keys and values [entries, d] as format 3's code tensors, with format 4's
    float entries (at `dtype`) where `code` keeps some."""
    out = {}
    if code.keeps_floats:
        floats = low_bit.float_entries(lengths, code.float_sinks, code.float_recent)
        out |= {f"layers.{i}.kfloats": keys[floats].to(dtype).contiguous(),
                f"layers.{i}.vfloats": values[floats].to(dtype).contiguous()}
        keys, values = keys[~floats], values[~floats]
        lengths = low_bit.coded_lengths(lengths, code.float_sinks, code.float_recent)
    keys, values = low_bit.turned_as_coded(code, keys, values)
    for prefix, coded in (("k", low_bit.encode_keys(keys, lengths, code)),
                          ("v", low_bit.encode_per_token(values, code.value_width, code.group))):
        out[f"layers.{i}.{prefix}codes"] = coded.codes
        out |= {f"layers.{i}.{prefix}{name}": t
                for name, t in low_bit.stored_scales(coded, code).items()}
    return out


def _decoded(i: int, tensors: dict[str, torch.Tensor], header: dict, lengths: list[int],
             dtype: torch.dtype, device: str | torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `i`'s keys and values [entries, d]: as stored, or decoded from format 3's codes
    on `device` (the Triton kernels on a GPU; the header's bits and group, checked as a
    configuration is), format 4's float entries put back in their places."""
    if "code" not in header:
        return tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]
    code = low_bit.code_of_header(header["code"])
    head_dim = int(header["head_dim"])
    coded = low_bit.coded_lengths(lengths, code.float_sinks, code.float_recent)
    keys, values = (low_bit.Coded(tensors[f"layers.{i}.{prefix}codes"].to(device),
                                  *low_bit.scales_of_stored(
                                      lambda name: tensors[f"layers.{i}.{prefix}{name}"].to(device),
                                      code))
                    for prefix in ("k", "v"))
    if header["format"] == LOW_FIRST_SPLIT_FORMAT:
        keys = keys._replace(codes=high_bits_first(keys.codes, code.bits))
        values = values._replace(codes=high_bits_first(values.codes, code.value_width))
    keys = low_bit.decode_keys(keys, coded, head_dim, code, dtype)
    values = low_bit.decode_per_token(values, sum(coded), head_dim, code.value_width,
                                      code.group, dtype)
    keys, values = (x.to(dtype) for x in low_bit.turned_as_coded(code, keys, values))
    if not code.keeps_floats:
        return keys, values
    floats = low_bit.float_entries(lengths, code.float_sinks, code.float_recent).to(device)
    return tuple(_placed(floats, tensors[f"layers.{i}.{prefix}floats"].to(device, dtype), part)
                 for prefix, part in (("k", keys), ("v", values)))


def _placed(floats: torch.Tensor, float_rows: torch.Tensor, coded_rows: torch.Tensor
            ) -> torch.Tensor:
    """Every entry's row [entries, d]: the float rows where `floats`, the decoded rows else."""
    rows = coded_rows.new_empty(len(floats), coded_rows.shape[-1])
    rows[floats], rows[~floats] = float_rows, coded_rows
    return rows


def read_header(data: bytes, name: str = "cache") -> dict:
    """The JSON header of a serialized cache, without loading tensors."""
    try:
        (size,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8:8 + size])["__metadata__"]
        header = json.loads(meta["header"])
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CacheCorruptError(
            f"cache object {name} is not a readable episodic cache ({e})") from None
    if header.get("format") not in READABLE_FORMATS:
        raise CacheCorruptError(f"cache object {name} has format {header.get('format')!r}, "
                                f"expected one of {READABLE_FORMATS}")
    return header


def deserialize(data: bytes, expected_sha256: str | None, name: str = "cache",
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                ) -> tuple[EpisodicCache, dict]:
    """Verify, parse and rebuild an `EpisodicCache` (padded per head) from serialized bytes."""
    if expected_sha256 is not None:
        check_sha256(sha256(data), expected_sha256, name)
    return parse(data, name, dtype, device)


def parse(data: bytes, name: str = "cache", dtype: torch.dtype = torch.float32,
          device: str | torch.device = "cpu") -> tuple[EpisodicCache, dict]:
    """Parse and rebuild bytes: no hash here (`deserialize` checks it first; the read path,
    `pipeline.store.objects.cache_read`, beside the parse, in `verifying`)."""
    try:
        data = zstd_object.decompressed(data)
    except ValueError as e:
        raise CacheCorruptError(f"cache object {name} {e}") from None
    header = read_header(data, name)
    try:
        tensors = st_load(data)
    except Exception as e:  # safetensors raises its own error types for malformed data
        raise CacheCorruptError(f"cache object {name} cannot be parsed ({e})") from None
    try:
        cache = _rebuild(tensors, header, dtype, device)
    except (KeyError, RuntimeError, ValueError, IndexError, TypeError) as e:
        raise CacheCorruptError(
            f"cache object {name} is inconsistent ({type(e).__name__}: {e})") from None
    return cache, header


def _rebuild(tensors: dict[str, torch.Tensor], header: dict, dtype: torch.dtype,
             device: str | torch.device) -> EpisodicCache:
    return EpisodicCache.from_layers([_layer(i, tensors, header, dtype, device)
                                      for i in range(_layer_count(tensors, header))])


class _StoredTier(NamedTuple):
    """A layer's Quantized entries as stored: entries per head, codes, scales, positions."""
    lengths: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor
    value_scales: torch.Tensor
    positions: torch.Tensor


def _layer(i: int, tensors: dict[str, torch.Tensor], header: dict, dtype: torch.dtype,
           device: str | torch.device) -> EpisodicLayer:
    """Layer `i`, padded per head, its Quantized entries (if any) dequantized for the view."""
    lengths = tensors[f"layers.{i}.lengths"].long()
    _check_lengths(i, lengths)
    keys, values = _decoded(i, tensors, header, lengths.tolist(), dtype, device)
    positions = tensors[f"layers.{i}.positions"].long()
    _check_counts(i, lengths, keys, values, positions)
    stored = _stored_tier(i, tensors)
    counts_list = lengths.tolist()
    tier = None
    if stored is None and _in_token_order(positions, counts_list):
        # The common case, as `serialize` writes it: each head's entries already in token
        # order, so each head is one copy (and dtype conversion) into its padded row.
        slots = max(counts_list, default=0)
        valid = torch.arange(slots)[None, :] < lengths[:, None]
        keys = _padded(keys, counts_list, slots, dtype, device)
        values = _padded(values, counts_list, slots, dtype, device)
        positions = _padded(positions, counts_list, slots, torch.long, "cpu")
    else:
        keys, values, valid, positions, tier = _merged(lengths, keys, values, positions, stored,
                                                       dtype, device)
    n_heads, slots = valid.shape
    valid, positions = valid.to(device), positions.to(device)
    tokens_seen = int(header["tokens_seen"])
    # A compacted cache holds each head's entries at positions 0, 1, 2, ... in token order,
    # except, with `compact_cut`, those of later tokens, at their spacing from `compact_base`.
    rank = torch.arange(slots, device=device).expand(n_heads, -1)
    cut = header.get("compact_cut")
    rope_positions = positions if header.get("positions") != "compact" else \
        rank if cut is None else torch.where(positions < cut, rank,
                                             int(header["compact_base"]) + positions - cut)
    return EpisodicLayer.from_stored(
        keys, values, valid, positions, rope_positions=rope_positions, tokens_seen=tokens_seen,
        next_position=int(header.get("next_position", tokens_seen)), quantized=tier)


def _stored_tier(i: int, tensors: dict[str, torch.Tensor]) -> _StoredTier | None:
    """Layer `i`'s stored Quantized entries, checked; None for a layer without them."""
    if f"layers.{i}.qkeys" not in tensors:
        return None
    stored = _StoredTier(tensors[f"layers.{i}.qlengths"].long(), tensors[f"layers.{i}.qkeys"],
                         tensors[f"layers.{i}.qvalues"], tensors[f"layers.{i}.qkey_scales"].float(),
                         tensors[f"layers.{i}.qvalue_scales"].float(),
                         tensors[f"layers.{i}.qpositions"])
    _check_counts(i, stored.lengths, stored.keys, stored.values, stored.positions)
    entries = stored.keys.shape[0]
    if stored.key_scales.shape[0] != entries or stored.value_scales.shape[0] != entries:
        raise ValueError(f"layer {i}: scales do not match the quantized entries")
    return stored


def _merged(lengths: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            positions: torch.Tensor, stored: _StoredTier | None, dtype: torch.dtype,
            device: str | torch.device):
    """Both tiers (the Quantized one dequantized, `kernels.quant` dispatch), merged per head in
    token order: keys and values [1, Hkv, slots, d], valid and positions [Hkv, slots] (on the
    CPU), and the Quantized tier as the layer holds it (None without one)."""
    n_heads = lengths.shape[0]
    qlengths = torch.zeros_like(lengths) if stored is None else stored.lengths
    qpositions = positions.new_zeros(0) if stored is None else stored.positions
    heads = torch.cat([torch.repeat_interleave(torch.arange(n_heads), lengths),
                       torch.repeat_interleave(torch.arange(n_heads), qlengths)])
    all_positions = torch.cat([positions, qpositions])
    span = int(all_positions.max().item()) + 1 if all_positions.numel() else 1
    order = torch.argsort(heads * span + all_positions)
    counts = lengths + qlengths
    slots = int(counts.max().item()) if counts.numel() else 0
    valid = torch.arange(slots)[None, :] < counts[:, None]
    is_quantized = torch.cat([torch.zeros(int(lengths.sum()), dtype=torch.bool),
                              torch.ones(int(qlengths.sum()), dtype=torch.bool)])[order]
    merged_positions = torch.zeros(n_heads, slots, dtype=torch.long)
    merged_positions[valid] = all_positions[order]
    padded = {}
    for name, original in (("keys", keys), ("values", values)):
        rows = original.to(device, dtype)
        if stored is not None:
            codes = stored.keys if name == "keys" else stored.values
            scales = stored.key_scales if name == "keys" else stored.value_scales
            rows = torch.cat([rows, dequantize(codes.to(device), scales.to(device), dtype=dtype)])
        padded[name] = rows.new_zeros(1, n_heads, slots, rows.shape[-1])
        padded[name][0][valid.to(device)] = rows[order.to(device)]
    if stored is None:
        return padded["keys"], padded["values"], valid, merged_positions, None
    mask = torch.zeros(n_heads, slots, dtype=torch.bool)
    mask[valid] = is_quantized
    raw = torch.uint8 if stored.keys.dtype == torch.float8_e4m3fn else torch.int8
    held = {}
    for name, rows in (("key_codes", stored.keys.view(raw)),
                       ("value_codes", stored.values.view(raw)),
                       ("key_scales", stored.key_scales), ("value_scales", stored.value_scales)):
        full = rows.new_zeros(n_heads, slots, *rows.shape[1:])
        full[mask] = rows[order[is_quantized] - lengths.sum()]
        held[name] = full.to(device)
    tier = QuantizedTier(mask.to(device), stored.keys.dtype, **held)
    return padded["keys"], padded["values"], valid, merged_positions, tier


def _layer_count(tensors: dict[str, torch.Tensor], header: dict) -> int:
    """The header's layer count, once the object holds that many layers: nothing is sized by
    the header alone."""
    layers = header["num_layers"]
    stored = sum(name.endswith(".lengths") and not name.endswith(".qlengths") for name in tensors)
    if not isinstance(layers, int) or layers != stored:
        raise ValueError(f"the header says {layers!r} layers, the object holds {stored}")
    return layers


def _in_token_order(positions: torch.Tensor, counts: list[int]) -> bool:
    """Whether each head's run of `positions` is non-decreasing (heads start anew)."""
    if positions.numel() < 2:
        return True
    steps = positions[1:] >= positions[:-1]
    starts = [s - 1 for s in itertools.accumulate(counts[:-1]) if 0 < s < positions.numel()]
    if starts:
        steps[starts] = True
    return bool(steps.all())


def _padded(rows: torch.Tensor, counts: list[int], slots: int, dtype: torch.dtype,
            device: str | torch.device) -> torch.Tensor:
    """[heads, slots, ...] (with a leading 1 for keys and values) of `dtype`: each head's rows
    (stored head after head) first, zeros after.

    The copies go in blocks under torch's parallel grain (32,768 elements), so each runs on
    the calling thread: a load runs while other threads decode on every core, and there a
    parallel region per small copy cost ~100x the copy itself (measured on 2 busy cores).
    """
    out = torch.empty(len(counts), slots, *rows.shape[1:], dtype=dtype, device=device)
    step = max(1, _SERIAL_ELEMENTS // max(1, rows[0].numel() if len(rows) else 1))
    start = 0
    for h, n in enumerate(counts):
        for b in range(0, n, step):
            end = min(n, b + step)
            out[h, b:end].copy_(rows[start + b:start + end])
        for b in range(n, slots, step):
            out[h, b:min(slots, b + step)].zero_()
        start += n
    return out[None] if rows.dim() > 1 else out


def _check_counts(i: int, lengths: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  positions: torch.Tensor) -> None:
    _check_lengths(i, lengths)
    total = int(lengths.sum().item())
    if not keys.shape[0] == values.shape[0] == positions.shape[0] == total:
        raise ValueError(f"layer {i}: {total} entries by lengths, {keys.shape[0]} keys, "
                         f"{values.shape[0]} values, {positions.shape[0]} positions")


def _check_lengths(i: int, lengths: torch.Tensor) -> None:
    if lengths.numel() and int(lengths.min()) < 0:  # else a head's slots could be any size
        raise ValueError(f"layer {i}: a negative entry count")
