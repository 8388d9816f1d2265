"""Triton kernels for per-token, per-head int8 / fp8 (e4m3) KV quantization, and for KIVI's
low-bit (2- to 8-bit) asymmetric group codes (see `kernels.quant_reference` for the formats and the
torch references they must match).

Imported only by the dispatch in `kernels.quant` on CUDA tensors, and by the kernel tests under
`TRITON_INTERPRET=1`. Rows (one (head, token) each) are processed BLOCK_R at a time, the whole
head dimension in one tile; scales and codes are computed in fp32.

Rounding is done in fp32 arithmetic, exactly, before the final cast: ties to even for int8
(`_round_half_even`) and onto the e4m3 grid (`_round_to_e4m3`). The cast to int8 / fp8 then
only stores an exactly representable value, so the result does not depend on the cast's
rounding mode (the CPU interpreter's fp8 cast rounds ties up and drops the mantissa carry).
The group codes round the same way; each byte of packed codes is built from PER_BYTE strided
column tiles (no reshapes), the first code in the lowest bits, one launch per part of a width
that is packed in two (`part_shifts`: high bits first); decoding gathers each column's byte of
each part.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_reference import (
    FP8_DTYPE,
    FP8_E4M3_MAX,
    INT8_MAX,
    check_group_bits,
    code_parts,
    gather_output,
    group_of_bytes,
    part_shifts,
)


@triton.jit
def _round_half_even(t):
    """Round to the nearest integer, ties to even (as torch.round), exactly: floor and the
    fraction t - floor(t) are exact in fp32."""
    low = tl.floor(t)
    frac = t - low
    low_is_odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
    up = (frac > 0.5) | ((frac == 0.5) & low_is_odd)
    return low + tl.where(up, 1.0, 0.0)


@triton.jit
def _round_to_e4m3(y):
    """Round |y| <= 448 to the nearest float8 e4m3 value (ties to even), in fp32. e4m3 keeps 3
    mantissa bits: at binary exponent e the grid step is 2^(e-3); below the smallest normal
    (2^-6) the subnormal step 2^-9 continues the same grid."""
    a = tl.abs(y)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 a); zero: -127
    exponent = tl.maximum(exponent, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3), exact
    inv_step = ((3 - exponent + 127) << 23).to(tl.float32, bitcast=True)  # 2^(3-e)
    rounded = _round_half_even(a * inv_step) * step  # both products exact (powers of two)
    return tl.where(y < 0, -rounded, rounded)


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, n_rows, head_dim, s_xr, s_xd,
                     QMAX: tl.constexpr, FP8: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    ok = row_ok[:, None] & (dims < head_dim)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * s_xr + dims[None, :] * s_xd, mask=ok,
                other=0.0).to(tl.float32)
    # Correctly rounded divisions (tl.div_rn; `/` is approximate on GPUs) match torch exactly.
    scale = tl.div_rn(tl.max(tl.abs(x), axis=1), tl.full([BLOCK_R], QMAX, tl.float32))
    safe = tl.where(scale > 0, scale, 1.0)
    y = tl.div_rn(x, tl.broadcast_to(safe[:, None], [BLOCK_R, BLOCK_D]))
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if FP8:
        codes = _round_to_e4m3(y)
    else:
        codes = _round_half_even(y)
    codes_out = codes_ptr + rows64[:, None] * head_dim + dims[None, :]
    tl.store(codes_out, codes.to(codes_ptr.dtype.element_ty), mask=ok)
    tl.store(scales_ptr + rows, scale, mask=row_ok)


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, index_ptr, out_ptr, n_out, head_dim,
                       HAS_INDEX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < n_out
    ok = row_ok[:, None] & (dims < head_dim)[None, :]
    if HAS_INDEX:
        src = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    codes = tl.load(codes_ptr + src[:, None] * head_dim + dims[None, :], mask=ok)  # masked: unused
    scale = tl.load(scales_ptr + src, mask=row_ok, other=0.0)
    values = codes.to(tl.float32) * scale[:, None]
    out = out_ptr + rows.to(tl.int64)[:, None] * head_dim + dims[None, :]
    tl.store(out, values.to(out_ptr.dtype.element_ty), mask=ok)


def _block_rows(head_dim: int) -> tuple[int, int]:
    """Rows per program and the head-dim tile: about 4K elements per program."""
    block_d = triton.next_power_of_2(head_dim)
    return max(1, min(64, 4096 // block_d)), block_d


def quantize_triton(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (codes [..., d], scales float32 [...]); fmt "int8" or "fp8"."""
    if fmt not in ("int8", "fp8"):
        raise ValueError(f"unknown format {fmt!r}")
    head_dim = x.shape[-1]
    rows = x.reshape(-1, head_dim)  # a view when the layout allows it (strides passed below)
    n_rows = rows.shape[0]
    fp8 = fmt == "fp8"
    codes = torch.empty(x.shape, dtype=FP8_DTYPE if fp8 else torch.int8, device=x.device)
    scales = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if n_rows == 0 or head_dim == 0:
        return codes, scales.zero_()
    block_r, block_d = _block_rows(head_dim)
    _quantize_kernel[(triton.cdiv(n_rows, block_r),)](
        rows, codes, scales, n_rows, head_dim, rows.stride(0), rows.stride(1),
        QMAX=FP8_E4M3_MAX if fp8 else INT8_MAX, FP8=fp8, BLOCK_R=block_r, BLOCK_D=block_d)
    return codes, scales


