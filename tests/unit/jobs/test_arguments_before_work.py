"""A bad argument is refused at once (exit 2, one line naming it), before Ray, Serve or a model
starts: the rows of issue 38's probe that were accepted, or failed after a 22-54 s start-up
(`jobs.serve`'s settings, `jobs.build`'s store and merge beta)."""

from __future__ import annotations

import os
import time

import pytest

import jobs.serve

STORE = ["--store", "caches"]


def _status_of(main, argv: list[str]) -> int:
    """A command's exit status: argparse's own errors exit, the rest return."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def _exit_status(argv: list[str]) -> int:
    return _status_of(jobs.serve.main, argv)


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


@pytest.mark.parametrize("flag", ["--conversations", "--target-tokens"])
def test_make_corpus_refuses_sizes_past_its_limits_at_once(flag, tmp_path, capsys):
    import jobs.make_corpus

    sizes = {"--conversations": "2", "--target-tokens": "300", flag: str(10**12)}
    argv = ["--out", str(tmp_path / "c.jsonl"), *(x for kv in sizes.items() for x in kv)]
    start = time.perf_counter()
    assert _status_of(jobs.make_corpus.main, argv) == 2
    assert f"argument {flag}: must be at most" in capsys.readouterr().err
    assert time.perf_counter() - start < 5 and not any(tmp_path.iterdir())


def test_make_corpus_streams_what_it_makes(tmp_path, monkeypatch):
    """Each conversation is written before the next is made: the corpus is never held whole."""
    import jobs.make_corpus
    from pipeline.corpus import synthetic

    made, out = [], tmp_path / "c.jsonl"
    partial = out.with_name(f".c.jsonl.{os.getpid()}.tmp")  # write_jsonl's file until renamed
    written_by_the_21st = []
    real = synthetic.make_conversation

    def spying(*args, **kwargs):
        if len(made) == 20:  # ~160 KB made by now: past the file buffer, so on disk if streamed
            written_by_the_21st.append(partial.stat().st_size if partial.exists() else 0)
        made.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(synthetic, "make_conversation", spying)
    assert jobs.make_corpus.main(["--out", str(out), "--conversations", "40",
                                  "--target-tokens", "2000"]) == 0
    assert len(made) == 40 and len(out.read_text().splitlines()) == 40
    assert written_by_the_21st[0] > 0


@pytest.mark.parametrize("out", ["a-file", "/dev/full"])
def test_evaluate_refuses_an_out_that_is_not_a_folder_before_reading_the_corpus(out, tmp_path,
                                                                                capsys):
    import jobs.evaluate

    target = tmp_path / out if out == "a-file" else out
    if out == "a-file":
        target.write_text("keep me")
    assert jobs.evaluate.main(["--corpus", str(tmp_path / "no-corpus"), "--methods", "full",
                               "--budgets", "512", "--out", str(target)]) == 2
    assert f"--out {target}: not a folder" in capsys.readouterr().err
    if out == "a-file":
        assert target.read_text() == "keep me"
