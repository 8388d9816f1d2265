"""Benchmark the kernels against their torch references: time and peak extra memory, side by side.

    python -m jobs.bench.kernels_speed [--shapes smollm2,3b] [--reps 5] [--dtype bf16|fp16|fp32]
                                 [--threads N] [--json]

Patched-prompt scoring over realistic shapes: SmolLM2-135M (9 query heads, 3 KV heads, head dim
64, N = 1024 + 512 cached, P = 500 patch queries) and a 3B-class model (24 / 8 heads, head dim
128, N = 8K + 2K, P = 256). Implementations:

- `triton`: the fused kernel (`kernels.score_triton`), CUDA only;
- `reference`: the torch reference (`kernels.score`, query chunks of 256 rows), the CPU path;
- `naive`: a plain full softmax that materialises the [Hq, P, N + P] attention (what the fused
  kernel avoids), to show the memory difference.

With CUDA, the int8 / fp8 quantize and gather-dequantize kernels, and the stored objects'
4- and 2-bit group codes, are also timed against their torch references on the shape's
[Hkv, N, d] keys. Without CUDA, the Triton kernels are not timed
(the CPU interpreter is for tests only) and the table has the torch paths only; it says so.

Time: median of `--reps` runs after one warm-up, the implementations interleaved run by run.
Peak extra memory: on CUDA, the allocator's peak above what was allocated before the call; on
CPU, the process's peak resident memory above its resident memory before the call, measured in
a fresh child process per implementation (peak reset through /proc/self/clear_refs; glibc's
mmap threshold fixed so large temporaries are returned to the system when freed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from kernels import quant_reference
from kernels.score import patch_attention_scores_reference
from lab.bench_cli import bench_parser, start_bench
from lab.bench_support import cpu_peak_extra, cuda_peak_extra

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INVALID_SHARE = 0.1  # cached slots marked invalid (evicted), as in a cache mid-build


@dataclass(frozen=True)
class Shape:
    label: str
    q_heads: int
    kv_heads: int
    head_dim: int
    n_cached: int
    n_patch: int


SHAPES = {
    "smollm2": Shape("SmolLM2-135M", 9, 3, 64, 1024 + 512, 500),
    "3b": Shape("3B-class", 24, 8, 128, 8192 + 2048, 256),
}


def naive_full_softmax_scores(q: torch.Tensor, kc: torch.Tensor, kp: torch.Tensor,
                              valid: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The definition computed the plain way: every query head's full [P, N + P] attention
    (keys repeated per GQA group), masked, softmaxed, cached columns max-reduced."""
    n_q, n_patch, _ = q.shape
    n_kv, n_cached, _ = kc.shape
    group = n_q // n_kv
    keys = torch.cat([kc, kp], dim=1).float().repeat_interleave(group, dim=0)
    logits = torch.bmm(q.float(), keys.transpose(1, 2)) * scale  # [Hq, P, N + P]
    allowed = torch.ones(n_patch, n_cached + n_patch, dtype=torch.bool, device=q.device)
    allowed[:, n_cached:] = torch.ones(n_patch, n_patch, dtype=torch.bool, device=q.device).tril()
    allowed = allowed.expand(n_q, -1, -1).clone()
    if valid is not None:
        allowed[:, :, :n_cached] &= valid.repeat_interleave(group, dim=0)[:, None, :]
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return probs[..., :n_cached].amax(dim=1).reshape(n_kv, group, n_cached).amax(dim=1)


def score_inputs(shape: Shape, dtype: torch.dtype, device: str, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape.q_heads, shape.n_patch, shape.head_dim, generator=g, dtype=dtype)
    kc = torch.randn(shape.kv_heads, shape.n_cached, shape.head_dim, generator=g, dtype=dtype)
    kp = torch.randn(shape.kv_heads, shape.n_patch, shape.head_dim, generator=g, dtype=dtype)
    valid = torch.rand(shape.kv_heads, shape.n_cached, generator=g) >= INVALID_SHARE
    return tuple(t.to(device) for t in (q, kc, kp, valid))


