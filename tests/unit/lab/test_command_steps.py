"""Commands as report steps (`jobs.bench.gpu`'s parts that need no GPU): a step's subprocess,
the build summary's tokens/s, the output tail, the report's layout."""

from __future__ import annotations

import sys

import pytest

from lab.command_steps import (
    Step,
    build_figure,
    output_tail,
    parse_build_summary,
    render_report,
    run_step,
)
from pipeline.builder.driver import Summary
from tests.support.paths import REPO


def test_tokens_per_second_from_a_real_summary_line() -> None:
    summary = Summary(built=1, episodes=4, tokens=28_708, bytes=46 * 2**20)
    line = summary.line(61.25, "file:///tmp/store")
    output = f"INFO jobs.build: committed locomo-30: 4 episodes\n{line}\n"
    assert parse_build_summary(output) == (28_708, 61.2)
    assert build_figure(output) == "28,708 tokens in 61.2 s: 469 tokens/s"
    assert parse_build_summary("error: corpus not found") is None
    assert build_figure("Traceback ...") == "no summary line"


def test_output_tail_keeps_the_last_state_of_redrawn_lines() -> None:
    output = "a\n\x1b[36mb\x1b[0m\nbar 10%\rbar 50%\rbar 100%\r\n" + "".join(
        f"row {i}\n" for i in range(100))
    tail = output_tail(output, lines=3)
    assert tail == "row 97\nrow 98\nrow 99"
    assert output_tail(output, lines=103).splitlines()[:3] == ["a", "b", "bar 100%"]


def test_report_layout() -> None:
    steps = [Step("kernel tests", ["python", "-m", "pytest"], 0, 12.34, "5 passed\n"),
             Step("build (first run)", ["python", "-m", "jobs.build"], None, 1800.0, "x",
                      figure="no summary line")]
    report = render_report({"device": "NVIDIA H100", "torch": "2.9"}, steps)
    assert report.startswith("# GPU report\n\n- device: NVIDIA H100\n- torch: 2.9\n")
    assert "| kernel tests | 0 | 12.3 s |  |" in report
    assert "| build (first run) | timeout | 1800.0 s | no summary line |" in report
    assert "## 1. kernel tests\n\n```sh\npython -m pytest\n```\n\nexit code 0, 12.3 s\n" in report
    assert "```text\n5 passed\n```" in report


def test_a_step_records_failure_and_timeout_and_unsets_triton_interpret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    code = "import os, sys; print(os.environ.get('TRITON_INTERPRET')); sys.exit(3)"
    failed = run_step(REPO, "fails", ["-c", code])
    assert (failed.returncode, failed.output) == (3, "None\n")
    assert failed.command == [sys.executable, "-c", code]
    code = "import time; print('started', flush=True); time.sleep(30)"
    slow = run_step(REPO, "slow", ["-c", code], timeout=2)
    assert slow.returncode is None and slow.seconds < 20
    assert slow.output.startswith("started") and slow.output.endswith("[killed after 2 s]")
