"""Kernels: the Triton kernels against their torch references, the references against plain
computations and the formats' error bounds, and the dispatch.

Triton picks its interpreter when a kernel module is imported (TRITON_INTERPRET=1 must be set
before), and the rest of the suite must not import triton at all. So every check of a Triton
kernel on CPU runs in one subprocess: this file, run as a script with TRITON_INTERPRET=1,
executes all CASES and prints one JSON line per case; the pytest test for a case reads its line.
On a machine with CUDA the same checks also run in-process on the compiled kernels.

Tolerances. The scoring kernel and the reference read the same (fp32, fp16 or bf16) inputs and
both accumulate in fp32, so every dtype gets the same bound: rtol 5e-5, atol 1e-6 against the
reference and against a float64 full softmax on the same inputs (seen: ~2e-6 relative).
Quantization is exact: the kernels round in exact fp32 arithmetic, so codes and scales equal
torch's bit for bit; dequantized fp32/fp16 equal the reference exactly, bf16 within one bf16
ulp (the interpreter truncates fp32 -> bf16, GPUs round to nearest). The low-bit group codes
likewise: codes, float16 steps and minimums equal the reference's bit for bit, dequantized as
above, and a round trip errs by at most step16 / 2 + 2^-10 max(|x|, |min16|) per number.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from kernels import quant, quant_reference
from kernels.score import patch_attention_scores, patch_attention_scores_reference
from tests.support.paths import REPO

RTOL, ATOL = 5e-5, 1e-6
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------- plain computations

def full_softmax_scores(q: torch.Tensor, kc: torch.Tensor, kp: torch.Tensor,
                        valid: torch.Tensor | None, scale: float, reduce: str = "max",
                        include_patch: bool = True) -> torch.Tensor:
    """The definition, materialised in float64: per query head, a softmax over [valid cached
    keys ; the patch's keys, causal] (or the cached keys alone), its cached columns max (or
    mean) over the patch queries and over each KV group's query heads."""
    n_q, n_patch, _ = q.shape
    n_kv, n_cached, _ = kc.shape
    group = n_q // n_kv
    if not include_patch:  # the patch's keys fully masked: they take no softmax mass
        kp = kp.new_zeros(n_kv, n_patch, kc.shape[-1])
    keys = torch.cat([kc, kp], dim=1).double().repeat_interleave(group, dim=0)
    logits = q.double() @ keys.transpose(1, 2) * scale  # [Hq, P, N + P]
    if valid is None:
        valid = torch.ones(n_kv, n_cached, dtype=torch.bool, device=q.device)
    allowed = torch.cat([
        valid.repeat_interleave(group, dim=0)[:, None, :].expand(n_q, n_patch, n_cached),
        torch.ones(n_patch, n_patch, dtype=torch.bool, device=q.device).tril().expand(n_q, -1, -1)
        & include_patch,
    ], dim=2)
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)[..., :n_cached]
    probs = torch.nan_to_num(probs)  # a row with nothing to see (no valid key) gives 0
    if reduce == "mean":
        return probs.mean(dim=1).reshape(n_kv, group, n_cached).mean(dim=1)
    return probs.amax(dim=1).reshape(n_kv, group, n_cached).amax(dim=1)


def score_inputs(n_q: int, n_kv: int, n_patch: int, n_cached: int, dim: int, dtype: torch.dtype,
                 seed: int, spread: float = 1.5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, n_patch, dim, generator=g) * spread
    kc = torch.randn(n_kv, n_cached, dim, generator=g) * spread
    kp = torch.randn(n_kv, n_patch, dim, generator=g) * spread
    return q.to(dtype), kc.to(dtype), kp.to(dtype), g


def assert_within_format_bound(x: torch.Tensor, deq: torch.Tensor, scales: torch.Tensor,
                               fmt: str) -> None:
    """int8: |x - deq| <= scale / 2. fp8 e4m3: <= 2^-4 |x| (half an ulp with 3 mantissa bits),
    or half the subnormal step, 2^-10 x scale. Slack 2^-12 for the fp32 division and product."""
    err = (x.float() - deq.float()).abs()
    step = scales.float()[..., None]
    if fmt == "int8":
        bound = step * 0.5
    else:
        bound = torch.maximum(x.float().abs() * 2.0 ** -4, step * 2.0 ** -10)
    excess = err - bound * (1 + 2.0 ** -12)
    assert (excess <= 0).all(), f"{fmt}: error exceeds the format bound by {excess.max().item()}"


