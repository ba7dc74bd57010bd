"""Command-line flags written once, on the dataclass field they set: its default is the field's.

    max_num_seqs: int = flag(256, "sequences in one step")

becomes `--max-num-seqs N` (default 256) through `add_flags(parser, Config)`, and
`values_for(Config, args)` picks the parsed values back out for `Config(**...)`.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Flag:
    help: str | None = None
    name: str | None = None  # default: "--" + the field name with dashes
    aliases: tuple[str, ...] = ()
    type: Callable[[str], Any] | None = None  # default: the default value's type (int, float, str)
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    env: str | None = None  # an environment variable that, when set, gives the flag's default


def flag(default: Any = MISSING, help: str | None = None, *, default_factory: Any = MISSING, **options: Any) -> Any:
    """A dataclass field that is also a flag (options: Flag's). A bool with default False is a
    switch (`--x`); one with default True can be turned off (`--no-x`)."""
    meta = {"flag": Flag(help, **options)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def add_flags(group: argparse._ActionsContainer, cls: type) -> None:
    for f in dataclasses.fields(cls):
        spec: Flag | None = f.metadata.get("flag")
        if spec is None:
            continue
        default = os.environ.get(spec.env, f.default) if spec.env else f.default
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": spec.help}
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        else:
            kwargs["type"] = spec.type or (type(f.default) if f.default is not None else str)
            kwargs["choices"] = spec.choices
            kwargs["metavar"] = spec.metavar
        name = spec.name or "--" + f.name.replace("_", "-")
        group.add_argument(name, *spec.aliases, **{k: v for k, v in kwargs.items() if v is not None or k == "default"})


def values_for(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed values of the fields of `cls` (flags or not) that `args` holds."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names}
