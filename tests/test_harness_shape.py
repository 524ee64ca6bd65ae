"""The proof harness (recipes/core) is one small, clear package: no module over 400 lines, no
circular import, no import of a recipe's private name, and no function that nothing calls."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORE = REPO / "recipes" / "core"
MODULES = sorted(CORE.rglob("*.py"))
# The harness's own tests: a function they alone call has no caller that needs it.
OWN_TESTS = {"test_world.py", "test_harness_shape.py"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, importer: str) -> list[tuple[str, list[str]]]:
    """(module, names) of every import anywhere in the tree, inside functions too."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package
                package = importer.split(".")[: -node.level]
                base = ".".join(package + ([base] if base else []))
            found.append((base, [alias.name for alias in node.names]))
    return found


def test_no_module_of_the_harness_is_over_400_lines():
    sizes = {module_name(p): len(p.read_text().splitlines()) for p in MODULES}
    assert sizes and not {name: n for name, n in sizes.items() if n > 400}


def test_the_harness_imports_no_private_name_of_a_recipe():
    """A recipe's underscored names (and its underscored helper modules) are its own business."""
    found = []
    for path in MODULES:
        for module, names in imported(ast.parse(path.read_text()), module_name(path)):
            if not module.startswith("recipes") or module.startswith("recipes.core"):
                continue
            private_module = any(part.startswith("_") for part in module.split("."))
            private = [name for name in names if name.startswith("_")]
            if private_module or private:
                found.append(f"{module_name(path)}: from {module} import {', '.join(names)}")
    assert not found


def test_the_harness_has_no_circular_import():
    """Every import counts, a function's too: a cycle broken by an import inside a function is
    still a cycle. Importing a submodule is an edge to that submodule, not to its package."""
    names = {module_name(p) for p in MODULES}
    edges: dict[str, set[str]] = {}
    for path in MODULES:
        importer = module_name(path)
        targets = set()
        for module, imported_names in imported(ast.parse(path.read_text()), importer):
            submodules = {f"{module}.{n}" for n in imported_names} & names
            if submodules:
                targets |= submodules
            if module in names and (
                not imported_names
                or set(imported_names) - {s.rsplit(".", 1)[-1] for s in submodules}
            ):
                targets.add(module)
        edges[importer] = targets - {importer}

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for target in edges.get(node, ()):
                if target == start:
                    return path + [start]
                if target not in path:
                    stack.append((target, path + [target]))
        return None

    cycles = [c for c in map(cycle_from, sorted(edges)) if c]
    assert not cycles, cycles[0]


def test_every_function_of_the_harness_has_a_caller_outside_its_own_tests():
    """A module-level function or class of recipes/core is referenced (not only named in a
    docstring) by the recipes, the harness itself, scripts/, the docs' hooks or a test other
    than the harness's own."""
    corpus = [*REPO.glob("recipes/**/*.py"), *REPO.glob("scripts/*.py"), *REPO.glob("docs/**/*.py")]
    corpus += [p for p in REPO.glob("tests/*.py") if p.name not in OWN_TESTS]
    used: set[str] = set()
    for path in corpus:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.alias):
                used.add(node.name.rsplit(".", 1)[-1])
    unused = [
        f"{module_name(path)}.{node.name}"
        for path in MODULES
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and node.name not in used
    ]
    assert not unused
