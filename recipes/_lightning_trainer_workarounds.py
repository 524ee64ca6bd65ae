"""What recipes/lightning_trainer.py needs that neither Lightning nor torch gives: each piece says
why. Copy it with the recipe; it imports torch and Lightning only.

Kept apart so that the recipe reads as the Lightning code a user writes; these are the workarounds
around it: FSDP on a CPU world, FSDP1's HYBRID_SHARD with one rank per node, the teardown of a gloo
group Lightning created, and the warnings that do not apply.
"""

from __future__ import annotations

import gc
import logging
import warnings

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy

__all__ = ["FSDPOnCPUStrategy", "LeaveWorld", "filter_known_warnings", "hybrid_shard_layout"]


class FSDPOnCPUStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy on a CPU (gloo) world: the same FSDP, two CUDA assumptions removed.

    1. Trainer refuses FSDPStrategy unless the accelerator is CUDA; its check compares the exact
       type, so a subclass passes.
    2. torch's FSDP refuses CPU modules unless ``device_id`` says "cpu", and Lightning passes
       ``root_device.index`` (None on CPU).

    On GPUs the recipe uses FSDPStrategy itself.
    """

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )
        _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)  # after
        return model


# --8<-- [start:hybrid]
def hybrid_shard_layout(sharding_strategy: str, accelerator: str, world_size: int, num_nodes: int):
    """FSDP1's sharding strategy and device mesh: HYBRID_SHARD gets an explicit (nodes, ranks) mesh.

    Pitfall (torch's FSDP1, seen on 2.13): HYBRID_SHARD shards over a node's ranks and all-reduces
    across nodes. With one rank per node the shard group has one rank, FSDP clamps the strategy to
    NO_SHARD over that group, and the cross-node all-reduce never runs: each rank trains on its own
    half of the batch, its gradient divided by the world size (tests/test_lightning_trainer.py
    keeps the reproduction). Without a mesh it is worse on CPU: FSDP counts ranks per node with
    ``torch.cpu.device_count()``, which is 1, so every rank is a "node". With one rank per node,
    HYBRID_SHARD means replication, which is NO_SHARD over the whole world: that is what runs.
    """
    if sharding_strategy != "HYBRID_SHARD" or not dist.is_initialized():
        return sharding_strategy, None  # ddp_spawn has no world yet; it never runs FSDP
    from torch.distributed.device_mesh import init_device_mesh

    per_node = world_size // num_nodes
    if per_node == 1:
        if dist.get_rank() == 0:
            print(
                "HYBRID_SHARD with one rank per node is replication: NO_SHARD over the world",
                flush=True,
            )
        return "NO_SHARD", None
    return sharding_strategy, init_device_mesh(
        accelerator, (num_nodes, per_node), mesh_dim_names=("replicate", "shard")
    )


# --8<-- [end:hybrid]


class LeaveWorld(L.Callback):
    """Destroy the process group Lightning created (ddp_spawn, LightningCLI) before exiting.

    Pitfall: Lightning registers a teardown for NCCL groups only; a process that exits with a gloo
    group alive aborts now and then ("terminate called without an active exception": 1 ddp_spawn
    run in 10 here). Hooks run after Strategy.teardown unwrapped DDP, so its reducer is gone before
    the group (the other way round, a DDP reducer freed after its group can deadlock at exit).
    """

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()


def filter_known_warnings() -> None:
    """Silence Lightning's warnings that do not apply here, each for a stated reason."""
    # The synthetic data is an in-memory tensor: worker processes would only add start-up time.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    # Lightning 2.6 builds a torch.utils._pytree.LeafSpec, which torch 2.13 deprecates: nothing
    # for a user to do.
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
    )
    # FSDP1's state dicts and checkpoints run through torch's own deprecated internals
    # (ShardedTensor, _get_pg_default_device, dcp.load_state_dict); torch warns itself, on every
    # rank, at every save.
    for message in (
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        r"`_get_pg_default_device` will be deprecated",
        r"Multiple backends are registered with this ProcessGroup",  # and it picks cpu: right here
        r"`load_state_dict` is deprecated and will be removed in future versions",
    ):
        warnings.filterwarnings("ignore", message=message)
    # Lightning's advertisements for its cloud products ("Tip: try installing litlogger") say
    # nothing about the run.
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in logger.filters):
            logger.addFilter(_DropTips())


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in str(record.msg)
