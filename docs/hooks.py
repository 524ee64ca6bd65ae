"""mkdocs hooks: the parts of the site generated from the code, so that they cannot drift from it.

A page asks for generated content with a marker on a line of its own (outside code blocks):

- ``<!-- options: recipes.X.ConfigClass -->``: the recipe's command-line options, from its config
  dataclass (``recipes.core.config.config_table``, the same fields ``--help`` is built from).
- ``<!-- results: X -->``: the figures measured for recipe X, from ``results/X.json`` (written by
  ``scripts/collect_results.py``). A recipe not measured yet gets a note that says how to measure
  it.
- ``<!-- api: module -->``: a module's API reference from its docstrings and signatures;
  ``<!-- api: package.* -->`` does it for every public module of the package (``recipes.*``: the
  recipes).
- ``<!-- recipe-index -->``: every recipe, grouped as in the navigation, with what it shows and its
  command.

And inline, anywhere outside code: ``[fsdp2][]`` (a recipe's name as an empty reference link)
becomes a link to docs/recipes/fsdp2.md once that page exists, and the name in code font until then,
so that prose can name recipes whose pages are still being written without breaking the strict
build.

A marker that names something missing is logged as a warning, so ``mkdocs build --strict`` fails on
it (the page also shows a red box saying what is missing, for a non-strict ``mkdocs serve``).

Registered in mkdocs.yml under ``hooks:``. The recipes are imported (the option tables and the API
need the real classes), so building the docs needs torch installed, like running the recipes does.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import inspect
import json
import logging
import os
import pkgutil
import pprint
import re
import sys
import typing
from pathlib import Path
from typing import Any, Callable

# Under the "mkdocs" logger, so that --strict counts these warnings as errors.
log = logging.getLogger("mkdocs.hooks.recipes")

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "results"
MARKER = re.compile(r"^<!--\s*(options|results|api|recipe-index|bench)\s*(?::\s*(\S+?))?\s*-->\s*$")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
RECIPE_LINK = re.compile(r"\[([a-z][a-z0-9_]*)\]\[\]")
RECIPES_SECTION = "Recipes"  # the nav section whose pages are recipe pages


class MarkerError(Exception):
    """A marker names something that does not exist, or its data is unusable."""


# --------------------------------------------------------------------------------------------------
# mkdocs events


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
    out, fence = [], None
    for line in markdown.split("\n"):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
        elif (
            fence is not None
            and line.strip().startswith(fence[0] * len(fence))
            and not line.strip().strip(fence[0])
        ):
            fence = None
        match = MARKER.match(line) if fence is None else None
        if match is None:
            out.append(line if fence is not None else _link_recipes(line, page, config))
            continue
        kind, argument = match.group(1), match.group(2) or ""
        try:
            out.append(RENDERERS[kind](argument, page=page, config=config))
        except MarkerError as exc:
            log.warning("%s: %s", page.file.src_uri, exc)
            out.append(f'!!! failure "Generated content missing"\n    {_escape(str(exc))}\n')
    return "\n".join(out)


def _link_recipes(line: str, page: Any, config: Any) -> str:
    def link(match: re.Match) -> str:
        name = match.group(1)
        target = f"recipes/{name}.md"
        if (Path(config["docs_dir"]) / target).exists():
            return f"[{name}]({os.path.relpath(target, os.path.dirname(page.file.src_uri))})"
        if not (REPO_ROOT / "recipes" / f"{name}.py").exists():
            log.warning(
                "%s: [%s][] names no recipe (no recipes/%s.py)", page.file.src_uri, name, name
            )
        return f"`{name}`"

    if "][]" not in line:
        return line
    spans = re.split(r"(`[^`]*`)", line)  # inline code stays as written
    return "".join(span if span.startswith("`") else RECIPE_LINK.sub(link, span) for span in spans)


# --------------------------------------------------------------------------------------------------
# <!-- options: recipes.X.ConfigClass -->


def render_options(target: str, **_: Any) -> str:
    from recipes.core.config import TrainConfig, config_table

    module_name, _, class_name = target.rpartition(".")
    cls = _import_attribute(module_name, class_name)
    if not (inspect.isclass(cls) and dataclasses.is_dataclass(cls)):
        raise MarkerError(f"options: {target} is not a config dataclass")
    try:
        hints = typing.get_type_hints(cls)
        table = config_table(cls)
    # A config the table cannot describe must fail the build clearly.
    except Exception as exc:  # noqa: BLE001
        raise MarkerError(
            f"options: cannot tabulate {target}: {type(exc).__name__}: {exc}"
        ) from None
    shared_defaults = {flag: default for flag, default, _ in config_table(TrainConfig)}
    own, shared = [], []
    for f, (flag, default, help_text) in zip(dataclasses.fields(cls), table):
        if not f.init:  # not a command-line option (parse_config skips it too)
            continue
        row = _option_row(flag, default, help_text, hints.get(f.name))
        inherited = issubclass(cls, TrainConfig) and shared_defaults.get(flag) == default
        (shared if inherited else own).append(row)
    module_cmd = f"python -m {module_name} --help"
    head = "| Option | Default | What it does |\n|---|---|---|\n"
    if not own:
        return (
            f"No options of its own: the fields every training recipe shares (`TrainConfig`). "
            f"`{module_cmd}` prints the same list.\n\n" + head + "\n".join(shared) + "\n"
        )
    text = f"Every option is a field of `{class_name}`; `{module_cmd}` prints the same list.\n\n"
    text += head + "\n".join(own) + "\n"
    if shared:
        indented = "\n".join("    " + line for line in (head + "\n".join(shared)).splitlines())
        text += (
            f'\n??? info "The options every training recipe shares (`TrainConfig`)"\n\n{indented}\n'
        )
    return text


def _option_row(flag: str, default: str, help_text: str, annotation: Any) -> str:
    if annotation is bool:
        flag = f"{flag} / --no-{flag[2:]}"
    help_text = _escape(help_text)
    if typing.get_origin(annotation) is typing.Literal:
        help_text += ". One of: " + ", ".join(
            f"`{choice}`" for choice in typing.get_args(annotation)
        )
    cells = [f"`{flag}`", f"`{default}`", help_text]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


# --------------------------------------------------------------------------------------------------
# <!-- results: X -->


def render_results(name: str, **_: Any) -> str:
    if not re.fullmatch(r"[a-z0-9_]+", name or ""):
        raise MarkerError(f"results: expected a recipe name, got {name!r}")
    path = RESULTS_DIR / f"{name}.json"
    if not path.exists():
        return (
            f'!!! note "Not measured yet"\n    Run `python scripts/collect_results.py {name}` '
            "to measure it "
            f"and commit `results/{name}.json`; the figures then appear here.\n"
        )
    try:
        return results_markdown(json.loads(path.read_text()), name)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise MarkerError(
            f"results: results/{name}.json is not a results file ({type(exc).__name__}: {exc}); "
            f"rerun python scripts/collect_results.py {name}"
        ) from None


# The fields of RecipeResult that get a row of their own; any other field of the result gets a plain
# row.
_SHOWN = {
    "recipe",
    "world_size",
    "backend",
    "device",
    "seconds_per_step",
    "peak_memory_bytes",
    "losses",
    "param_checksum",
    "extras",
}


def results_markdown(data: dict, name: str) -> str:
    """The "Measured" table for one results file (see scripts/collect_results.py for its fields)."""
    result, machine = data["result"], data["machine"]
    rows = [
        (
            "Machine",
            f"{machine['description']}; load average {machine['load_average_1m']:.1f} when the run "
            "started",
        )
    ]
    if {"world_size", "backend", "device"} <= result.keys():
        rows.append(
            (
                "World",
                f"{result['world_size']} rank(s), backend `{result['backend']}`, device "
                f"`{result['device']}`",
            )
        )
    elif "world_size" in result:
        rows.append(("World size", str(result["world_size"])))
    if "seconds_per_step" in result:
        rows.append(
            (
                "Time per step",
                f"{_milliseconds(result['seconds_per_step'])} "
                "(rank 0, median over the steps after the first)",
            )
        )
    if "peak_memory_bytes" in result:
        rows.append(
            (
                "Peak memory per rank",
                _memory(result["peak_memory_bytes"], str(result.get("device", ""))),
            )
        )
    losses = result.get("losses") or []
    if losses:
        rows.append(
            (
                "Loss",
                f"{_number(losses[0])} at the first step, {_number(losses[-1])} after "
                f"{len(losses)} steps",
            )
        )
    extras = {
        **{k: v for k, v in result.items() if k not in _SHOWN},
        **(result.get("extras") or {}),
    }
    nested = False
    for key, value in extras.items():
        text = _number(value)
        if isinstance(value, (dict, list)) and len(text) > 200:
            text, nested = "in the whole result below", True
        rows.append((f"`{key}`", _escape(text)))
    date = datetime.datetime.fromisoformat(data["date"]).strftime("%Y-%m-%d")
    rows += [
        ("Command", f"`{data['command']}`"),
        (
            "Measured",
            f"{date}, torch {data['torch']}, Python {data['python']}, "
            f"{data['wall_seconds']:.0f} s for the whole command",
        ),
    ]
    table = "| Figure | Value |\n|---|---|\n" + "\n".join(
        f"| {k} | {v.replace('|', chr(92) + '|')} |" for k, v in rows
    )
    if nested:
        lines = json.dumps(result, indent=2).splitlines()
        lines = lines[:80] + (["..."] if len(lines) > 80 else [])
        table += (
            '\n\n??? note "The whole result (JSON)"\n\n    ```json\n'
            + "\n".join(f"    {line}" for line in lines)
            + "\n    ```"
        )
    if "seconds_per_step" in result and not machine.get("gpus"):
        table += (
            "\n\nTimes on a shared CPU are noisy and say little about a GPU cluster: these figures "
            "show "
            "that the recipe runs and what it costs here."
        )
    return table + f"\n\nReproduce them with `python scripts/collect_results.py {name}`.\n"


def _milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _memory(num_bytes: int, device: str) -> str:
    text = f"{num_bytes / 2**20:,.0f} MiB"
    if device.startswith("cuda"):
        return text + " (rank 0: `torch.cuda.max_memory_allocated`)"
    return (
        text
        + " (rank 0; on CPU this is the process's peak resident set, Python and torch included)"
    )


def _number(value: Any, top: bool = True) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_number(v, False) for v in value) + "]"
    if isinstance(value, dict):
        text = ", ".join(f"{k}: {_number(v, False)}" for k, v in value.items())
        return text if top else "{" + text + "}"
    return str(value)


# --------------------------------------------------------------------------------------------------
# <!-- recipe-index -->


def render_recipe_index(_: str, *, page: Any, config: Any) -> str:
    from recipes.__main__ import describe, recipe_modules

    here = os.path.dirname(page.file.src_uri)
    groups = _recipe_groups(config["nav"] or [])
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
        for name, path in entries:
            module = Path(path).stem
            link = (
                f"[{module}]({os.path.relpath(path, here)})"
                if (docs_dir / path).exists()
                else f"{module} (no page yet)"
            )
            if module in modules:
                summary, command = describe(module)
                rows.append(f"| {link} | {_escape(summary)} | `{command}` |")
            else:
                rows.append(f"| {link} | (no module recipes/{module}.py yet) | |")
        parts.append(
            f"### {group}\n\n| Recipe | What it shows | Run it |\n|---|---|---|\n" + "\n".join(rows)
        )
    return "\n\n".join(parts) + "\n"


def _recipe_groups(nav: list) -> dict[str, list[tuple[str, str]]]:
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


# --------------------------------------------------------------------------------------------------
# <!-- api: module -->


def render_api(target: str, **_: Any) -> str:
    # every public module of a package: new modules appear without a docs edit
    if target.endswith(".*"):
        package = _import_module(target[:-2])
        names = sorted(
            m.name
            for m in pkgutil.iter_modules(package.__path__)
            if not m.ispkg and not m.name.startswith("_")
        )
        return "\n\n".join(_module_api(f"{package.__name__}.{name}") for name in names)
    return _module_api(target)


def _module_api(module_name: str) -> str:
    module = _import_module(module_name)
    parts = [f"## `{module_name}` {{ #{module_name} }}\n", _docstring(module.__doc__)]
    for name in _public_names(module):
        obj = getattr(module, name)
        anchor = f"{module_name}.{name}"
        parts.append(f"### `{name}` {{ #{anchor} }}\n")
        if inspect.isclass(obj):
            declaration = _class_declaration(obj)
        elif callable(obj):
            declaration = f"def {name}{_signature(obj)}"
        else:  # a constant: its value (an instance's __doc__ would be its type's, so none is shown)
            declaration = f"{name} = {_value(obj)}"
        parts.append(f"```python\n{declaration}\n```\n")
        if inspect.isclass(obj) or callable(obj):
            parts.append(_docstring(_own_doc(obj)))
        if inspect.isclass(obj):
            for member_name, member in _public_members(obj):
                parts.append(f"#### `{name}.{member_name}` {{ #{anchor}.{member_name} }}\n")
                if isinstance(member, property):
                    returns = _signature(member.fget).rpartition(" -> ")[2] if member.fget else ""
                    parts.append(
                        f"```python\n{member_name}: {returns or 'property'}  # property\n```\n"
                    )
                else:
                    parts.append(f"```python\ndef {member_name}{_signature(member)}\n```\n")
                parts.append(_docstring(_own_doc(member)))
    return "\n".join(part for part in parts if part)


def _public_names(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:  # a recipe module: the classes and functions it defines itself
        names = [
            name
            for name, obj in vars(module).items()
            if not name.startswith("_")
            and (inspect.isclass(obj) or inspect.isfunction(obj))
            and getattr(obj, "__module__", None) == module.__name__
        ]
    return [name for name in names if hasattr(module, name)]


def _public_members(cls: type) -> list[tuple[str, Any]]:
    members = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isfunction(member) or isinstance(member, property):
            members.append((name, member))
    return members


class _Annotation:
    """An annotation kept as the source text (``from __future__ import annotations``), shown
    unquoted."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature(obj: Callable, *, indent: str = "") -> str:
    """``(a: int, *, b: str = 'x') -> bool``, one parameter per line when it is long."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # some builtins have none
        return "(...)"

    def unquoted(annotation: Any) -> Any:
        return _Annotation(annotation) if isinstance(annotation, str) else annotation

    params = [p.replace(annotation=unquoted(p.annotation)) for p in signature.parameters.values()]
    parts, positional_only, keyword_marker = [], False, True
    for param in params:
        if param.kind is param.POSITIONAL_ONLY:
            positional_only = True
        elif positional_only:
            parts.append("/")
            positional_only = False
        if param.kind is param.VAR_POSITIONAL:
            keyword_marker = False
        elif param.kind is param.KEYWORD_ONLY and keyword_marker:
            parts.append("*")
            keyword_marker = False
        parts.append(str(param))
    if positional_only:
        parts.append("/")
    returns = ""
    if signature.return_annotation is not inspect.Signature.empty:
        returns = " -> " + inspect.formatannotation(unquoted(signature.return_annotation))
    one_line = f"({', '.join(parts)}){returns}"
    if len(one_line) <= 80:
        return one_line
    return "(\n" + "".join(f"{indent}    {part},\n" for part in parts) + f"{indent}){returns}"


def _value(obj: Any, max_lines: int = 30) -> str:
    lines = pprint.pformat(obj, width=110, sort_dicts=False).splitlines()
    return "\n".join(lines[:max_lines] + (["..."] if len(lines) > max_lines else []))


def _class_declaration(cls: type) -> str:
    """A dataclass as its fields (with their help as comments); another class as its bases and
    __init__."""
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    head = f"class {cls.__name__}({', '.join(bases)}):" if bases else f"class {cls.__name__}:"
    if dataclasses.is_dataclass(cls):
        hints = vars(cls).get("__annotations__", {})
        lines = [f"@dataclass\n{head}"]
        # inherited fields: see the base
        own = [f for f in dataclasses.fields(cls) if f.name in hints]
        for f in own:
            annotation = f.type if isinstance(f.type, str) else inspect.formatannotation(f.type)
            if f.default is not dataclasses.MISSING:
                default = f" = {f.default!r}"
            elif f.default_factory is not dataclasses.MISSING:
                default = f" = {f.default_factory()!r}"
            else:
                default = ""
            help_text = f.metadata.get("help", "")
            lines.append(
                f"    {f.name}: {annotation}{default}" + (f"  # {help_text}" if help_text else "")
            )
        if not own:
            lines.append("    ...  # no fields of its own" if bases else "    ...")
        return "\n".join(lines)
    init = vars(cls).get("__init__")
    if inspect.isfunction(init):
        return f"{head}\n    def __init__{_signature(init, indent='    ')}"
    return head


def _own_doc(obj: Any) -> str:
    doc = obj.__doc__ if isinstance(obj, property) else getattr(obj, "__doc__", None)
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__")
        # A dataclass without a docstring gets its signature as __doc__: that is not documentation.
        if doc and doc.startswith(f"{obj.__name__}("):
            doc = None
    return doc or ""


def _docstring(doc: str | None) -> str:
    """A docstring as markdown: ``literal`` -> `literal`, and <words> kept as text, not HTML."""
    if not doc:
        return ""
    lines = inspect.cleandoc(doc).splitlines()
    out = []
    for line in lines:
        if line.startswith("    "):  # an indented block stays code
            out.append(line)
            continue
        line = line.replace("``", "`")
        spans = re.split(r"(`[^`]*`)", line)
        out.append("".join(span if span.startswith("`") else _escape(span) for span in spans))
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------------
# helpers


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    # A module that fails to import fails the build with its error.
    except Exception as exc:  # noqa: BLE001
        raise MarkerError(f"cannot import {name}: {type(exc).__name__}: {exc}") from None


def _import_attribute(module_name: str, attribute: str) -> Any:
    module = _import_module(module_name) if module_name else None
    if module is None or not hasattr(module, attribute):
        raise MarkerError(f"{module_name or '(no module)'} has no {attribute!r}")
    return getattr(module, attribute)


def _escape(text: str) -> str:
    """Plain text for markdown: no raw HTML, and no snippet include (--8<--) by accident."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# --------------------------------------------------------------------------------------------------
