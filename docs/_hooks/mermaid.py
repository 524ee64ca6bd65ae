"""Mermaid diagrams: a collective drawn with arrows at both ends."""

from __future__ import annotations

import re


# In a sequence diagram, a collective that every rank takes part in is drawn with arrows at both
# ends: a one-way arrow would say that one rank sends and the other only receives.
SYMMETRIC = re.compile(r"^(\s*\w+\s*)(-->>|->>)(\s*\w+\s*:.*\b(all-reduce|all-gather|"
                       r"reduce-scatter|all-to-all|all_reduce|all_gather|reduce_scatter|"
                       r"allreduce|barrier)\b.*)$", re.I)


def symmetric_collective(line: str) -> str:
    match = SYMMETRIC.match(line)
    if not match:
        return line
    arrow = "<<-->>" if match.group(2) == "-->>" else "<<->>"
    return match.group(1) + arrow + match.group(3)

