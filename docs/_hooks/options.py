"""``<!-- options: recipes.X.make_parser -->`` (a copyable recipe's argparse parser) or
``<!-- options: recipes.X.XConfig -->`` (a harness recipe's config dataclass): the recipe's
command-line options as a table, built from what ``--help`` is built from."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

from .base import MarkerError, escape, import_attribute


def render_options(target: str, **_: Any) -> str:
    from recipes.core.config import TrainConfig, config_table

    module_name, _, class_name = target.rpartition(".")
    cls = import_attribute(module_name, class_name)
    if inspect.isfunction(cls):  # a copyable recipe's make_parser(): argparse's own options
        return _argparse_options(cls(), module_name)
    if not (inspect.isclass(cls) and dataclasses.is_dataclass(cls)):
        raise MarkerError(f"options: {target} is not a config dataclass")
    try:
        hints = typing.get_type_hints(cls)
        table = config_table(cls)
    # A config the table cannot describe must fail the build clearly.
    except Exception as exc:  # noqa: BLE001
        raise MarkerError(
            f"options: cannot tabulate {target}: {type(exc).__name__}: {exc}"
        ) from None
    shared_defaults = {flag: default for flag, default, _ in config_table(TrainConfig)}
    own, shared = [], []
    for f, (flag, default, help_text) in zip(dataclasses.fields(cls), table):
        if not f.init:  # not a command-line option (parse_config skips it too)
            continue
        row = _option_row(flag, default, help_text, hints.get(f.name))
        inherited = issubclass(cls, TrainConfig) and shared_defaults.get(flag) == default
        (shared if inherited else own).append(row)
    module_cmd = f"python -m {module_name} --help"
    head = "| Option | Default | What it does |\n|---|---|---|\n"
    if not own:
        return (
            f"No options of its own: the fields every training recipe shares (`TrainConfig`). "
            f"`{module_cmd}` prints the same list.\n\n" + head + "\n".join(shared) + "\n"
        )
    text = f"Every option is a field of `{class_name}`; `{module_cmd}` prints the same list.\n\n"
    text += head + "\n".join(own) + "\n"
    if shared:
        indented = "\n".join("    " + line for line in (head + "\n".join(shared)).splitlines())
        text += (
            f'\n??? info "The options every training recipe shares (`TrainConfig`)"\n\n{indented}\n'
        )
    return text


def _argparse_options(parser: Any, module_name: str) -> str:
    """The table of a copyable recipe, whose command line is a plain ``argparse`` parser built by
    its ``make_parser()``: one row per option, as ``--help`` prints it."""
    import argparse

    if not isinstance(parser, argparse.ArgumentParser):
        raise MarkerError(f"options: {module_name}.make_parser() must return an ArgumentParser")
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        flag = "`" + "`<br>`".join(action.option_strings or [action.dest]) + "`"
        default = "" if action.default in (None, argparse.SUPPRESS) else f"`{action.default}`"
        help_text = escape((action.help or "").replace("%(default)s", str(action.default)))
        if action.choices:
            help_text += ". One of: " + ", ".join(f"`{c}`" for c in action.choices)
        cells = [flag, default, help_text]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    head = "| Option | Default | What it does |\n|---|---|---|\n"
    return (
        f"`python -m {module_name} --help` prints the same list.\n\n"
        + head
        + "\n".join(rows)
        + "\n"
    )


def _option_row(flag: str, default: str, help_text: str, annotation: Any) -> str:
    if annotation is bool:
        # the negation on a line of its own: the flag column stays narrow, the description wide
        flag_cell = f"`{flag}`<br>`--no-{flag[2:]}`"
    else:
        flag_cell = f"`{flag}`"
    help_text = escape(help_text)
    if typing.get_origin(annotation) is typing.Literal:
        help_text += ". One of: " + ", ".join(
            f"`{choice}`" for choice in typing.get_args(annotation)
        )
    cells = [flag_cell, f"`{default}`", help_text]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"
