"""Count the collectives a recipe runs, from outside: a dispatch mode the harness enters.

recipes/sharded_accumulation.py's proof: ``AccumulationObserver`` (recipes/core/observe/sharding.py)
runs each of its steps under a ``CollectiveCounter``, and tests/test_sharded_accumulation.py
asserts the counts and bytes exactly.
"""

from __future__ import annotations

import collections
from typing import ClassVar

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveCounter"]


class CollectiveCounter(TorchDispatchMode):
    """Counts the c10d collectives run under it: ``calls[(kind, group_size)]`` and ``bytes[...]``.

    Every eager collective (``dist.all_reduce``, fully_shard's reduce-scatters and all-gathers)
    reaches the dispatcher as a ``c10d`` op, so this sees exactly what is sent. The bytes are the
    full buffer each rank contributes: a reduce-scatter's input, an all-gather's output.
    """

    KINDS: ClassVar[dict[str, str]] = {
        "allreduce_": "all_reduce",
        "_reduce_scatter_base_": "reduce_scatter",
        "reduce_scatter_": "reduce_scatter",
        "_allgather_base_": "all_gather",
        "allgather_": "all_gather",
    }

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = self.KINDS.get(func._opname) if func.namespace == "c10d" else None
        if kind is not None:
            if isinstance(args[0], list):  # allreduce_, allgather_: lists of tensors
                tensors = args[0]
            else:  # the base ops: (output, input); count an all-gather's output, else the input
                tensors = [args[0 if kind == "all_gather" else 1]]
            tensors = [t for item in tensors for t in (item if isinstance(item, list) else [item])]
            groups = [a for a in args if type(a).__name__ == "ScriptObject"]
            unbox = getattr(dist.ProcessGroup, "unbox", None)  # the ScriptObject -> ProcessGroup
            size = unbox(groups[0]).size() if groups and unbox else None
            self.calls[(kind, size)] += 1
            self.bytes[(kind, size)] += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, dict[str, int]]:
        """{"reduce_scatter over 2": {"calls": 6, "bytes": ...}, ...}, JSON-ready."""
        return {
            f"{kind} over {size}": {
                "calls": self.calls[(kind, size)],
                "bytes": self.bytes[(kind, size)],
            }
            for kind, size in sorted(self.calls, key=str)
        }
