"""`jobs.answer` holds its arguments to the limits the server holds a request to, and refuses a
bad one (a 100,000-character question, a temperature of -1 or nan) with exit 2 and one error
line, before torch, transformers or the store are touched."""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("option, value", [
    ("--topup-turns", "-2"), ("--topup-turns", "two"),
    ("--topup-max-tokens", "0"), ("--topup-max-tokens", "1.5"), ("--topup", "yes")])
def test_bad_topup_values_are_argument_errors(option, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([*ARGS, "--question", "Who?", option, value])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert "error:" in last and (option in last or value in last)


def test_topup_options_make_the_answerers_configuration():
    from pipeline.cli.options import topup_config_from_args
    from pipeline.config import TopUpConfig

    def config(*extra: str) -> TopUpConfig:
        return topup_config_from_args(parse_args([*ARGS, "--question", "Who?", *extra]))

    assert config() == TopUpConfig()
    assert config("--topup", "--topup-turns", "2", "--topup-max-tokens", "64") == \
        TopUpConfig(enabled=True, turns=2, max_tokens=64)
    # 0 turns: no cap on their number, as many as the tokens hold
    assert config("--topup-turns", "0").turns is None
    assert config("--topup", "--no-topup").enabled is False  # the last one given wins
    assert config("--no-topup", "--topup").enabled is True
    assert config("--topup-skip-held").skip_held and not config().skip_held
    assert config("--topup-skip-held", "--topup-nearer-than-held").nearer_than_held


def _answered(monkeypatch, capsys, topup: dict, *extra: str) -> tuple[dict, str]:
    """`jobs.answer`'s output over a stand-in Answerer whose answer carries `topup`, and the
    keyword arguments the Answerer was made with."""
    import jobs.answer
    from pipeline.answer import answerer

    made: dict = {}

    class StandInAnswerer:
        def __init__(self, store, **kwargs):
            made.update(kwargs)

        def answer_checked(self, cid, question):
            return answerer.AnswerResult(
                cid, question.text, "Miso", 1, 0.5, False,
                {"embed": 1.0, "route": 0.1, "load": 2.0, "topup": 0.3, "decode": 9.0}, [1], topup)

    monkeypatch.setattr(answerer, "Answerer", StandInAnswerer)
    monkeypatch.setattr(jobs.answer, "open_store", lambda *a, **k: object())
    monkeypatch.setattr(jobs.answer, "retain_freed_memory", lambda: None)  # this process's malloc
    assert jobs.answer.main([*ARGS, "--question", "What is the kitten called?", *extra]) == 0
    return made, capsys.readouterr().out


def test_the_output_says_when_a_topup_was_read_or_could_not_be(monkeypatch, capsys):
    from pipeline.answer.topup import TopUp
    from pipeline.config import TopUpConfig

    used = TopUp("\n\nx", ("D2:4", "D5:1"), 57, "used").as_dict()
    made, out = _answered(monkeypatch, capsys, used, "--topup", "--topup-turns", "3")
    assert made["topup"] == TopUpConfig(enabled=True, turns=3)
    assert "A: Miso" in out and "topped up: turns D2:4, D5:1, 57 tokens" in out
    note = "turn index ... failed its checksum; rebuild it: python -m jobs.build --force"
    _, out = _answered(monkeypatch, capsys, TopUp.unavailable(note).as_dict(), "--topup")
    assert f"no top-up: {note}" in out
    _, out = _answered(monkeypatch, capsys, TopUp(status="none").as_dict(), "--topup")
    assert "top-up" not in out and "topped up" not in out
    _, out = _answered(monkeypatch, capsys, used, "--topup", "--json")
    assert json.loads(out)["topup"] == used
