"""What the Lightning recipes need that neither Lightning nor torch gives: each piece says why.

Kept apart from ``recipes/lightning_trainer.py`` so that the recipe reads as the Lightning code a
user writes; these are the workarounds around it (a CPU FSDP strategy, teardown of a gloo group,
the full weights of a sharded model, warnings that do not apply), and the two callbacks that
measure a run for the cookbook's ``RecipeResult`` (``StepLog``, ``RecipeMetrics``).
"""

from __future__ import annotations

import gc
import logging
import warnings
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy

from recipes.core.log import get_logger
from recipes.core.result import StepTimer, peak_memory_bytes
from recipes.core.state import full_state_on_rank0

__all__ = [
    "FSDPOnCPUStrategy",
    "RecipeMetrics",
    "StepLog",
    "LeaveWorld",
    "filter_known_warnings",
    "full_state",
    "tensorboard_available",
]

log = get_logger(__name__)


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
        _setup_activation_checkpointing(
            model, self._activation_checkpointing_kwargs
        )  # after wrapping
        return model


class LeaveWorld(L.Callback):
    """Destroy the process group Lightning created (ddp_spawn, LightningCLI) before exiting.

    Pitfall: Lightning registers a teardown for NCCL groups only; a process that exits with a gloo
    group
    alive aborts now and then ("terminate called without an active exception": 1 ddp_spawn run in 10
    here).
    Hooks run after Strategy.teardown unwrapped DDP, so its reducer is gone before the group (see
    recipes/lightning_fabric.py for what happens the other way round).
    """

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()


def full_state(trainer: L.Trainer, module: L.LightningModule) -> dict[str, torch.Tensor]:
    """The unsharded weights on rank 0, whatever wraps them (DDP, FSDP units, DTensor TP shards).

    Pitfall: ``module.state_dict()`` of a sharded model returns this rank's shards (or DTensors),
    not the weights; ``full_state_on_rank0`` gathers them (a collective: every rank calls it).
    """
    if not dist.is_initialized():  # ddp_spawn: the main process got rank 0's weights back
        return {name: p.detach().cpu().clone() for name, p in module.model.state_dict().items()}
    # The cookbook's one way to gather a sharded model (DDP, FSDP, fully_shard, TP and 2-D alike):
    # rank 0 gets the state, the other ranks {}.
    state, _ = full_state_on_rank0(trainer.strategy.model)
    return {name.removeprefix("model."): t for name, t in state.items()}


def filter_known_warnings() -> None:
    """Silence Lightning's warnings that do not apply here, each for a stated reason."""
    # The synthetic data is an in-memory tensor: worker processes would only add start-up time.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    # Lightning 2.6 builds a torch.utils._pytree.LeafSpec, which torch 2.13 deprecates: nothing for
    # a user to do.
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
    )
    # FSDP1's state dicts and checkpoints run through torch's own deprecated internals
    # (ShardedTensor,
    # _get_pg_default_device, dcp.load_state_dict); torch warns itself, on every rank, at every
    # save.
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


def tensorboard_available() -> bool:
    import importlib.util

    return (
        importlib.util.find_spec("tensorboard") is not None
        or importlib.util.find_spec("tensorboardX") is not None
    )


class StepLog(L.Callback):
    """One line per optimizer step on rank 0 (step, loss, time), and the step times."""

    def __init__(self, timer: StepTimer, print_lines: bool):
        self.timer, self.print_lines = timer, print_lines

    # The StepTimer synchronises CUDA on entry and exit, as in the raw recipes: unsynchronised, a
    # step's time would be the time to queue its kernels (on an H200 at batch 64 it read 48.8 ms:
    # faster than the bare loop's measured 67 ms).
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.timer.__enter__()

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        self.timer.__exit__(None, None, None)
        if self.print_lines:
            loss = trainer.callback_metrics.get("train_loss", torch.tensor(float("nan")))
            log.info(
                "step %d loss %.4f time %.1f ms",
                trainer.global_step - 1,
                float(loss),
                self.timer.durations[-1] * 1e3,
            )


class RecipeMetrics(L.Callback):
    """At the end of fit, on every rank: the global loss of each optimizer step, for the result.

    Stored in ``trainer.callback_metrics``: with ddp_spawn that is what Lightning sends back to
    the main process (with rank 0's weights), so every strategy reads its result from one place.
    """

    def __init__(self, timer: StepTimer):
        self.timer = timer

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # pl_module keeps each micro-batch's loss in local_losses (the recipe's LMModule does)
        k = trainer.accumulate_grad_batches
        local = (
            torch.stack(pl_module.local_losses or [torch.zeros(0)]).view(-1, k).mean(dim=1)
        )  # per step
        losses = trainer.strategy.reduce(
            local, reduce_op="mean"
        )  # mean over ranks: the global batch's loss
        trainer.callback_metrics["recipe/losses"] = losses.detach().cpu()
        trainer.callback_metrics["recipe/seconds_per_step"] = torch.tensor(
            self.timer.seconds_per_step
        )
        trainer.callback_metrics["recipe/peak_memory_bytes"] = torch.tensor(
            peak_memory_bytes(pl_module.device)
        )
        # What this rank holds of the weights: all of them under DDP, its shards under FSDP / tensor
        # parallel.
        from torch.distributed.tensor import DTensor

        held = sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() for p in pl_module.parameters()
        )
        trainer.callback_metrics["recipe/param_elements_per_rank"] = torch.tensor(held)
