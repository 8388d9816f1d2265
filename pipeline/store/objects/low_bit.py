"""A stored layer's keys and values in KIVI's low-bit codes (arXiv 2402.02750).

Keys carry outlier channels, so they are coded per channel (`encode_per_channel`): each channel
of `group` consecutive entries of one head shares a minimum and a step. Values are coded per
token (`encode_per_token`): each run of `group` channels of one entry (at most the head
dimension) shares them; so are turned keys where `CodeConfig.key_axis` says so, since the turn
leaves no outlier channel (QuaRot codes them so). The codes are `kernels.quant`'s asymmetric
group codes (`quantize_groups`: Triton on CUDA, torch on CPU).

Entries are as `cache_format` stores them: the valid entries of every head, head after head, in
token order, with `lengths` [Hkv] entries per head. A head's last group of keys is filled up by
repeating its last entry, which leaves that group's minimum and maximum as they are; the filler
is dropped when decoding.

Some entries of each head may be kept as floats beside the codes (`float_entries`): its first
(the attention sinks, which every question reads) and its last (KIVI's float residual of the
most recent tokens). The codes then cover the rest, and `lengths` count the coded entries.

The keys may be turned before they are coded (`turned`, QuaRot's rotation, arXiv 2404.00456):
each key times an orthonormal Hadamard matrix over its head's channels. A few channels carry
most of a key's range, and the queries are large in those same channels; coded per channel,
they take the widest steps and so most of the error, where the attention logits weigh it most.
Turned, every channel shares that range: the keys' own error is about as large (5-20% larger
on SmolLM2's), but spread evenly, so the logits take a fraction of it. The matrix is its own
inverse, so the same turn undoes it when read. The values may be turned too
(`CodeConfig.rotate_values`, as QuaRot does): coded per token, a wide channel sets its whole
group's step; turned, the range is shared and the steps narrow.

Each group's float16 step and minimum take 4 bytes, a tenth of a 4 + 4-bit object. They may be
double quantized (`stored_scales`, QLoRA's double quantization): coded at 8 bits in blocks of
256 groups, each block with its own float16 step and minimum. The codes are made with the
float16 scales and read with the 8-bit ones, so a number's error grows by its scales' error.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from kernels.quant import dequantize_groups, quantize_groups
from pipeline.config.stages import CodeConfig


class Coded(NamedTuple):
    """Rows of `group` numbers coded: packed codes [R, group x bits / 8], float16 steps and
    minimums [R]."""
    codes: torch.Tensor
    steps: torch.Tensor
    mins: torch.Tensor


# the turn `turned` makes, as a format 6 header names it
TURN = "hadamard"
# groups whose float16 steps (or minimums) share one 8-bit code's step and minimum where they
# are double quantized (`CodeConfig.double_quant`; QLoRA's blocks of 256, arXiv 2305.14314)
SCALE_BLOCK = 256


@functools.lru_cache(maxsize=8)
def _hadamard(d: int, device: torch.device) -> torch.Tensor:
    """The orthonormal Hadamard matrix of order `d` (Sylvester's: `d` a power of two), made once
    per device, not copied there at every layer read."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"keys turned before coding need a head dimension that is a power of two, "
                         f"got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / d ** 0.5).to(device)


def turned(keys: torch.Tensor) -> torch.Tensor:
    """keys [..., d] times the orthonormal Hadamard matrix of order d, in float32: the turn
    before coding, and (the matrix being symmetric and orthogonal) its own undoing."""
    return keys.float() @ _hadamard(keys.shape[-1], keys.device)


def turned_as_coded(code: CodeConfig, keys: torch.Tensor, values: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [entries, d] turned where `code` turns them (`rotate`, `rotate_values`;
    a turned one in float32): the turn before coding and, being its own inverse, its undoing."""
    return tuple(turned(x) if turn else x
                 for x, turn in ((keys, code.rotate), (values, code.rotate_values)))


def code_header(code: CodeConfig) -> dict:
    """A stored object's header `code`: bits and group, the float entries where it keeps some,
    the values' width where it differs, the keys' and values' turns, the keys' axis where not
    per channel and the scales' block where double quantized (formats 3 to 9,
    `pipeline.store.objects.cache_format`)."""
    floats = {"float_sinks": code.float_sinks, "float_recent": code.float_recent}
    return ({"bits": code.bits, "group": code.group} | (floats if code.keeps_floats else {})
            | ({"value_bits": code.value_bits} if code.mixed_bits else {})
            | ({"rotate": TURN} if code.rotate else {})
            | ({"rotate_values": TURN} if code.rotate_values else {})
            | ({"key_axis": code.key_axis} if code.key_axis != "channel" else {})
            | ({"double_quant": SCALE_BLOCK} if code.double_quant else {}))


def code_of_header(stored: dict) -> CodeConfig:
    """`code_header` read back, checked as a configuration is (a ValueError where a field is
    out of range or the keys were turned by a turn this reader does not know)."""
    turn, value_turn = stored.get("rotate"), stored.get("rotate_values")
    for what, by in (("keys", turn), ("values", value_turn)):
        if by not in (None, TURN):
            raise ValueError(f"{what} turned by {by!r} cannot be read (known: {TURN!r})")
    block = stored.get("double_quant")
    if block not in (None, SCALE_BLOCK):
        raise ValueError(f"scales double quantized in blocks of {block!r} cannot be read "
                         f"(known: {SCALE_BLOCK})")
    value_bits = stored.get("value_bits")
    return CodeConfig(bits=int(stored["bits"]), group=int(stored["group"]),
                      float_sinks=int(stored.get("float_sinks", 0)),
                      float_recent=int(stored.get("float_recent", 0)),
                      value_bits=None if value_bits is None else int(value_bits),
                      rotate=turn == TURN, rotate_values=value_turn == TURN,
                      key_axis=stored.get("key_axis", "channel"),
                      double_quant=block is not None)


def _groups_per_head(lengths: list[int], group: int) -> list[int]:
    return [-(-n // group) for n in lengths]


def encode_per_channel(keys: torch.Tensor, lengths: list[int], bits: int, group: int
                       ) -> Coded:
    """keys [entries, d], head after head -> per-channel codes: for each head, for each run of
    `group` entries, one row of `group` numbers per channel."""
    rows = []
    for head in torch.split(keys, lengths):
        if not len(head):
            continue
        fill = -len(head) % group
        if fill:
            head = torch.cat([head, head[-1:].expand(fill, -1)])
        rows.append(head.reshape(-1, group, head.shape[-1]).transpose(1, 2)
                    .reshape(-1, group))
    data = torch.cat(rows) if rows else keys.new_zeros(0, group)
    return Coded(*quantize_groups(data.contiguous(), bits))


def decode_per_channel(coded: Coded, lengths: list[int], head_dim: int, bits: int, group: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """`encode_per_channel` undone: keys [entries, d] in `dtype`, the filler dropped."""
    groups = _groups_per_head(lengths, group)
    if sum(groups) * head_dim != coded.codes.shape[0]:
        raise ValueError(f"{coded.codes.shape[0]} key code rows, {sum(groups) * head_dim} "
                         "expected from the entries per head")
    rows = dequantize_groups(coded.codes, coded.steps, coded.mins, bits, dtype)
    heads = []
    for n, chunk in zip(lengths, torch.split(rows, [g * head_dim for g in groups])):
        heads.append(chunk.reshape(-1, head_dim, group).transpose(1, 2)
                     .reshape(-1, head_dim)[:n])
    return torch.cat(heads) if heads else rows.new_zeros(0, head_dim)


def encode_keys(keys: torch.Tensor, lengths: list[int], code: CodeConfig) -> Coded:
    """Keys [entries, d], head after head, coded along `code.key_axis` at `code.bits`."""
    if code.key_axis == "token":
        return encode_per_token(keys, code.bits, code.group)
    return encode_per_channel(keys, lengths, code.bits, code.group)


def decode_keys(coded: Coded, lengths: list[int], head_dim: int, code: CodeConfig,
                dtype: torch.dtype) -> torch.Tensor:
    """`encode_keys` undone: keys [entries, d] in `dtype`."""
    if code.key_axis == "token":
        return decode_per_token(coded, sum(lengths), head_dim, code.bits, code.group, dtype)
    return decode_per_channel(coded, lengths, head_dim, code.bits, code.group, dtype)


def value_group(head_dim: int, group: int) -> int:
    """The channels a value group spans: `group`, or the whole head when it is shorter; a head
    dimension it does not divide cannot be coded per token."""
    span = min(group, head_dim)
    if head_dim % span:
        raise ValueError(f"a head dimension of {head_dim} does not split into groups of {span}")
    return span


def encode_per_token(values: torch.Tensor, bits: int, group: int) -> Coded:
    """values (or turned keys) [entries, d] -> per-token codes: each entry's channels in runs of
    `value_group(d, group)`."""
    span = value_group(values.shape[-1], group)
    return Coded(*quantize_groups(values.reshape(-1, span).contiguous(), bits))


def decode_per_token(coded: Coded, entries: int, head_dim: int, bits: int, group: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """`encode_per_token` undone: [entries, d] in `dtype`."""
    span = value_group(head_dim, group)
    if coded.codes.shape[0] * span != entries * head_dim:
        raise ValueError(f"{coded.codes.shape[0]} value code rows, {entries * head_dim // span} "
                         "expected from the entries")
    rows = dequantize_groups(coded.codes, coded.steps, coded.mins, bits, dtype)
    return rows.reshape(entries, head_dim)


def float_entries(lengths: list[int], sinks: int, recent: int) -> torch.Tensor:
    """[sum(lengths)] bool over the entries of every head, head after head: those kept as
    floats, each head's first `sinks` and last `recent` (all of a head shorter than both)."""
    marks = []
    for n in lengths:
        index = torch.arange(n)
        marks.append((index < sinks) | (index >= n - recent))
    return torch.cat(marks) if marks else torch.zeros(0, dtype=torch.bool)


def coded_lengths(lengths: list[int], sinks: int, recent: int) -> list[int]:
    """The entries per head left to the codes once `float_entries` are taken out."""
    return [max(n - sinks - recent, 0) for n in lengths]


def stored_scales(coded: Coded, code: CodeConfig) -> dict[str, torch.Tensor]:
    """Coded rows' steps and minimums as an object stores them, by name: float16, or where
    `code.double_quant`, each as 8-bit codes in blocks of `SCALE_BLOCK` rows with the block's
    own float16 step and minimum (`<name>_steps`, `<name>_mins`). The rows' codes were made with
    their float16 scales; the reader decodes them with these, a little off."""
    if not code.double_quant:
        return {"steps": coded.steps, "mins": coded.mins}
    out = {}
    for name, scales in (("steps", coded.steps), ("mins", coded.mins)):
        fill = -len(scales) % SCALE_BLOCK
        blocks = torch.cat([scales, scales[-1:].expand(fill)]) if fill and len(scales) else scales
        codes, steps, mins = quantize_groups(blocks.float().reshape(-1, SCALE_BLOCK), 8)
        out |= {name: codes.reshape(-1)[:len(scales)].contiguous(), f"{name}_steps": steps,
                f"{name}_mins": mins}
    return out


def scales_of_stored(stored: Callable[[str], torch.Tensor], code: CodeConfig
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`stored_scales` read back (`stored` gives a tensor by name): float16 steps and minimums."""
    if not code.double_quant:
        return stored("steps"), stored("mins")
    out = []
    for name in ("steps", "mins"):
        codes = stored(name)
        blocks = torch.cat([codes, codes.new_zeros(-len(codes) % SCALE_BLOCK)])
        scales = dequantize_groups(blocks.reshape(-1, SCALE_BLOCK), stored(f"{name}_steps"),
                                   stored(f"{name}_mins"), 8)
        out.append(scales.reshape(-1)[:len(codes)].half())
    return out[0], out[1]


def _scale_bytes(rows: int, code: CodeConfig) -> int:
    """Bytes of `rows` rows' steps and minimums as `stored_scales` stores them."""
    if not code.double_quant:
        return 4 * rows
    return 2 * rows + 8 * -(-rows // SCALE_BLOCK)


def coded_bytes(lengths: list[int], head_dim: int, code: CodeConfig, float_bytes: int = 2
                ) -> int:
    """Bytes of one layer's keys and values in `code` (codes, steps and minimums; what a float
    object's `.keys` and `.values` take), for `lengths` entries per head, the `float_entries`
    among them at `float_bytes` a number."""
    coded = coded_lengths(lengths, code.float_sinks, code.float_recent)
    floats = (sum(lengths) - sum(coded)) * head_dim * 2  # keys and values
    lengths = coded
    span = value_group(head_dim, code.group)
    value_rows = sum(lengths) * head_dim // span
    key_rows, key_group = ((value_rows, span) if code.key_axis == "token" else
                           (sum(_groups_per_head(lengths, code.group)) * head_dim, code.group))
    # each row: its codes, a step and a minimum
    return (key_rows * key_group * code.bits // 8 + _scale_bytes(key_rows, code)
            + value_rows * span * code.value_width // 8 + _scale_bytes(value_rows, code)
            + floats * float_bytes)