def assert_within_group_bound(x: torch.Tensor, deq: torch.Tensor, steps: torch.Tensor,
                              mins: torch.Tensor) -> None:
    """Group codes: |x - deq| <= step16 / 2 + 2^-10 max(|x|, |min16|). The slack covers
    float16's rounding of the minimum (half an ulp, 2^-11 |min|: a number below min16 clamps to
    code 0, and when min16 rounds above the group's maximum the step is clamped at 0) and
    fp32's roundings of x - min16, the division and the decode (~2^-22 of
    those magnitudes). It assumes a normal float16 step (groups spanning more than ~2^-14 x
    qmax)."""
    err = (x.float() - deq.float()).abs()
    assert (steps.float() >= 0).all(), "a negative step"
    bound = steps.float()[:, None] * 0.5 + 2.0 ** -10 * torch.maximum(
        x.float().abs(), mins.float().abs()[:, None])
    excess = err - bound
    assert (excess <= 0).all(), f"group codes: error exceeds the bound by {excess.max().item()}"


# --------------------------------------------------------------------------- kernel checks

def check_score(device: str, n_q: int, n_kv: int, n_patch: int, n_cached: int, dim: int = 32,
                dtype: str = "fp32", mask: str = "valid", n_splits: int | None = None,
                block_m: int = 64, block_n: int = 64, spread: float = 1.5,
                strided: bool = False, seed: int = 0, reduce: str = "max",
                include_patch: bool = True) -> None:
    """Fused scoring kernel vs the torch reference and the float64 full softmax; invalid slots
    and slots past a head's length score exactly 0."""
    from kernels.score_triton import patch_attention_scores_triton

    q, kc, kp, g = score_inputs(n_q, n_kv, n_patch, n_cached, dim, DTYPES[dtype], seed, spread)
    valid = lengths = None
    if mask in ("valid", "both", "empty-head"):
        valid = torch.rand(n_kv, n_cached, generator=g) >= 0.3
        if mask == "empty-head":
            valid[0] = False
    if mask in ("lengths", "both"):
        lengths = torch.randint(0, n_cached + 1, (n_kv,), generator=g)
        lengths[0] = min(3, n_cached)  # a short head: later key splits are empty for it
    if strided:  # views as the attention call passes them: [1, H, T, d] tensors, sliced
        extra = 5
        big_q = torch.randn(1, n_q, extra + n_patch, dim, generator=g).to(q.dtype)
        big_q[0, :, extra:] = q
        big_k = torch.cat([kc, kp], dim=1)[None]
        q, kc, kp = big_q[0, :, -n_patch:], big_k[0, :, :n_cached], big_k[0, :, n_cached:]
        if valid is not None:  # a bool mask sliced out of a bigger one (non-contiguous)
            valid = valid.repeat_interleave(2, dim=0)[::2]
        assert not q.is_contiguous() and not kc.is_contiguous()
    scale = dim ** -0.5
    on = dict(device=device)
    got = patch_attention_scores_triton(
        q.to(**on), kc.to(**on), kp.to(**on), None if valid is None else valid.to(**on), scale,
        lengths=None if lengths is None else lengths.to(**on), n_splits=n_splits,
        block_m=block_m, block_n=block_n, reduce=reduce, include_patch=include_patch).cpu()
    reference = patch_attention_scores_reference(q, kc, kp, valid, scale, lengths=lengths,
                                                 reduce=reduce, include_patch=include_patch)
    assert got.shape == (n_kv, n_cached) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference, rtol=RTOL, atol=ATOL)
    seen = torch.ones(n_kv, n_cached, dtype=torch.bool) if valid is None else valid.clone()
    if lengths is not None:
        seen &= torch.arange(n_cached)[None, :] < lengths[:, None]
    torch.testing.assert_close(got.double(), full_softmax_scores(q, kc, kp, seen, scale, reduce,
                                                                 include_patch),
                               rtol=RTOL, atol=ATOL)
    assert (got[~seen] == 0).all(), "a slot no query may see must score exactly 0"
    if seen.any():
        assert got[seen].max() > 1e-3  # not trivially zero


def check_quantize(device: str, fmt: str, dtype: str, dim: int, rows: int = 77,
                   strided: bool = False, seed: int = 0) -> None:
    """Quantize kernel vs reference (codes and scales bit-exact), then the format's error bound
    on dequantized values; an all-zero row gets scale 0."""
    from kernels.quant_triton import quantize_triton

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, rows, dim, generator=g) * torch.rand(3, rows, 1, generator=g) * 5
    x[1, 5] = 0.0  # an all-zero token
    x[0, 3, dim // 2] = 100.0  # an outlier dominates its row's scale
    x = x.to(DTYPES[dtype])
    if strided:  # every other token of a bigger tensor
        x = torch.stack([x, x * 2], dim=2).reshape(3, 2 * rows, dim)[:, ::2]
        assert not x.is_contiguous()
    codes, scales = quantize_triton(x.to(device), fmt)
    codes, scales = codes.cpu(), scales.cpu()
    ref_codes, ref_scales = (quant_reference.quantize_int8_reference if fmt == "int8"
                             else quant_reference.quantize_fp8_reference)(x)
    assert codes.dtype == ref_codes.dtype and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == x.shape[:-1]
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes.float(), ref_codes.float())
    assert scales[1, 5] == 0 and (codes[1, 5].float() == 0).all()
    assert_within_format_bound(x, codes.float() * scales[..., None], scales, fmt)


