"""Gathering what the ranks hold, each in one place: a model's full state (sharded:
``full_state_on_rank0``; unsharded: ``full_state_on_cpu``), and one value from every rank
(``all_ranks``)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = [
    "full_state_on_rank0",
    "full_state_on_cpu",
    "all_ranks",
]


# --8<-- [start:full_state]
def full_state_on_rank0(model: nn.Module) -> tuple[dict[str, torch.Tensor], float]:
    """The unsharded ``state_dict`` on rank 0's CPU (other ranks get {}), and its checksum on every
    rank.

    Works for a plain module, DDP, classic FSDP and fully_shard alike: ``get_model_state_dict``
    gives clean names (no ``module.`` or ``_fsdp_wrapped_module.`` prefixes). Every rank must call
    it: it all-gathers each parameter.

    Pitfall 1: without ``cpu_offload`` every rank briefly holds the whole model on its GPU. With it,
    the full state is built up in rank 0's host memory only (rank0_only).
    Pitfall 2: when classic FSDP's flat parameters already live in host memory (a CPU world, or
    CPUOffload), ``cpu_offload`` frees the very storage it then copies and the process crashes
    (pytorch/pytorch#188989): gather without offloading there; it is on the host anyway.
    (fully_shard needs the opposite on a CPU world: without ``cpu_offload`` its gather aborts the
    process.)
    """
    # Imported here, not at the top: DCP takes ~0.6 s to import, which every DDP recipe would pay.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel

    classic_fsdp_on_host = next(model.parameters()).device.type == "cpu" and any(
        isinstance(module, FullyShardedDataParallel) for module in model.modules()
    )
    options = StateDictOptions(full_state_dict=True, cpu_offload=not classic_fsdp_on_host)
    # fully_shard over tensor-parallel shards reaches rank 0 in two all-gathers per tensor, which
    # torch logs as suboptimal on every rank: true, and irrelevant for a one-off gather at the end.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        state = get_model_state_dict(model, options=options)
    finally:
        redistribute_log.setLevel(level)
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = {name: t.detach().cpu() for name, t in state.items()} if rank == 0 else {}
    checksum = [float(sum(t.double().sum().item() for t in state.values()))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(checksum, src=0)
    return state, checksum[0]


# --8<-- [end:full_state]


def full_state_on_cpu(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of an unsharded module's parameters (DDP's ``.module`` prefix
    removed)."""
    module = getattr(module, "module", module)
    return {name: p.detach().cpu().clone() for name, p in module.named_parameters()}


def all_ranks(value: Any) -> list[Any]:
    """Every rank's value, in rank order: how rank 0's result reports what each rank measured."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
