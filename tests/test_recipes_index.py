"""`python -m recipes` lists every recipe, and every recipe answers --help."""

import contextlib
import io
import runpy
import sys

import pytest

from recipes.__main__ import describe, recipe_modules
from tests.helpers import PYTHON, REPO_ROOT, run_cli


def test_every_recipe_is_listed_with_a_summary_and_a_command():
    proc = run_cli([PYTHON, "-m", "recipes"], timeout_s=120)
    assert proc.returncode == 0, proc.stderr
    for name in recipe_modules():
        summary, command = describe(name)
        assert summary and summary.endswith("."), (
            f"recipes/{name}.py: the docstring's first line should be a sentence"
        )
        assert f"recipes.{name}" in command, (
            f"recipes/{name}.py: its docstring should open with the command that runs it"
        )
        assert name in proc.stdout and command in proc.stdout


# runpy warns when the recipe was imported before (by this test process's collection): running it
# again as __main__ is exactly what `python -m` would do in a fresh interpreter.
@pytest.mark.filterwarnings("ignore:'recipes\\.\\w+' found in sys.modules:RuntimeWarning")
def test_every_recipe_answers_help(monkeypatch):
    """Each recipe's __main__ with --help, run in this process (torch is imported once, not ~30
    times): the command line parses, prints its usage and exits 0, before any work starts."""
    for name in recipe_modules():
        monkeypatch.setattr(sys, "argv", [name, "--help"])
        out, code = io.StringIO(), None
        # argparse exits 0 after the usage; a main() under torch's @record returns instead (record
        # swallows SystemExit(0), for entry points run with runpy)
        with contextlib.redirect_stdout(out):
            try:
                runpy.run_module("recipes." + name, run_name="__main__", alter_sys=True)
            except SystemExit as exit_info:
                code = exit_info.code
        text = out.getvalue()[:300]
        assert code in (0, None), f"recipes.{name} --help exited {code}: {text}"
        assert "usage" in text.lower(), f"recipes.{name} --help printed no usage: {text}"


# What the command line of each recipe calls: train(cfg) where it trains, run(cfg) where it does
# something else (README, "Every recipe is a module"); the exceptions, each for its stated reason.
ENTRY_EXCEPTIONS = {
    "memory_estimate": "estimate",  # runs nothing: estimate(cfg) returns a dict
}


def test_every_recipe_command_line_calls_train_or_run_and_imports_no_harness():
    """Every recipe is copyable: it imports nothing of the proof harness (recipes.core), and its
    __main__ block calls main(), which parses the command line and calls train or run."""
    import ast
    from pathlib import Path

    for name in recipe_modules():
        tree = ast.parse(Path(REPO_ROOT, "recipes", f"{name}.py").read_text())
        assert is_copyable(tree), f"recipes/{name}.py imports recipes.core"
        main_block = next(
            node
            for node in tree.body
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
        )
        called = {
            ast.unparse(node.func) for node in ast.walk(main_block) if isinstance(node, ast.Call)
        }
        assert "main" in called, f"recipes/{name}.py: its __main__ block should call main()"
        main_fn = next(
            node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"
        )
        in_main = {
            ast.unparse(node.func) for node in ast.walk(main_fn) if isinstance(node, ast.Call)
        }
        assert in_main & {"train", "run", ENTRY_EXCEPTIONS.get(name)}, (
            f"recipes/{name}.py: main() calls {in_main}"
        )


def is_copyable(tree) -> bool:
    """A recipe in the copyable shape imports nothing of the proof harness (recipes.core)."""
    import ast

    return not any(
        isinstance(node, (ast.Import, ast.ImportFrom))
        and any(
            name.startswith("recipes.core")
            for name in (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [alias.name for alias in node.names]
            )
        )
        for node in ast.walk(tree)
    )