# Rows whose absmax makes the scale exactly 1, so each value is rounded as it is: ties and
# carries, with the result the format's round-to-nearest-even must give.
TIE_ROWS = {
    "int8": ([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 3.4999998, -0.50000006],
             [127, 0, 2, 2, 0, -2, -2, 126, 3, -1]),
    "fp8": ([448.0, 17.0, -19.0, 432.0, 1.96875, 0.49999997, 2.0 ** -10, 3 * 2.0 ** -10,
             5 * 2.0 ** -10, 447.0, 2.0 ** -12, 0.0],
            [448.0, 16.0, -20.0, 448.0, 2.0, 0.5, 0.0, 2.0 ** -8, 2.0 ** -8, 448.0, 0.0, 0.0]),
}


def check_rounding_ties(device: str, fmt: str) -> None:
    """Round to nearest, ties to even, with the mantissa carry, on known values."""
    from kernels.quant_triton import quantize_triton

    values, expected = TIE_ROWS[fmt]
    x = torch.tensor([values], dtype=torch.float32)
    codes, scales = quantize_triton(x.to(device), fmt)
    assert scales.item() == 1.0
    assert codes.cpu().float()[0].tolist() == expected
    ref_codes, _ = (quant_reference.quantize_int8_reference if fmt == "int8"
                    else quant_reference.quantize_fp8_reference)(x)
    assert ref_codes.float()[0].tolist() == expected


def check_dequantize(device: str, fmt: str, out_dtype: str, gather: str = "per-head",
                     dim: int = 64, seed: int = 0) -> None:
    """Gather + dequantize kernel vs reference: per-head kept slots in token order into a new
    tensor, all rows, or into a slice of a bigger buffer (the rest left untouched)."""
    from kernels.quant_triton import dequantize_triton

    g = torch.Generator().manual_seed(seed)
    n_kv, n_cached, kept = 3, 77, 50
    x = torch.randn(n_kv, n_cached, dim, generator=g) * 3
    codes, scales = (quant_reference.quantize_int8_reference if fmt == "int8"
                     else quant_reference.quantize_fp8_reference)(x)
    dtype = DTYPES[out_dtype]
    index = None
    if gather != "all":
        slots = torch.stack([torch.randperm(n_cached, generator=g)[:kept].sort().values
                             for _ in range(n_kv)])
        index = slots + n_cached * torch.arange(n_kv)[:, None]
    ref = quant_reference.dequantize_reference(codes, scales, index, dtype=dtype)
    on = dict(device=device)
    args = (codes.to(**on), scales.to(**on), None if index is None else index.to(**on))
    if gather == "into-buffer":
        buffer = torch.full((n_kv * kept + 7, dim), -7.0, dtype=dtype, device=device)
        target = buffer[4:4 + n_kv * kept].view(n_kv, kept, dim)
        got = dequantize_triton(*args, out=target)
        assert got.data_ptr() == target.data_ptr()
        untouched = torch.cat([buffer[:4], buffer[4 + n_kv * kept:]]).cpu()
        assert (untouched == -7.0).all()
        got = got.cpu()
    else:
        got = dequantize_triton(*args, dtype=dtype).cpu()
    assert got.shape == ref.shape and got.dtype == dtype and got.is_contiguous()
    if out_dtype == "bf16":
        torch.testing.assert_close(got.float(), ref.float(), rtol=2.0 ** -7, atol=0)
    else:
        assert torch.equal(got, ref)
    if out_dtype == "fp32":
        source = x if index is None else x.reshape(-1, dim)[index]
        row_scales = scales if index is None else scales.reshape(-1)[index]
        assert_within_format_bound(source, got, row_scales, fmt)


def check_dequantize_rejects_bad_index(device: str) -> None:
    """An index outside the codes' rows is an error, not a read of arbitrary memory."""
    from kernels.quant_triton import dequantize_triton

    codes, scales = quant_reference.quantize_int8_reference(torch.randn(2, 5, 16))
    for bad in ([0, 10], [-1, 3]):
        with pytest.raises(IndexError, match="index values"):
            dequantize_triton(codes.to(device), scales.to(device), torch.tensor(bad).to(device))


