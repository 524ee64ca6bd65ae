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
import functools
import importlib
import inspect
import json
import logging
import math
import os
import pkgutil
import pprint
import re
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, Callable

# Under the "mkdocs" logger, so that --strict counts these warnings as errors.
log = logging.getLogger("mkdocs.hooks.recipes")

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "results"
MARKER = re.compile(
    r"^(\s*)<!--\s*(options|results|api|recipe-index|bench|chart|source)"
    r"\s*(?::\s*(\S+?))?\s*-->\s*$"
)
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
    out, fence, linked = [], None, set()
    markdown = _fold_pitfalls(_run_command_on_top(markdown, page))
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
            line = _symmetric_collective(line)
        match = MARKER.match(line) if fence is None else None
        if match is None:
            if fence is None and not line.startswith("#"):
                line = _link_api(_link_recipes(line, page, config), linked)
            out.append(line)
            continue
        # an indented marker (inside a content tab or an admonition) renders indented alike
        indent, kind, argument = match.group(1), match.group(2), match.group(3) or ""
        try:
            rendered = RENDERERS[kind](argument, page=page, config=config)
            out.append("\n".join(indent + _link_recipes(part, page, config) if part else part
                                 for part in rendered.split("\n")))
        except MarkerError as exc:
            log.warning("%s: %s", page.file.src_uri, exc)
            out.append(f'!!! failure "Generated content missing"\n    {_escape(str(exc))}\n')
    return _append_proofs("\n".join(out))


# Pitfalls fold: each `- **Title.** detail` item of a "## Pitfalls" section becomes a collapsed
# block (pymdownx.details) whose one-line summary is the title and numbered links to the tests that
# prove it, so that the section reads as a short list; the detail opens on a click.
PITFALL = re.compile(r"^- \*\*(.+?)\*\*\s*(.*)$")


def _fold_pitfalls(markdown: str) -> str:
    lines, out, i, in_pitfalls = markdown.split("\n"), [], 0, False
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            in_pitfalls = line.strip() == "## Pitfalls"
        match = PITFALL.match(line) if in_pitfalls else None
        if match is None:
            out.append(line)
            i += 1
            continue
        body, i = [match.group(2)], i + 1
        while i < len(lines) and (lines[i].startswith("  ") or (
                not lines[i].strip() and i + 1 < len(lines) and lines[i + 1].startswith("  "))):
            body.append(lines[i][2:])
            i += 1
        tests = list(dict.fromkeys(TEST_NAME.findall("\n".join(body))))
        title = match.group(1).replace('"', "&quot;")
        # numbered links, each titled with its test's name: the summary stays one short line
        proof = (" (proven by " + " ".join(f'[{k}](#{t}){{ title="{t}" }}'
                                           for k, t in enumerate(tests, 1)) + ")") if tests else ""
        out += ["", f'??? warning "{title}{proof}"', "",
                *[("    " + b) if b.strip() else "" for b in body], ""]
    return "\n".join(out)


# In a sequence diagram, a collective that every rank takes part in is drawn with arrows at both
# ends: a one-way arrow would say that one rank sends and the other only receives.
SYMMETRIC = re.compile(r"^(\s*\w+\s*)(-->>|->>)(\s*\w+\s*:.*\b(all-reduce|all-gather|"
                       r"reduce-scatter|all-to-all|all_reduce|all_gather|reduce_scatter|"
                       r"allreduce|barrier)\b.*)$", re.I)


def _symmetric_collective(line: str) -> str:
    match = SYMMETRIC.match(line)
    if not match:
        return line
    arrow = "<<-->>" if match.group(2) == "-->>" else "<<->>"
    return match.group(1) + arrow + match.group(3)


def _run_command_on_top(markdown: str, page: Any) -> str:
    """A recipe page opens with the command that runs the recipe (its docstring's first command),
    right under the title, so that a reader can run it before reading on."""
    src = page.file.src_uri
    name = Path(src).stem
    if not (src.startswith("recipes/") and (REPO_ROOT / "recipes" / f"{name}.py").exists()):
        return markdown
    from recipes.__main__ import describe

    title, newline, rest = markdown.partition("\n")
    if not title.startswith("# "):
        return markdown
    command = describe(name)[1]
    more = " ([more ways](#how-to-run))" if "\n## How to run" in rest else ""
    return f"{title}{newline}\n**Run it:** `{command}`{more}\n{rest}"


# The torch APIs the recipes teach: the first mention of each on a page, in code font, links to its
# PyTorch documentation.
TORCH_DOCS = "https://docs.pytorch.org/docs/stable/"
API_PAGES = {
    "DistributedDataParallel": "generated/torch.nn.parallel.DistributedDataParallel.html",
    "DistributedSampler": "data.html#torch.utils.data.distributed.DistributedSampler",
    "init_process_group": "distributed.html#torch.distributed.init_process_group",
    "dist.init_process_group": "distributed.html#torch.distributed.init_process_group",
    "destroy_process_group": "distributed.html#torch.distributed.destroy_process_group",
    "new_group": "distributed.html#torch.distributed.new_group",
    "init_device_mesh": "distributed.html#torch.distributed.device_mesh.init_device_mesh",
    "DeviceMesh": "distributed.html#torch.distributed.device_mesh.DeviceMesh",
    "ZeroRedundancyOptimizer": "distributed.optim.html",
    "FullyShardedDataParallel": "fsdp.html",
    "fully_shard": "distributed.fsdp.fully_shard.html",
    "parallelize_module": "distributed.tensor.parallel.html",
    "ColwiseParallel": "distributed.tensor.parallel.html",
    "RowwiseParallel": "distributed.tensor.parallel.html",
    "SequenceParallel": "distributed.tensor.parallel.html",
    "DTensor": "distributed.tensor.html",
    "torch.autocast": "amp.html#torch.autocast",
    "GradScaler": "amp.html#gradient-scaling",
    "torch.utils.checkpoint": "checkpoint.html",
    "torch.compile": "generated/torch.compile.html",
    "torch.multiprocessing.spawn": "multiprocessing.html",
    "mp.spawn": "multiprocessing.html",
    "clip_grad_norm_": "generated/torch.nn.utils.clip_grad_norm_.html",
    "torch.nn.utils.clip_grad_norm_": "generated/torch.nn.utils.clip_grad_norm_.html",
    "nn.DataParallel": "generated/torch.nn.DataParallel.html",
    "torch.distributed.checkpoint": "distributed.checkpoint.html",
    "torch.distributed.pipelining": "distributed.pipelining.html",
    "torch.profiler": "profiler.html",
    "torchrun": "elastic/run.html",
    "no_sync": "generated/torch.nn.parallel.DistributedDataParallel.html"
               "#torch.nn.parallel.DistributedDataParallel.no_sync",
}
INLINE_CODE = re.compile(r"(?<![\[`])`([^`]+)`(?![`\]])")