def score_implementations(device: str) -> dict[str, Callable]:
    impls = {"reference": patch_attention_scores_reference, "naive": naive_full_softmax_scores}
    if device == "cuda":
        from kernels.score_triton import patch_attention_scores_triton  # CUDA only (see kernels)
        impls = {"triton": patch_attention_scores_triton, **impls}
    return impls


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_interleaved(calls: dict[str, Callable[[], object]], device: str,
                     reps: int) -> dict[str, float]:
    """Median seconds per call; one warm-up each, then the calls take turns rep by rep."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    _sync(device)
    for _ in range(reps):
        for name, call in calls.items():
            _sync(device)
            start = time.perf_counter()
            call()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def cpu_memory_probe(shape_key: str, impl: str, dtype: str, threads: int) -> int:
    """In this (fresh) process: peak resident bytes of one call above the resident bytes
    before it."""
    torch.set_num_threads(threads)
    q, kc, kp, valid = score_inputs(SHAPES[shape_key], DTYPES[dtype], "cpu")
    call = score_implementations("cpu")[impl]
    scale = q.shape[-1] ** -0.5
    return cpu_peak_extra(lambda: call(q, kc, kp, valid, scale))


def cpu_peak_extra_probe(shape_key: str, impl: str, dtype: str, threads: int) -> int | None:
    """Run `cpu_memory_probe` in a child process; None if the platform cannot measure it."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, "-m", "jobs.bench.kernels_speed", "--memory-probe", shape_key, impl,
           "--dtype", dtype, "--threads", str(threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        print(f"memory probe failed ({impl}, {shape_key}): {proc.stderr.strip()[-300:]}",
              file=sys.stderr)
        return None
    return int(proc.stdout.strip().splitlines()[-1])


def bench_scoring(shape_key: str, device: str, dtype: str, reps: int, threads: int) -> list[dict]:
    shape = SHAPES[shape_key]
    q, kc, kp, valid = score_inputs(shape, DTYPES[dtype], device)
    scale = shape.head_dim ** -0.5
    impls = score_implementations(device)
    calls = {name: (lambda f=f: f(q, kc, kp, valid, scale)) for name, f in impls.items()}
    expected = patch_attention_scores_reference(q, kc, kp, valid, scale)
    seconds = time_interleaved(calls, device, reps)
    rows = []
    for name, call in calls.items():
        if device == "cuda":
            peak = cuda_peak_extra(call)
        else:
            peak = cpu_peak_extra_probe(shape_key, name, dtype, threads)
        max_err = (call() - expected).abs().max().item()
        rows.append({"op": "score", "shape": shape.label, "impl": name,
                     "ms": seconds[name] * 1e3, "peak_extra_mib": None if peak is None
                     else peak / 2 ** 20, "max_abs_diff_vs_reference": max_err})
    return rows


def bench_quant(shape_key: str, dtype: str, reps: int) -> list[dict]:
    """CUDA only: quantize and gather-dequantize kernels vs torch on [Hkv, N, d] keys."""
    from kernels.quant_triton import (  # CUDA only (see kernels)
        dequantize_groups_triton,
        dequantize_triton,
        quantize_groups_triton,
        quantize_triton,
    )

    shape = SHAPES[shape_key]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape.kv_heads, shape.n_cached, shape.head_dim, generator=g)
    x = x.to("cuda", DTYPES[dtype])
    kept = shape.n_cached // 2  # half of each head's slots survive, gathered in token order
    slots = torch.rand(shape.kv_heads, shape.n_cached, generator=g).argsort(dim=1)[:, :kept]
    index = (slots.sort(dim=1).values + shape.n_cached * torch.arange(shape.kv_heads)[:, None])
    index = index.cuda()
    rows = []
    for fmt, reference in (("int8", quant_reference.quantize_int8_reference),
                           ("fp8", quant_reference.quantize_fp8_reference)):
        if fmt == "fp8" and torch.cuda.get_device_capability() < (8, 9):
            continue
        codes, scales = reference(x)
        pairs = {
            f"quantize-{fmt}": {"triton": lambda fmt=fmt: quantize_triton(x, fmt),
                                "reference": lambda reference=reference: reference(x)},
            f"dequantize-{fmt}-gather": {
                "triton": lambda c=codes, s=scales: dequantize_triton(c, s, index, x.dtype),
                "reference": lambda c=codes, s=scales: quant_reference.dequantize_reference(
                    c, s, index, x.dtype)},
        }
        rows += _timed(pairs, shape, reps)
    groups = x.reshape(-1, 32)  # the stored codes' groups of 32 (`pipeline.store.objects.low_bit`)
    for bits in (4, 2):
        coded = quant_reference.quantize_groups_reference(groups, bits)
        rows += _timed({
            f"quantize-int{bits}-groups": {
                "triton": lambda bits=bits: quantize_groups_triton(groups, bits),
                "reference": lambda bits=bits: quant_reference.quantize_groups_reference(
                    groups, bits)},
            f"dequantize-int{bits}-groups": {
                "triton": lambda c=coded, bits=bits: dequantize_groups_triton(*c, bits, x.dtype),
                "reference": lambda c=coded, bits=bits: quant_reference.dequantize_groups_reference(
                    *c, bits, x.dtype)}}, shape, reps)
    return rows


