"""Property-based: the shared argparse types (`pipeline.cli.numbers`, `pipeline.cli.parser`) given
any text return a value of their documented range or refuse it as an argument error, never with
another exception; and through every command's real parser (`build_parser()`, parse only: no Ray,
no model), a refused value of any option typed by them ends with exit 2 and one line
`error: argument --x: ...` naming the option.

A text that is no number of the type's kind at all raises `ValueError` from `int()`/`float()`, on
purpose: argparse turns it into its own one-line "invalid int value: 'x'" (`numbers.number`)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import math
import os
import pkgutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import jobs
from pipeline.cli.numbers import count, finite, non_negative, number, port_number, positive_int
from pipeline.cli.parser import non_empty, writable_folder

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# the tmp_path of one test is shared by its examples on purpose: nothing may appear in it
ON_DISK = settings(FAST, suppress_health_check=[HealthCheck.too_slow,
                                                HealthCheck.function_scoped_fixture])

# Texts int() or float() read unexpectedly (or nearly do), and ones past float's range
SPECIAL = ["nan", "NaN", "-nan", "inf", "-inf", "+inf", "Infinity", "-Infinity", "1e309", "-1e309",
           "0x10", "0b1", "0o7", " 5 ", "\n-5\n", "\t7\x0b", "-5\u2028", "", " ", "\n", "1_000",
           "1__000", "_1", "1_", "5.", ".5", ".", "-0", "-0.0", "+0", "1e3", "1E-3", "\u0663",
           "\uff11\uff12", "1" * 400, "-" + "9" * 400, "9" * 5000, "0" * 50 + "1", "4.9e-324",
           "-4.9e-324", "1.7976931348623157e308", "65535", "65536", "1\x00", "1 2", "--5",
           "2**8", "1e", "e1", "True", "None", "0.5", "1.0", "1.5"]

TEXT = st.one_of(
    st.text(),
    st.sampled_from(SPECIAL),
    st.integers().map(str),
    st.integers(min_value=-10**400, max_value=10**400).map(str),  # past float's range
    st.floats().map(str),
    st.floats(allow_nan=False).map(lambda f: f" {f!r}\n"),
    st.from_regex(r"\A\s?[-+]?[0-9_]{0,6}(\.[0-9_]{0,4})?([eE][-+]?[0-9]{1,4})?\s?\Z"),
)

_NUMBER_CODE = number(int).__code__  # every type number() makes shares its code


def is_number_type(parse) -> bool:
    return getattr(parse, "__code__", None) is _NUMBER_CODE


def bounds_of(parse) -> dict:
    """kind, at_least, above and at_most of a type number() made (its closure)."""
    return dict(zip(parse.__code__.co_freevars, (c.cell_contents for c in parse.__closure__)))


def is_finite(value) -> bool:
    """An int is always finite (math.isfinite overflows on one past float's range)."""
    return not isinstance(value, float) or math.isfinite(value)


def in_range(value, b: dict) -> bool:
    return ((b["at_least"] is None or value >= b["at_least"])
            and (b["above"] is None or value > b["above"])
            and (b["at_most"] is None or value <= b["at_most"]))


def one_line(message: str) -> bool:
    return len(message.splitlines()) == 1 and message.strip() == message


def check_number(parse, text: str):
    """`parse(text)`: a value of its kind, finite and in range, equal to what `kind(text)`
    reads; or ArgumentTypeError (one line) for a number out of range or not finite; or
    ValueError only for text that `kind()` itself cannot read. Returns the value, or None."""
    b = bounds_of(parse)
    kind = b["kind"]
    try:
        value = parse(text)
    except argparse.ArgumentTypeError as e:
        assert one_line(str(e)), repr(str(e))
        read = kind(text)  # it refuses only numbers that make no sense
        assert not (is_finite(read) and in_range(read, b)), (text, str(e))
        return None
    except ValueError:
        with pytest.raises(ValueError):
            kind(text)
        return None
    assert type(value) is kind, (text, value)
    assert is_finite(value) and in_range(value, b), (text, value)
    assert value == kind(text)
    return value


# ---------------------------------------------------------------------------------------------
# 1. The numeric types, alone
# ---------------------------------------------------------------------------------------------

# name: (kind, at_least, above, at_most), as numbers.py documents them
NAMED = {"finite": (finite, float, None, None, None),
         "non_negative": (non_negative, float, 0, None, None),
         "count": (count, int, 0, None, None),
         "positive_int": (positive_int, int, 1, None, None),
         "port_number": (port_number, int, 1, None, 65535)}


@pytest.mark.parametrize("name", NAMED)
def test_named_types_have_their_documented_range(name):
    parse, kind, at_least, above, at_most = NAMED[name]
    assert is_number_type(parse)
    assert bounds_of(parse) == {"kind": kind, "at_least": at_least, "above": above,
                                "at_most": at_most}
    assert parse.__name__ == kind.__name__  # argparse's "invalid int value: ..."


@FAST
@given(st.sampled_from(sorted(NAMED)), TEXT)
@example("port_number", "1" * 400)  # past float's range: math.isfinite overflowed
@example("count", "-" + "9" * 400)
@example("non_negative", "\n-5\n")  # refused in one line
def test_any_text_is_a_number_in_range_or_an_argument_error(name, text):
    check_number(NAMED[name][0], text)


@st.composite
def number_types(draw):
    """number() with any kind and bounds (at_least <= at_most when both are given)."""
    kind = draw(st.sampled_from([int, float]))
    bound = (st.integers(-1000, 1000) if kind is int
             else st.floats(-1e6, 1e6, allow_nan=False) | st.integers(-1000, 1000))
    at_least, above, at_most = (draw(st.none() | bound) for _ in range(3))
    if at_least is not None and at_most is not None and at_most < at_least:
        at_least, at_most = at_most, at_least
    return number(kind, at_least=at_least, above=above, at_most=at_most)


@FAST
@given(number_types(), TEXT)
def test_any_bounds_any_text(parse, text):
    check_number(parse, text)


@FAST
@given(number_types(), st.data())
def test_in_range_numbers_as_text_come_back(parse, data):
    b = bounds_of(parse)
    at_least, above, at_most = b["at_least"], b["above"], b["at_most"]
    if b["kind"] is int:  # the bounds number_types() gives an int type are ints
        low = max((x for x in (at_least, None if above is None else above + 1) if x is not None),
                  default=None)
        assume(low is None or at_most is None or low <= at_most)
        value = data.draw(st.integers(low, at_most))
        texts = [str(value), f" {value}\n", format(value, "_")]
    else:
        exclude = above is not None and (at_least is None or above >= at_least)
        low = above if exclude else at_least
        assume(low is None or at_most is None or low < at_most or low == at_most and not exclude)
        value = data.draw(st.floats(low, at_most, allow_nan=False, allow_infinity=False,
                                    exclude_min=exclude))
        texts = [str(value), repr(value), f"\t{value}  "]
    for text in texts:
        got = parse(text)
        assert got == value and type(got) is b["kind"], (text, got)


@FAST
@given(st.data())
def test_named_types_take_every_value_in_their_range(data):
    name = data.draw(st.sampled_from(sorted(NAMED)))
    parse, kind, at_least, _, at_most = NAMED[name]
    if kind is int:
        value = data.draw(st.integers(at_least, at_most))
    else:
        value = data.draw(st.floats(at_least, at_most, allow_nan=False, allow_infinity=False))
    assert parse(str(value)) == value and type(parse(str(value))) is kind


BOUNDARIES = [  # (type, text, the value, or None for refused)
    (port_number, "1", 1), (port_number, "65535", 65535),
    (port_number, "0", None), (port_number, "65536", None), (port_number, "-1", None),
    (positive_int, "1", 1), (positive_int, "0", None),
    (count, "0", 0), (count, "-1", None), (count, "-0", 0),
    (non_negative, "0", 0.0), (non_negative, "0.0", 0.0), (non_negative, "-0.0", 0.0),
    (non_negative, "-4.9e-324", None), (non_negative, "4.9e-324", 5e-324),
    (finite, "1.7976931348623157e308", sys.float_info.max), (finite, "1e309", None),
    (finite, "-1e309", None), (finite, "nan", None), (finite, "-inf", None),
    (number(float, above=0), "0", None), (number(float, above=0), "5e-324", 5e-324),
    (number(int, above=0), "0", None), (number(int, above=0), "1", 1),
    (number(float, at_most=1), "1", 1.0), (number(float, at_most=1), "1.0000000000000002", None),
    (number(int, at_least=1, at_most=10_000_000), "10_000_000", 10_000_000),
    (number(int, at_least=1, at_most=10_000_000), "10000001", None),
]


@pytest.mark.parametrize("parse,text,expected", BOUNDARIES,
                         ids=[f"{bounds_of(p)['kind'].__name__}{i}:{t}"
                              for i, (p, t, _) in enumerate(BOUNDARIES)])
def test_boundaries_exactly(parse, text, expected):
    if expected is None:
        with pytest.raises(argparse.ArgumentTypeError, match=r"^must be (a finite number|at "
                                                             r"least|at most|greater than)"):
            parse(text)
    else:
        value = parse(text)
        assert value == expected and type(value) is bounds_of(parse)["kind"]


def test_refusals_name_the_limit_and_the_text():
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be at least 1, got 0$"):
        port_number("0")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be at most 65535, got 65536$"):
        port_number(" 65536\n")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be greater than 0, got -1$"):
        number(float, above=0)("-1")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be a finite number, got 'nan'$"):
        non_negative("nan")


# ---------------------------------------------------------------------------------------------
# 2. The text and path types
# ---------------------------------------------------------------------------------------------

@FAST
@given(TEXT)
@example("")
@example(" \n\t\u2028")
def test_non_empty_returns_the_text_or_refuses_blank(text):
    try:
        assert non_empty(text) == text and text.strip()
    except argparse.ArgumentTypeError as e:
        assert not text.strip() and str(e) == "must not be empty"


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def landscape(tmp_path):
    """A folder with a file, a folder and a read-only folder in it."""
    (tmp_path / "a-file").write_text("keep me")
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "read-only").mkdir(mode=0o555)
    yield tmp_path
    (tmp_path / "read-only").chmod(0o755)


