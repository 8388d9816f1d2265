"""Numbers that make no sense are argument errors (exit 2, one line naming the option) before
anything runs, and `jobs.make_corpus` on a full disk says so in one line and leaves nothing
half-written."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from jobs import build, evaluate, gc, make_corpus, manifests
from pipeline.cli.numbers import budget_list
from pipeline.corpus import reader
from pipeline.corpus.reader import read_corpus

STORE = ["--store", "no-such-store"]
CORPUS = ["--corpus", "no-such-corpus.jsonl"]
MAKE = ["--out", "never-written.jsonl", "--conversations", "2", "--target-tokens", "50"]

# (command, the arguments it needs, the option, a value it must refuse)
REFUSED = [
    (gc, STORE, "--min-age-seconds", "-5"),
    (gc, STORE, "--min-age-seconds", "nan"),
    (manifests, STORE, "--retain-hours", "-1"),
    (make_corpus, MAKE, "--conversations", "0"),
    (make_corpus, MAKE, "--target-tokens", "-3"),
    (make_corpus, MAKE, "--topics", "0"),
    (evaluate, CORPUS, "--questions-per-conversation", "0"),
    (evaluate, CORPUS, "--limit-conversations", "-1"),
    (evaluate, CORPUS, "--max-new-tokens", "0"),
    (evaluate, CORPUS, "--alpha", "nan"),
    (build, CORPUS + STORE, "--alpha", "nan"),
    (build, CORPUS + STORE, "--tri-gamma", "inf"),
    (build, CORPUS + STORE, "--focus", "nan"),
    (build, CORPUS + STORE, "--seed", "-5"),
    (build, CORPUS + STORE, "--max-context-tokens", "0"),
    (build, CORPUS + STORE, "--calibration-tokens", "-5"),
    (build, CORPUS + STORE, "--calibration-window", "0"),
    (build, CORPUS + STORE, "--cpus-per-task", "-1"),
    (build, CORPUS + STORE, "--gpus-per-task", "nan"),
    (build, CORPUS + STORE, "--budget", "0"),
    (evaluate, CORPUS, "--budgets", "512,0"),
    (evaluate, CORPUS, "--budgets", "512,x"),
]


@pytest.mark.parametrize("command,args,option,value", REFUSED,
                         ids=[f"{c.__name__.split('.')[-1]}{o}={v}" for c, _, o, v in REFUSED])
def test_nonsense_numbers_are_argument_errors(command, args, option, value, capsys, tmp_path,
                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        command.main([*args, option, value])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: argument {option}: " in last and value in last
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_gc_takes_zero_and_fractions(tmp_path, capsys):
    """The range check refuses only what makes no sense: 0 and 0.5 seconds are ages."""
    store = tmp_path / "store"
    store.mkdir()
    assert gc.main(["--store", str(store), "--min-age-seconds", "0"]) == 0
    assert gc.main(["--store", str(store), "--min-age-seconds", "0.5"]) == 0


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_make_corpus_on_a_full_device_is_one_error_line(capsys):
    rc = make_corpus.main(["--out", "/dev/full", "--conversations", "2", "--target-tokens", "50"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().splitlines() == [
        "error: cannot write /dev/full: No space left on device"], err
    assert Path("/dev/full").is_char_device()  # written in place, never renamed over


def test_make_corpus_leaves_no_half_written_corpus(tmp_path, capsys, monkeypatch):
    """A write that fails half-way (a full disk) leaves the earlier corpus as it was and no
    temporary file; the next write replaces it whole."""
    out = tmp_path / "corpus.jsonl"
    args = ["--out", str(out), "--conversations", "3", "--target-tokens", "50"]
    assert make_corpus.main(args) == 0
    before = out.read_bytes()
    written = []

    def full_after_one(conversations, f):
        for conv in conversations:
            if written:
                raise OSError(28, os.strerror(28))
            f.write("half a corpus\n")
            written.append(conv)

    monkeypatch.setattr(reader, "_write_records", full_after_one)
    assert make_corpus.main([*args, "--seed", "1"]) == 2
    assert "error: cannot write" in capsys.readouterr().err
    assert out.read_bytes() == before and os.listdir(tmp_path) == ["corpus.jsonl"]
    monkeypatch.undo()
    assert make_corpus.main([*args, "--seed", "1"]) == 0
    assert out.read_bytes() != before and len(read_corpus(out)[0]) == 3
    assert os.listdir(tmp_path) == ["corpus.jsonl"]


def test_a_budget_list_is_positive_integers_each_once():
    """`--budgets` (`pipeline.cli.numbers.budget_list`): in the order given, each once, blanks
    between commas ignored; anything else names the whole text."""
    assert budget_list("512, 1024,512,") == [512, 1024]
    for text in ("", " , ", "512,x", "0", "-4,512", "1.5", "512 1024"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated positive integers"):
            budget_list(text)