def group_inputs(bits: int, group: int, rows: int, dtype: str, seed: int) -> torch.Tensor:
    """Random groups at various scales and offsets, plus rows that test the edges: constant
    (fp16-representable, and not: min16 rounds above the maximum, the step clamped at 0), one
    outlier,
    a minimum that is a float16 tie (ties to even: 1 + 2^-11 -> 1, 1 + 3 x 2^-11 -> 1 + 2^-9),
    and a step that is one ((max - min) / qmax = 1 + 2^-11 exactly, -> 1.0)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, group, generator=g) * torch.rand(rows, 1, generator=g) * 5
         + torch.randn(rows, 1, generator=g) * 2)
    qmax = 2 ** bits - 1
    x[0] = 0.75
    x[1] = 100.045
    x[2, group // 2] = 100.0
    x[3] = torch.rand(group, generator=g) * 3 + 1.5
    x[3, 5] = 1 + 2.0 ** -11
    x[4] = torch.rand(group, generator=g) * 3 + 1.5
    x[4, 1] = 1 + 3 * 2.0 ** -11
    x[5] = torch.rand(group, generator=g) * qmax
    x[5, 0], x[5, -1] = 0.0, qmax * (1 + 2.0 ** -11)
    return x.to(DTYPES[dtype])


def check_group_codes(device: str, bits: int, dtype: str, group: int, rows: int = 150,
                      strided: bool = False, seed: int = 0) -> None:
    """Group quantize kernel vs reference (codes, steps, minimums bit-exact), then the dequantize
    kernel into fp32 / fp16 (exact) and bf16 (one ulp), and the round-trip bound."""
    from kernels.quant_triton import dequantize_groups_triton, quantize_groups_triton

    x = group_inputs(bits, group, rows, dtype, seed)
    if strided:  # every other row of a bigger tensor
        x = torch.stack([x, x * 2], dim=1).reshape(2 * rows, group)[::2]
        assert not x.is_contiguous()
    codes, steps, mins = (t.cpu() for t in quantize_groups_triton(x.to(device), bits))
    ref = quant_reference.quantize_groups_reference(x, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (rows, group * bits // 8)
    assert steps.dtype == mins.dtype == torch.float16 and steps.shape == mins.shape == (rows,)
    assert torch.equal(steps, ref[1]) and torch.equal(mins, ref[2])
    assert torch.equal(codes, ref[0])
    if dtype == "fp32":  # the edge rows came through as built
        assert mins[3] == 1.0 and mins[4] == 1 + 2.0 ** -9 and steps[5] == 1.0
        assert steps[1] == 0 and (codes[1] == 0).all()  # min16 above the max: clamped
    assert steps[0] == 0 and (codes[0] == 0).all() and mins[0] == 0.75
    on = dict(device=device)
    for out_dtype in DTYPES.values():
        got = dequantize_groups_triton(codes.to(**on), steps.to(**on), mins.to(**on), bits,
                                       dtype=out_dtype).cpu()
        expected = quant_reference.dequantize_groups_reference(codes, steps, mins, bits,
                                                               dtype=out_dtype)
        assert got.dtype == out_dtype and got.shape == (rows, group)
        if out_dtype == torch.bfloat16:
            torch.testing.assert_close(got.float(), expected.float(), rtol=2.0 ** -7, atol=0)
        else:
            assert torch.equal(got, expected), out_dtype
        if out_dtype == torch.float32:
            assert (got[0] == 0.75).all()
            assert_within_group_bound(x, got, steps, mins)


def check_group_codes_edges(device: str) -> None:
    """No rows, and the reference's errors for bits outside (2, 3, 4, 5, 6, 8) and groups that
    do not pack into whole bytes (in each part of a split width)."""
    from kernels.quant_triton import dequantize_groups_triton, quantize_groups_triton

    codes, steps, mins = quantize_groups_triton(torch.empty(0, 32, device=device), 4)
    assert codes.shape == (0, 16) and steps.shape == mins.shape == (0,)
    assert dequantize_groups_triton(codes, steps, mins, 4, dtype=torch.float16).shape == (0, 32)
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize_groups_triton(torch.randn(3, 32, device=device), 7)
    with pytest.raises(ValueError, match="bits must be one of"):
        dequantize_groups_triton(torch.zeros(3, 14, dtype=torch.uint8, device=device),
                                 torch.ones(3, dtype=torch.float16, device=device),
                                 torch.zeros(3, dtype=torch.float16, device=device), 7)
    with pytest.raises(ValueError, match="whole bytes"):
        quantize_groups_triton(torch.randn(3, 6, device=device), 2)
    with pytest.raises(ValueError, match="whole bytes"):  # 3 bits: a 1-bit part of 4 codes
        quantize_groups_triton(torch.randn(3, 4, device=device), 3)


@dataclass
class Case:
    name: str
    check: Callable[..., None]
    params: dict = field(default_factory=dict)

    def run(self, device: str) -> None:
        self.check(device, **self.params)


CASES = [
    # scoring: MHA and GQA groups 1, 3, 4, 8; P from 1 to 300; N off the 64-tile; masks.
    Case("score-mha-fp32-P5-N45", check_score, dict(n_q=4, n_kv=4, n_patch=5, n_cached=45)),
    Case("score-gqa3-fp16-lengths-splits3", check_score,
         dict(n_q=6, n_kv=2, n_patch=37, n_cached=130, dim=24, dtype="fp16", mask="lengths",
              n_splits=3)),
    Case("score-gqa4-bf16-valid+lengths", check_score,
         dict(n_q=8, n_kv=2, n_patch=17, n_cached=100, dim=64, dtype="bf16", mask="both",
              n_splits=2)),
    Case("score-gqa8-fp32-P200", check_score,
         dict(n_q=8, n_kv=1, n_patch=200, n_cached=70, seed=1)),
    Case("score-mha-bf16-P300", check_score,
         dict(n_q=2, n_kv=2, n_patch=300, n_cached=20, dtype="bf16", mask="none", seed=2)),
    Case("score-gqa4-fp32-P1-N1", check_score,
         dict(n_q=8, n_kv=2, n_patch=1, n_cached=1, dim=16, mask="none")),
    Case("score-gqa3-fp16-empty-head", check_score,
         dict(n_q=9, n_kv=3, n_patch=9, n_cached=50, dtype="fp16", mask="empty-head", seed=3)),
    Case("score-gqa3-fp32-sharp-empty-splits", check_score,
         dict(n_q=3, n_kv=1, n_patch=12, n_cached=150, mask="lengths", spread=4.0, n_splits=4,
              seed=4)),
    Case("score-gqa4-bf16-strided-views", check_score,
         dict(n_q=8, n_kv=2, n_patch=11, n_cached=60, dtype="bf16", strided=True, seed=5)),
    Case("score-gqa3-fp32-tiles16x32", check_score,
         dict(n_q=6, n_kv=2, n_patch=23, n_cached=45, block_m=16, block_n=32, seed=6)),
    Case("score-gqa3-fp32-mean", check_score,
         dict(n_q=6, n_kv=2, n_patch=23, n_cached=75, reduce="mean", seed=8)),
    Case("score-gqa3-fp16-past-only-splits2", check_score,
         dict(n_q=6, n_kv=2, n_patch=19, n_cached=130, dtype="fp16", include_patch=False,
              n_splits=2, seed=9)),
    Case("score-gqa4-fp32-mean-past-only-lengths", check_score,
         dict(n_q=8, n_kv=2, n_patch=7, n_cached=90, mask="both", reduce="mean",
              include_patch=False, n_splits=3, seed=10)),
    Case("score-gqa3-bf16-P256-N150-d128", check_score,
         dict(n_q=3, n_kv=1, n_patch=256, n_cached=150, dim=128, dtype="bf16", n_splits=2,
              seed=7)),
    # quantization: both formats, three input dtypes, head dims 64, 24 (not a power of 2), 128.
    *[Case(f"quantize-{fmt}-{dtype}-d{dim}", check_quantize,
           dict(fmt=fmt, dtype=dtype, dim=dim, seed=dim))
      for fmt in ("int8", "fp8") for dtype in DTYPES for dim in (64, 24, 128)],
    *[Case(f"quantize-{fmt}-bf16-strided", check_quantize,
           dict(fmt=fmt, dtype="bf16", dim=64, strided=True)) for fmt in ("int8", "fp8")],
    *[Case(f"rounding-ties-{fmt}", check_rounding_ties, dict(fmt=fmt)) for fmt in ("int8", "fp8")],
    *[Case(f"dequantize-{fmt}-to-{dtype}-{gather}", check_dequantize,
           dict(fmt=fmt, out_dtype=dtype, gather=gather))
      for fmt in ("int8", "fp8") for dtype in DTYPES for gather in ("per-head", "into-buffer")],
    *[Case(f"dequantize-{fmt}-all-rows-d24", check_dequantize,
           dict(fmt=fmt, out_dtype="fp32", gather="all", dim=24)) for fmt in ("int8", "fp8")],
    Case("dequantize-rejects-out-of-range-index", check_dequantize_rejects_bad_index),
    # low-bit group codes: 2, 4, 8 bits, groups of 32 and 64, three input dtypes; 150 rows
    # (BLOCK_R is 64: the last program is partly padding); the widths packed in two parts
    # (3, 5, 6) at both groups in fp32, and in every dtype at 64.
    *[Case(f"groups-{bits}bit-{dtype}-G{group}", check_group_codes,
           dict(bits=bits, dtype=dtype, group=group, seed=bits * group))
      for bits in (2, 4, 8) for dtype in DTYPES for group in (32, 64)],
    *[Case(f"groups-{bits}bit-{dtype}-G{group}", check_group_codes,
           dict(bits=bits, dtype=dtype, group=group, seed=bits * group))
      for bits in (3, 5, 6) for dtype in DTYPES for group in (32, 64)
      if dtype == "fp32" or group == 64],
    Case("groups-4bit-bf16-strided", check_group_codes,
         dict(bits=4, dtype="bf16", group=64, rows=37, strided=True)),
    Case("groups-no-rows-and-bad-arguments", check_group_codes_edges),
]
CASE_NAMES = [case.name for case in CASES]


# --------------------------------------------------------------------------- interpreted kernels

def run_interpreted_cases() -> None:
    """Script mode: run every case on CPU tensors through the Triton interpreter."""
    import traceback

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    for case in CASES:
        start = time.perf_counter()
        try:
            case.run("cpu")
            result = {"name": case.name, "ok": True, "error": ""}
        except Exception:  # noqa: BLE001 - reported to the pytest case
            result = {"name": case.name, "ok": False, "error": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - start, 3)
        print("CASE " + json.dumps(result), flush=True)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    """One subprocess runs all cases under TRITON_INTERPRET=1; results by case name."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            result = json.loads(line[5:])
            results[result["name"]] = result
    results["__proc__"] = {"returncode": proc.returncode, "stderr": proc.stderr[-4000:]}
    return results


