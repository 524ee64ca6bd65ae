"""``python -m recipes``: every recipe, with one line of what it shows and the command that runs
it."""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import recipes

# What recipes share and a user copies with them: the toy model/data, the world set-up, the
# functions that parallelize a model and the command line derived from a config.
SHARED_MODULES = ("toy", "dist_setup", "parallelize", "options")


def recipe_modules() -> list[str]:
    """Recipe module names: every module of the package except the shared ``core``, the shared
    modules a user copies with a recipe, and private ones."""
    return sorted(
        m.name
        for m in pkgutil.iter_modules(recipes.__path__)
        if not m.ispkg and not m.name.startswith("_") and m.name not in SHARED_MODULES
    )


def describe(name: str) -> tuple[str, str]:
    """(what it shows, how to run it), both taken from the module's docstring.

    The docstring is read from the source, not imported: listing needs neither torch nor the
    optional extras (lightning) that some recipes import.
    """
    source = Path(recipes.__path__[0], f"{name}.py").read_text(encoding="utf-8")
    doc = (ast.get_docstring(ast.parse(source)) or "").strip()
    lines = [line.strip() for line in doc.splitlines()]
    # The summary is the first sentence, which may wrap onto the next lines (sources stay within 100
    # characters): it ends at the first line ending in "." or at the first blank line.
    summary_lines: list[str] = []
    for line in lines:
        if not line:
            break
        summary_lines.append(line)
        if line.endswith("."):
            break
    summary = " ".join(summary_lines)
    command = next(
        (line for line in lines if line.startswith(("torchrun ", "python "))),
        f"python -m recipes.{name}",
    )
    command = command.split("  #")[0].strip()
    return summary, command


def main() -> None:
    rows = [(name, *describe(name)) for name in recipe_modules()]
    width = max(len(name) for name, _, _ in rows)
    for name, summary, command in rows:
        print(f"{name:<{width}}  {summary}\n{'':<{width}}  $ {command}")


if __name__ == "__main__":
    main()
