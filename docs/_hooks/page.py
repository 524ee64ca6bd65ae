"""What happens to every page's own Markdown, marker or not: a recipe page opens with its run
command, a "## Pitfalls" list folds into one line per pitfall, ``[name][]`` links a recipe's page,
and the first mention of a torch API the recipes teach links to its documentation."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from .base import REPO_ROOT, log
from .source import TEST_NAME

RECIPE_LINK = re.compile(r"\[([a-z][a-z0-9_]*)\]\[\]")


# Pitfalls fold: each `- **Title.** detail` item of a "## Pitfalls" section becomes a collapsed
# block (pymdownx.details) whose one-line summary is the title and numbered links to the tests that
# prove it, so that the section reads as a short list; the detail opens on a click.
PITFALL = re.compile(r"^- \*\*(.+?)\*\*\s*(.*)$")


def fold_pitfalls(markdown: str) -> str:
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
        while i < len(lines) and (
            lines[i].startswith("  ")
            or (not lines[i].strip() and i + 1 < len(lines) and lines[i + 1].startswith("  "))
        ):
            body.append(lines[i][2:])
            i += 1
        tests = list(dict.fromkeys(TEST_NAME.findall("\n".join(body))))
        title = match.group(1).replace('"', "&quot;")
        # numbered links, each titled with its test's name: the summary stays one short line
        proof = (
            (
                " (proven by "
                + " ".join(f'[{k}](#{t}){{ title="{t}" }}' for k, t in enumerate(tests, 1))
                + ")"
            )
            if tests
            else ""
        )
        out += [
            "",
            f'??? warning "{title}{proof}"',
            "",
            *[("    " + b) if b.strip() else "" for b in body],
            "",
        ]
    return "\n".join(out)


def run_command_on_top(markdown: str, page: Any) -> str:
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


def link_api(line: str, linked: set[str]) -> str:
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
    return "".join(
        part if part.startswith("[") and "](" in part else INLINE_CODE.sub(link, part)
        for part in parts
    )


def link_recipes(line: str, page: Any, config: Any) -> str:
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
