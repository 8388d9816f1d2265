"""KV quantization for tri-state compression (ARKV): one dispatch function per operation.

The Triton kernels (`kernels.quant_triton`) run on CUDA tensors, the torch references
(`kernels.quant_reference`, where the formats are described) on CPU tensors. The kernels are
imported inside the dispatch, on first use on CUDA: a CPU process never imports Triton.
"""

from __future__ import annotations

import torch

from kernels.quant_reference import (
    dequantize_groups_reference,
    dequantize_reference,
    quantize_fp8_reference,
    quantize_groups_reference,
    quantize_int8_reference,
)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: per-token, per-head symmetric int8 (Triton on CUDA, torch on CPU)."""
    if x.is_cuda:
        from kernels.quant_triton import quantize_triton
        return quantize_triton(x, "int8")
    return quantize_int8_reference(x)


def _fp8_kernel_supported(device: torch.device) -> bool:
    """Triton's e4m3 conversions need sm_89+ (Ada/Hopper); older GPUs take the torch path."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: per-token, per-head fp8 e4m3 with an absmax scale."""
    if x.is_cuda and _fp8_kernel_supported(x.device):
        from kernels.quant_triton import quantize_triton
        return quantize_triton(x, "fp8")
    return quantize_fp8_reference(x)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, index: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch: gather + dequantize int8 or fp8 codes (see `dequantize_reference`)."""
    if codes.is_cuda and (codes.dtype == torch.int8 or _fp8_kernel_supported(codes.device)):
        from kernels.quant_triton import dequantize_triton
        return dequantize_triton(codes, scales, index, dtype=dtype, out=out)
    return dequantize_reference(codes, scales, index, dtype=dtype, out=out)


def quantize_groups(x: torch.Tensor, bits: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dispatch: KIVI low-bit asymmetric codes, one group per row of x [R, G] (see
    `quantize_groups_reference`); Triton on CUDA (no reshapes, one pass), torch on CPU."""
    if x.is_cuda:
        from kernels.quant_triton import quantize_groups_triton
        return quantize_groups_triton(x, bits)
    return quantize_groups_reference(x, bits)


def dequantize_groups(codes: torch.Tensor, steps: torch.Tensor, mins: torch.Tensor, bits: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dispatch: unpack and dequantize group codes; Triton on CUDA (unpacked in registers, no
    intermediate tensors), torch on CPU."""
    if codes.is_cuda:
        from kernels.quant_triton import dequantize_groups_triton
        return dequantize_groups_triton(codes, steps, mins, bits, dtype=dtype)
    return dequantize_groups_reference(codes, steps, mins, bits, dtype=dtype)
