"""`jobs.build` takes only what its method reads (`pipeline.config.registry.reads`, the rule of
the build's hash): an option of a section only other methods read, or `--budget` for a method
that does not evict, is refused with exit code 2 and one line naming the option and the method,
before anything loads, even at its default value; `--scorer full` is built without a budget."""

from __future__ import annotations

import time

import pytest

from jobs import build
from pipeline.config import BuildConfig

REQUIRED = ["--corpus", "no-such-corpus.jsonl", "--store", "no-such-store"]

# (method, an option it does not read, the words of the reason)
REFUSED = [
    ("snapkv", ["--focus", "3"], "it runs at its own parameters (the scoring options are read "
                                 "by epicache)"),
    ("streamingllm", ["--focus", "10"], "scoring options"),  # the default value, given
    ("keydiff", ["--patch-tokens", "128"], "scoring options"),
    ("knorm", ["--paper"], "scoring options"),
    ("kvzip", ["--episodes", "3"], "it builds one cache per conversation (the episodes' options "
                                   "are read by the methods built per episode: epicache)"),
    ("infinipot", ["--medoids", "2"], "episodes' options"),
    ("random", ["--window", "6"], "episodes' options"),
    ("oldest", ["--seed", "1"], "episodes' options"),
    ("full", ["--budget", "512"], "it does not evict"),
    ("full", ["--foc", "3"], "scoring options"),  # an abbreviation argparse takes, seen as given
]


@pytest.mark.parametrize("method,option,why", REFUSED, ids=[f"{m}{o[0]}" for m, o, _ in REFUSED])
def test_an_option_the_method_does_not_read_is_refused(method, option, why, capsys, tmp_path,
                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    assert build.main([*REQUIRED, "--scorer", method, *option]) == 2
    assert time.perf_counter() - start < 1.0
    err = capsys.readouterr().err.strip().splitlines()
    flag = "--focus" if option[0] == "--foc" else option[0]
    assert len(err) == 1 and err[0].startswith(f"error: {flag} is not read by --scorer {method}: ")
    assert why in err[0]
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("args", [
    ["--focus", "3", "--episodes", "3", "--medoids", "2", "--paper", "--patch-tokens", "0"],
    ["--scorer", "snapkv", "--budget", "512", "--block", "256", "--tristate", "--alpha", "1"],
    ["--scorer", "full", "--full", "--block", "256"],
])
def test_what_the_method_reads_is_taken(args):
    build.config_from_args(build.parse_args([*REQUIRED, *args]))


def test_the_full_cache_is_built_without_a_budget():
    """`--scorer full` alone once evicted to the default budget by equal scores; it is the full
    cache now, with the hash of `--scorer full --full`."""
    alone = build.config_from_args(build.parse_args([*REQUIRED, "--scorer", "full"]))
    given = build.config_from_args(build.parse_args([*REQUIRED, "--scorer", "full", "--full"]))
    assert alone.budget is None and alone == given == BuildConfig(scorer="full", budget=None)


def test_a_namespace_made_otherwise_is_checked_by_its_values():
    """Without the parser's note of what was given, an option is given when it holds another
    value than the default (a command that builds its namespace itself)."""
    a = build.build_parser().parse_args([*REQUIRED, "--scorer", "snapkv", "--episodes", "3"])
    with pytest.raises(ValueError, match="--episodes is not read by --scorer snapkv"):
        build.config_from_args(a)
    a = build.build_parser().parse_args([*REQUIRED, "--scorer", "snapkv", "--episodes", "4"])
    assert build.config_from_args(a).scorer == "snapkv"