@pytest.mark.parametrize("name", CASE_NAMES)
def test_triton_kernel_under_interpreter(name: str, interpreted: dict[str, dict]) -> None:
    result = interpreted.get(name)
    if result is None:
        pytest.fail(f"no result from the interpreter subprocess: {interpreted['__proc__']}")
    assert result["ok"], result["error"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a CUDA GPU")
@pytest.mark.parametrize("name", CASE_NAMES)
def test_compiled_kernel_on_gpu(name: str) -> None:
    """The same checks on the compiled kernels (CUDA tensors in, compared on CPU)."""
    case = CASES[CASE_NAMES.index(name)]
    if "fp8" in name and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's fp8 e4m3 conversions need sm_89+")
    case.run("cuda")


# --------------------------------------------------------------------------- references, dispatch

@pytest.mark.parametrize("mask", ["lengths", "valid+lengths"])
@pytest.mark.parametrize("query_chunk", [7, 256])
def test_reference_with_lengths_matches_full_softmax(mask: str, query_chunk: int) -> None:
    """The reference's optional per-head lengths act like a validity mask of the prefix."""
    q, kc, kp, g = score_inputs(6, 2, 13, 40, 16, torch.float32, seed=7)
    lengths = torch.tensor([0, 29])
    valid = torch.rand(2, 40, generator=g) >= 0.3 if mask == "valid+lengths" else None
    got = patch_attention_scores_reference(q, kc, kp, valid, 0.25, query_chunk=query_chunk,
                                           lengths=lengths)
    seen = torch.arange(40)[None, :] < lengths[:, None]
    if valid is not None:
        seen &= valid
    torch.testing.assert_close(got.double(), full_softmax_scores(q, kc, kp, seen, 0.25),
                               rtol=1e-5, atol=1e-7)
    assert (got[~seen] == 0).all() and (got[1, seen[1]] > 0).all()
    # The dispatch entry point (CPU: the reference) takes the same keyword.
    torch.testing.assert_close(patch_attention_scores(q, kc, kp, valid, 0.25, lengths=lengths),
                               got)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reference_score_inputs_in_half_precision(dtype: str) -> None:
    """fp16/bf16 inputs are scored in fp32: equal to the float64 definition on the same
    (rounded) inputs within fp32 tolerance."""
    q, kc, kp, g = score_inputs(8, 2, 21, 33, 32, DTYPES[dtype], seed=8)
    valid = torch.rand(2, 33, generator=g) >= 0.2
    got = patch_attention_scores(q, kc, kp, valid, 32 ** -0.5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), full_softmax_scores(q, kc, kp, valid, 32 ** -0.5),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reference_quantize_dequantize_within_format_bound(fmt: str, dtype: str) -> None:
    """CPU dispatch (the torch reference): quantize -> dequantize stays within the format's
    bound; scales are absmax / QMAX per (head, token); some element sits at +-QMAX."""
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(4, 300, 64, generator=g) * torch.rand(4, 300, 1, generator=g) * 8)
    x = x.to(DTYPES[dtype])
    codes, scales = quant.quantize_int8(x) if fmt == "int8" else quant.quantize_fp8(x)
    qmax = quant_reference.INT8_MAX if fmt == "int8" else quant_reference.FP8_E4M3_MAX
    torch.testing.assert_close(scales, x.float().abs().amax(dim=-1) / qmax, rtol=0, atol=0)
    assert (codes.float().abs().amax(dim=-1) == qmax).all()
    deq = quant.dequantize(codes, scales)
    assert_within_format_bound(x, deq, scales, fmt)
    if fmt == "int8":  # the bound is tight enough to matter: truncating instead breaks it
        truncated = torch.trunc(x.float() / scales[..., None]) * scales[..., None]
        with pytest.raises(AssertionError):
            assert_within_format_bound(x, truncated, scales, fmt)


