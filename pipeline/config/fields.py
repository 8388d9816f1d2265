"""Configuration fields by dotted path: their type, their value, a copy with one changed, and a
value cast from text by the field's type.

The configurations are frozen dataclasses nested in one another (`BuildConfig.prefill.tristate`
...); the command line (`pipeline.cli.options`) and Serve's builder arguments
(`ServeSettings.from_strings`) read types and defaults from the fields through these, so no
default or type is written twice.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable, Literal, Union


def _hint(cls: type, name: str) -> Any:
    hints = typing.get_type_hints(cls)
    if name not in hints:
        raise KeyError(f"{cls.__name__} has no field {name!r}")
    return hints[name]


def _optional_inner(hint: Any) -> Any:
    """`X` of `X | None` (the hint itself otherwise)."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1:
            return inner[0]
    return hint


def field_hint(cls: type, path: str) -> Any:
    """The type hint of the field at `path` ("prefill.tristate.window"), `| None` removed."""
    head, _, rest = path.partition(".")
    hint = _optional_inner(_hint(cls, head))
    return field_hint(hint, rest) if rest else hint


def is_optional(cls: type, path: str) -> bool:
    """Whether the field at `path` admits None (`X | None`)."""
    head, _, name = path.rpartition(".")
    hint = _hint(field_hint(cls, head) if head else cls, name)
    return _optional_inner(hint) is not hint


def field_of(cls: type, path: str) -> dataclasses.Field:
    head, _, rest = path.partition(".")
    if rest:
        return field_of(_optional_inner(_hint(cls, head)), rest)
    return next(f for f in dataclasses.fields(cls) if f.name == head)


def choices_of(cls: type, path: str) -> tuple | None:
    """The values a `Literal[...]` field admits (None for any other type)."""
    hint = field_hint(cls, path)
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None


def parser_of(cls: type, path: str) -> Callable[[str], Any]:
    """How text becomes the field's value: the field's `metadata["parse"]` if it has one, else
    its type (`str` for a Literal)."""
    custom = field_of(cls, path).metadata.get("parse")
    if custom is not None:
        return custom
    hint = field_hint(cls, path)
    if typing.get_origin(hint) is Literal:
        return str
    if hint is bool:
        return _parse_bool
    if not isinstance(hint, type):
        raise TypeError(f"field {path!r} of {cls.__name__} has no text form ({hint})")
    return hint


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def get_path(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def replace_path(obj: Any, path: str, value: Any) -> Any:
    """A copy of the frozen dataclass `obj` with the field at `path` set (nested copies made
    down the path; each one's own checks run)."""
    head, _, rest = path.partition(".")
    if rest:
        value = replace_path(getattr(obj, head), rest, value)
    return dataclasses.replace(obj, **{head: value})