def _link_api(line: str, linked: set[str]) -> str:
    """The first `Name` on the page that is a torch API the recipes teach becomes a link."""
    if "`" not in line or line.lstrip().startswith(("<", "|---")):
        return line

    def link(match: re.Match) -> str:
        name = match.group(1)
        if name not in API_PAGES or name in linked:
            return match.group(0)
        linked.add(name)
        return f"[`{name}`]({TORCH_DOCS}{API_PAGES[name]})"

    parts = re.split(r"(\[[^\]]*\]\([^)]*\))", line)  # leave existing links alone
    return "".join(part if part.startswith("[") and "](" in part else INLINE_CODE.sub(link, part)
                   for part in parts)


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
    if inspect.isfunction(cls):  # a copyable recipe's make_parser(): argparse's own options
        return _argparse_options(cls(), module_name)
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


def _argparse_options(parser: Any, module_name: str) -> str:
    """The table of a copyable recipe, whose command line is a plain ``argparse`` parser built by
    its ``make_parser()``: one row per option, as ``--help`` prints it."""
    import argparse

    if not isinstance(parser, argparse.ArgumentParser):
        raise MarkerError(f"options: {module_name}.make_parser() must return an ArgumentParser")
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        flag = "`" + "`<br>`".join(action.option_strings or [action.dest]) + "`"
        default = "" if action.default in (None, argparse.SUPPRESS) else f"`{action.default}`"
        help_text = _escape((action.help or "").replace("%(default)s", str(action.default)))
        if action.choices:
            help_text += ". One of: " + ", ".join(f"`{c}`" for c in action.choices)
        cells = [flag, default, help_text]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    head = "| Option | Default | What it does |\n|---|---|---|\n"
    return f"`python -m {module_name} --help` prints the same list.\n\n" + head + "\n".join(
        rows) + "\n"


def _option_row(flag: str, default: str, help_text: str, annotation: Any) -> str:
    if annotation is bool:
        # the negation on a line of its own: the flag column stays narrow, the description wide
        flag_cell = f"`{flag}`<br>`--no-{flag[2:]}`"
    else:
        flag_cell = f"`{flag}`"
    help_text = _escape(help_text)
    if typing.get_origin(annotation) is typing.Literal:
        help_text += ". One of: " + ", ".join(
            f"`{choice}`" for choice in typing.get_args(annotation)
        )
    cells = [flag_cell, f"`{default}`", help_text]
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
        return _gpu_runs(name) + results_markdown(json.loads(path.read_text()), name)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise MarkerError(
            f"results: results/{name}.json is not a results file ({type(exc).__name__}: {exc}); "
            f"rerun python scripts/collect_results.py {name}"
        ) from None


def _gpu_runs(name: str) -> str:
    """A recipe's own GPU runs, from results/bench/<device>-<name>.json (the job's): device, torch
    and date first, then one row per run."""
    parts = []
    for path in sorted((RESULTS_DIR / "bench").glob(f"*-{name}.json")):
        data = json.loads(path.read_text())
        rows = ["| run | ms/step | tokens/s | MFU (bf16 peak) | waiting for data |",
                "|---|---|---|---|---|"]
        for run, record in data["runs"].items():
            result = record["result"]
            rows.append(f"| `{run}` | {1e3 * result['seconds_per_step']:.1f} | "
                        f"{result['tokens_per_second']:,.0f} | {100 * result['mfu']:.1f}% | "
                        f"{100 * result['data_wait_fraction']:.2f}% |")
        parts.append(f"**On one {data['device']}** (torch {data['torch']}, {data['date']}): "
                     f"{_escape(data['what'])}.\n\n" + "\n".join(rows) + "\n\n")
    return "".join(parts)


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
    """The "Measured" section for one results file (see scripts/collect_results.py for its fields).

    What the recipe is about, with units: model-state bytes per rank against DDP (not the process's
    resident memory, which is mostly Python and torch on CPU), per-op and per-rank figures as real
    tables, the GPU benchmark's row for this recipe with its device and torch version. CPU times are
    shown only when the machine was not overloaded (load average at most its cores); temporary
    paths, empty values and None are left out.
    """
    result, machine = data["result"], data["machine"]
    load, cores = machine["load_average_1m"], machine.get("cpu_cores") or 1
    on_gpu = bool(machine.get("gpus")) or str(result.get("device", "")).startswith("cuda")
    timing_ok = on_gpu or load <= cores
    rows = [("Machine", f"{machine['description']}; load average {load:.1f} when the run started")]
    if {"world_size", "backend", "device"} <= result.keys():
        rows.append(("World", f"{result['world_size']} rank(s), backend `{result['backend']}`, "
                              f"device `{result['device']}`"))
    elif "world_size" in result:
        rows.append(("World size", str(result["world_size"])))
    losses = result.get("losses") or []
    # A CPU time taken while other jobs held the cores measures them, not the recipe: such a row is
    # left out (never a row that says why it is empty); the GPU table below has the real figure.
    if "seconds_per_step" in result and losses and timing_ok:
        rows.append(("Time per step", f"{_milliseconds(result['seconds_per_step'])} "
                                      "(rank 0, median over the steps after the first)"))
    extras = {**{k: v for k, v in result.items() if k not in _SHOWN},
              **(result.get("extras") or {})}
    memory = extras.pop("memory_per_rank", None)
    if memory:
        parts = memory[0]
        total = sum(parts.get(k, 0) for k in PART_LABELS)
        ddp = _ddp_model_state()
        versus = ""
        if ddp and name != "ddp_torchrun":
            versus = f", {total / ddp:.2f} x DDP's {_kib(ddp)}"
        rows.append(("Model state per rank", f"{_kib(total)} on rank 0{versus}: parameters "
                     f"{_kib(parts['param_bytes'])}, gradients {_kib(parts['grad_bytes'])}, "
                     f"optimizer {_kib(parts['optimizer_bytes'])} "
                     "(`recipes.core.memory.model_state_bytes`)"))
    if "peak_memory_bytes" in result and on_gpu:
        rows.append(("Peak memory per rank", _memory(result["peak_memory_bytes"],
                                                     str(result.get("device", "")))))
    if losses:
        rows.append(("Loss", f"{_number(losses[0])} at the first step, {_number(losses[-1])} "
                             f"after {len(losses)} steps"))
    if not timing_ok:  # the same for every timing in the extras and in their tables
        extras = _without_timings(extras)
    tables = []
    special = SPECIAL_TABLES.get(name)
    if special:
        tables.append(special(result))
        extras = {k: v for k, v in extras.items() if k not in ("layouts", "rows")}
    for key, value in _figures(extras):
        if isinstance(value, str) and value.startswith("|"):
            tables.append(f"**`{key}`**\n\n{value}")
        else:
            raw = extras.get(key)
            if key.endswith("bytes") and isinstance(raw, (int, float)):
                value = _kib(raw)
            rows.append((f"`{key}`", _escape(value)))
    date = datetime.datetime.fromisoformat(data["date"]).strftime("%Y-%m-%d")
    rows += [
        ("Command", f"`{data['command']}`"),
        ("Measured", f"{date}, torch {data['torch']}, Python {data['python']}, "
                     f"{data['wall_seconds']:.0f} s for the whole command"),
    ]
    table = "| Figure | Value |\n|---|---|\n" + "\n".join(
        f"| {k} | {v.replace('|', chr(92) + '|')} |" for k, v in rows)
    # The GPU figure first, where one exists: it is the one that measures speed.
    gpu = _bench_rows(name)
    parts_md = [gpu, table, *tables] if gpu else [table, *tables]
    return "\n\n".join(parts_md) + (
        f"\n\nReproduce them with `python scripts/collect_results.py {name}`.\n")


