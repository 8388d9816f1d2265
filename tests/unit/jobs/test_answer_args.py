"""`jobs.answer` holds its arguments to the limits the server holds a request to, and refuses a
bad one (a 100,000-character question, a temperature of -1 or nan) with exit 2 and one error
line, before torch, transformers or the store are touched."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jobs.answer import parse_args
from tests.support.paths import REPO

ARGS = ["--store", "no-such-store", "--conversation", "synth-0000"]

_CHECK = """
import sys
from jobs.answer import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    print("exit", e.code, "torch" in sys.modules, "transformers" in sys.modules)
"""


def test_a_100_000_character_question_is_refused_before_anything_loads():
    proc = subprocess.run([sys.executable, "-c", _CHECK, *ARGS, "--question", "a" * 100_000],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["exit", "2", "False", "False"], proc.stderr
    error = proc.stderr.splitlines()[-1]
    assert "100,000 characters long; the limit is 4,096 characters (512 tokens)" in error


@pytest.mark.parametrize("option, value, named", [
    ("--temperature", "-1", "--temperature"), ("--temperature", "nan", "--temperature"),
    ("--temperature", "inf", "--temperature"), ("--max-new-tokens", "0", "--max-new-tokens"),
    ("--max-new-tokens", "513", "--max-new-tokens"),
    ("--max-question-tokens", "0", "--max-question-tokens")])
def test_sampling_parameters_are_checked_as_the_server_checks_them(option, value, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([*ARGS, "--question", "Who?", option, value])
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err.splitlines()[-1]


def test_good_arguments_carry_the_limits():
    a = parse_args([*ARGS, "--question", "Who?", "--max-question-tokens", "64"])
    assert a.limits.max_question_tokens == 64 and a.limits.max_question_chars == 512
    with pytest.raises(SystemExit):
        parse_args([*ARGS, "--question", "x" * 513, "--max-question-tokens", "64"])
