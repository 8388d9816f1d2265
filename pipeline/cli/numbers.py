"""Argparse types for numbers with a range, so that a value that makes no sense (a negative age,
a NaN temperature) is an argument error (exit 2) naming the option, before anything runs.

`float("nan")` and `float("inf")` parse as floats, and a NaN passes every `<` check a
configuration makes later, so every float type here refuses them.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

Number = int | float


def number(kind: type = int, *, at_least: Number | None = None, above: Number | None = None,
           at_most: Number | None = None) -> Callable[[str], Number]:
    """An argparse `type`: text parsed as `kind` (int or float), finite, and at least
    `at_least` / greater than `above` / at most `at_most` where given; otherwise
    `ArgumentTypeError`, which argparse prints as "argument --flag: <why>"."""
    def parse(text: str) -> Number:
        value = kind(text)  # text that is no number: argparse's "invalid int value: 'x'"
        # an int is always finite (and math.isfinite overflows on one past float's range)
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        shown = text.strip()  # int() and float() allow whitespace around, "\n" included
        if at_least is not None and value < at_least:
            raise argparse.ArgumentTypeError(f"must be at least {at_least}, got {shown}")
        if above is not None and value <= above:
            raise argparse.ArgumentTypeError(f"must be greater than {above}, got {shown}")
        if at_most is not None and value > at_most:
            raise argparse.ArgumentTypeError(f"must be at most {at_most}, got {shown}")
        return value

    parse.__name__ = kind.__name__  # what argparse calls the type in its messages
    return parse


finite = number(float)
non_negative = number(float, at_least=0)
count = number(int, at_least=0)
positive_int = number(int, at_least=1)
port_number = number(int, at_least=1, at_most=65535)


def budget_list(text: str) -> list[int]:
    """An argparse `type`: `--budgets`, comma-separated positive integers ("512,1024"), in the
    order given, each once (blanks between commas ignored); otherwise `ArgumentTypeError`."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"takes comma-separated positive integers, got {text!r}")
    budgets: list[int] = []
    for part in parts:
        try:
            budget = positive_int(part)
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(
                f"takes comma-separated positive integers, got {text!r}") from None
        if budget not in budgets:
            budgets.append(budget)
    return budgets
