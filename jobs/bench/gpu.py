"""Run everything that needs a GPU and write one Markdown report: the compiled kernel tests, the
kernel benchmark, one real build's tokens/s and the decode benchmark.

    python -m jobs.bench.gpu [--out gpu-report]
    make gpu-report

For a machine with CUDA, which is rarely at hand: one command gathers the figures the project
still owes. Each step runs as a subprocess of the same Python from the repository root, with
TRITON_INTERPRET unset (the Triton kernels compile); its output is captured, and a failed step
is recorded and the next one runs. The steps:

1. the kernel tests (`KERNEL_TESTS`), which run the compiled kernels against their torch
   references when CUDA is present;
2. the kernel benchmark (`jobs.bench.kernels_speed`): the fused kernels against torch;
3. a small real build (`jobs.build`, the packaged model, tasks on the GPU) of one LoCoMo
   conversation (`LOCOMO`) or, where that folder is absent, of a synthetic corpus
   (`jobs.make_corpus`), cut to fit the model's positions; run twice, the second time with
   `--force` (model converted, layer profile stored), each with its tokens/s from the build's
   summary line (end to end: Ray start, model loads and clustering included);
4. the decode benchmark (`jobs.bench.decode`), with fewer questions than its default (its
   builds and its answers on the GPU);
5. where the LoCoMo folder is present, the build's costs at full length
   (`jobs.bench.full_length`, in-process, no Ray): LoCoMo 30 at its cut and whole, block
   prefill and one pass (by blocks past its first span, and by a window) against the model's
   own prefill of the same tokens, tokens/s each.

The report (`<out>/gpu-report.md`) has the device, the torch / Triton / CUDA versions and per
step the command, exit code, wall time and the tail of its output; the command prints the
report's path and exits 1 if any step failed. Without CUDA nothing runs and nothing is written:
one line says so, and the exit code is 0.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from lab.bench_cli import bench_parser, start_bench
from lab.command_steps import Step, build_figure, render_report, run_step

ROOT = Path(__file__).resolve().parents[2]  # the repository root: every step runs there
KERNEL_TESTS = "tests/unit/kernels"
LOCOMO = "../shared/data/locomo"  # relative to the repository root
LOCOMO_FILE = "30.json"  # the shortest conversation; any file of the folder when it is absent
CONTEXT_TOKENS = 7500  # the build cuts at a session boundary to fit SmolLM2's 8,192 positions
REPORT = "gpu-report.md"
NO_CUDA = ("jobs.bench.gpu: no CUDA device found (torch.cuda.is_available() is False): nothing "
           "was run and no report was written")


def build_corpus(work: Path) -> tuple[str, Step | None]:
    """The build's corpus and the step that wrote it (if any): one LoCoMo file, else a small
    synthetic corpus."""
    locomo = (ROOT / LOCOMO).resolve()
    if locomo.is_dir():
        files = sorted(locomo.glob("*.json"))
        chosen = locomo / LOCOMO_FILE if (locomo / LOCOMO_FILE).is_file() else \
            (files[0] if files else None)
        if chosen is not None:
            return str(chosen), None
    corpus = work / "corpus.jsonl"
    step = run_step(ROOT, "synthetic corpus", ["-m", "jobs.make_corpus", "--out", str(corpus),
                                         "--conversations", "2", "--target-tokens", "6000"])
    return str(corpus), step


def build_steps(work: Path) -> list[Step]:
    """The corpus (if written), then the build twice into one temporary store: cold, and again
    with `--force` once the model is converted and the layer profile stored."""
    corpus, corpus_step = build_corpus(work)
    steps = [corpus_step] if corpus_step else []
    if corpus_step and corpus_step.returncode != 0:
        return steps
    args = ["-m", "jobs.build", "--corpus", corpus, "--store", str(work / "store"),
            "--max-context-tokens", str(CONTEXT_TOKENS), "--no-progress"]
    for title, more in (("build (first run)", []), ("build (re-run, --force)", ["--force"])):
        step = run_step(ROOT, title, args + more)
        step.figure = build_figure(step.output)
        steps.append(step)
    return steps


def run_all() -> list[Step]:
    """Every step, in order; each one runs whatever happened to the ones before it."""
    steps = [run_step(ROOT, "kernel tests", ["-m", "pytest", "-q", "-rs", KERNEL_TESTS]),
             run_step(ROOT, "kernel benchmark", ["-m", "jobs.bench.kernels_speed", "--reps", "10"])]
    with tempfile.TemporaryDirectory(prefix="gpu-report-") as work:  # stores, corpus: removed
        steps += build_steps(Path(work))
        steps.append(run_step(ROOT, "decode benchmark",
                              ["-m", "jobs.bench.decode", "--questions", "4",
                               "--max-new-tokens", "32", "--store", str(Path(work) / "decode")]))
    if (ROOT / LOCOMO).is_dir():
        steps.append(run_step(ROOT, "build costs at full length, block and one pass",
                              ["-m", "jobs.bench.full_length", "--corpus", LOCOMO,
                               "--conversations", "30", "--questions", "4"]))
    return steps


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception as e:  # noqa: BLE001 - the report says why instead
        return f"unavailable ({type(e).__name__})"


def environment() -> dict[str, str]:
    """What the figures were measured on."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, cwd=ROOT,
                            text=True, capture_output=True).stdout.strip()
    major, minor = torch.cuda.get_device_capability()
    return {"device": f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})",
            "torch": torch.__version__, "triton": _version("triton"),
            "CUDA (torch built with)": str(torch.version.cuda),
            "python": platform.python_version(), "commit": commit or "unknown",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("gpu", __doc__)
    p.add_argument("--out", type=Path, default=Path("gpu-report"),
                   help=f"folder of the report ({REPORT}); created when CUDA is present")
    return p


def main(argv: list[str] | None = None) -> int:
    a = start_bench(build_parser(), argv)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    out = a.out.resolve()  # the steps run from the repository root
    env = environment()
    print(f"jobs.bench.gpu: {env['device']}; report in {out / REPORT}", flush=True)
    steps = run_all()
    out.mkdir(parents=True, exist_ok=True)
    report = out / REPORT
    report.write_text(render_report(env, steps), encoding="utf-8")
    failed = [s.title for s in steps if s.returncode != 0]
    print(f"failed steps: {', '.join(failed)}" if failed else "every step passed")
    print(report)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