def test_reference_dequantize_gathers_rows_in_index_order() -> None:
    """index picks rows of codes viewed as [rows, d], in the index's order and shape."""
    x = torch.arange(2 * 5 * 4, dtype=torch.float32).reshape(2, 5, 4) - 20
    codes, scales = quant.quantize_int8(x)
    slots = torch.tensor([[0, 3, 4], [1, 2, 4]])
    index = slots + 5 * torch.arange(2)[:, None]
    got = quant.dequantize(codes, scales, index, dtype=torch.float32)
    assert got.shape == (2, 3, 4)
    expected = torch.stack([x[h, slots[h]] for h in range(2)])
    assert_within_format_bound(expected, got, torch.stack([scales[h, slots[h]] for h in range(2)]),
                               "int8")
    with pytest.raises(ValueError, match="contiguous"):
        quant.dequantize(codes, scales, index, out=torch.empty(2, 4, 3).transpose(1, 2))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reference_group_codes_round_trip_within_bound(bits: int, dtype: str) -> None:
    """CPU dispatch (the torch reference): minimums are the groups' minimum in float16, steps
    (max - min16) / qmax in float16, codes span [0, qmax], and quantize -> dequantize stays
    within step16 / 2 + 2^-10 max(|x|, |min16|) (see `assert_within_group_bound`)."""
    x = group_inputs(bits, 64, 300, dtype, seed=11)
    codes, steps, mins = quant.quantize_groups(x, bits)
    qmax = 2 ** bits - 1
    assert torch.equal(mins, x.float().amin(dim=-1).half())
    assert torch.equal(steps, ((x.float().amax(dim=-1) - mins.float()) / qmax).clamp_min(0).half())
    shifts = torch.arange(8 // bits, dtype=torch.uint8) * bits
    unpacked = ((codes[..., None] >> shifts) & qmax).reshape(300, 64)
    assert unpacked.min() == 0 and unpacked.max() == qmax
    deq = quant.dequantize_groups(codes, steps, mins, bits)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    assert_within_group_bound(x, deq, steps, mins)
    # The bound is tight enough to matter: truncating the codes instead breaks it.
    safe = torch.where(steps > 0, steps.float(), 1.0)[:, None]
    truncated = torch.floor((x.float() - mins.float()[:, None]) / safe).clamp(0, qmax)
    with pytest.raises(AssertionError):
        assert_within_group_bound(x, truncated * steps.float()[:, None] + mins.float()[:, None],
                                  steps, mins)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_reference_constant_group_decodes_exactly(bits: int) -> None:
    """A constant group (of float16-representable numbers) has step 0 and codes 0, and decodes
    to the constant exactly, in every output dtype that holds it."""
    values = torch.tensor([0.75, -3.5, 0.0, 1000.0, 2.0 ** -14])
    x = values[:, None].expand(5, 32)
    codes, steps, mins = quant.quantize_groups(x, bits)
    assert (codes == 0).all() and (steps == 0).all() and torch.equal(mins.float(), values)
    for dtype in DTYPES.values():
        assert torch.equal(quant.dequantize_groups(codes, steps, mins, bits, dtype=dtype),
                           x.to(dtype))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_reference_group_packing_puts_the_first_code_lowest(bits: int) -> None:
    """Groups arange(G) and its reverse with G = 2^bits have step 1, so code i is i (or
    G - 1 - i); the bytes hold 8 / bits consecutive codes, the first in the lowest bits."""
    group = 2 ** bits
    ramp = torch.arange(group, dtype=torch.float32)
    codes, steps, mins = quant.quantize_groups(torch.stack([ramp, ramp.flip(0)]), bits)
    assert (steps == 1).all() and (mins == 0).all()
    per_byte = 8 // bits
    expected = [[sum(int(c) << (k * bits) for k, c in enumerate(row[p:p + per_byte]))
                 for p in range(0, group, per_byte)] for row in (ramp, ramp.flip(0))]
    assert codes.tolist() == expected
    if bits == 2:  # spelled out: codes 0, 1, 2, 3 -> 0b11_10_01_00; 3, 2, 1, 0 -> 0b00_01_10_11
        assert codes.tolist() == [[0b11100100], [0b00011011]]
    if bits == 4:
        assert codes[0, :3].tolist() == [0x10, 0x32, 0x54]
    torch.testing.assert_close(quant.dequantize_groups(codes, steps, mins, bits),
                               torch.stack([ramp, ramp.flip(0)]), rtol=0, atol=0)


@pytest.mark.parametrize("bits, parts", [(3, (2, 1)), (5, (4, 1)), (6, (4, 2))])
def test_reference_split_widths_pack_their_high_bits_then_their_low_bits(
        bits: int, parts: tuple[int, int]) -> None:
    """A width that does not divide 8 is packed in two parts: the high bits of every code of
    the group, packed as the wider part's width packs, then the low bits as the narrower's; the
    group takes G x bits / 8 bytes and decodes exactly. Format 7's order (low bits first) is
    `high_first=False`, and `high_bits_first` turns it into this one."""
    group = 2 ** bits
    ramp = torch.arange(group, dtype=torch.float32)
    codes, steps, mins = quant.quantize_groups(torch.stack([ramp, ramp.flip(0)]), bits)
    assert (steps == 1).all() and (mins == 0).all() and codes.shape == (2, group * bits // 8)
    high, low = parts
    for high_first, order in ((True, ((high, low), (low, 0))), (False, ((high, 0), (low, high)))):
        packed = quant_reference.pack_codes(torch.stack([ramp, ramp.flip(0)]).to(torch.uint8),
                                            bits, high_first=high_first)
        for row, values in zip(packed.tolist(), (ramp, ramp.flip(0))):
            expected = []
            for width, shift in order:
                part = [(int(v) >> shift) & (2 ** width - 1) for v in values]
                per_byte = 8 // width
                expected += [sum(c << (k * width) for k, c in enumerate(part[p:p + per_byte]))
                             for p in range(0, group, per_byte)]
            assert row == expected
        if high_first:
            assert torch.equal(packed, codes)
        else:
            assert torch.equal(quant_reference.high_bits_first(packed, bits), codes)
    torch.testing.assert_close(quant.dequantize_groups(codes, steps, mins, bits),
                               torch.stack([ramp, ramp.flip(0)]), rtol=0, atol=0)


def test_reference_group_codes_reject_bad_bits_and_groups() -> None:
    """Bits outside (2, 3, 4, 5, 6, 8), groups that do not fill whole bytes in each part, and
    bytes that hold no whole group are clear errors."""
    with pytest.raises(ValueError, match=r"bits must be one of \(2, 3, 4, 5, 6, 8\), got 7"):
        quant.quantize_groups(torch.randn(2, 32), 7)
    with pytest.raises(ValueError, match="bits must be one of"):
        quant.dequantize_groups(torch.zeros(2, 14, dtype=torch.uint8), torch.ones(2).half(),
                                torch.zeros(2).half(), 7)
    with pytest.raises(ValueError, match="hold no whole group of 3-bit codes"):
        quant.dequantize_groups(torch.zeros(2, 5, dtype=torch.uint8), torch.ones(2).half(),
                                torch.zeros(2).half(), 3)
    for bits, group in ((2, 6), (4, 5), (2, 2), (3, 4), (5, 12), (6, 2)):
        with pytest.raises(ValueError, match=f"a group of {group} numbers does not pack into "
                                             f"whole bytes at {bits} bits"):
            quant.quantize_groups(torch.randn(2, group), bits)


def test_cpu_dispatch_never_imports_triton() -> None:
    """Importing the kernels and calling every dispatch function on CPU tensors leaves triton
    unimported (the rest of the suite, and CPU builds, must not load it)."""
    code = (
        "import sys, torch\n"
        "from kernels.score import patch_attention_scores\n"
        "from kernels import quant\n"
        "q, k = torch.randn(4, 3, 16), torch.randn(2, 5, 16)\n"
        "patch_attention_scores(q, k, torch.randn(2, 3, 16), None, 0.25)\n"
        "for f in (quant.quantize_int8, quant.quantize_fp8):\n"
        "    quant.dequantize(*f(k))\n"
        "quant.dequantize_groups(*quant.quantize_groups(k.reshape(10, 16), 4), 4)\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


if __name__ == "__main__":
    run_interpreted_cases()
