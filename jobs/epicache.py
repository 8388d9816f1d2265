"""The `epicache` command: every command of `jobs/` under one name.

    epicache build --corpus corpus.jsonl --store caches/     # = python -m jobs.build ...
    epicache bench decode --tokens 4000                      # = python -m jobs.bench.decode ...
    epicache --help                                          # the commands, one line each

Each command runs exactly as `python -m jobs.<name>` runs it (which `ray job submit` uses and
which keeps working); only the chosen command's module is loaded.
"""

from __future__ import annotations

import argparse
import ast
import pkgutil
import runpy
import sys
from pathlib import Path

from pipeline.cli.parser import make_parser

JOBS = Path(__file__).resolve().parent
SELF = Path(__file__).stem


def _summary(path: Path) -> str:
    """A module's one-line summary: its docstring's first sentence, read without importing it."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    sentence = first.split(". ")[0].rstrip(".")
    return sentence if len(sentence) <= 90 else sentence[:87].rstrip() + "..."


def commands(folder: Path = JOBS) -> dict[str, Path]:
    """The command modules of a folder (jobs/ or jobs/bench/), by name."""
    return {m.name: folder / f"{m.name}.py" for m in pkgutil.iter_modules([str(folder)])
            if not m.ispkg and m.name != SELF}


def _listing() -> str:
    lines = ["commands:"]
    lines += [f"  {name:<13} {_summary(path)}" for name, path in sorted(commands().items())]
    lines += ["", "benchmarks (epicache bench <name>):"]
    lines += [f"  {name:<13} {_summary(path)}"
              for name, path in sorted(commands(JOBS / "bench").items())]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.epicache", __doc__, epilog=_listing())
    p.prog = "epicache"
    p.add_argument("command", help="a command (or `bench`, then a benchmark's name)")
    p.add_argument("arguments", nargs=argparse.REMAINDER,
                   help="the command's own arguments (`epicache <command> --help` lists them)")
    return p


def module_of(command: str, arguments: list[str]) -> tuple[str, list[str]]:
    """The module `python -m` would run, and the arguments left for it; ValueError naming the
    commands when there is no such command."""
    if command == "bench":
        benches = commands(JOBS / "bench")
        if not arguments or arguments[0] not in benches:
            raise ValueError(f"epicache bench takes one of: {', '.join(sorted(benches))}")
        return f"jobs.bench.{arguments[0]}", arguments[1:]
    if command not in commands():
        raise ValueError(f"no command {command!r}; the commands: "
                         f"{', '.join(sorted(commands()))}, bench")
    return f"jobs.{command}", arguments


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        module, arguments = module_of(a.command, a.arguments)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.argv = [f"epicache {a.command}", *arguments]
    try:  # as `python -m <module>`: the module runs as __main__ and exits with its code
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
