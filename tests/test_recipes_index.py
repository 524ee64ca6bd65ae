"""`python -m recipes` lists every recipe, and every recipe answers --help (one process for all of them)."""

import json

from recipes.__main__ import describe, recipe_modules
from tests.helpers import PYTHON, run_cli

# Runs each recipe's __main__ with --help inside one interpreter (torch is imported once, not 20 times).
HELP_ALL = """
import contextlib, io, json, runpy, sys
codes = {}
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module("recipes." + name, run_name="__main__", alter_sys=True)
        codes[name] = ("no exit", out.getvalue()[:300])
    except SystemExit as exc:
        codes[name] = (exc.code, out.getvalue()[:300])
print(json.dumps(codes))
"""


def test_every_recipe_is_listed_with_a_summary_and_a_command():
    proc = run_cli([PYTHON, "-m", "recipes"], timeout_s=120)
    assert proc.returncode == 0, proc.stderr
    for name in recipe_modules():
        summary, command = describe(name)
        assert summary and summary.endswith("."), f"recipes/{name}.py: the docstring's first line should be a sentence"
        assert f"recipes.{name}" in command, f"recipes/{name}.py: its docstring should open with the command that runs it"
        assert name in proc.stdout and command in proc.stdout


def test_every_recipe_answers_help():
    names = recipe_modules()
    proc = run_cli([PYTHON, "-c", HELP_ALL, *names], timeout_s=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in names:
        code, text = codes[name]
        assert code in (0, None), f"recipes.{name} --help exited with {code}: {text}"
        assert "usage" in text.lower(), f"recipes.{name} --help printed no usage: {text}"
