"""Code and proofs from the tested source: ``<!-- source: path.py::function -->`` shows a
function's code, and each test a page names in code font (`test_x`) links to a "Proven by" section
at the end of the page with that test's assertions, read from tests/ at build time."""

from __future__ import annotations

import ast
import functools
import io
import re
import textwrap
from typing import Any

from .base import FENCE, REPO_ROOT, MarkerError


def render_source(spec: str, **_: Any) -> str:
    """``<!-- source: path.py::function -->``: a function's code from the tested source at build
    time (its docstring left out: the code is the point), for a function without snippet markers."""
    return "```python\n" + "\n".join(_function_source(spec)) + "\n```\n"


def _function_source(spec: str) -> list[str]:
    path, _, name = spec.partition("::")
    file = REPO_ROOT / path
    if not file.is_file() or not name:
        raise MarkerError(f"source: no file {path!r} or no function named in {spec!r}")
    source = file.read_text()
    tree = ast.parse(source)
    node = next(
        (
            n
            for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
        ),
        None,
    )
    if node is None:
        raise MarkerError(f"source: {path} has no function {name!r}")
    lines = source.splitlines()
    skip: set[int] = set()
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
        skip = set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    body = [
        lines[i - 1] for i in range(start, (node.end_lineno or node.lineno) + 1) if i not in skip
    ]
    return textwrap.dedent("\n".join(body)).splitlines()


# "Proven by `test_x`": each test a page names (in code font, outside code blocks) links to a
# section at the end of the page that shows the test's assertions, included from tests/ at build
# time.
TEST_NAME = re.compile(r"`(test_[a-z0-9_]+)`")


@functools.lru_cache(maxsize=1)
def _test_index() -> dict[str, tuple[str, list[str]]]:
    """{test function name: (file, its assertion statements as source)} over tests/test_*.py."""
    index: dict[str, tuple[str, list[str]]] = {}
    for path in sorted((REPO_ROOT / "tests").glob("test_*.py")):
        source = path.read_text()
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = io.StringIO(source, newline="").readlines()  # split as ast splits: \n, \r\n, \r
        for node in ast.walk(tree):
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            checks = []
            for inner in ast.walk(node):
                is_check = isinstance(inner, ast.Assert) or (
                    isinstance(inner, ast.Expr)
                    and isinstance(inner.value, ast.Call)
                    and "assert" in ast.unparse(inner.value.func).lower()
                )
                if is_check:
                    checks.append((inner.lineno, textwrap.dedent(_segment(lines, inner))))
            checks.sort()
            index.setdefault(
                node.name, (str(path.relative_to(REPO_ROOT)), [text for _, text in checks])
            )
    return index


def _segment(lines: list[str], node: ast.AST) -> str:
    """``ast.get_source_segment(source, node, padded=True)`` from the file's lines, split once:
    the library splits the whole file again for each node, which made this index most of the docs
    build's time (about 1,200 assertions in 50 test files)."""
    first, last = node.lineno - 1, node.end_lineno - 1
    start, end = node.col_offset, node.end_col_offset  # UTF-8 byte offsets
    if first == last:
        return lines[first].encode()[start:end].decode()
    head = lines[first].encode()
    # padded: what stands before the node on its first line becomes spaces (tabs kept)
    padding = "".join(c if c in "\f\t" else " " for c in head[:start].decode())
    return "".join(
        [
            padding + head[start:].decode(),
            *lines[first + 1 : last],
            lines[last].encode()[:end].decode(),
        ]
    )


def append_proofs(markdown: str) -> str:
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
            lines[i] = TEST_NAME.sub(
                lambda m: (
                    f"[`{m.group(1)}`](#{m.group(1)})"
                    if m.group(1) in _test_index()
                    else m.group(0)
                ),
                line,
            )
    if not names:
        return markdown
    out = [
        "",
        "## Proven by",
        "",
        "Each test this page names, with its assertions, included from the test file at "
        "build time: open one to read them.",
        "",
        '<div class="proofs" markdown>',
        "",
    ]
    for name in names:
        path, checks = _test_index()[name]
        # a collapsed block with the test's name as its id: the page's links land on it
        out += [
            f'<details class="note" id="{name}" markdown>',
            f"<summary><code>{name}</code> in <code>{path}</code></summary>",
            "",
        ]
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
