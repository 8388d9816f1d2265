"""`python -m jobs.bench.gpu` without a GPU: it says so, runs nothing and writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO


def test_without_cuda_nothing_runs_or_is_written(tmp_path: Path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))  # as on a CPU machine
    for args in ([], ["--out", str(tmp_path / "out")]):  # the default out folder is relative
        proc = subprocess.run([sys.executable, "-m", "jobs.bench.gpu", *args], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        [line] = proc.stdout.splitlines()
        assert "no CUDA device" in line and "nothing was run" in line
    assert list(tmp_path.iterdir()) == []