def _timed(pairs: dict[str, dict[str, Callable]], shape: Shape, reps: int) -> list[dict]:
    """Each op's implementations timed side by side on CUDA, with their peak extra memory."""
    rows = []
    for op, calls in pairs.items():
        seconds = time_interleaved(calls, "cuda", reps)
        for name, call in calls.items():
            rows.append({"op": op, "shape": shape.label, "impl": name,
                         "ms": seconds[name] * 1e3,
                         "peak_extra_mib": cuda_peak_extra(call) / 2 ** 20,
                         "max_abs_diff_vs_reference": None})
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Per (op, shape): each implementation's time and memory relative to the reference
    (> 1: the reference takes that many times longer / more memory)."""
    refs = {(r["op"], r["shape"]): r for r in rows if r["impl"] == "reference"}
    for r in rows:
        ref = refs[(r["op"], r["shape"])]
        r["speedup_vs_reference"] = ref["ms"] / r["ms"]
        ok = r["peak_extra_mib"] and ref["peak_extra_mib"] is not None
        r["memory_saving_vs_reference"] = (ref["peak_extra_mib"] / r["peak_extra_mib"] if ok
                                           else None)


def print_table(rows: list[dict]) -> None:
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    header = (f"{'op':<24} {'shape':<13} {'impl':<10} {'time ms':>10} {'peak extra MiB':>15} "
              f"{'ref time / time':>15} {'ref mem / mem':>14} {'max |diff|':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['op']:<24} {r['shape']:<13} {r['impl']:<10} {r['ms']:>10.2f} "
              f"{fmt(r['peak_extra_mib'], '.1f'):>15} {fmt(r['speedup_vs_reference'], '.2f'):>15} "
              f"{fmt(r['memory_saving_vs_reference'], '.2f'):>14} "
              f"{fmt(r['max_abs_diff_vs_reference'], '.1e'):>11}")


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("kernels_speed", __doc__)
    p.add_argument("--shapes", default="smollm2,3b", help=f"comma-separated of {list(SHAPES)}")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (the median is kept)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="input dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="CPU threads for the torch paths")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    p.add_argument("--memory-probe", nargs=2, metavar=("SHAPE", "IMPL"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = start_bench(parser, argv)
    if a.memory_probe:
        print(cpu_memory_probe(*a.memory_probe, dtype=a.dtype or "fp32", threads=a.threads))
        return 0

    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; choose from {list(SHAPES)}")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = a.dtype or ("bf16" if cuda else "fp32")
    if cuda:
        print(f"device: {torch.cuda.get_device_name()} | inputs {dtype} | median of {a.reps} runs")
    else:
        print("No CUDA device: the Triton kernels were NOT timed (Triton's CPU interpreter is for "
              "tests only).\nCPU table of the torch paths only: the chunked reference vs a naive "
              f"full softmax. Inputs {dtype}, {a.threads} thread(s), median of {a.reps} runs.")
    rows = []
    for key in shapes:
        rows += bench_scoring(key, device, dtype, a.reps, a.threads)
        if cuda:
            rows += bench_quant(key, dtype, a.reps)
    add_ratios(rows)
    print_table(rows)
    if a.json:
        print(json.dumps({"device": device, "dtype": dtype, "rows": rows,
                          "shapes": {k: asdict(SHAPES[k]) for k in shapes}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
