"""`epicache <command>` runs `python -m jobs.<command>`, and `epicache bench <name>` runs
`python -m jobs.bench.<name>`: the same arguments, output and exit code."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from jobs import epicache
from tests.support.paths import REPO


def test_every_command_and_benchmark_is_listed():
    listing = epicache.build_parser().format_help()
    for name in ("build", "answer", "serve", "evaluate", "manifests", "gc", "make_corpus", "demo"):
        assert f"\n  {name} " in listing
    for name in ("decode", "scale", "gpu", "kernels_speed"):
        assert f"\n  {name} " in listing


# runpy warns that the command's module is already imported (another test imported it); the
# console script runs in a fresh process
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
def test_a_command_runs_as_python_dash_m_runs_it(tmp_path, capsys):
    out = tmp_path / "corpus.jsonl"
    assert epicache.main(["make_corpus", "--out", str(out), "--conversations", "1",
                          "--target-tokens", "300"]) == 0
    assert out.read_text().count("\n") == 1
    assert epicache.main(["make_corpus", "--conversations", "x"]) == 2  # argparse's own exit code
    assert "invalid int value" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["nope"], "no command 'nope'"),
    (["bench"], "epicache bench takes one of"),
    (["bench", "nope"], "epicache bench takes one of"),
])
def test_an_unknown_command_is_one_error_line(argv, message, capsys):
    assert epicache.main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_console_script_is_installed():
    script = shutil.which("epicache", path=str(REPO / ".venv" / "bin")) or shutil.which("epicache")
    if script is None:
        pytest.skip("the epicache script is not installed here (pip install -e . installs it)")
    proc = subprocess.run([script, "bench", "scale", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "--index-rows" in proc.stdout
