"""Fused patched-prompt scoring in Triton (see `kernels.score` for the definition).

Imported only by the dispatch in `kernels.score` on CUDA tensors, and by the kernel tests under
`TRITON_INTERPRET=1` (the interpreter is chosen when this module is imported). Two passes over
the keys, so no P x N attention matrix ever exists:

1. `_row_stats_kernel`: per patch query row, the softmax normaliser (running max m and sum l, in
   base 2) over the valid cached keys plus the patch's own keys up to the query. The cached keys
   can be split across programs (split-K, for parallelism when Hq x P is small); the partial
   (m, l) are merged with a log-sum-exp in torch, O(splits x Hq x P) floats.
2. `_score_kernel`: per (KV head, tile of cached keys), the probabilities exp2(s - m) / l for
   every query row of the head's group, max-reduced on the fly: [Hkv, N] out.

The rows of a KV head are its group's query heads times the patch queries, packed as
(query head in group, patch position), so each key tile is loaded once per group (GQA).
Extra memory: O(splits x Hq x P + Hkv x N); fp32 accumulation for fp16, bf16 and fp32 inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _online_update(m_i, l_i, s):
    """Fold a tile of base-2 logits s [BLOCK_M, BLOCK_N] (masked entries -inf) into the running
    row max and sum."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    l_new = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
    return m_new, l_new


@triton.jit
def _n_keys(len_ptr, kv, n_cached, HAS_LENGTHS: tl.constexpr):
    """How many cached keys KV head `kv` has: all of them, or its own length when given."""
    n_end = n_cached
    if HAS_LENGTHS:
        n_end = tl.minimum(tl.load(len_ptr + kv).to(tl.int32), n_cached)
    return n_end


@triton.jit
def _key_mask(valid_ptr, kv, cols, stop, s_vh, s_vn, HAS_VALID: tl.constexpr):
    """For a tile of cached key positions: which exist (below `stop`, to load), and which may be
    attended (those that exist and, given a validity mask, are marked valid)."""
    in_range = cols < stop
    col_ok = in_range
    if HAS_VALID:
        col_ok = col_ok & (tl.load(valid_ptr + kv * s_vh + cols * s_vn, mask=in_range,
                                   other=0) != 0)
    return in_range, col_ok


