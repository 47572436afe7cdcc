"""argparse options generated from a frozen config dataclass, so defaults live in one place.

Each field's `metadata` may carry `help`, `choices` and `flag` (the option name; default is the
field name with dashes). Booleans become `--x/--no-x`.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def _scalar_type(annotation: Any) -> Any:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        meta = field.metadata
        flag = meta.get("flag", "--" + field.name.replace("_", "-"))
        kind = _scalar_type(hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = meta.get("help", "")
        if default is not None and kind is not bool:
            help_text += f" (default: {default})"
        if kind is bool:
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        else:
            parser.add_argument(flag, dest=field.name, type=kind, default=default, choices=meta.get("choices"),
                                help=help_text)


def dataclass_from_args(cls: type[T], args: argparse.Namespace) -> T:
    names = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def parse_config(parser: argparse.ArgumentParser, cls: type[T],
                 argv: list[str] | None = None) -> tuple[T, argparse.Namespace]:
    """Parse flags into the config dataclass; its own validation errors exit like argparse's."""
    args = parser.parse_args(argv)
    try:
        return dataclass_from_args(cls, args), args
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: error() exits