TIMING_KEY = re.compile(r"(_ms\b|_ms_|_us\b|seconds|per_second|_per_s\b|tflops|^mfu$|"
                        r"idle_fraction_measured|timeline)")


def _without_timings(value: Any) -> Any:
    """The extras without a timing anywhere in them (keys named like TIMING_KEY, in records too)."""
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if not TIMING_KEY.search(str(k))}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _memory_estimate_table(result: dict) -> str:
    """memory_estimate's whole table: one row per optimizer layout and strategy, in GB."""
    from recipes.memory_estimate import STAGES

    lines = [f"**Per rank, {result['params']:.4g} parameters on {result['world_size']} ranks** "
             "(GB = 10^9 bytes; offload moves the sharded parts to the host):", "",
             "| Optimizer | Strategy | Parameters | Gradients | Optimizer state | On the GPU "
             "| On the host |", "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        device, host = row["device"], row["host"]
        label = STAGES[row["stage"]].label + (" + offload" if row["offload"] else "")
        lines.append(f"| {row['optimizer']} | {_escape(label)} | "
                     f"{device['param_bytes'] / 1e9:,.2f} | {device['grad_bytes'] / 1e9:,.2f} | "
                     f"{device['optimizer_bytes'] / 1e9:,.2f} | "
                     f"**{device['total_bytes'] / 1e9:,.2f}** | {host['total_bytes'] / 1e9:,.2f} |")
    return "\n".join(lines)


SPECIAL_TABLES: dict[str, Callable[[dict], str]] = {"memory_estimate": _memory_estimate_table}


def _ddp_model_state() -> float | None:
    path = RESULTS_DIR / "ddp_torchrun.json"
    try:
        per_rank = json.loads(path.read_text())["result"]["extras"]["memory_per_rank"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    return sum(per_rank.get(k, 0) for k in PART_LABELS)


def _useless(value: Any) -> bool:
    """None, empty, or a path into a temporary directory: nothing a reader can use."""
    if value is None or value == "" or value == [] or value == {}:
        return True
    if isinstance(value, str):
        return value.startswith(("/tmp/", "/var/folders/")) or "/tmp/" in value
    if isinstance(value, list):
        return all(_useless(v) for v in value)
    return False


def _figures(extras: dict) -> list[tuple[str, str]]:
    """(name, text or markdown table) for each extra worth showing: dicts of scalars that share
    their keys become one table (collectives' op -> status and op -> ms), lists of records become
    tables, the rest a value."""
    shown = {k: v for k, v in extras.items() if not _useless(v)}
    out: list[tuple[str, str]] = []
    scalar_dicts = {k: v for k, v in shown.items() if isinstance(v, dict) and len(v) > 3
                    and all(not isinstance(x, (dict, list)) for x in v.values())}
    if scalar_dicts:
        keys = list(dict.fromkeys(k for d in scalar_dicts.values() for k in d))
        head = "| | " + " | ".join(f"`{k}`" for k in scalar_dicts) + " |"
        lines = [head, "|---" * (len(scalar_dicts) + 1) + "|"]
        for key in keys:
            cells = [_cell(d.get(key, "")) for d in scalar_dicts.values()]
            lines.append(f"| `{key}` | " + " | ".join(cells) + " |")
        out.append((" and ".join(scalar_dicts), "\n".join(lines)))
    for key, value in shown.items():
        if key in scalar_dicts:
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out.append((key, _records_table(value)))
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            out.append((key, _records_table([{"": k, **v} for k, v in value.items()])))
        elif not _raw_list(value):
            out.append((key, _number(value)))
    return out


def _raw_list(value: Any) -> bool:
    """A list too long or too deep to read in a table cell (a timeline, every step's value): it
    stays in the results file, and a chart or a scalar on the page shows it."""
    if isinstance(value, dict):
        return any(_raw_list(v) for v in value.values())
    if not isinstance(value, (list, tuple)):
        return False
    return len(value) > 8 or len(_number(value)) > 80 or any(
        isinstance(v, (list, tuple)) and _raw_list(v) for v in value)


def _records_table(records: list[dict]) -> str:
    flat = []
    for record in records:
        row = {}
        for key, value in record.items():
            if isinstance(value, dict):
                row.update({f"{key}.{k}": v for k, v in value.items()})
            elif not _useless(value) or key == "":
                row[key] = value
        flat.append(row)
    columns = [c for c in dict.fromkeys(k for row in flat for k in row)
               if not any(_raw_list(row.get(c)) for row in flat)]
    lines = ["| " + " | ".join(f"`{c}`" if c else "" for c in columns) + " |",
             "|---" * len(columns) + "|"]
    for row in flat[:60]:
        lines.append("| " + " | ".join(_cell(row.get(c, ""), c) for c in columns) + " |")
    return "\n".join(lines)


def _cell(value: Any, column: str = "") -> str:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and column.endswith("bytes"):
        if value < 1024:
            return f"{value:g} B"
        return _kib(value) if value < 2**30 else f"{value / 1e9:,.2f} GB"
    return _escape(_number(value)).replace("|", "\\|")


def _bench_rows(name: str) -> str:
    """This recipe's rows in every GPU benchmark (results/bench/*.json), with the device."""
    parts = []
    for path in sorted((RESULTS_DIR / "bench").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        rows = [("recipes", row) for batch, group in (data.get("recipes") or {}).items()
                for row in group if row.get("recipe") == name and row.get("ms_per_step")]
        rows += [("ladder", row) for row in data.get("ladder") or []
                 if row.get("recipe") == name and row.get("ms_per_step")]
        if not rows:
            continue
        measured = data.get("measured") or {}
        dates = sorted({str(measured.get(part, data["date"]))[:10] for part, _ in rows})
        lines = ["| Run | Global batch | Precision | Time per step | Tokens/s | MFU (bf16 peak) "
                 "| Peak memory |", "|---|---|---|---|---|---|---|"]
        for _, row in rows:
            mfu = row.get("mfu_vs_bf16_peak")
            lines.append(f"| {_escape(row['label'])} | {row.get('batch', '')} | "
                         f"{row.get('precision', '')} | {row['ms_per_step']:.1f} ms | "
                         f"{row.get('tokens_per_second', 0):,.0f} | "
                         f"{'' if mfu is None else f'{mfu:.0%}'} | "
                         f"{row.get('peak_memory_gib', 0):.1f} GiB |")
        # Every benchmark row is a world of 1: say what that measures, so that a DDP or FSDP row is
        # not read as a multi-GPU figure.
        parts.append(f"**On a GPU: {_escape(data['device'])}, torch {data['torch']}**, model "
                     f"`{data['model']}`, measured {' and '.join(dates)} by "
                     f"`python scripts/bench.py`. One process on one GPU (a world of 1): what "
                     "this recipe's code costs against the bare loop, with nothing to "
                     "communicate; multi-GPU speed is not measured here. All rows: "
                     "[Performance](performance.md).\n\n" + "\n".join(lines))
    return "\n\n".join(parts)


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
            declaration = f"{name} = {_value(obj, width=96 - len(name) - 3)}"
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


def _value(obj: Any, max_lines: int = 30, width: int = 96) -> str:
    lines = pprint.pformat(obj, width=width, sort_dicts=False).splitlines()
    # pprint cannot break a dataclass repr: wrap what is still too wide for the code column.
    lines = [part for line in lines for part in (
        textwrap.wrap(line, width, subsequent_indent=" " * (len(line) - len(line.lstrip()) + 4),
                      break_long_words=False) if len(line) > width else [line])]
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
            field = f"    {f.name}: {annotation}{default}"
            if help_text and len(field) + len(help_text) + 4 > 96:
                # A long help goes above its field, wrapped: the code column holds 100 characters.
                lines += ["    # " + part for part in textwrap.wrap(help_text, 90)]
                help_text = ""
            if len(field) > 96:  # e.g. a long Literal: continue inside its brackets
                field = "\n".join(textwrap.wrap(field, 96, subsequent_indent=" " * 8,
                                                 break_long_words=False, break_on_hyphens=False,
                                                 drop_whitespace=True))
            lines.append(field + (f"  # {help_text}" if help_text else ""))
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
    # <device>.json: the benchmark; <device>-<recipe>.json: a recipe's own GPU runs (its page)
    files = [path for path in sorted((RESULTS_DIR / "bench").glob("*.json"))
             if "model" in json.loads(path.read_text())]
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
        for batch, rows in data.get("gaps", {}).items():
            parts.append(
                f"**The gaps at global batch {batch}** (measured "
                f"{data.get('measured', {}).get('gaps', data['date'])[:10]}): each place a "
                "recipe was measured behind the bare loop, beside it; *vs bare* is against the "
                "first row, the eager bare loop. `python scripts/bench.py --parts gaps,profile` "
                "measures them and writes the profiler's top entries to "
                "`results/bench/<device>-profiles.txt`:\n\n"
                + bench.table(rows, rows[0].get("ms_per_step"), compact=True)
            )
        for batch, rows in data.get("recipes", {}).items():
            parts.append(
                f"**Every recipe at world 1, global batch {batch}**; *vs bare* is against the "
                "bare loop with the same precision, fused AdamW and batch:\n\n"
                + bench.table(rows, rows[0].get("ms_per_step"), compact=True)
            )
    return "\n\n".join(parts) + "\n"


# --------------------------------------------------------------------------------------------------
# <!-- chart: KIND -->: figures drawn at build time as inline SVG from results/*.json and from the
# code (the model's shapes), never by hand. Colours come from CSS classes (docs/assets/extra.css),
# so they follow the light and dark palettes; text uses the page's own colour.

CHART_WIDTH = 760
PART_LABELS = {"param_bytes": "parameters", "grad_bytes": "gradients",
               "optimizer_bytes": "optimizer state"}
# The strategy each recipe measures, as memory_estimate's stages: the estimate drawn next to it.
ESTIMATE_STAGE = {"ddp_torchrun": "ddp", "zero": "zero1", "fsdp": "zero3", "fsdp2": "zero3",
                  "sharded_accumulation": "zero3"}
CHART_ORDER = ["ddp_torchrun", "zero", "fsdp", "fsdp2"]


def render_chart(kind: str, **_: Any) -> str:
    charts = {"memory": chart_memory, "loss": chart_loss, "ladder": chart_ladder,
              "pipeline": chart_pipeline, "fsdp-units": chart_fsdp_units,
              "tp-split": chart_tp_split, "comm-busbw": chart_comm_busbw,
              "job-loss": chart_job_loss}
    if kind not in charts:
        raise MarkerError(f"chart: unknown kind {kind!r}; one of {', '.join(charts)}")
    try:
        return charts[kind]()
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as exc:
        raise MarkerError(f"chart {kind}: the data cannot be drawn ({type(exc).__name__}: {exc})")


def chart_comm_busbw() -> str:
    """comm_bench's busbw against size: drawn by docs/charts_comm.py with the helpers below."""
    spec = importlib.util.spec_from_file_location("charts_comm", Path(__file__).with_name(
        "charts_comm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.chart_comm_busbw(RESULTS_DIR, svg=_svg, text=_text, figure=_figure,
                                   escape=_escape, width=CHART_WIDTH)


def chart_job_loss() -> str:
    """The job's validation loss against the step: drawn by docs/charts_job.py."""
    spec = importlib.util.spec_from_file_location("charts_job", Path(__file__).with_name(
        "charts_job.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.chart_job_loss(RESULTS_DIR, svg=_svg, text=_text, figure=_figure,
                                 escape=_escape, width=CHART_WIDTH)


def _figure(svg: str, caption: str, kind: str) -> str:
    # One line of raw HTML: Markdown leaves a block-level element alone; the caption is
    # Markdown-free.
    return (
        f'<figure class="recipe-chart" data-chart="{kind}">{svg}'
        f"<figcaption>{caption}</figcaption></figure>\n"
    )


MIN_TEXT_PX = 9.5  # a chart never shrinks below this: on a phone its figure scrolls instead


def _svg(width: int, height: int, body: list[str], label: str) -> str:
    # The SVG shrinks with the column (max-width: 100%) down to the width at which its smallest
    # text is MIN_TEXT_PX; narrower, its figure scrolls sideways (overflow-x: auto in extra.css).
    sizes = [float(m) for m in re.findall(r'font-size="([0-9.]+)"', "".join(body))] or [12.0]
    min_width = min(width, math.ceil(width * MIN_TEXT_PX / min(sizes)))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" style="min-width: {min_width}px" role="img" '
        f'aria-label="{_attr(label)}">'
        f"<title>{_escape(label)}</title>{''.join(body)}</svg>"
    )


def _attr(text: str) -> str:
    return _escape(text).replace('"', "&quot;")


def _text(
    x: float, y: float, text: str, *, anchor: str = "start", cls: str = "t", size: int = 12
) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" class="{cls}" '
        f'font-size="{size}">{_escape(text)}</text>'
    )


def _rect(x: float, y: float, w: float, h: float, cls: str, title: str = "") -> str:
    tip = f"<title>{_escape(title)}</title>" if title else ""
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{h:.1f}" '
        f'class="{cls}">{tip}</rect>'
    )


def _load_results() -> dict[str, dict]:
    out = {}
    for path in sorted(RESULTS_DIR.glob("*.json")):
        try:
            out[path.stem] = json.loads(path.read_text())
        except ValueError:
            continue
    return out


def _extras(data: dict) -> dict:
    result = data["result"]
    return {**{k: v for k, v in result.items() if k not in _SHOWN}, **(result.get("extras") or {})}


def _kib(num_bytes: float) -> str:
    return f"{num_bytes / 1024:,.1f} KiB" if num_bytes < 2**20 else f"{num_bytes / 2**20:,.2f} MiB"


def _ordered(names: list[str]) -> list[str]:
    return sorted(names, key=lambda n: (CHART_ORDER.index(n) if n in CHART_ORDER else 99, n))


def model_state_rows() -> list[dict]:
    """Measured model-state bytes of rank 0 for every recipe whose result has memory_per_rank, with
    the ZeRO paper's estimate for the same model and world where the strategy has one."""
    from recipes.core.workload import build_model
    from recipes.memory_estimate import LAYOUTS, model_state_per_rank

    results = _load_results()
    measured = {
        name: data for name, data in results.items() if _extras(data).get("memory_per_rank")
    }
    numel = sum(p.numel() for p in build_model("tiny", seed=0).parameters())
    rows = []
    for name in _ordered(list(measured)):
        data = measured[name]
        per_rank = _extras(data)["memory_per_rank"][0]
        world = data["result"]["world_size"]
        row = {"recipe": name, "world_size": world, "measured": per_rank, "estimated": None}
        if name in ESTIMATE_STAGE:
            estimate = model_state_per_rank(
                numel, world, ESTIMATE_STAGE[name], LAYOUTS["adam-fp32"]
            )
            row["estimated"] = {k: estimate["device"][k] for k in PART_LABELS}
            row["stage"] = ESTIMATE_STAGE[name]
        rows.append(row)
    return rows


def chart_memory() -> str:
    rows = model_state_rows()
    if not rows:
        raise MarkerError("chart memory: no results/*.json has memory_per_rank")
    bars = []
    for row in rows:
        bars.append((f"{row['recipe']} measured", row["measured"], ""))
        if row["estimated"]:
            bars.append((f"{row['recipe']} estimated", row["estimated"], " est"))
    top = max(sum(parts[k] for k in PART_LABELS) for _, parts, _ in bars)
    left, right, bar_h, gap = 170, 150, 18, 6
    scale = (CHART_WIDTH - left - right) / top
    body, y = [], 30
    for i, key in enumerate(PART_LABELS):  # legend
        body += [
            _rect(left + i * 150, 6, 12, 12, f"c{i}"),
            _text(left + i * 150 + 16, 16, PART_LABELS[key]),
        ]
    ddp_total = next(
        (sum(r["measured"][k] for k in PART_LABELS) for r in rows if r["recipe"] == "ddp_torchrun"),
        None,
    )
    for label, parts, suffix in bars:
        x = left
        body.append(_text(left - 8, y + 13, label, anchor="end"))
        for i, key in enumerate(PART_LABELS):
            w = parts[key] * scale
            body.append(
                _rect(
                    x,
                    y,
                    w,
                    bar_h,
                    f"c{i}{suffix.replace(' ', '-')}",
                    f"{label}: {PART_LABELS[key]} {_kib(parts[key])}",
                )
            )
            x += w
        total = sum(parts[k] for k in PART_LABELS)
        note = _kib(total) + (f" ({total / ddp_total:.2f} x DDP)" if ddp_total else "")
        body.append(_text(x + 6, y + 13, note))
        y += bar_h + gap
    svg = _svg(CHART_WIDTH, y + 8, body, "Model-state bytes per rank, measured and estimated")
    worlds = sorted({r["world_size"] for r in rows})
    caption = (
        f"Model-state bytes held by rank 0 (parameters, gradients, AdamW state; activations "
        f"not included), measured by <code>recipes.core.memory.model_state_bytes</code> "
        f"after the last step of each recipe's default command on "
        f"{', '.join(map(str, worlds))} CPU ranks (gloo, the cookbook's tiny model; "
        f"results/*.json: bytes, which the machine's load does not change), against the ZeRO "
        f"paper's estimate for fp32 AdamW (4 + 4 + 8 bytes per parameter; "
        f"<code>recipes.memory_estimate</code>). Measured optimizer state includes AdamW's "
        f"step counters; FSDP's includes the padding that makes each flat buffer divide."
    )
    return _figure(svg, caption, "memory") + "\n" + memory_table(rows)


def memory_table(rows: list[dict]) -> str:
    ddp = next((r for r in rows if r["recipe"] == "ddp_torchrun"), None)
    ddp_total = sum(ddp["measured"][k] for k in PART_LABELS) if ddp else None
    # One world size for every row (the usual case) goes above the table: a column fewer, so that
    # the table fits the column at 1280 px.
    worlds = {row["world_size"] for row in rows}
    ranks_column = len(worlds) > 1
    lines = [] if ranks_column else [f"Per rank of {worlds.pop()} ranks:", ""]
    lines += [
        "| Recipe |" + (" Ranks |" if ranks_column else "") + " Parameters | Gradients "
        "| Optimizer | Total per rank | vs DDP | Estimated total |",
        "|---|" + ("---|" if ranks_column else "") + "---|---|---|---|---|---|",
    ]
    for row in rows:
        m = row["measured"]
        total = sum(m[k] for k in PART_LABELS)
        est = row["estimated"]
        est_text = f"{_kib(sum(est[k] for k in PART_LABELS))} ({row['stage']})" if est else ""
        vs = f"{total / ddp_total:.2f} x" if ddp_total else ""
        ranks = f" {row['world_size']} |" if ranks_column else ""
        lines.append(
            f"| [{row['recipe']}][] |{ranks} {_kib(m['param_bytes'])} | "
            f"{_kib(m['grad_bytes'])} | {_kib(m['optimizer_bytes'])} | {_kib(total)} | "
            f"{vs} | {est_text} |"
        )
    return "\n".join(lines) + "\n"


def loss_series() -> tuple[list[tuple[str, list[float]]], list[str]]:
    """(recipe, losses) of every result trained on the reference model and data (its first loss is
    ddp_torchrun's), and the names left out because they train something else."""
    results = _load_results()
    reference = results.get("ddp_torchrun", {}).get("result", {}).get("losses") or []
    series, other = [], []
    for name in _ordered(list(results)):
        losses = results[name]["result"].get("losses")
        if not isinstance(losses, list) or len(losses) < 2:
            continue
        if reference and abs(losses[0] - reference[0]) > 1e-3 * abs(reference[0]):
            other.append(name)
            continue
        series.append((name, [float(v) for v in losses]))
    return series, other


# Why a run's loss differs from DDP's by more than float rounding: what its default command trains.
LOSS_DIFFERENCE_REASONS = {
    "amp": "bf16 autocast rounds",
    "finetune": "LoRA: only adapters train",
    "sharded_accumulation": "ragged samples, 25 % padding",
    "grad_clipping": "SGD with clipping",
}
ROUNDING = 1e-5  # float32 summation order moves a loss near 4 by a few 1e-7


def chart_loss() -> str:
    """Each run's largest difference from ddp_torchrun's loss, on a log scale, labelled directly:
    17 curves on one plot would lie on top of each other and hide the ones that do not."""
    series, other = loss_series()
    if len(series) < 2:
        raise MarkerError("chart loss: fewer than two results with losses on the reference run")
    reference = dict(series).get("ddp_torchrun")
    if reference is None:
        raise MarkerError("chart loss: results/ddp_torchrun.json has no losses")
    rows = []
    for name, losses in series:
        if name == "ddp_torchrun":
            continue
        steps = min(len(losses), len(reference))
        delta = max(abs(a - b) for a, b in zip(losses[:steps], reference[:steps]))
        rows.append((delta, name, steps))
    rows.sort()
    lo_exp, hi_exp = -8, -1  # 1e-8 .. 1e-1: float32 rounding up to a different training run
    left, right, top, bar_h, gap = 170, 230, 34, 16, 6
    plot_w = CHART_WIDTH - left - right

    def x_of(delta: float) -> float:
        if delta <= 0:
            return left
        e = min(max(math.log10(delta), lo_exp), hi_exp)
        return left + plot_w * (e - lo_exp) / (hi_exp - lo_exp)

    height = top + len(rows) * (bar_h + gap) + 4
    body = [f'<line x1="{left}" y1="{top - 4}" x2="{left}" y2="{height}" class="axis"/>']
    for e in range(lo_exp, hi_exp + 1):
        x = x_of(10.0**e)
        body += [f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{height}" class="grid"/>',
                 _text(x, top - 10, f"1e{e}", anchor="middle", size=11)]
    x = x_of(ROUNDING)
    body.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{height}" class="limit"/>')
    y = top
    for delta, name, steps in rows:
        same = delta <= ROUNDING
        note = "identical" if delta == 0 else f"{delta:.0e}"
        if steps < len(reference):
            note += f", {steps} steps"
        if not same:
            note += f": {LOSS_DIFFERENCE_REASONS.get(name, 'trains something else')}"
        body.append(_text(left - 8, y + 12, name, anchor="end", size=12))
        if delta > 0:
            body.append(_rect(left, y, x_of(delta) - left, bar_h, "c1" if same else "c0",
                              f"{name}: largest difference {delta:.3g}"))
        body.append(_text(max(x_of(delta), left) + 6, y + 12, note, size=11))
        y += bar_h + gap
    svg = _svg(CHART_WIDTH, height, body, "Largest loss difference from ddp_torchrun, per recipe")
    same = [n for d, n, _ in rows if d <= ROUNDING]
    dates = sorted({_load_results()[n]["date"][:10] for _, n, _ in rows})
    caption = (
        "The largest difference, over the steps both ran, between each recipe's loss and "
        "ddp_torchrun's, each run with its default command on CPU (gloo, torch "
        f"{_escape(_load_results()['ddp_torchrun']['torch'])}; results/*.json, measured "
        f"{dates[0]} to {dates[-1]}), on a log scale. {len(same)} of {len(rows)} equal DDP "
        "to within float32 rounding (blue, left of the red line at 1e-5: a different "
        "summation order), most of them exactly; the orange ones train something else by "
        "default, named beside the bar."
    )
    if other:
        caption += (" Left out because they train another model or precision by default: "
                    + ", ".join(other) + ".")
    return _figure(svg, caption, "loss")


def chart_ladder() -> str:
    # <device>.json: the benchmark; <device>-<recipe>.json: a recipe's own GPU runs (its page)
    files = [path for path in sorted((RESULTS_DIR / "bench").glob("*.json"))
             if "model" in json.loads(path.read_text())]
    if not files:
        raise MarkerError("chart ladder: no results/bench/*.json (run python scripts/bench.py)")
    parts = []
    for path in files:
        data = json.loads(path.read_text())
        ladder = [r for r in data.get("ladder", []) if r.get("tokens_per_second")]
        if not ladder:
            continue
        # Tokens per second, not time per step: rows with another batch stay comparable.
        base = ladder[0]["tokens_per_second"]
        top = max(r["tokens_per_second"] for r in ladder)
        left, right, bar_h, gap = 250, 190, 20, 8
        scale = (CHART_WIDTH - left - right) / top
        body, y = [], 8
        for row in ladder:
            rate = row["tokens_per_second"]
            w = rate * scale
            note = (f"{rate / 1e3:,.0f}k tokens/s, {rate / base:.1f} x "
                    f"({row['ms_per_step']:.1f} ms, batch {row.get('batch', '?')})")
            body += [_text(left - 8, y + 14, row["label"], anchor="end", size=11),
                     _rect(left, y, w, bar_h, "c0", f"{row['label']}: {note}"),
                     _text(left + w + 6, y + 14, note, size=11)]
            y += bar_h + gap
        title = f"{data['device']}, torch {data['torch']}"
        svg = _svg(CHART_WIDTH, y + 4, body, f"Training throughput, {title}")
        parts.append(_figure(svg, (
            f"Training throughput on {_escape(title)}, one device, model "
            f"<code>{_escape(data['model'])}</code>, measured {data['date'][:10]} by "
            f"<code>python scripts/bench.py</code> (results/bench/{path.name}). Longer is "
            f"faster; the factor is against the first row, plain fp32."), "ladder"))
    if not parts:
        raise MarkerError("chart ladder: no benchmark file has a ladder")
    return "\n".join(parts)


# Pipeline timelines: every timeline a results file holds (extras.timeline_per_rank, and each row of
# extras.schedule_table), one rank per row; without measured timelines, the schedules' order for the
# measured pp_size and micro-batches, computed here (unit times: forward 1, backward 2).


def _timelines(extras: dict) -> list[tuple[str, list[list], bool]]:
    found = []
    for row in extras.get("schedule_table") or []:
        if isinstance(row, dict) and row.get("timeline_per_rank"):
            found.append((str(row.get("schedule")), row["timeline_per_rank"], True))
    if not found and extras.get("timeline_per_rank"):
        found.append((str(extras.get("schedule")), extras["timeline_per_rank"], True))
    return found


def simulated_schedule(name: str, pp: int, microbatches: int) -> list[list]:
    """[[kind, stage, microbatch, start, end], ...] per rank for GPipe or 1F1B, one stage per rank:
    each rank runs its actions in order, each as soon as the neighbour it waits on is done."""
    orders = []
    for rank in range(pp):
        if name == "gpipe":
            order = [("F", m) for m in range(microbatches)] + [
                ("B", m) for m in range(microbatches)
            ]
        else:  # 1F1B: warm-up forwards, then one forward one backward, then the last backwards
            warm = min(pp - rank - 1, microbatches)
            order = [("F", m) for m in range(warm)]
            f, b = warm, 0
            while b < microbatches:
                if f < microbatches:
                    order.append(("F", f))
                    f += 1
                order.append(("B", b))
                b += 1
        orders.append(order)
    done: dict[tuple[str, int, int], float] = {}
    clock, position = [0.0] * pp, [0] * pp
    timeline: list[list] = [[] for _ in range(pp)]
    progress = True
    while progress:
        progress = False
        for rank in range(pp):
            if position[rank] == len(orders[rank]):
                continue
            kind, m = orders[rank][position[rank]]
            need = (
                ("F", rank - 1, m)
                if kind == "F" and rank > 0
                else ("B", rank + 1, m)
                if kind == "B" and rank < pp - 1
                else ("F", rank, m)
                if kind == "B"
                else None
            )
            if need is not None and need not in done:
                continue
            start = max(clock[rank], done.get(need, 0.0) if need else 0.0)
            end = start + (1.0 if kind == "F" else 2.0)
            done[(kind, rank, m)] = clock[rank] = end
            timeline[rank].append([kind, rank, m, start, end])
            position[rank] += 1
            progress = True
    return timeline


def _timeline_svg(title: str, per_rank: list[list], unit: str) -> str:
    left, right, row_h = 70, 20, 26
    end = max((float(a[4]) for actions in per_rank for a in actions), default=1.0) or 1.0
    scale = (CHART_WIDTH - left - right) / end
    body, y = [], 4
    for rank, actions in enumerate(per_rank):
        body.append(_text(left - 8, y + 17, f"rank {rank}", anchor="end", size=11))
        body.append(_rect(left, y, end * scale, row_h - 4, "idle", f"rank {rank}: idle"))
        for action in actions:
            kind, stage, micro, start, stop = action[:5]
            x, w = left + float(start) * scale, (float(stop) - float(start)) * scale
            letter = str(kind)[:1].upper()
            cls = {"F": "c0", "B": "c1", "W": "c2"}.get(letter, "c3")
            body.append(
                _rect(
                    x,
                    y,
                    w,
                    row_h - 4,
                    cls,
                    f"rank {rank}: {kind} stage {stage} micro-batch {micro}, "
                    f"{float(start):.3g}-{float(stop):.3g} {unit}",
                )
            )
            if w > 16:
                body.append(
                    _text(
                        x + w / 2,
                        y + 15,
                        f"{letter}{micro}",
                        anchor="middle",
                        cls="t on-bar",
                        size=10,
                    )
                )
        y += row_h
    body.append(_text(left, y + 12, f"0 {unit}", size=10))
    body.append(_text(CHART_WIDTH - right, y + 12, f"{end:.3g} {unit}", anchor="end", size=10))
    return _svg(CHART_WIDTH, y + 18, body, title)


def chart_pipeline() -> str:
    """The measured timelines when the machine was idle enough for times to mean something (one
    chart per schedule, each caption naming its schedule, machine and load); otherwise GPipe's and
    1F1B's order computed for the measured shape, said to be computed."""
    path = RESULTS_DIR / "pipeline_parallel.json"
    if not path.exists():
        raise MarkerError("chart pipeline: no results/pipeline_parallel.json")
    data = json.loads(path.read_text())
    extras, machine = _extras(data), data["machine"]
    load, cores = machine["load_average_1m"], machine.get("cpu_cores") or 1
    where = f"{_escape(machine['description'])}, torch {_escape(data['torch'])}"
    parts = []
    if load <= cores or machine.get("gpus"):
        for schedule, per_rank, _ in _timelines(extras):
            svg = _timeline_svg(f"Pipeline schedule {schedule}, measured", per_rank, "ms")
            ranks = len(per_rank)
            parts.append(_figure(svg, (
                f"<strong>{_escape(schedule)}</strong>, measured on {where} (load average "
                f"{load:.1f} when the run started), {ranks} ranks: the last training step's "
                "forward (F), backward (B) and weight-gradient (W) actions of each rank, "
                "labelled with their micro-batch, in milliseconds; grey is idle, the bubble. "
                f"From results/pipeline_parallel.json (<code>{_escape(data['command'])}</code>)."
            ), "pipeline"))
    if not parts:
        pp, micro = int(extras["pp_size"]), int(extras["microbatches"])
        measured = ""
        if _timelines(extras):
            measured = (f" The measured timelines are in results/pipeline_parallel.json, but "
                        f"they were taken under a load average of {load:.1f} on {cores} cores, "
                        "so their times would show the other processes: not drawn.")
        for schedule in ("gpipe", "1f1b"):
            per_rank = simulated_schedule(schedule, pp, micro)
            end = max(a[4] for actions in per_rank for a in actions)
            busy = sum(a[4] - a[3] for actions in per_rank for a in actions)
            svg = _timeline_svg(f"Pipeline schedule {schedule}, {pp} ranks", per_rank, "time units")
            parts.append(_figure(svg, (
                f"<strong>{schedule}</strong> on {pp} ranks with {micro} micro-batches (the "
                "measured run's shape), computed from the schedule, not timed: forward = 1 "
                "time unit, backward = 2, each rank running its actions in the schedule's "
                f"order. Grey is the bubble: {1 - busy / (end * pp):.0%} of the ranks' time "
                f"here.{measured if schedule == '1f1b' else ''}"
            ), "pipeline"))
    return "\n".join(parts)


def _units_of_tiny() -> list[tuple[str, int]]:
    """(unit, parameter bytes) as FSDP wraps the cookbook's model: one unit per block, the rest in
    the root (embeddings, final norm, output)."""
    from recipes.core.workload import build_model

    model = build_model("tiny", seed=0)
    units = [
        (f"layers.{name}", sum(p.numel() * p.element_size() for p in block.parameters()))
        for name, block in model.layers.items()
    ]
    in_blocks = sum(b for _, b in units)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return [("root", total - in_blocks)] + units


def chart_fsdp_units(world_size: int = 2) -> str:
    units = _units_of_tiny()
    blocks = [u for u in units if u[0] != "root"]
    phases = (
        ["forward root"]
        + [f"forward {n}" for n, _ in blocks]
        + [f"backward {n}" for n, _ in reversed(blocks)]
        + ["backward root"]
    )
    left, cell_w, row_h = 110, (CHART_WIDTH - 110 - 10) / len(phases), 24
    body, y = [], 4
    for i, phase in enumerate(phases):
        kind, _, name = phase.partition(" ")
        body.append(_text(left + (i + 0.5) * cell_w, y + 12, kind, anchor="middle", size=10))
        body.append(_text(left + (i + 0.5) * cell_w, y + 24, name, anchor="middle", size=10))
    y += 32
    held = []
    for unit, nbytes in units:
        body.append(_text(left - 8, y + 16, unit, anchor="end", size=11))
        for i, phase in enumerate(phases):
            _, _, name = phase.partition(" ")
            # The root stays gathered from its forward to its backward (fully_shard does not
            # reshard the root after forward: it is needed again at once); a block is gathered for
            # its own forward and again for its own backward, then freed to its shard.
            gathered = name == unit or (unit == "root")
            cls = "c0" if gathered else "shard"
            state = "gathered (full)" if gathered else f"sharded (1/{world_size})"
            body.append(
                _rect(
                    left + i * cell_w + 1,
                    y,
                    cell_w - 2,
                    row_h - 4,
                    cls,
                    f"{unit} during {phase}: {state}",
                )
            )
        y += row_h
    for i, phase in enumerate(phases):
        _, _, name = phase.partition(" ")
        nbytes = sum(b if (n == name or n == "root") else b / world_size for n, b in units)
        held.append(nbytes)
        body.append(
            _text(left + (i + 0.5) * cell_w, y + 14, _kib(nbytes), anchor="middle", size=10)
        )
    body.append(_text(left - 8, y + 14, "params held", anchor="end", size=11))
    svg = _svg(CHART_WIDTH, y + 22, body, "What FSDP gathers and frees per unit")
    full = sum(b for _, b in units)
    caption = (
        f"One training step of the cookbook's tiny model under FSDP on {world_size} ranks, "
        f"one unit per block plus the root: a unit's parameters are all-gathered (orange) "
        f"just before its forward and again before its backward, and freed back to this "
        f"rank's 1/{world_size} shard (grey) right after; gradients are reduce-scattered "
        f"as each backward ends. The bottom row is the parameter bytes a rank holds: at "
        f"most {_kib(max(held))} instead of {_kib(full)} for the whole model. Sizes from "
        f'the model\'s own parameters (<code>build_model("tiny")</code>).'
    )
    return _figure(svg, caption, "fsdp-units")


def chart_tp_split(tp: int = 2) -> str:
    from recipes.core.workload import MODEL_PRESETS

    cfg = MODEL_PRESETS["tiny"]
    dim, hidden = cfg.dim, cfg.mlp_ratio * cfg.dim
    body = []
    s = 1.3  # px per feature
    y0 = 30

    def matrix(x: float, y: float, rows: int, cols: int, split: str, label: str) -> float:
        w, h = cols * s, rows * s
        for r in range(tp):
            if split == "col":
                rect = (x + r * w / tp, y, w / tp, h)
            elif split == "row":
                rect = (x, y + r * h / tp, w, h / tp)
            else:
                rect = (x, y, w, h)
            body.append(
                _rect(
                    *rect,
                    f"c{r}" if split != "none" else "shard",
                    f"{label}: rank {r}'s part" if split != "none" else label,
                )
            )
            if split == "none":
                break
        body.append(_text(x + w / 2, y - 8, label, anchor="middle", size=11))
        return x + w

    x = 10
    x = matrix(x, y0, 16, dim, "none", f"x [tokens, {dim}]") + 14
    body.append(_text(x, y0 + 20, "@", size=14))
    x = matrix(x + 16, y0, dim, hidden, "col", f"w_in [{dim}, {hidden}] columns") + 14
    body.append(_text(x, y0 + 20, "=", size=14))
    x = matrix(x + 16, y0, 16, hidden, "col", f"h [tokens, {hidden // tp}] per rank") + 10
    body.append(_text(x, y0 + 20, "GELU, @", size=12))
    x = matrix(x + 52, y0, hidden, dim, "row", f"w_out [{hidden}, {dim}] rows") + 14
    body.append(_text(x, y0 + 20, "=", size=14))
    matrix(x + 16, y0, 16, dim, "none", "sum of partials")
    body.append(_text(x + 16, y0 + 16 * s + 16, "all-reduce", size=11))
    legend_y = y0 + hidden * s + 16
    for r in range(tp):
        body += [
            _rect(10 + r * 110, legend_y, 12, 12, f"c{r}"),
            _text(28 + r * 110, legend_y + 10, f"rank {r}", size=11),
        ]
    svg = _svg(CHART_WIDTH, legend_y + 20, body, "Tensor parallel: column then row split")
    caption = (
        f"The MLP of one block with tensor parallelism over {tp} ranks, to scale for the "
        f"cookbook's tiny model (dim {dim}, hidden {hidden}): <code>ColwiseParallel</code> "
        f"gives each rank a block of w_in's output columns, so each computes its own slice of "
        f"h with no communication and applies GELU to it; <code>RowwiseParallel</code> gives "
        f"each rank the matching rows of w_out, so each produces a partial sum of the full "
        f"output, and one all-reduce adds them. Attention splits the same way: wq, wk, wv by "
        f"columns (whole heads per rank), wo by rows."
    )
    return _figure(svg, caption, "tp-split")


def render_source(spec: str, **_: Any) -> str:
    """``<!-- source: path.py::function -->``: a function's code from the tested source at build
    time (its docstring left out: the code is the point), for a function without snippet markers."""
    return "```python\n" + "\n".join(_function_source(spec)) + "\n```\n"


def _function_source(spec: str) -> list[str]:
    import ast
    import textwrap

    path, _, name = spec.partition("::")
    file = REPO_ROOT / path
    if not file.is_file() or not name:
        raise MarkerError(f"source: no file {path!r} or no function named in {spec!r}")
    source = file.read_text()
    tree = ast.parse(source)
    node = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == name), None)
    if node is None:
        raise MarkerError(f"source: {path} has no function {name!r}")
    lines = source.splitlines()
    skip: set[int] = set()
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
        skip = set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    body = [lines[i - 1] for i in range(start, (node.end_lineno or node.lineno) + 1)
            if i not in skip]
    return textwrap.dedent("\n".join(body)).splitlines()


