"""``<!-- options: recipes.X.make_parser -->`` (a recipe's argparse parser): the recipe's
command-line options as a table, built from what ``--help`` is built from."""

from __future__ import annotations

import inspect
from typing import Any

from .base import MarkerError, escape, import_attribute


def render_options(target: str, **_: Any) -> str:
    module_name, _, function_name = target.rpartition(".")
    make_parser = import_attribute(module_name, function_name)
    if not inspect.isfunction(make_parser):
        raise MarkerError(f"options: {target} is not a recipe's make_parser function")
    return _argparse_options(make_parser(), module_name)


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
