"""Every `jobs.*` command documents itself, and the README's and docs' examples name only real
options and parse.

Each command module exposes `build_parser()` (made by `pipeline.cli.parser.make_parser`); these
tests import every module of `jobs/` (never running its main) and read the parsers. The reference
material the README links to lives in docs/: the methods and variants in docs/evaluation.md, the
scorers in docs/building.md, the serve settings in docs/serving.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import pkgutil
import re
import shlex

import pytest

import jobs
from tests.support.paths import REPO as ROOT
from tests.support.paths import doc_pages

DOCS = doc_pages()
# a module name followed by `.<name>` is a placeholder (`python -m jobs.bench.<name>`), not an
# example
_COMMAND = re.compile(r"(?:^|\s)(?:\S*/)?python -m (jobs(?:\.\w+)+)(?![.\w<])(.*)")


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(jobs.__path__, "jobs.") if not m.ispkg)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser; a module with a main() but no build_parser() fails the test."""
    parsers = {}
    for name in _modules():
        module = importlib.import_module(name)
        if hasattr(module, "build_parser"):
            parsers[name] = module.build_parser()
        else:
            assert not hasattr(module, "main"), f"{name} has main() but no build_parser()"
    return parsers


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    return _parsers()


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options a user sees: every action but --help and the ones hidden on purpose."""
    return [a for a in parser._actions
            if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS]


def test_every_command_has_a_parser(parsers):
    commands = {name for name in _modules() if hasattr(importlib.import_module(name), "main")}
    assert commands == set(parsers) and len(parsers) >= 15


def test_every_option_has_help_and_shows_its_default(parsers):
    missing = []
    for name, parser in parsers.items():
        assert parser.description, f"{name}: no description"
        for action in _options(parser):
            flag = f"{name} {'/'.join(action.option_strings)}"
            if not (action.help or "").strip():
                missing.append(f"{flag}: no help")
            # a None default shows nothing by itself: the help must say what it falls back to
            elif (action.default is None and not action.required and action.nargs != 0
                  and "default" not in action.help):
                missing.append(f"{flag}: default None, not explained")
        parser.format_help()  # every help string formats (no stray %)
    assert not missing, "\n".join(missing)


def test_help_lists_methods_scorers_and_serve_builder_keys(parsers):
    from jobs.serve import ServeSettings
    from pipeline.eval.methods import PRESETS
    from pipeline.kv.methods import REGISTRY

    # the help as read: lines joined, a name broken after its hyphen made whole again
    methods = re.sub(r"-\s+", "-", " ".join(parsers["jobs.evaluate"].format_help().split()))
    for name in PRESETS:
        assert name in methods
    assert "<path>=<value>" in methods and "--set" in methods and "entries" in methods
    assert len(PRESETS) <= 20  # a short table of presets, the rest is overrides
    scorer = next(a for a in parsers["jobs.build"]._actions if a.dest == "scorer")
    assert set(scorer.choices) == {n for n, r in REGISTRY.items() if not r.per_question}
    assert "question" not in scorer.choices and "epicache" in scorer.choices
    build_help = " ".join(parsers["jobs.build"].format_help().split())
    assert all(name in build_help for name in scorer.choices)
    serve_help = " ".join(parsers["jobs.serve"].format_help().split())
    assert all(f.name in serve_help for f in dataclasses.fields(ServeSettings))


def test_route_by_names_only_the_routers_that_exist(parsers):
    """Every `--route-by` offers the registry's routers and no retired one."""
    from pipeline.routers import ROUTERS

    for name in ("jobs.serve", "jobs.answer"):
        [action] = [a for a in parsers[name]._actions if "--route-by" in a.option_strings]
        text = f"{action.help} {action.choices or ''}"
        assert all(router in text for router in ROUTERS), name
        assert not re.search(r"\b(knn|expand|expandwin)\b", text), (name, text)


def test_budgets_are_spelled_and_parsed_one_way(parsers):
    """One cache's budget is `--budget N`, the budgets of a command that runs several
    `--budgets N,N,...`, in every command, parsed by the same types (`pipeline.cli.numbers`)."""
    from pipeline.cli.numbers import budget_list, positive_int

    wrong, lists = [], []
    for name, parser in parsers.items():
        for action in parser._actions:
            flags = [f for f in action.option_strings if "budget" in f]
            if flags == ["--budgets"] and action.type is budget_list:
                lists.append(name)
                assert budget_list(action.default), name  # a list of budgets, parsed as given
            elif flags and (flags != ["--budget"] or action.type is not positive_int):
                wrong.append(f"{name}: {flags} parsed by {getattr(action.type, '__name__', None)}")
    assert not wrong, "\n".join(wrong)
    assert {"jobs.evaluate", "jobs.scorecard", "jobs.screen", "jobs.bench.append"} <= set(lists)


_CODE_BLOCK = re.compile(r"```[a-z]*\n(.*?)```", flags=re.S)