@triton.jit
def _load_tile(row_ptrs, row_ok, dims, dim_ok, s_d, DOT_FP32: tl.constexpr):
    """A [rows, BLOCK_D] tile of query or key vectors starting at `row_ptrs`, zero outside the
    masks; widened to fp32 when the dot runs in fp32."""
    tile = tl.load(row_ptrs[:, None] + dims[None, :] * s_d,
                   mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _row_stats_kernel(q_ptr, kc_ptr, kp_ptr, valid_ptr, len_ptr, m_ptr, l_ptr,
                      n_patch, n_cached, n_rows, group, head_dim, keys_per_split, n_kv_heads,
                      s_qh, s_qp, s_qd, s_kch, s_kcn, s_kcd, s_kph, s_kpp, s_kpd, s_vh, s_vn,
                      qk_scale,
                      HAS_VALID: tl.constexpr, HAS_LENGTHS: tl.constexpr, DOT_FP32: tl.constexpr,
                      PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, INCLUDE_PATCH: tl.constexpr, MEAN: tl.constexpr):
    kv = tl.program_id(0)
    row_block = tl.program_id(1)
    split = tl.program_id(2)

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    q_head = kv * group + rows // n_patch
    q_pos = rows % n_patch
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = _load_tile(q_ptr + q_head * s_qh + q_pos * s_qp, row_ok, dims, dim_ok, s_qd, DOT_FP32)

    # A finite "minus infinity" (written out: Triton 3.6 refuses a plain global in a compiled
    # kernel, and its interpreter a constexpr one): exp2(-inf - -inf) would be NaN for a row
    # whose keys in one split are all masked; exp2(-inf - (-1e30)) is a clean 0.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    start = split * keys_per_split
    stop = tl.minimum(start + keys_per_split, _n_keys(len_ptr, kv, n_cached, HAS_LENGTHS))
    for n0 in range(start, stop, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        in_range, col_ok = _key_mask(valid_ptr, kv, cols, stop, s_vh, s_vn, HAS_VALID)
        k = _load_tile(kc_ptr + kv * s_kch + cols * s_kcn, in_range, dims, dim_ok, s_kcd,
                       DOT_FP32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_i, l_i = _online_update(m_i, l_i, s)

    if INCLUDE_PATCH and split == 0:  # the patch's own keys, causally: only one split adds them
        for j0 in range(0, n_patch, BLOCK_N):
            cols = j0 + tl.arange(0, BLOCK_N)
            in_range = cols < n_patch
            k = _load_tile(kp_ptr + kv * s_kph + cols * s_kpp, in_range, dims, dim_ok, s_kpd,
                           DOT_FP32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            seen = in_range[None, :] & (cols[None, :] <= q_pos[:, None])
            s = tl.where(seen, s, float("-inf"))
            m_i, l_i = _online_update(m_i, l_i, s)

    out = (split * n_kv_heads + kv) * n_rows + rows
    tl.store(m_ptr + out, m_i, mask=row_ok)
    tl.store(l_ptr + out, l_i, mask=row_ok)


@triton.jit
def _score_kernel(q_ptr, kc_ptr, valid_ptr, len_ptr, m_ptr, l_ptr, out_ptr,
                  n_patch, n_cached, n_rows, group, head_dim,
                  s_qh, s_qp, s_qd, s_kch, s_kcn, s_kcd, s_vh, s_vn,
                  qk_scale,
                  HAS_VALID: tl.constexpr, HAS_LENGTHS: tl.constexpr, DOT_FP32: tl.constexpr,
                  PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, INCLUDE_PATCH: tl.constexpr, MEAN: tl.constexpr):
    kv = tl.program_id(0)
    col_block = tl.program_id(1)

    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_end = _n_keys(len_ptr, kv, n_cached, HAS_LENGTHS)
    in_range, col_ok = _key_mask(valid_ptr, kv, cols, n_end, s_vh, s_vn, HAS_VALID)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    k = _load_tile(kc_ptr + kv * s_kch + cols * s_kcn, in_range, dims, dim_ok, s_kcd, DOT_FP32)

    best = tl.zeros([BLOCK_N], dtype=tl.float32)
    # A tile entirely past this head's length has nothing to score: skip the row loop.
    rows_to_scan = tl.where(col_block * BLOCK_N < n_end, n_rows, 0)
    for r0 in range(0, rows_to_scan, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        q_head = kv * group + rows // n_patch
        q_pos = rows % n_patch
        q = _load_tile(q_ptr + q_head * s_qh + q_pos * s_qp, row_ok, dims, dim_ok, s_qd,
                       DOT_FP32)
        m = tl.load(m_ptr + kv * n_rows + rows, mask=row_ok, other=0.0)
        row_sum = tl.load(l_ptr + kv * n_rows + rows, mask=row_ok, other=1.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(row_ok[:, None], s, float("-inf"))
        p = tl.exp2(s - m[:, None]) / row_sum[:, None]
        if MEAN:
            best += tl.sum(tl.where(row_ok[:, None], p, 0.0), axis=0)
        else:
            best = tl.maximum(best, tl.max(p, axis=0))

    if MEAN:
        best = best / n_rows
    best = tl.where(col_ok, best, 0.0)
    tl.store(out_ptr + kv * n_cached + cols, best, mask=cols < n_cached)


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _default_splits(n_kv_heads: int, row_blocks: int, n_cached: int, block_n: int,
                    device: torch.device) -> int:
    """Split the cached keys of pass 1 until there are about two programs per multiprocessor."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    base = max(1, n_kv_heads * row_blocks)
    return max(1, min(triton.cdiv(target, base), triton.cdiv(n_cached, block_n)))


def patch_attention_scores_triton(patch_queries: torch.Tensor, cached_keys: torch.Tensor,
                                  patch_keys: torch.Tensor, cached_valid: torch.Tensor | None,
                                  scale: float, lengths: torch.Tensor | None = None,
                                  block_m: int = 64, block_n: int = 64,
                                  n_splits: int | None = None, num_warps: int = 4,
                                  num_stages: int = 2, reduce: str = "max",
                                  include_patch: bool = True) -> torch.Tensor:
    """The fused kernel; same contract as `patch_attention_scores_reference` (any strides, e.g.
    views into the attention call's query/key tensors). `n_splits` (pass-1 split of the cached
    keys) defaults to enough programs for the device."""
    n_q_heads, n_patch, head_dim = patch_queries.shape
    n_kv_heads, n_cached, _ = cached_keys.shape
    if n_q_heads % n_kv_heads:
        raise ValueError(f"{n_q_heads} query heads do not group into {n_kv_heads} KV heads")
    if patch_keys.shape != (n_kv_heads, n_patch, head_dim):
        raise ValueError(f"patch_keys {tuple(patch_keys.shape)} != "
                         f"{(n_kv_heads, n_patch, head_dim)}")
    if reduce not in ("max", "mean"):
        raise ValueError(f"reduce must be 'max' or 'mean', got {reduce!r}")
    group = n_q_heads // n_kv_heads
    device = patch_queries.device
    out = torch.empty(n_kv_heads, n_cached, dtype=torch.float32, device=device)
    if n_cached == 0:
        return out
    if n_patch == 0:
        return out.zero_()
    n_rows = group * n_patch
    for block in (block_m, block_n):
        if block < 16 or block & (block - 1):
            raise ValueError(f"tile sizes must be powers of two >= 16 (tl.dot), got {block}")
    block_d = max(16, triton.next_power_of_2(head_dim))

    dtype = patch_queries.dtype
    if not (dtype == cached_keys.dtype == patch_keys.dtype):
        raise ValueError("patch queries, cached keys and patch keys must share a dtype")
    # fp32 inputs: full-precision dot, not TF32 (scores feed a top-k; match the reference).
    # The interpreter cannot multiply bf16 tiles (it stores them as raw uint16), so there bf16
    # is widened to fp32 first: the same products, which fp32 holds exactly either way.
    dot_fp32 = dtype == torch.float32 or (dtype == torch.bfloat16 and _interpreting())
    precision = "ieee" if dot_fp32 else "tf32"  # ignored for fp16/bf16 operands

    has_valid = cached_valid is not None
    valid = cached_valid.view(torch.uint8) if has_valid else out  # dummy pointer when unused
    if has_valid and cached_valid.shape != (n_kv_heads, n_cached):
        raise ValueError(f"cached_valid {tuple(cached_valid.shape)} != {(n_kv_heads, n_cached)}")
    has_lengths = lengths is not None
    lens = lengths.to(device=device, dtype=torch.int32).contiguous() if has_lengths else out

    row_blocks = triton.cdiv(n_rows, block_m)
    splits = n_splits or _default_splits(n_kv_heads, row_blocks, n_cached, block_n, device)
    keys_per_split = triton.cdiv(triton.cdiv(n_cached, splits), block_n) * block_n
    splits = triton.cdiv(n_cached, keys_per_split)
    m_part = torch.empty(splits, n_kv_heads, n_rows, dtype=torch.float32, device=device)
    l_part = torch.empty_like(m_part)
    qk_scale = float(scale) * _LOG2E
    flags = dict(HAS_VALID=has_valid, HAS_LENGTHS=has_lengths, DOT_FP32=dot_fp32,
                 PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                 INCLUDE_PATCH=include_patch, MEAN=reduce == "mean",
                 num_warps=num_warps, num_stages=num_stages)
    q, kc, kp = patch_queries, cached_keys, patch_keys
    v_strides = (valid.stride(0), valid.stride(1)) if has_valid else (0, 0)

    _row_stats_kernel[(n_kv_heads, row_blocks, splits)](
        q, kc, kp, valid, lens, m_part, l_part,
        n_patch, n_cached, n_rows, group, head_dim, keys_per_split, n_kv_heads,
        *q.stride(), *kc.stride(), *kp.stride(), *v_strides, qk_scale, **flags)
    if splits == 1:
        m, row_sum = m_part[0], l_part[0]
    else:  # merge the splits' partial normalisers (base 2)
        m = m_part.amax(dim=0)
        row_sum = (l_part * torch.exp2(m_part - m)).sum(dim=0)

    _score_kernel[(n_kv_heads, triton.cdiv(n_cached, block_n))](
        q, kc, valid, lens, m, row_sum, out,
        n_patch, n_cached, n_rows, group, head_dim,
        *q.stride(), *kc.stride(), *v_strides, qk_scale, **flags)
    return out

