"""``<!-- api: shared -->`` and ``<!-- api: recipes -->``: the API reference of what a user copies,
rendered by mkdocstrings (mkdocs.yml) from the modules' signatures and docstrings.

``shared`` is the modules every recipe is copied with (``recipes.__main__.SHARED_MODULES``:
the toy model and data, the world's set-up, the ``apply_*`` functions, the command line);
``recipes`` is every copyable recipe: a module that imports nothing of the proof harness
(``recipes.core``), directly or through another module of the package. A recipe appears here
the day it stops importing the harness, with no docs edit; the harness itself stays out (a
contributor reads recipes/core).
"""

from __future__ import annotations

import ast
from typing import Any

from .base import REPO_ROOT, MarkerError

PACKAGE = REPO_ROOT / "recipes"


def render_api(scope: str, **_: Any) -> str:
    from recipes.__main__ import SHARED_MODULES

    if scope == "shared":
        names = list(SHARED_MODULES)
    elif scope == "recipes":
        names = copyable_recipes()
    else:
        raise MarkerError(f"api: expected 'shared' or 'recipes', got {scope!r}")
    # mkdocstrings expands each `::: identifier` block when the page's Markdown is converted.
    return "\n\n".join(f"::: recipes.{name}" for name in names) + "\n"


def copyable_recipes() -> list[str]:
    """The recipe modules (``python -m recipes`` lists them) that import nothing of recipes.core."""
    from recipes.__main__ import recipe_modules

    direct: dict[str, set[str]] = {}  # each file parsed once in this call (was 4 times each)
    return [name for name in recipe_modules() if "core" not in _imports(name, direct)]


def _imports(name: str, direct: dict[str, set[str]]) -> set[str]:
    """The package's modules that recipes/<name>.py imports, directly or through each other
    (``core`` for anything under recipes/core). ``direct``: what each module's own lines import,
    filled in as it is read."""
    found, todo = set(), [name]
    while todo:
        importer = todo.pop()
        if importer not in direct:
            direct[importer] = _direct_imports(importer)
        for module in direct[importer] - found:
            found.add(module)
            if (PACKAGE / f"{module}.py").exists():
                todo.append(module)
    return found


def _direct_imports(name: str) -> set[str]:
    direct = set()
    for node in ast.walk(ast.parse((PACKAGE / f"{name}.py").read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from recipes import core` names the module in the imported names
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):  # relative: from . import x, from .core import y
            modules = [f"recipes.{node.module or alias.name}" for alias in node.names]
        else:
            continue
        direct |= {module.split(".")[1] for module in modules if module.startswith("recipes.")}
    return direct
