"""mkdocs hooks: the parts of the site generated from the code, so that they cannot drift from it.

A page asks for generated content with a marker on a line of its own (outside code blocks):

- ``<!-- options: recipes.X.make_parser -->`` (or ``recipes.X.XConfig``): the recipe's
  command-line options (_hooks/options.py).
- ``<!-- results: X -->``: the figures measured for recipe X, from ``results/X.json`` (written by
  ``scripts/collect_results.py``); a recipe not measured yet gets a note that says how to measure
  it. ``<!-- bench -->``: every GPU benchmark (_hooks/results.py).
- ``<!-- chart: KIND -->``: a figure drawn at build time from results/ and from the code
  (_hooks/charts.py, _hooks/diagrams.py).
- ``<!-- api: shared -->``, ``<!-- api: recipes -->``: the API reference of what a user copies,
  rendered by mkdocstrings (_hooks/api.py names the modules).
- ``<!-- recipe-index -->``: every recipe, grouped as in the navigation, with what it shows and its
  command (_hooks/index.py).
- ``<!-- source: path.py::function -->``: a function's code (_hooks/source.py).
- ``<!-- diff: OLD.py:section,NEW.py:section -->``: what a recipe adds to another, as a diff of
  two snippet sections (_hooks/diff.py).

And on every page (_hooks/page.py, _hooks/source.py, _hooks/mermaid.py): a recipe page opens with
its run command; ``[fsdp2][]`` (a recipe's name as an empty reference link) becomes a link to
docs/recipes/fsdp2.md once that page exists, and the name in code font until then, so that prose
can name recipes whose pages are still being written without breaking the strict build; the tests
a page names link to their assertions; the vendored mermaid is loaded by the pages that have a
diagram, and only by them.

A marker that names something missing is logged as a warning, so ``mkdocs build --strict`` fails on
it (the page also shows a red box saying what is missing, for a non-strict ``mkdocs serve``).

Registered in mkdocs.yml under ``hooks:``. The recipes are imported (the option tables need the
real parsers), so building the docs needs torch installed, like running the recipes does.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# mkdocs loads this file by its path, not as part of a package: docs/ goes on sys.path so that the
# package beside it imports by name (mkdocs adds it only while it loads this file; the tests not
# at all).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _hooks import base  # noqa: E402
from _hooks.api import copyable_recipes, render_api  # noqa: E402
from _hooks.base import FENCE, REPO_ROOT, MarkerError, escape, log  # noqa: E402
from _hooks.charts import loss_series, model_state_rows, render_chart  # noqa: E402
from _hooks.diagrams import simulated_schedule  # noqa: E402
from _hooks.diff import render_diff  # noqa: E402
from _hooks.index import recipe_groups, render_recipe_index  # noqa: E402
from _hooks.mermaid import symmetric_collective, with_mermaid_script  # noqa: E402
from _hooks.options import render_options  # noqa: E402
from _hooks.page import fold_pitfalls, link_api, link_recipes, run_command_on_top  # noqa: E402
from _hooks.results import PART_LABELS, render_bench, render_results, results_markdown  # noqa: E402
from _hooks.source import append_proofs, render_source  # noqa: E402

# What the tests call through this module (tests/test_docs.py), besides the mkdocs events.
__all__ = [
    "MarkerError",
    "PART_LABELS",
    "base",
    "copyable_recipes",
    "loss_series",
    "model_state_rows",
    "recipe_groups",
    "render_bench",
    "render_chart",
    "render_results",
    "results_markdown",
    "simulated_schedule",
]

MARKER = re.compile(
    r"^(\s*)<!--\s*(options|results|api|recipe-index|bench|chart|source|diff)"
    r"\s*(?::\s*(\S+?))?\s*-->\s*$"
)
RENDERERS: dict[str, Callable[..., str]] = {
    "source": render_source,
    "diff": render_diff,
    "chart": render_chart,
    "bench": render_bench,
    "options": render_options,
    "results": render_results,
    "api": render_api,
    "recipe-index": render_recipe_index,
}


def on_config(config: Any) -> Any:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return config


def on_pre_build(config: Any) -> None:
    # `mkdocs serve` rebuilds in the same process: forget the recipe modules so that an edited
    # config dataclass or docstring shows up (torch and lightning stay imported, so this costs
    # little).
    for name in [n for n in sys.modules if n == "recipes" or n.startswith("recipes.")]:
        del sys.modules[name]


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    out, fence, linked = [], None, set()
    markdown = fold_pitfalls(run_command_on_top(markdown, page))
    mermaid = False
    for line in markdown.split("\n"):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
            mermaid = line.strip().endswith("mermaid")
        elif (
            fence is not None
            and line.strip().startswith(fence[0] * len(fence))
            and not line.strip().strip(fence[0])
        ):
            fence = None
        if fence is not None and mermaid:
            line = symmetric_collective(line)
        match = MARKER.match(line) if fence is None else None
        if match is None:
            if fence is None and not line.startswith("#"):
                line = link_api(link_recipes(line, page, config), linked)
            out.append(line)
            continue
        # an indented marker (inside a content tab or an admonition) renders indented alike
        indent, kind, argument = match.group(1), match.group(2), match.group(3) or ""
        try:
            rendered = RENDERERS[kind](argument, page=page, config=config)
            out.append(
                "\n".join(
                    indent + link_recipes(part, page, config) if part else part
                    for part in rendered.split("\n")
                )
            )
        except MarkerError as exc:
            log.warning("%s: %s", page.file.src_uri, exc)
            out.append(f'!!! failure "Generated content missing"\n    {escape(str(exc))}\n')
    return append_proofs("\n".join(out))


def on_post_page(output: str, *, page: Any, config: Any) -> str:
    return with_mermaid_script(output)