NAMES = st.one_of(st.text(), st.sampled_from(["", ".", "..", "/", "//", "~", "a-file",
                                              "a-file/x", "a-file/x/y", "a-folder", "a-folder/",
                                              "a-folder/new/deeper", "read-only/new", "x" * 300,
                                              "x/" * 3000, "a\x00b", "-", "--out", "\n"]))


@ON_DISK
@given(NAMES, st.sampled_from(["", "a-folder/", "a-file/", "read-only/"]))
@example("x" * 300, "")  # a name longer than the system allows: exists() raised OSError
@example("x/" * 3000, "a-folder/")
def test_writable_folder_refuses_in_one_error_and_makes_nothing(landscape, name, under):
    path = f"{landscape}/{under}{name}"
    before = _listing(landscape)
    try:
        folder = writable_folder(path, "--out")
    except ValueError as e:  # its documented error, which jobs.evaluate prints as exit 2
        assert str(e).startswith(f"--out {path}: ")
    else:
        assert folder == Path(path)
        assert not under.startswith("a-file")
        if os.geteuid() != 0 and ".." not in name:  # root writes anywhere
            assert not under.startswith("read-only")
    assert _listing(landscape) == before
    assert (landscape / "a-file").read_text() == "keep me"


@ON_DISK
@given(NAMES)
def test_writable_folder_relative_to_the_working_folder(landscape, monkeypatch, name):
    monkeypatch.chdir(landscape)
    before = _listing(landscape)
    try:
        assert writable_folder(name, "--report") == Path(name)
    except ValueError as e:
        assert str(e).startswith(f"--report {name}: ")
    assert _listing(landscape) == before


