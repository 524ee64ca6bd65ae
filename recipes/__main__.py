"""``python -m recipes``: every recipe, with one line of what it shows and the command that runs it."""

from __future__ import annotations

import importlib
import pkgutil

import recipes


def recipe_modules() -> list[str]:
    """Recipe module names: every module of the package except the shared ``core`` and private ones."""
    return sorted(m.name for m in pkgutil.iter_modules(recipes.__path__)
                  if not m.ispkg and not m.name.startswith("_"))


def describe(name: str) -> tuple[str, str]:
    """(what it shows, how to run it), both taken from the module's docstring."""
    doc = (importlib.import_module(f"recipes.{name}").__doc__ or "").strip()
    lines = [line.strip() for line in doc.splitlines()]
    summary = lines[0] if lines else ""
    command = next((line for line in lines if line.startswith(("torchrun ", "python "))), f"python -m recipes.{name}")
    command = command.split("  #")[0].strip()
    return summary, command


def main() -> None:
    rows = [(name, *describe(name)) for name in recipe_modules()]
    width = max(len(name) for name, _, _ in rows)
    for name, summary, command in rows:
        print(f"{name:<{width}}  {summary}\n{'':<{width}}  $ {command}")


if __name__ == "__main__":
    main()
