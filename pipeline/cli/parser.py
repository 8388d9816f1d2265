"""The one argument parser of every `jobs.*` command, so that each documents itself alike.

Every command module exposes `build_parser()`, built on `make_parser`: `--help` shows the
module docstring's first paragraph as written, and every option's help line with its default
(a test holds each command, and the examples in README.md and docs/, to that).
"""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout and appends `(default: X)` to an option's help, except
    where there is nothing worth showing: a required option, a flag (False), a None default
    (the help says in words what the option falls back to) or a help that names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.required or action.nargs == 0 or action.default in (None, argparse.SUPPRESS)
                or "(default" in text or "default:" in text):
            return text
        return f"{text} (default: %(default)s)"


def make_parser(module: str, doc: str, epilog: str | None = None) -> argparse.ArgumentParser:
    """The parser of `python -m <module>`, described by the first paragraph of its docstring."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0],
                                   epilog=epilog, formatter_class=HelpFormatter)
