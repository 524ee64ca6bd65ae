"""A recipe's command line, derived from its config dataclass: one ``--flag`` per field.

Copy this file with any recipe that imports it: it needs only the standard library.

Each field declares its default, its help and the values it accepts with ``option``; the config's
``__post_init__`` calls ``check_options(self)``, so a config built in code
(``train(DDPConfig(lr=float("nan")))``) is refused exactly like ``--lr nan``: one line that names
the field, what is valid and what it got (``ValueError`` from code; usage and exit 2 from the
command line). Unknown flags are refused with argparse's list of the valid ones.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import operator
import os
import sys
import types
import typing

__all__ = ["option", "check_options", "config_parser", "parse_config", "exit_on_bad_input"]


def option(
    default,
    help: str,
    *,
    choices=None,
    at_least=None,
    above=None,
    at_most=None,
    finite: bool = True,
):
    """A config field: its default, its ``--help`` text and its range (numbers) or choices."""
    limits = dict(help=help, choices=choices, at_least=at_least, above=above, at_most=at_most)
    if isinstance(default, list | dict | set):  # a mutable default is built fresh per config
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata=dict(limits, finite=finite)
        )
    return dataclasses.field(default=default, metadata=dict(limits, finite=finite))


LIMITS = {
    "at_least": (">=", operator.ge),
    "above": (">", operator.gt),
    "at_most": ("<=", operator.le),
}


def _problem(value, kind, meta) -> str | None:
    """What is wrong with one field's value, by its type and declared limits; None if valid."""
    if meta.get("choices") is not None and value not in meta["choices"]:
        return f"must be one of {', '.join(map(str, meta['choices']))}, got {value!r}"
    if kind not in (int, float) or value is None:
        return None
    limits = [(words, test, meta[key]) for key, (words, test) in LIMITS.items() if key in meta]
    limits = [(words, test, bound) for words, test, bound in limits if bound is not None]
    finite = kind is float and meta.get("finite", True)
    wanted = " ".join(
        ["a whole number" if kind is int else "a finite number" if finite else "a number"]
        + [" and ".join(f"{words} {bound}" for words, _, bound in limits)]
    ).strip()
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if (
        not number
        or (kind is int and not isinstance(value, int))
        or (finite and not math.isfinite(value))
        or not all(test(value, bound) for _, test, bound in limits)
    ):
        return f"must be {wanted}, got {value!r}"
    return None


def check_options(config) -> None:
    """Refuses the first field outside its type or declared limits: ``ValueError``, one line."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        kind = hints[field.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None -> X
            inner = [t for t in typing.get_args(kind) if t is not type(None)]
            kind = inner[0] if len(inner) == 1 else kind
        problem = _problem(getattr(config, field.name), kind, field.metadata)
        if problem:
            raise ValueError(f"{field.name} {problem}")


def _prints() -> bool:
    """Whether this process says what is wrong: the first process of each node (torchrun's
    LOCAL_RANK 0, or a world of one). Every rank of a node parses the same command line, so one
    copy is enough; a node whose input differs (a file missing there) still says so itself."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0))) == 0


class _FirstOfNodeParser(argparse.ArgumentParser):
    """Usage, help and errors from the first process of each node only; every rank still exits
    with argparse's code."""

    def _print_message(self, message, file=None):
        if _prints():
            super()._print_message(message, file)


def config_parser(config_class, *, prog: str, doc: str | None) -> argparse.ArgumentParser:
    """An argparse parser with one ``--flag`` per field of ``config_class`` (``_`` -> ``-``)."""
    parser = _FirstOfNodeParser(
        prog=prog,
        description=(doc or "").split("\n")[0],
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        kind, meta, flag = hints[field.name], field.metadata, "--" + field.name.replace("_", "-")
        default = field.default_factory() if callable(field.default_factory) else field.default
        limits = [f"{w} {meta[key]}" for key, (w, _) in LIMITS.items() if meta.get(key) is not None]
        help_text = meta.get("help", " ") + (f" ({', '.join(limits)})" if limits else "")
        kwargs = dict(default=default, help=help_text, choices=meta.get("choices"))
        inner = [t for t in typing.get_args(kind) if t is not type(None)]  # X | None -> X
        if kind is bool:
            kwargs.update(action=argparse.BooleanOptionalAction)
        elif typing.get_origin(kind) in (list, tuple):
            kwargs.update(nargs="+", type=inner[0])
        else:
            kwargs.update(type=inner[0] if inner else kind)
        parser.add_argument(flag, **kwargs)
    return parser


def parse_config(parser: argparse.ArgumentParser, config_class, argv: list[str] | None = None):
    """The config the command line asks for; a refused value is usage and one line, exit 2."""
    values = vars(parser.parse_args(argv))
    hints = typing.get_type_hints(config_class)
    for name, kind in hints.items():  # nargs="+" gives a list; a tuple field stays a tuple
        if typing.get_origin(kind) is tuple and isinstance(values.get(name), list):
            values[name] = tuple(values[name])
    try:
        return config_class(**values)
    except ValueError as exc:
        parser.error(str(exc))


@contextlib.contextmanager
def exit_on_bad_input():
    """A ``ValueError`` that every rank raises (a batch that does not divide across the ranks)
    becomes one line (from each node's first process) and exit 2, not a traceback per rank."""
    try:
        yield
    except ValueError as exc:
        if _prints():
            print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