# <!-- bench -->: every results/bench/*.json that scripts/bench.py wrote on a GPU, as its own
# tables.


def render_bench(_: str | None = None, **__: Any) -> str:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench", REPO_ROOT / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    files = sorted((RESULTS_DIR / "bench").glob("*.json"))
    if not files:
        return (
            '!!! note "Not measured on a GPU yet"\n    Run `python scripts/bench.py` on a GPU '
            "and commit "
            "the `results/bench/<device>.json` it writes; the tables then appear here.\n"
        )
    parts = []
    for path in files:
        data = json.loads(path.read_text())
        parts.append(
            f"### {data['device']}, torch {data['torch']}, model `{data['model']}`\n\n"
            f"Measured {data['date'][:10]} by `python scripts/bench.py` "
            f"({data['steps']} steps a row, the median after the first). "
            f"{_escape(data.get('notes', ''))}\n"
        )
        if data.get("ladder"):
            parts.append(
                f"**The ladder** (one device, `recipes.performance`, global batch "
                f"{data['ladder'][0]['batch']} unless the row says otherwise); *vs bare* is "
                "against the first row. MFU is against the "
                "dense bf16 peak for every row, so the ladder reads on one scale (the JSON also "
                "has it against each precision's own peak):\n\n"
                + bench.table(data["ladder"], data["ladder"][0].get("ms_per_step"), compact=True)
            )
        for batch, rows in data.get("recipes", {}).items():
            parts.append(
                f"**Every recipe at world 1, global batch {batch}**; *vs bare* is against the "
                "bare loop with the same precision, fused AdamW and batch:\n\n"
                + bench.table(rows, rows[0].get("ms_per_step"), compact=True)
            )
    return "\n\n".join(parts) + "\n"


RENDERERS: dict[str, Callable[..., str]] = {
    "bench": render_bench,
    "options": render_options,
    "results": render_results,
    "api": render_api,
    "recipe-index": render_recipe_index,
}
