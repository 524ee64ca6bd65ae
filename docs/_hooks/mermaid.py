"""Mermaid diagrams: a collective drawn with arrows at both ends, and the vendored mermaid (2.7 MB)
loaded only by the pages that have a diagram."""

from __future__ import annotations

import re

# In a sequence diagram, a collective that every rank takes part in is drawn with arrows at both
# ends: a one-way arrow would say that one rank sends and the other only receives.
SYMMETRIC = re.compile(
    r"^(\s*\w+\s*)(-->>|->>)(\s*\w+\s*:.*\b(all-reduce|all-gather|"
    r"reduce-scatter|all-to-all|all_reduce|all_gather|reduce_scatter|"
    r"allreduce|barrier)\b.*)$",
    re.I,
)


def symmetric_collective(line: str) -> str:
    match = SYMMETRIC.match(line)
    if not match:
        return line
    arrow = "<<-->>" if match.group(2) == "-->>" else "<<->>"
    return match.group(1) + arrow + match.group(3)


# mkdocs-material draws every `<pre class="mermaid">` block with the global `mermaid`, which it
# fetches from unpkg.com when the page has not defined it: a page with a diagram must load the
# vendored copy (offline), a page without one need not load 2.7 MB. The script goes where
# extra_javascript would have put it, just before mermaid-fixes.js (which wraps its functions),
# with the same relative path.
MERMAID_SCRIPT = "assets/mermaid-11.17.2.min.js"
FIXES_TAG = re.compile(r'<script src="([^"]*)assets/mermaid-fixes\.js"></script>')


def with_mermaid_script(html: str) -> str:
    """The built page, with the vendored mermaid loaded if it has a diagram."""
    if '<pre class="mermaid">' not in html:
        return html
    fixes = FIXES_TAG.search(html)
    if fixes is None:
        raise ValueError(
            "a page with a mermaid diagram has no assets/mermaid-fixes.js script tag "
            "(mkdocs.yml extra_javascript) to load mermaid before"
        )
    tag = f'<script src="{fixes.group(1)}{MERMAID_SCRIPT}"></script>'
    return html[: fixes.start()] + tag + html[fixes.start() :]