def test_docs_name_every_method_variant_and_scorer():
    """docs/evaluation.md names every preset, docs/building.md every scorer."""
    from pipeline.eval.methods import PRESETS
    from pipeline.kv.methods import REGISTRY

    evaluation = (ROOT / "docs" / "evaluation.md").read_text(encoding="utf-8")
    assert [name for name in PRESETS if f"`{name}`" not in evaluation] == []
    building = (ROOT / "docs" / "building.md").read_text(encoding="utf-8")
    assert [name for name in REGISTRY if f"`{name}`" not in building] == []


def _examples() -> list[tuple[str, str, list[str], bool]]:
    """(where, module, arguments, whether it is a command line) of every `python -m jobs.X ...`
    in the docs: code-block lines, continuations joined as the shell joins them (a backslash and
    its newline removed), and inline code spans (which may wrap), which name a command or an
    option in prose rather than give a command to run."""
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        blocks = _CODE_BLOCK.findall(text)
        lines = [(line, True) for block in blocks
                 for line in block.replace("\\\n", "").splitlines()]
        prose = _CODE_BLOCK.sub("", text).replace("\n", " ")
        lines += [(span, False) for span in re.findall(r"`([^`]*python -m jobs\.[^`]*)`", prose)]
        for line, in_block in lines:
            match = _COMMAND.search(line)
            if match:
                found.append((f"{doc.name}: {line.strip()}", match.group(1),
                              shlex.split(match.group(2), comments=True),
                              in_block and _launched(line[:match.start()])))
    return found


def _launched(before: str) -> bool:
    """Whether what precedes `python -m` on a code-block line starts the command (nothing,
    `NAME=value` settings, or a launcher ending in `--`, as `ray job submit ... --`), rather than
    being a diagram's or a file tree's text around a command's name."""
    words = shlex.split(before, comments=True)
    return all(re.fullmatch(r"[A-Z_]+=\S*", w) for w in words) or words[-1:] == ["--"]


def test_readme_examples_use_real_options(parsers):
    examples = _examples()
    assert len(examples) >= 15
    wrong = []
    for where, module, args, _ in examples:
        assert module in parsers, f"{where}: no command {module}"
        options = parsers[module]._option_string_actions
        tokens = [t.strip("[]") for t in args]
        for i, token in enumerate(tokens):
            if not token.startswith("--"):
                continue
            flag = token.split("=")[0]
            action = options.get(flag)
            if action is None:
                wrong.append(f"{where}: {flag} is not an option of {module}")
            elif action.choices and i + 1 < len(tokens) and tokens[i + 1] != action.metavar:
                # `--scorer a|b|c` lists every choice (or names them by the metavar, SCORER);
                # a single value must be one of them
                given = set(tokens[i + 1].split("|"))
                choices = set(action.choices)
                if not given <= choices or (len(given) > 1 and given != choices):
                    wrong.append(f"{where}: {flag} {sorted(given)}, choices {sorted(choices)}")
    assert not wrong, "\n".join(wrong)


_SHELL = ("|", "&&", ";", ">", "2>&1", "&")  # where a command line's own arguments end


def _outside_brackets(args: list[str]) -> list[str]:
    """A usage line's arguments less its optional parts (`[--layers N]`, `[--paper]`)."""
    kept, depth = [], 0
    for token in args:
        depth += token.count("[")
        if depth == 0:
            kept.append(token)
        depth -= token.count("]")
    return kept


def test_docs_command_lines_parse(parsers):
    """Every command line of README.md and docs/ (a code block's `python -m jobs.X ...`) parses
    with its command's own parser, as a user pasting it would run it: its required options
    given, every value of the type the option takes. A usage line's optional parts
    (`[--budget 1024]`, `[--layers N]`) are left out: the rest must parse, and their options
    are checked by name and choice (`test_readme_examples_use_real_options`)."""
    wrong = []
    for where, module, args, command in _examples():
        if not command:
            continue
        ends = [i for i, token in enumerate(args) if token in _SHELL]
        args = _outside_brackets(args[:ends[0] if ends else None])
        error = io.StringIO()
        try:
            with contextlib.redirect_stderr(error), contextlib.redirect_stdout(io.StringIO()):
                parsers[module].parse_args(args)
        except SystemExit as e:
            if e.code:
                wrong.append(f"{where}\n  -> {error.getvalue().strip().splitlines()[-1]}")
    assert not wrong, "\n".join(wrong)


def test_docs_name_the_serve_run_keys():
    """`serve run` takes the ServeSettings fields: docs/serving.md's example uses only those, and
    it names every one of them, as `jobs.serve --help` does."""
    from jobs.serve import ServeSettings

    names = {f.name for f in dataclasses.fields(ServeSettings)}
    text = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    runs = re.findall(r"serve run jobs\.serve:app_builder([^\n`]*)", text)
    keys = {word.split("=")[0] for run in runs for word in run.split() if "=" in word}
    assert keys and keys <= names, keys - names
    assert {name for name in names if f"`{name}`" not in text} == set()
