"""The one argument parser of every `jobs.*` command, so that each documents itself alike.

Every command module exposes `build_parser()`, built on `make_parser`: `--help` shows the
module docstring's first paragraph as written, and every option's help line with its default
(a test holds each command, and the examples in README.md and docs/, to that).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pipeline.store.backends.base import StoreOptions


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


GIVEN = "given_options"  # the parsed namespace's set of the options the command line gave


def parse_noting_given(parser: argparse.ArgumentParser,
                       argv: list[str] | None = None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, plus the dests of the options the command line gave, as the
    attribute `GIVEN`: a command can then refuse an option its configuration does not read even
    when it is given at its default value (a comparison with the default could not tell)."""
    a = parser.parse_args(argv)
    saved = [(action, action.default, action.required) for action in parser._actions]
    try:  # parsed again with no defaults: the namespace holds only what was given
        for action in parser._actions:
            action.default, action.required = argparse.SUPPRESS, False
        given = frozenset(vars(parser.parse_args(argv)))
    finally:
        for action, default, required in saved:
            action.default, action.required = default, required
    setattr(a, GIVEN, given)
    return a


def non_empty(text: str) -> str:
    """An argparse `type`: text that is not empty or blank (an empty --store would be the
    current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def writable_folder(path: str | Path, option: str = "--out") -> Path:
    """`path` as an output folder: one that is a folder and writable, or can be made (its
    nearest existing parent is); otherwise a `ValueError` naming the option. Nothing is made
    here: a command checks before any work, and writes nothing if the rest is refused."""
    folder = Path(path)
    try:  # exists() raises on some names (one longer than the system allows)
        existing = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    except OSError as e:
        raise ValueError(f"{option} {path}: cannot be made ({e.strerror or e})") from None
    if not existing.is_dir():
        what = "not a folder" if existing == folder else f"cannot be made ({existing} is a file)"
        raise ValueError(f"{option} {path}: {what}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: cannot be written (permission denied on {existing})")
    return folder


def add_store_options(p: argparse.ArgumentParser,
                      help: str = "store folder, or s3://bucket/prefix") -> None:
    """`--store`, `--s3-endpoint` and `--s3-region`, as every command that opens a store takes
    them (`jobs.serve` from its settings' fields of the same names); the command passes them on
    as one `store_options(a)`, whose endpoint the S3 backend resolves
    (`pipeline.store.backends.s3.s3_endpoint`)."""
    p.add_argument("--store", required=True, type=non_empty, help=help)
    p.add_argument("--s3-endpoint", default=None,
                   help="S3-compatible endpoint URL (default: $EPICACHE_S3_ENDPOINT, else "
                        "$AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL, else AWS)")
    p.add_argument("--s3-region", default=None, help="S3 region (default: the AWS chain)")


def store_options(a: argparse.Namespace) -> StoreOptions:
    """The store options `add_store_options` parsed, as `open_store` takes them."""
    return StoreOptions(endpoint=a.s3_endpoint, region=a.s3_region)
