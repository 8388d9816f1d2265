"""A bad argument is refused at once (exit 2, one line naming it), before Ray, Serve or a model
starts: the rows of issue 38's probe that were accepted, or failed after a 22-54 s start-up
(`jobs.serve`'s settings, `jobs.build`'s store and merge beta)."""

from __future__ import annotations

import time

import pytest

import jobs.serve

STORE = ["--store", "caches"]


def _exit_status(argv: list[str]) -> int:
    """The command's exit status: argparse's own errors exit, the settings' return."""
    try:
        return jobs.serve.main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("args, named", [
    (["--port", "-1"], "--port"), (["--port", "65536"], "--port"),
    (["--metrics-port", "0"], "--metrics-port"),
    (["--router-cpus", "-1"], "router_cpus"), (["--decoder-cpus", "-0.5"], "decoder_cpus"),
    (["--decoder-gpus", "-1"], "decoder_gpus"), (["--router-cpus", "nan"], "--router-cpus"),
    (["--route-by", "bogus"], "route_by"), (["--two-below", "-0.1"], "two_below"),
    (["--decoder-target-ongoing", "0"], "decoder_target_ongoing"),
    (["--torch-threads", "0"], "torch_threads"),
    (["--affinity-max-imbalance", "-1"], "affinity_max_imbalance"),
])
def test_a_bad_argument_is_refused_at_once_naming_it(args, named, capsys):
    start = time.perf_counter()
    assert _exit_status([*STORE, *args]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert time.perf_counter() - start < 5  # no Ray, no model


def test_an_empty_store_is_refused(capsys):
    assert _exit_status(["--store", ""]) == 2
    assert "store" in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [
    (["--corpus", "c.jsonl", "--store", ""], "--store"),
    (["--corpus", "c.jsonl", "--store", "s", "--merge", "--merge-beta", "2"], "merge beta"),
])
def test_the_build_refuses_an_empty_store_and_a_merge_beta_out_of_range(argv, named, capsys,
                                                                        tmp_path, monkeypatch):
    import jobs.build

    monkeypatch.chdir(tmp_path)
    try:
        status = jobs.build.main(argv)
    except SystemExit as e:
        status = e.code
    assert status == 2 and named in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written, no store made
