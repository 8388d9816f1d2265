"""jobs.bench.gpu without a GPU: it runs nothing and writes nothing; and its parts that need no
GPU (a step's subprocess, the build summary's tokens/s, the output tail, the report's layout)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from jobs.bench import gpu
from pipeline.build.driver import Summary


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a CPU machine, wherever the test runs; and any step that would run fails the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu, "run_step", lambda *a, **k: pytest.fail("a step ran without CUDA"))


def test_without_cuda_nothing_runs_or_is_written(no_cuda, tmp_path: Path, capsys,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default out folder (gpu-report/) is relative to here
    assert gpu.main([]) == 0
    assert gpu.main(["--out", str(tmp_path / "out")]) == 0
    assert list(tmp_path.iterdir()) == []
    lines = capsys.readouterr().out.splitlines()
    assert lines == [gpu.NO_CUDA] * 2
    assert "no CUDA device" in gpu.NO_CUDA and "nothing was run" in gpu.NO_CUDA


def test_tokens_per_second_from_a_real_summary_line() -> None:
    summary = Summary(built=1, episodes=4, tokens=28_708, bytes=46 * 2**20)
    line = summary.line(61.25, "file:///tmp/store")
    output = f"INFO jobs.build: committed locomo-30: 4 episodes\n{line}\n"
    assert gpu.parse_build_summary(output) == (28_708, 61.2)
    assert gpu.build_figure(output) == "28,708 tokens in 61.2 s: 469 tokens/s"
    assert gpu.parse_build_summary("error: corpus not found") is None
    assert gpu.build_figure("Traceback ...") == "no summary line"


def test_output_tail_keeps_the_last_state_of_redrawn_lines() -> None:
    output = "a\n\x1b[36mb\x1b[0m\nbar 10%\rbar 50%\rbar 100%\r\n" + "".join(
        f"row {i}\n" for i in range(100))
    tail = gpu.output_tail(output, lines=3)
    assert tail == "row 97\nrow 98\nrow 99"
    assert gpu.output_tail(output, lines=103).splitlines()[:3] == ["a", "b", "bar 100%"]


def test_kernel_tests_fall_back_to_the_single_file(tmp_path: Path) -> None:
    assert gpu.kernel_tests_path(tmp_path) == gpu.KERNEL_TESTS_FALLBACK
    (tmp_path / gpu.KERNEL_TESTS).mkdir(parents=True)
    assert gpu.kernel_tests_path(tmp_path) == gpu.KERNEL_TESTS


def test_report_layout() -> None:
    steps = [gpu.Step("kernel tests", ["python", "-m", "pytest"], 0, 12.34, "5 passed\n"),
             gpu.Step("build (first run)", ["python", "-m", "jobs.build"], None, 1800.0, "x",
                      figure="no summary line")]
    report = gpu.render_report({"device": "NVIDIA H100", "torch": "2.9"}, steps)
    assert report.startswith("# GPU report\n\n- device: NVIDIA H100\n- torch: 2.9\n")
    assert "| kernel tests | 0 | 12.3 s |  |" in report
    assert "| build (first run) | timeout | 1800.0 s | no summary line |" in report
    assert "## 1. kernel tests\n\n```sh\npython -m pytest\n```\n\nexit code 0, 12.3 s\n" in report
    assert "```text\n5 passed\n```" in report


def test_a_step_records_failure_and_timeout_and_unsets_triton_interpret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    code = "import os, sys; print(os.environ.get('TRITON_INTERPRET')); sys.exit(3)"
    failed = gpu.run_step("fails", ["-c", code])
    assert (failed.returncode, failed.output) == (3, "None\n")
    assert failed.command == [sys.executable, "-c", code]
    code = "import time; print('started', flush=True); time.sleep(30)"
    slow = gpu.run_step("slow", ["-c", code], timeout=2)
    assert slow.returncode is None and slow.seconds < 20
    assert slow.output.startswith("started") and slow.output.endswith("[killed after 2 s]")
