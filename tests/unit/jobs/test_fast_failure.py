"""Bad input fails before the heavy libraries load: every command checks its arguments and its
corpus before it imports torch, transformers or Ray, so a malformed corpus fails in well under a
second. Held structurally, not by a timer: each command runs in a fresh process on bad input,
and the process reports at exit which of those libraries it had imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.config import ALLOCATOR_NAMES, ROUTER_NAMES
from pipeline.kv.budgets import Allocator, allocator_class
from pipeline.routers import ROUTERS
from tests.support.paths import REPO

HEAVY = ("torch", "transformers", "ray")

# Runs `python -m <module> <args>` as runpy does, then prints the heavy modules it imported.
_WRAPPER = f"""
import atexit, runpy, sys
atexit.register(lambda: print("heavy:", ",".join(m for m in {HEAVY!r} if m in sys.modules)))
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""

# A record whose turn lacks its text: the corpus is malformed at its first record.
_BAD_RECORD = {"conversation_id": "c1", "speakers": ["Ann", "Bob"],
               "turns": [{"turn_id": "D1:1", "speaker": "Ann", "session": 1}]}
_BAD_CORPUS_ERROR = "bad.jsonl, record 1 (conversation 'c1'): field 'turns[0].text': is missing"


# Per case: the command and its arguments ({tmp}: the test's folder, holding bad.jsonl and
# nothing else), and what its error line says.
CASES = {
    "build": ("jobs.build --corpus {tmp}/bad.jsonl --store {tmp}/store", _BAD_CORPUS_ERROR),
    "evaluate": ("jobs.evaluate --corpus {tmp}/bad.jsonl --out {tmp}/eval", _BAD_CORPUS_ERROR),
    "screen": ("jobs.screen --corpus {tmp}/bad.jsonl", _BAD_CORPUS_ERROR),
    "screen budgets": ("jobs.screen --corpus {tmp}/bad.jsonl --budgets 512,x",
                       "argument --budgets: takes comma-separated positive integers, got '512,x'"),
    "evaluate budgets": ("jobs.evaluate --corpus {tmp}/bad.jsonl --budgets 0,512",
                         "argument --budgets: takes comma-separated positive integers"),
    "demo": ("jobs.demo --out {tmp}/demo --budget 0",
             "argument --budget: must be at least 1, got 0"),
    "build unread option": ("jobs.build --corpus {tmp}/bad.jsonl --store {tmp}/store "
                            "--scorer snapkv --focus 3",
                            "--focus is not read by --scorer snapkv: it runs at its own "
                            "parameters (the scoring options are read by epicache)"),
    "gc": ("jobs.gc --store {tmp}/none", "store folder {tmp}/none does not exist"),
    "manifests": ("jobs.manifests --store {tmp}/none", "store folder {tmp}/none does not exist"),
    "make_corpus": ("jobs.make_corpus --out {tmp}/c.jsonl --conversations 0 --target-tokens 9",
                    "argument --conversations: must be at least 1, got 0"),
    "epicache": ("jobs.epicache nope", "no command 'nope'"),
    "epicache build": ("jobs.epicache build --corpus {tmp}/bad.jsonl --store {tmp}/store",
                       _BAD_CORPUS_ERROR),
}


# the cases refused by argparse itself (a number's or a list's type): the usage, then the line
ARGPARSE_ERRORS = {"make_corpus", "screen budgets", "evaluate budgets", "demo"}


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WRAPPER, *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_with_one_line_before_torch_transformers_and_ray(tmp_path, case):
    (tmp_path / "bad.jsonl").write_text(json.dumps(_BAD_RECORD) + "\n", encoding="utf-8")
    command, message = (text.replace("{tmp}", str(tmp_path)) for text in CASES[case])
    done = _run(command.split())
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and message in err[-1], done.stderr
    if case not in ARGPARSE_ERRORS:  # argparse's own errors print the usage first
        assert len(err) == 1 and err[0].startswith("error: "), done.stderr
    assert done.stdout.strip().splitlines()[-1] == "heavy:", done.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]  # nothing written


# `jobs.bench.fleet`'s values that make no sense (each once started Ray and built a store)
FLEET_REFUSED = [("--requests", "-1"), ("--zipf", "-1"), ("--zipf", "nan"), ("--replicas", "0"),
                 ("--concurrency", "0"), ("--follow-ups", "0"), ("--max-imbalance", "-1")]


@pytest.mark.parametrize("option,value", FLEET_REFUSED, ids=[f"{o}={v}" for o, v in FLEET_REFUSED])
def test_the_fleet_benchmark_refuses_a_bad_value_before_torch_loads(option, value, tmp_path):
    """`jobs.bench.fleet` (Ray's client imported at its top) checks its numbers before the model
    stack loads, Ray starts or a store is built: argparse's usage, then one line naming the
    option."""
    done = _run(["jobs.bench.fleet", "--dir", str(tmp_path / "fleet"), option, value])
    assert done.returncode == 2, done.stderr
    assert f"error: argument {option}: " in done.stderr.strip().splitlines()[-1]
    heavy = done.stdout.strip().splitlines()[-1].removeprefix("heavy:").split(",")
    assert not {"torch", "transformers"} & set(heavy), done.stdout[-300:]
    assert list(tmp_path.iterdir()) == []  # no store built


def test_the_fleet_benchmarks_help_loads_no_model_stack():
    done = _run(["jobs.bench.fleet", "--help"])
    assert done.returncode == 0 and "--follow-ups" in done.stdout, done.stderr
    assert "torch" not in done.stdout.strip().splitlines()[-1], done.stdout[-300:]


def test_a_heavy_import_is_seen():
    """The check above can fail: a command that imports torch at its top is reported."""
    done = _run(["jobs.bench.memory", "--help"])
    last = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0 and last.startswith("heavy: torch"), done.stdout[-300:]


def test_the_names_offered_without_torch_are_the_registries_names():
    """The command line offers allocators and routers by the names in `pipeline.config`, read
    from their registries (`pipeline.config.registry`, which names them without importing
    them), and each name is the class it loads."""
    for name in ALLOCATOR_NAMES:
        assert issubclass(allocator_class(name), Allocator) and allocator_class(name).name == name
    assert tuple(ROUTERS) == ROUTER_NAMES
