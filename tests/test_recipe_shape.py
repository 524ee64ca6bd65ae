"""The shape of a recipe (docs/contributing.md, ../shared/CONVENTIONS.md): a config dataclass that
checks its own values, whether it is built in code or from the command line; a command line that
is a few lines derived from that config (recipes/options.py); the API a recipe teaches, in its
own file; a docstring that says what and why, and holds no measurement."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import typing
from pathlib import Path

import pytest

from recipes.__main__ import recipe_modules
from recipes.options import parse_config

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def config_class(module):
    """The recipe's config: the dataclass its ``train`` (or ``main``) is built from."""
    found = [
        value
        for name, value in vars(module).items()
        if name.endswith("Config")
        and isinstance(value, type)
        and dataclasses.is_dataclass(value)
        and value.__module__ == module.__name__
    ]
    assert len(found) == 1, f"{module.__name__}: expected one *Config dataclass, found {found}"
    return found[0]


def values_outside(meta: dict, kind) -> list:
    """One value just outside each limit a field declares (and nan for a finite float)."""
    step = 1 if kind is int else 0.5
    bad = []
    if meta.get("choices") is not None:
        bad.append("not-one-of-them")
    if meta.get("at_least") is not None:
        bad.append(kind(meta["at_least"] - step))
    if meta.get("above") is not None:
        bad.append(kind(meta["above"]))
    if meta.get("at_most") is not None:
        bad.append(kind(meta["at_most"] + step))
    if kind is float and meta.get("finite", True):
        bad.append(float("nan"))
    return bad


@pytest.mark.parametrize("name", recipe_modules())
def test_a_config_refuses_each_value_outside_its_limits_from_code_and_command_line(name, capsys):
    """``train(Config(bad))`` is one ``ValueError`` line naming the field; ``--field bad`` is
    argparse's usage, one line and exit 2. Every field is declared with ``option`` (its help text,
    and its range or choices where it has one), so the command line and the docs' option table
    come from the same declaration."""
    module = importlib.import_module(f"recipes.{name}")
    config = config_class(module)
    hints = typing.get_type_hints(config, vars(module))
    parser = module.make_parser()
    # a positional (loss_compare's result files) is given, so that only the option is wrong
    base = ["x" for action in parser._actions if not action.option_strings and action.required]
    checked = 0
    for field in dataclasses.fields(config):
        assert field.metadata.get("help"), f"{name}: field {field.name} has no help (option())"
        inner = [t for t in typing.get_args(hints[field.name]) if t is not type(None)]
        kind = hints[field.name] if not inner or bool in inner else inner[0]
        for bad in values_outside(field.metadata, kind):
            with pytest.raises(ValueError) as refused:
                config(**{field.name: bad})
            message = str(refused.value)
            assert "\n" not in message and field.name in message, (name, field.name, message)
            flag = "--" + field.name.replace("_", "-")
            if not any(flag in action.option_strings for action in parser._actions):
                continue  # a field the command line does not take (set in code only)
            with pytest.raises(SystemExit) as exit_info:
                parse_config(parser, config, base + [flag, str(bad)])
            assert exit_info.value.code == 2, (name, flag, bad)
            error = capsys.readouterr().err.strip().splitlines()[-1]
            assert "error:" in error and (field.name in error or flag in error), (name, error)
            checked += 1
    assert checked or name in NO_LIMITS, f"{name}: no field declares a range or choices"


# Recipes whose every option is free text or a flag (none has a range to refuse).
NO_LIMITS: set[str] = set()


def command_line_lines(path: Path) -> tuple[int, int]:
    """(lines of command-line code, all lines) of one module: ``make_parser``, ``main``, any
    top-level function that uses argparse, and the ``if __name__ == "__main__":`` block."""
    source = path.read_text()
    tree = ast.parse(source)
    cli = 0
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_source_segment(source, node) or ""
            if node.name in ("make_parser", "main") or "argparse" in text:
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                cli += node.end_lineno - first + 1
        elif isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            cli += node.end_lineno - node.lineno + 1
    return cli, len(source.splitlines())


def test_command_line_code_is_under_5_percent_of_recipe_lines():
    """Copy-pasted argparse types drift (three versions of one is a defect): the command line is
    derived from the config by recipes/options.py, and each recipe keeps a few lines of its own."""
    counts = {name: command_line_lines(RECIPES / f"{name}.py") for name in recipe_modules()}
    shared = len((RECIPES / "options.py").read_text().splitlines())
    cli = sum(c for c, _ in counts.values()) + shared
    total = sum(t for _, t in counts.values()) + shared
    heaviest = sorted(counts.items(), key=lambda item: -item[1][0])[:5]
    assert cli / total < 0.05, f"{cli} of {total} lines ({cli / total:.1%}); most: {heaviest}"


@pytest.mark.parametrize(
    "name, call",
    [
        ("fsdp2", "fully_shard("),
        ("fsdp2", "MixedPrecisionPolicy("),
        ("tensor_parallel", "parallelize_module("),
        ("zero", "ZeroRedundancyOptimizer("),
        ("fsdp", "FullyShardedDataParallel("),
    ],
)
def test_a_recipe_shows_the_api_it_teaches_in_its_own_file(name, call):
    source = (RECIPES / f"{name}.py").read_text()
    code = re.sub(r'"""(.*?)"""', "", source, flags=re.S)  # in the code, not only the docstring
    assert call in code, f"recipes/{name}.py does not call {call} itself"


DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b(H100|H200|A100)\b.*\d+(\.\d+)? ?(ms|s|tokens/s|%)")


@pytest.mark.parametrize("name", recipe_modules())
def test_a_module_docstring_holds_no_dated_measurement(name):
    """Measurements live in results/ and the pages' Measured sections, rendered from results."""
    doc = ast.get_docstring(ast.parse((RECIPES / f"{name}.py").read_text())) or ""
    found = [line.strip() for line in doc.splitlines() if DATED.search(line)]
    assert not found, f"recipes/{name}.py's docstring holds measurements: {found}"