# "Proven by `test_x`": each test a page names (in code font, outside code blocks) links to a
# section at the end of the page that shows the test's assertions, included from tests/ at build
# time.
TEST_NAME = re.compile(r"`(test_[a-z0-9_]+)`")


@functools.lru_cache(maxsize=1)
def _test_index() -> dict[str, tuple[str, list[str]]]:
    """{test function name: (file, its assertion statements as source)} over tests/test_*.py."""
    import ast
    import textwrap

    index: dict[str, tuple[str, list[str]]] = {}
    for path in sorted((REPO_ROOT / "tests").glob("test_*.py")):
        source = path.read_text()
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            checks = []
            for inner in ast.walk(node):
                is_check = isinstance(inner, ast.Assert) or (
                    isinstance(inner, ast.Expr) and isinstance(inner.value, ast.Call)
                    and "assert" in ast.unparse(inner.value.func).lower())
                if is_check:
                    checks.append((inner.lineno,
                                   textwrap.dedent(ast.get_source_segment(source, inner,
                                                                          padded=True) or "")))
            checks.sort()
            index.setdefault(node.name, (str(path.relative_to(REPO_ROOT)),
                                         [text for _, text in checks]))
    return index


def _append_proofs(markdown: str) -> str:
    lines, fence, names = markdown.split("\n"), None, []
    for i, line in enumerate(lines):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
            continue
        if fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            continue
        if line.startswith("#"):
            continue
        found = [n for n in TEST_NAME.findall(line) if n in _test_index()]
        if found:
            names += [n for n in found if n not in names]
            lines[i] = TEST_NAME.sub(lambda m: f"[`{m.group(1)}`](#{m.group(1)})"
                                     if m.group(1) in _test_index() else m.group(0), line)
    if not names:
        return markdown
    out = ["", "## Proven by", "",
           "Each test this page names, with its assertions, included from the test file at "
           "build time: open one to read them.", "", '<div class="proofs" markdown>', ""]
    for name in names:
        path, checks = _test_index()[name]
        # a collapsed block with the test's name as its id: the page's links land on it
        out += [f'<details class="note" id="{name}" markdown>',
                f'<summary><code>{name}</code> in <code>{path}</code></summary>', ""]
        shown = checks[:6]
        if shown:
            out += ["```python", *"\n".join(shown).splitlines(), "```"]
            if len(checks) > len(shown):
                out.append(f"\n... and {len(checks) - len(shown)} more assertions.")
        else:
            out.append("(its assertions are in the helpers it calls)")
        out += ["", "</details>", ""]
    out += ["</div>", ""]
    return "\n".join(lines + out)


RENDERERS: dict[str, Callable[..., str]] = {
    "source": render_source,
    "chart": render_chart,
    "bench": render_bench,
    "options": render_options,
    "results": render_results,
    "api": render_api,
    "recipe-index": render_recipe_index,
}
