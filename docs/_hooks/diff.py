"""What one recipe adds to another, as a diff: ``<!-- diff: OLD,NEW -->`` where each side is
``path.py:section``, the section a ``# --8<-- [start:section]`` marker opens in the tested source
(the same sections the pages include), read as ``git diff -w`` does: a line whose indentation
alone changed is not a change. An optional third part, ``context=N``, keeps N unchanged lines
around each change; without it the whole function shows, every line marked."""

from __future__ import annotations

import difflib
import textwrap
from typing import Any

from .base import REPO_ROOT, MarkerError


def render_diff(spec: str, **_: Any) -> str:
    parts = spec.split(",")
    if len(parts) not in (2, 3) or (len(parts) == 3 and not parts[2].startswith("context=")):
        raise MarkerError(f"diff: expected OLD.py:section,NEW.py:section[,context=N], got {spec!r}")
    old, new = (snippet_section(part) for part in parts[:2])
    context = int(parts[2].removeprefix("context=")) if len(parts) == 3 else None
    lines = diff_lines(old, new, context)
    if not any(line[:1] in "+-" for line in lines):
        raise MarkerError(f"diff: {parts[0]} and {parts[1]} are the same")
    return "```diff\n" + "\n".join([f"--- {parts[0]}", f"+++ {parts[1]}", *lines]) + "\n```\n"


def diff_lines(old: list[str], new: list[str], context: int | None) -> list[str]:
    """``git diff -w``'s view: lines that differ only in indentation (a body moved into a
    ``try:``) are unchanged, shown as the new file has them; ``context``: unchanged lines kept
    around each change (None: all of them), a gap marked ``...``."""
    matcher = difflib.SequenceMatcher(
        a=[line.strip() for line in old], b=[line.strip() for line in new], autojunk=False
    )
    marked: list[tuple[str, str]] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            marked += [(" ", line) for line in new[j1:j2]]
            continue
        marked += [("-", line) for line in old[i1:i2]]
        marked += [("+", line) for line in new[j1:j2]]
    if context is None:
        return [f"{sign}{line}" for sign, line in marked]
    changed = [i for i, (sign, _) in enumerate(marked) if sign != " "]
    keep = {i for c in changed for i in range(c - context, c + context + 1)}
    out, skipped = [], False
    for i, (sign, line) in enumerate(marked):
        if i in keep:
            out.append(f"{sign}{line}")
            skipped = False
        elif not skipped:
            out.append(" ...")
            skipped = True
    return out


def snippet_section(spec: str) -> list[str]:
    """The lines of section ``name`` of ``path`` (``path:name``), dedented as pymdownx.snippets
    does (dedent_subsections), marker lines left out."""
    path, _, name = spec.partition(":")
    file = REPO_ROOT / path
    if not file.is_file() or not name:
        raise MarkerError(f"diff: no file {path!r} or no section named in {spec!r}")
    lines = file.read_text().splitlines()
    start, end = f"--8<-- [start:{name}]", f"--8<-- [end:{name}]"
    try:
        first = next(i for i, line in enumerate(lines) if line.strip().endswith(start))
        last = next(i for i, line in enumerate(lines) if line.strip().endswith(end))
    except StopIteration:
        raise MarkerError(f"diff: {path} has no section {name!r} ({start} ... {end})") from None
    body = [line for line in lines[first + 1 : last] if "--8<--" not in line]
    return textwrap.dedent("\n".join(body)).splitlines()
