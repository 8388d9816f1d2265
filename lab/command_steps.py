"""Commands run as the steps of a report: each one's exit code, wall time and output kept, and
the whole rendered as Markdown (`jobs.bench.gpu` gathers the GPU figures this way)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TAIL_LINES = 60  # lines of each step's output kept in the report
STEP_TIMEOUT_S = 1800
_SUMMARY = re.compile(r"built (\d+) conversations, appended to \d+ \((\d+) episode caches, "
                      r"([\d,]+) tokens prefilled, [\d.]+ MiB\) in ([\d.]+)s")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class Step:
    """One subprocess, run: what it was, how it ended, what it printed."""
    title: str
    command: list[str]
    returncode: int | None  # None: killed at the timeout
    seconds: float
    output: str
    figure: str = ""  # one line for the summary table (e.g. tokens/s)


def step_env() -> dict[str, str]:
    """The parent's environment without TRITON_INTERPRET, so the kernels compile."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env


def run_step(root: Path, title: str, args: list[str], timeout: float = STEP_TIMEOUT_S) -> Step:
    """Run `python <args>` from `root`; never raises for the command's failure."""
    command = [sys.executable, *args]
    print(f"[{title}] {' '.join(command)}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, check=False, cwd=root, env=step_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace", timeout=timeout)
        code, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        code = None
        output = (out.decode(errors="replace") if isinstance(out, bytes) else out) + \
            f"\n[killed after {timeout:.0f} s]"
    step = Step(title, command, code, time.perf_counter() - start, output)
    print(f"[{title}] exit {code}, {step.seconds:.1f} s", flush=True)
    return step


def parse_build_summary(output: str) -> tuple[int, float] | None:
    """(tokens, seconds) from the last summary line of `jobs.build` in `output`, else None."""
    found = _SUMMARY.findall(output)
    if not found:
        return None
    _, _, tokens, seconds = found[-1]
    return int(tokens.replace(",", "")), float(seconds)


def build_figure(output: str) -> str:
    parsed = parse_build_summary(output)
    if parsed is None:
        return "no summary line"
    tokens, seconds = parsed
    return f"{tokens:,} tokens in {seconds:.1f} s: {tokens / max(seconds, 1e-9):,.0f} tokens/s"


def output_tail(output: str, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines, as a terminal would show them: colours dropped, a line redrawn
    with carriage returns (a progress bar) reduced to its last state."""
    shown = [_ANSI.sub("", line).rstrip("\r").split("\r")[-1].rstrip()
             for line in output.rstrip().split("\n")]  # not splitlines(): it splits at "\r"
    return "\n".join(shown[-lines:]).strip("\n")


def render_report(env: dict[str, str], steps: list[Step]) -> str:
    """The Markdown report: the environment, a summary table, then each step in full."""
    out = ["# GPU report", ""] + [f"- {k}: {v}" for k, v in env.items()] + ["", "## Summary", "",
           "| step | exit code | wall time | figure |", "| --- | --- | --- | --- |"]
    for s in steps:
        code = "timeout" if s.returncode is None else str(s.returncode)
        out.append(f"| {s.title} | {code} | {s.seconds:.1f} s | {s.figure} |")
    for i, s in enumerate(steps, 1):
        code = f"killed at the {STEP_TIMEOUT_S} s timeout" if s.returncode is None \
            else f"exit code {s.returncode}"
        out += ["", f"## {i}. {s.title}", "", "```sh", " ".join(s.command), "```", "",
                f"{code}, {s.seconds:.1f} s" + (f"; {s.figure}" if s.figure else ""), "",
                f"Last {TAIL_LINES} lines of its output:", "", "```text", output_tail(s.output),
                "```"]
    return "\n".join(out) + "\n"
