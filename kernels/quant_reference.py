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