def dequantize_triton(codes: torch.Tensor, scales: torch.Tensor,
                      index: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather + dequantize in one pass; same contract as `kernels.quant.dequantize_reference`.
    Indices are range-checked first (one reduction): the kernel itself would read any address."""
    if codes.dtype not in (torch.int8, FP8_DTYPE):
        raise ValueError(f"codes must be int8 or float8_e4m3fn, got {codes.dtype}")
    head_dim = codes.shape[-1]
    if scales.shape != codes.shape[:-1]:
        raise ValueError(f"scales {tuple(scales.shape)} != codes rows {tuple(codes.shape[:-1])}")
    target = gather_output(codes, index, out.dtype if out is not None else dtype, out)
    codes_c, scales_c = codes.contiguous(), scales.contiguous().float()
    index_c = index.reshape(-1).contiguous() if index is not None else None
    if index_c is not None and index_c.numel():
        low, high = torch.aminmax(index_c)
        n_rows = codes.numel() // head_dim if head_dim else 0
        if int(low) < 0 or int(high) >= n_rows:
            raise IndexError(f"index values must lie in [0, {n_rows}), got [{int(low)}, "
                             f"{int(high)}]")
    n_out = target.numel() // head_dim if head_dim else 0
    if n_out == 0:
        return target
    block_r, block_d = _block_rows(head_dim)
    _dequantize_kernel[(triton.cdiv(n_out, block_r),)](
        codes_c, scales_c, index_c if index_c is not None else scales_c, target, n_out, head_dim,
        HAS_INDEX=index_c is not None, BLOCK_R=block_r, BLOCK_D=block_d)
    return target


# ------------------------------------------------------------------ low-bit codes in groups

@triton.jit
def _quantize_groups_kernel(x_ptr, codes_ptr, steps_ptr, mins_ptr, n_rows, group, row_bytes,
                            part_start, part_bytes, s_xr, s_xg, BITS: tl.constexpr,
                            PART_BITS: tl.constexpr, PART_SHIFT: tl.constexpr,
                            PER_BYTE: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_G: tl.constexpr, BLOCK_B: tl.constexpr):
    """One part of each group's codes (`part_shifts`: PART_BITS of them from bit PART_SHIFT),
    packed into bytes part_start .. part_start + part_bytes of each row's codes."""
    QMAX: tl.constexpr = (1 << BITS) - 1
    PART_MASK: tl.constexpr = (1 << PART_BITS) - 1
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    # The whole group, for its minimum and maximum (padding rows load zeros: finite, unstored).
    cols = tl.arange(0, BLOCK_G)
    col_ok = cols < group
    x = tl.load(x_ptr + rows64[:, None] * s_xr + cols[None, :] * s_xg,
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    low = tl.min(tl.where(col_ok[None, :], x, float("inf")), axis=1).to(tl.float16)
    high = tl.max(tl.where(col_ok[None, :], x, float("-inf")), axis=1)
    low32 = low.to(tl.float32)
    # As the reference: the range over qmax in fp32 (correctly rounded), then float16; at
    # least 0 (a group within half a float16 step of one value may round its minimum above
    # its maximum).
    step = tl.maximum(tl.div_rn(high - low32, tl.full([BLOCK_R], QMAX, tl.float32)), 0.0)
    step = step.to(tl.float16)
    step32 = step.to(tl.float32)
    safe = tl.broadcast_to(tl.where(step32 > 0, step32, 1.0)[:, None], [BLOCK_R, BLOCK_B])
    low_b = tl.broadcast_to(low32[:, None], [BLOCK_R, BLOCK_B])
    # Byte p of the part holds the codes of columns p * PER_BYTE + sub, code `sub` at bit
    # sub * PART_BITS.
    byte_idx = tl.arange(0, BLOCK_B)
    ok = row_ok[:, None] & (byte_idx < part_bytes)[None, :]
    packed = tl.zeros([BLOCK_R, BLOCK_B], dtype=tl.int32)
    for sub in tl.static_range(PER_BYTE):
        sub_cols = byte_idx * PER_BYTE + sub
        xs = tl.load(x_ptr + rows64[:, None] * s_xr + sub_cols[None, :] * s_xg, mask=ok,
                     other=0.0).to(tl.float32)
        codes = _round_half_even(tl.div_rn(xs - low_b, safe))
        codes = tl.minimum(tl.maximum(codes, 0.0), QMAX).to(tl.int32)
        packed = packed | (((codes >> PART_SHIFT) & PART_MASK) << (sub * PART_BITS))
    tl.store(codes_ptr + rows64[:, None] * row_bytes + part_start + byte_idx[None, :],
             packed.to(tl.uint8), mask=ok)
    tl.store(steps_ptr + rows, step, mask=row_ok)
    tl.store(mins_ptr + rows, low, mask=row_ok)


@triton.jit
def _dequantize_groups_kernel(codes_ptr, steps_ptr, mins_ptr, out_ptr, n_rows, n_bytes, group,
                              FIRST_BITS: tl.constexpr, FIRST_PER_BYTE: tl.constexpr,
                              LOW_BITS: tl.constexpr, LOW_PER_BYTE: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    """Each column's code gathered from its byte of the first part (the high bits) and of the
    low part after it, where LOW_BITS > 0 (`part_shifts`), then code x step + min."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_G)
    ok = row_ok[:, None] & (cols < group)[None, :]
    row_codes = codes_ptr + rows64[:, None] * n_bytes
    first_bytes = tl.load(row_codes + (cols // FIRST_PER_BYTE)[None, :], mask=ok, other=0)
    codes = (first_bytes.to(tl.int32) >> ((cols % FIRST_PER_BYTE) * FIRST_BITS)[None, :]) \
        & ((1 << FIRST_BITS) - 1)
    if LOW_BITS > 0:
        low_bytes = tl.load(row_codes + (group // FIRST_PER_BYTE + cols // LOW_PER_BYTE)[None, :],
                            mask=ok, other=0)
        low_part = (low_bytes.to(tl.int32) >> ((cols % LOW_PER_BYTE) * LOW_BITS)[None, :]) \
            & ((1 << LOW_BITS) - 1)
        codes = (codes << LOW_BITS) | low_part
    step = tl.load(steps_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    low = tl.load(mins_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    # code (<= 8 bits) x step (11 significant bits) is exact in fp32: fusing the product and
    # the sum into an fma (as GPU compilers may) rounds exactly as torch's mul + add.
    values = codes.to(tl.float32) * step + low
    tl.store(out_ptr + rows64[:, None] * group + cols[None, :],
             values.to(out_ptr.dtype.element_ty), mask=ok)


def _rows_per_program(group: int) -> int:
    """Rows per program: about 4K numbers per program."""
    return max(1, min(64, 4096 // triton.next_power_of_2(group)))


def quantize_groups_triton(x: torch.Tensor, bits: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, G] (fp32/fp16/bf16, any strides) -> (codes uint8 [R, G * bits / 8], steps float16
    [R], mins float16 [R]); same contract as `kernels.quant_reference.quantize_groups_reference`
    (one launch per part of the codes, `part_shifts`)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, group], got shape {tuple(x.shape)}")
    n_rows, group = x.shape
    n_bytes = check_group_bits(bits, group)
    if group == 0:
        raise ValueError("a group needs at least one number")
    codes = torch.empty(n_rows, n_bytes, dtype=torch.uint8, device=x.device)
    steps = torch.empty(n_rows, dtype=torch.float16, device=x.device)
    mins = torch.empty(n_rows, dtype=torch.float16, device=x.device)
    if n_rows == 0:
        return codes, steps, mins
    block_r, start = _rows_per_program(group), 0
    for width, shift in part_shifts(bits):
        part_bytes = group * width // 8
        _quantize_groups_kernel[(triton.cdiv(n_rows, block_r),)](
            x, codes, steps, mins, n_rows, group, n_bytes, start, part_bytes, x.stride(0),
            x.stride(1), BITS=bits, PART_BITS=width, PART_SHIFT=shift, PER_BYTE=8 // width,
            BLOCK_R=block_r, BLOCK_G=triton.next_power_of_2(group),
            BLOCK_B=triton.next_power_of_2(part_bytes))
        start += part_bytes
    return codes, steps, mins


def dequantize_groups_triton(codes: torch.Tensor, steps: torch.Tensor, mins: torch.Tensor,
                             bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes uint8 [R, G * bits / 8], steps and mins float16 [R] -> [R, G] in `dtype`; same
    contract as `kernels.quant_reference.dequantize_groups_reference`."""
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"codes must be uint8 [rows, bytes], got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    n_rows, n_bytes = codes.shape
    if steps.shape != (n_rows,) or mins.shape != (n_rows,):
        raise ValueError(f"steps {tuple(steps.shape)} and mins {tuple(mins.shape)} must be "
                         f"[{n_rows}]")
    group = group_of_bytes(bits, n_bytes)
    out = torch.empty(n_rows, group, dtype=dtype, device=codes.device)
    if out.numel() == 0:
        return out
    first_bits, low_bits = (code_parts(bits) + (0,))[:2]
    block_r = _rows_per_program(group)
    _dequantize_groups_kernel[(triton.cdiv(n_rows, block_r),)](
        codes.contiguous(), steps.contiguous(), mins.contiguous(), out, n_rows, n_bytes, group,
        FIRST_BITS=first_bits, FIRST_PER_BYTE=8 // first_bits, LOW_BITS=low_bits,
        LOW_PER_BYTE=8 // low_bits if low_bits else 1, BLOCK_R=block_r,
        BLOCK_G=triton.next_power_of_2(group))
    return out
