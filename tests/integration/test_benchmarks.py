"""The benchmark commands run as a user runs them (`python -m jobs.bench.<name>`), on sizes
that take seconds: they drive the real machinery and print their figures."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.paths import REPO


def _run(*args: str, timeout: float = 600) -> str:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _measure(table: str, name: str) -> str:
    """The value of one row of the scale rehearsal's table."""
    match = re.search(rf"^\| {re.escape(name)}\s+\| (.+)$", table, flags=re.M)
    assert match, (name, table)
    return match.group(1).strip()


def test_scale_rehearsal_drives_the_real_scheduler():
    """Every conversation committed with its episodes, the in-flight bound reached and never
    exceeded, manifests listed and read back, and a re-run that skips everything."""
    table = _run("jobs.bench.scale", "--conversations", "150", "--max-in-flight", "8",
                 "--no-progress")
    assert _measure(table, "conversations") == "150"
    assert _measure(table, "episode caches written") == "300"
    assert _measure(table, "Ray tasks") == "450"
    assert _measure(table, "failed conversations") == "0"
    assert _measure(table, "tasks in flight (peak / bound)") == "8 / 8"
    assert _measure(table, "read all manifests").endswith("(300 rows)")
    assert _measure(table, "re-run, all up to date").endswith("(150 skipped)")
    for measure in ("tasks/s", "driver RSS peak", "list manifests"):
        _measure(table, measure)


def test_index_rehearsal_prints_the_figure_line():
    """`--index-rows`: 6,000 conversations x 4 episodes into a Delta table, then its scan."""
    out = _run("jobs.bench.scale", "--index-rows", "6000").splitlines()
    assert f"{6_000 * 4:,} rows" in out[0]
    assert re.fullmatch(rf"index scan: {6_000 * 4} rows in \d+\.\d s; point lookup \d+ ms",
                        out[-1]), out[-1]
