"""``<!-- recipe-index -->``: every recipe, grouped as in the navigation's Recipes section, with
what it shows and the command that runs it (both from the module's docstring)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .base import MarkerError, escape

RECIPES_SECTION = "Recipes"  # the nav section whose pages are recipe pages


def render_recipe_index(_: str, *, page: Any, config: Any) -> str:
    from recipes.__main__ import describe, recipe_modules

    here = os.path.dirname(page.file.src_uri)
    groups = recipe_groups(config["nav"] or [])
    listed = {path for paths in groups.values() for _, path in paths}
    missing = [name for name in recipe_modules() if f"recipes/{name}.md" not in listed]
    if missing:
        groups["Not in the navigation yet"] = [(name, f"recipes/{name}.md") for name in missing]
    modules = set(recipe_modules())
    docs_dir = Path(config["docs_dir"])
    parts = []
    for group, entries in groups.items():
        if not entries:
            continue
        rows = []
        for _name, path in entries:
            module = Path(path).stem
            link = (
                f"[{module}]({os.path.relpath(path, here)})"
                if (docs_dir / path).exists()
                else f"{module} (no page yet)"
            )
            if module in modules:
                summary, command = describe(module)
                rows.append(f"| {link} | {escape(summary)} | `{command}` |")
            else:
                rows.append(f"| {link} | (no module recipes/{module}.py yet) | |")
        parts.append(
            f"### {group}\n\n| Recipe | What it shows | Run it |\n|---|---|---|\n" + "\n".join(rows)
        )
    return "\n\n".join(parts) + "\n"


def recipe_groups(nav: list) -> dict[str, list[tuple[str, str]]]:
    """{group title: [(title, page path)]} for the pages under the nav's Recipes section."""
    for item in nav:
        if isinstance(item, dict) and RECIPES_SECTION in item:
            groups: dict[str, list[tuple[str, str]]] = {}
            for entry in item[RECIPES_SECTION] or []:
                if isinstance(entry, dict):
                    ((title, value),) = entry.items()
                    if isinstance(value, list):
                        groups[title] = [_nav_page(child) for child in value]
                    elif value != "recipes/index.md":
                        groups.setdefault("Other", []).append((title, value))
            return groups
    raise MarkerError(f"recipe-index: the nav has no {RECIPES_SECTION!r} section")


def _nav_page(entry: Any) -> tuple[str, str]:
    if isinstance(entry, str):
        return Path(entry).stem, entry
    ((title, path),) = entry.items()
    return title, path