def test_writable_folder_says_why():
    with pytest.raises(ValueError, match=r"^--out /dev/null: not a folder$"):
        writable_folder("/dev/null")
    with pytest.raises(ValueError, match=r"^--out /dev/null/x: cannot be made \(/dev/null is a "):
        writable_folder("/dev/null/x")
    with pytest.raises(ValueError, match=r"^--out /x{300}: cannot be made \(File name too long\)"):
        writable_folder("/" + "x" * 300)


# ---------------------------------------------------------------------------------------------
# 3. Through every command's parser
# ---------------------------------------------------------------------------------------------

@functools.cache
def parsers() -> dict[str, argparse.ArgumentParser]:
    modules = sorted(m.name for m in pkgutil.walk_packages(jobs.__path__, "jobs.") if not m.ispkg)
    found = {}
    for name in modules:
        module = importlib.import_module(name)
        if hasattr(module, "build_parser"):
            found[name] = module.build_parser()
    return found


def _typed(check) -> list[tuple[str, str]]:
    return [(name, action.option_strings[-1]) for name, p in parsers().items()
            for action in p._actions if action.option_strings and check(action.type)]


NUMERIC = _typed(is_number_type)
NON_EMPTY = _typed(lambda t: t is non_empty)


def action_of(module: str, flag: str) -> argparse.Action:
    return parsers()[module]._option_string_actions[flag]


