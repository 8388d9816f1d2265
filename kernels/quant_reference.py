"""KV quantization for tri-state compression (ARKV): per-token, per-head symmetric scales.

A key or value tensor [..., d] (e.g. [Hkv, N, d]) is quantized row by row: every (head, token)
row gets its own scale = absmax(row) / QMAX, and codes = round(row / scale). Two formats:

- int8: QMAX = 127, round to nearest (ties to even), codes in [-127, 127]. Error per element at
  most scale / 2.
- fp8 e4m3 (`torch.float8_e4m3fn`): QMAX = 448 (its largest finite value), round to nearest
  even on the e4m3 grid. Error per element at most 2^-4 |x| (3 mantissa bits), or half the
  subnormal step (2^-10 x scale) near zero.

Dequantization gathers: given row indices (a head's kept tokens in token order, head after
head), it writes code x scale straight into a contiguous output buffer, so the gather and the
dequantization are one pass. An all-zero row has scale 0 and dequantizes to zeros.

These are the references: the CPU path, and what the Triton kernels (`kernels.quant_triton`)
must match. `kernels.quant` dispatches between the two.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0


FP8_E4M3_MAX = 448.0


FP8_DTYPE = torch.float8_e4m3fn


def _absmax_scales(x: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scales (float32) and the rows divided by them (a zero row divides by 1)."""
    x32 = x.float()
    scales = x32.abs().amax(dim=-1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return scales, x32 / safe[..., None]


def quantize_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] (fp32/fp16/bf16) -> (codes int8 [..., d], scales float32 [...])."""
    scales, scaled = _absmax_scales(x, INT8_MAX)
    codes = torch.round(scaled).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


def quantize_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (codes float8_e4m3fn [..., d], scales float32 [...])."""
    scales, scaled = _absmax_scales(x, FP8_E4M3_MAX)
    codes = scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return codes, scales


def gather_output(codes: torch.Tensor, index: torch.Tensor | None, dtype: torch.dtype,
                  out: torch.Tensor | None) -> torch.Tensor:
    """The buffer a dequantization writes: `out` (checked) or a new contiguous tensor of shape
    index.shape + [d] (codes.shape when index is None)."""
    shape = codes.shape if index is None else (*index.shape, codes.shape[-1])
    if out is None:
        return torch.empty(shape, dtype=dtype, device=codes.device)
    if tuple(out.shape) != tuple(shape) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(shape)} tensor, got "
                         f"{tuple(out.shape)} (contiguous={out.is_contiguous()})")
    return out