def valid_text(action: argparse.Action, folder: Path) -> str:
    """A value `action` takes: its type's least number, its first choice, or a path."""
    if is_number_type(action.type):
        b = bounds_of(action.type)
        return str(b["at_least"] if b["at_least"] is not None else 1)
    if action.choices:
        return str(next(iter(action.choices)))
    return str(folder / action.dest)


def required_argv(module: str, folder: Path) -> list[str]:
    """The parser's required options, each given a valid value (`--x=value`)."""
    return [f"{a.option_strings[-1]}={valid_text(a, folder)}" for a in parsers()[module]._actions
            if a.option_strings and a.required]


NUMERIC_BY_MODULE: dict[str, list[str]] = {}
for _module, _flag in NUMERIC:
    NUMERIC_BY_MODULE.setdefault(_module, []).append(_flag)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("never-written")


def parse(module: str, argv: list[str]) -> tuple[argparse.Namespace | None, int | None, str]:
    """parse_args alone (never main: no Ray, no torch model): the namespace or the exit code,
    and what it wrote on stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parsers()[module].parse_args(argv), None, err.getvalue()
        except SystemExit as e:
            return None, e.code, err.getvalue()


def assert_refused(module: str, flag: str, code, err: str) -> None:
    prog = parsers()[module].prog
    names = "/".join(action_of(module, flag).option_strings)
    lines = err.splitlines()
    assert code == 2, err
    assert lines[0].startswith("usage: ") and err.endswith("\n")
    assert lines[-1].startswith(f"{prog}: error: argument {names}: "), err
    assert sum("error:" in line for line in lines) == 1, err  # the error is one line


def test_every_command_with_a_main_has_a_parser_and_the_shared_types_are_used():
    for name in sorted(m.name for m in pkgutil.walk_packages(jobs.__path__, "jobs.")
                       if not m.ispkg):
        if hasattr(importlib.import_module(name), "main"):
            assert name in parsers(), f"{name} has main() but no build_parser()"
    assert {"jobs.build", "jobs.evaluate", "jobs.serve", "jobs.gc", "jobs.manifests",
            "jobs.make_corpus", "jobs.answer"} <= set(NUMERIC_BY_MODULE)
    assert len(NUMERIC) >= 50 and ("jobs.serve", "--port") in NUMERIC


@pytest.mark.parametrize("module", sorted(parsers()))
def test_required_arguments_alone_parse_and_defaults_are_in_range(module, folder):
    """What the other tests add the wrong option to parses alone; and a numeric option's default
    (never run through its type by argparse) lies in the type's range."""
    if module == "jobs.epicache":  # a command name and its arguments, positional
        argv = ["gc", "--store", str(folder)]
    else:
        argv = required_argv(module, folder)
    a, _, err = parse(module, argv)
    assert a is not None, err
    for flag in NUMERIC_BY_MODULE.get(module, []):
        action = action_of(module, flag)
        if action.default is not None:
            b = bounds_of(action.type)
            assert (type(action.default) is b["kind"] or b["kind"] is float
                    and type(action.default) is int), (flag, action.default)
            assert is_finite(action.default) and in_range(action.default, b), \
                (module, flag, action.default, b)


def _refused_texts(action: argparse.Action) -> list[str]:
    b = bounds_of(action.type)
    texts = ["nan", "inf", "-inf", "abc", "", " ", "0x10", "1e309", "1.5e", "1 2"]
    if b["kind"] is int:
        texts += ["1.5", "1e3"]
    if b["kind"] is float or b["at_most"] is not None:
        texts.append("9" * 400)
    if b["at_least"] is not None:
        texts += [str(b["at_least"] - 1), f"\n{b['at_least'] - 1}\n", "-" + "9" * 400]
        if b["kind"] is float:
            texts.append(repr(math.nextafter(b["at_least"], -math.inf)))
    if b["above"] is not None:
        texts.append(str(b["above"]))
    if b["at_most"] is not None:
        texts.append(str(b["at_most"] + 1))
        if b["kind"] is float:
            texts.append(repr(math.nextafter(b["at_most"], math.inf)))
    return texts


@pytest.mark.parametrize("module,flag", NUMERIC, ids=[f"{m}{f}" for m, f in NUMERIC])
def test_a_refused_number_is_one_argument_error_naming_the_option(module, flag, folder, capsys):
    required = [arg for arg in required_argv(module, folder) if not arg.startswith(f"{flag}=")]
    ray_before = _ray_running()  # the session's Ray may be up already (the e2e tests')
    for text in _refused_texts(action_of(module, flag)):
        with pytest.raises(SystemExit) as exit_:
            parsers()[module].parse_args([f"{flag}={text}", *required])
        err = capsys.readouterr().err
        assert_refused(module, flag, exit_.value.code, err)
    assert list(folder.iterdir()) == []  # parsing wrote nothing
    assert _ray_running() == ray_before  # and started no Ray


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@pytest.mark.parametrize("module,flag", NON_EMPTY, ids=[f"{m}{f}" for m, f in NON_EMPTY])
@pytest.mark.parametrize("text", ["", " ", "\n\t"])
def test_a_blank_store_is_one_argument_error(module, flag, text, folder):
    required = [arg for arg in required_argv(module, folder) if not arg.startswith(f"{flag}=")]
    a, code, err = parse(module, [f"{flag}={text}", *required])
    assert a is None
    assert_refused(module, flag, code, err)
    assert err.splitlines()[-1].endswith(": must not be empty")


@settings(FAST, max_examples=150)
@given(st.sampled_from(NUMERIC), TEXT)
@example(("jobs.serve", "--port"), "1" * 400)  # was an OverflowError traceback
@example(("jobs.gc", "--min-age-seconds"), "\n-5")  # was an error over two lines
def test_any_text_for_any_numeric_option_parses_in_range_or_exits_2(folder, option, text):
    module, flag = option
    action = action_of(module, flag)
    required = [arg for arg in required_argv(module, folder) if not arg.startswith(f"{flag}=")]
    a, code, err = parse(module, [f"{flag}={text}", *required])
    expected = check_number(action.type, text)
    if a is None:
        assert expected is None, (text, err)
        assert_refused(module, flag, code, err)
    else:
        assert expected is not None and getattr(a, action.dest) == expected and err == ""