def dequantize_reference(codes: torch.Tensor, scales: torch.Tensor,
                         index: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """codes [..., d] (int8 or float8_e4m3fn), scales [...] -> rows code x scale, in `dtype`.
    `index` (int64, any shape) picks rows of codes viewed as [R, d], R = codes.numel() // d;
    e.g. per-head kept slots `slots` [Hkv, M] of a [Hkv, N, d] cache are
    `slots + N * arange(Hkv)[:, None]`. The result (index.shape + [d]) goes into `out` if
    given (contiguous, e.g. a slice of a bigger buffer), else a new tensor."""
    target = gather_output(codes, index, out.dtype if out is not None else dtype, out)
    rows = codes.reshape(-1, codes.shape[-1])
    row_scales = scales.reshape(-1)
    if index is not None:
        flat = index.reshape(-1)
        rows, row_scales = rows[flat], row_scales[flat]
    values = rows.float() * row_scales[:, None]
    target.view(-1, codes.shape[-1]).copy_(values)
    return target


# ------------------------------------------------------------------ low-bit codes in groups
# KIVI's asymmetric codes (arXiv 2402.02750): a row of G numbers (a group) is coded with `bits`
# bits each against its own minimum and step, both float16: step = (max - min) / (2^bits - 1),
# code = round((x - min16) / step16) clamped to [0, 2^bits - 1] (ties to even), value = code x
# step16 + min16. The float16 minimum and step are the ones quantization divides by, so the
# error per number is at most step16 / 2 (plus float16's rounding of the minimum, absorbed by
# the clamp). A group whose minimum rounds above its maximum (all within half a float16 step of
# one value) has step 0: its codes are 0 and it decodes to min16, as does a constant group.
# Codes are packed 8 / bits to a byte, the first code in the lowest bits: a group of G numbers
# takes G x bits / 8 bytes. A width that does not divide 8 (3, 5, 6) is split into two parts
# that do (`code_parts`: 3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2): the codes' high bits packed as the
# wider part's width, then the low bits as the narrower's, one after the other in the group's
# bytes; the parts shifted back and added are the code. High bits first because they carry what
# a lossless coder can take (a code's distribution is peaked, its lowest bit nearly a coin): a
# 5-bit code's high nibbles compress as a 4-bit code's do. (Format 7 packed the low bits first:
# `high_bits_first` reorders its codes.) Which numbers form a group (a channel over G tokens
# for keys, G channels of a token for values) is the caller's choice: see
# `pipeline.store.objects.low_bit`.

GROUP_BITS = (2, 3, 4, 5, 6, 8)
_SPLIT_BITS = {3: (2, 1), 5: (4, 1), 6: (4, 2)}


def code_parts(bits: int) -> tuple[int, ...]:
    """The widths a `bits`-bit code is packed in, its high bits first: `bits` itself where it
    divides 8, else two that do."""
    return _SPLIT_BITS.get(bits, (bits,))


def check_group_bits(bits: int, group: int) -> int:
    """Bytes a group of `group` codes at `bits` takes; a ValueError for another width or a group
    that does not fill whole bytes in each of its parts."""
    if bits not in GROUP_BITS:
        raise ValueError(f"bits must be one of {GROUP_BITS}, got {bits}")
    if group % (8 // min(code_parts(bits))):
        raise ValueError(f"a group of {group} numbers does not pack into whole bytes at {bits} "
                         "bits")
    return group * bits // 8


def group_of_bytes(bits: int, n_bytes: int) -> int:
    """The numbers in a group whose codes at `bits` take `n_bytes` bytes; a ValueError for
    another width or bytes that hold no whole group."""
    if bits not in GROUP_BITS:
        raise ValueError(f"bits must be one of {GROUP_BITS}, got {bits}")
    if n_bytes * 8 % bits:
        raise ValueError(f"{n_bytes} bytes hold no whole group of {bits}-bit codes")
    group = n_bytes * 8 // bits
    check_group_bits(bits, group)
    return group


def quantize_groups_reference(x: torch.Tensor, bits: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, G] (fp32/fp16/bf16) -> (codes uint8 [R, G * bits / 8], steps float16 [R],
    minimums float16 [R])."""
    check_group_bits(bits, x.shape[-1])
    qmax = float(2 ** bits - 1)
    x32 = x.float()
    low = x32.amin(dim=-1).half()
    # a group within half a float16 step of one value may round its minimum above its maximum
    step = ((x32.amax(dim=-1) - low.float()) / qmax).clamp_min(0).half()
    safe = torch.where(step > 0, step.float(), torch.ones_like(step, dtype=torch.float32))
    codes = torch.round((x32 - low.float()[:, None]) / safe[:, None]).clamp_(0, qmax)
    return pack_codes(codes.to(torch.uint8), bits), step, low


def dequantize_groups_reference(codes: torch.Tensor, steps: torch.Tensor, mins: torch.Tensor,
                                bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes uint8 [R, G * bits / 8], steps and mins float16 [R] -> [R, G] in `dtype`."""
    codes = unpack_codes(codes, bits).float()
    return (codes * steps.float()[:, None] + mins.float()[:, None]).to(dtype)


def part_shifts(bits: int, high_first: bool = True) -> list[tuple[int, int]]:
    """Each part of a `bits`-bit code in packing order: (its width, the code bit it starts at);
    format 7's order where not `high_first`."""
    widths, shifts = code_parts(bits), []
    for i, width in enumerate(widths):
        shifts.append(bits - sum(widths[:i + 1]) if high_first else sum(widths[:i]))
    return list(zip(widths, shifts))


def pack_codes(codes: torch.Tensor, bits: int, high_first: bool = True) -> torch.Tensor:
    """codes uint8 [R, G] (each below 2^bits) -> their bytes [R, G * bits / 8], the first code of
    each byte in its lowest bits, part after part (`part_shifts`)."""
    packed = []
    for width, shift in part_shifts(bits, high_first):
        per_byte = 8 // width
        part = ((codes >> shift) & (2 ** width - 1)).view(*codes.shape[:-1],
                                                          codes.shape[-1] // per_byte, per_byte)
        shifts = torch.arange(per_byte, dtype=torch.uint8, device=codes.device) * width
        packed.append((part << shifts).sum(dim=-1, dtype=torch.int32).to(torch.uint8))
    return torch.cat(packed, dim=-1)


def unpack_codes(codes: torch.Tensor, bits: int, high_first: bool = True) -> torch.Tensor:
    """`pack_codes` undone: bytes uint8 [R, G * bits / 8] -> codes int32 [R, G]."""
    group = group_of_bytes(bits, codes.shape[-1])
    unpacked, start = 0, 0
    for width, shift in part_shifts(bits, high_first):
        per_byte = 8 // width
        part = codes[:, start:start + group // per_byte]
        shifts = torch.arange(per_byte, dtype=torch.uint8, device=codes.device) * width
        part = ((part[..., None] >> shifts) & (2 ** width - 1)).reshape(codes.shape[0], group)
        unpacked = unpacked + (part.int() << shift)
        start += group // per_byte
    return unpacked


def high_bits_first(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed codes of format 7 (a split width's low bits first) in today's layout (high bits
    first); codes of a width that is not split are returned as they are."""
    if len(code_parts(bits)) == 1:
        return codes
    return pack_codes(unpack_codes(codes, bits, high_first=False).to(torch.uint8), bits)
