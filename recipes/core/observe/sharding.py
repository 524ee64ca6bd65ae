"""Observers of the recipes that shard the model state over the data-parallel ranks: fsdp2,
fsdp (classic FullyShardedDataParallel), sharded_accumulation, and zero's optimizer partition."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from recipes.core.counting import CollectiveCounter
from recipes.core.memory import measure_last_forward, model_state_bytes
from recipes.core.observe.base import Observer
from recipes.core.state import all_ranks, full_state_on_rank0

__all__ = ["AccumulationObserver", "ClassicFSDPObserver", "ShardedObserver", "zero_extras"]


def zero_extras(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """ZeRO-1's split: the parameter elements whose optimizer state each rank keeps (a
    ZeroRedundancyOptimizer holds its partition's AdamW in ``.optim``; plain AdamW holds all)."""
    local = getattr(optimizer, "optim", optimizer)
    owned = sum(p.numel() for group in local.param_groups for p in group["params"])
    return {"optimizer_numel_per_rank": all_ranks(owned)}


class ShardedObserver(Observer):
    """fsdp2's measurements beyond the common ones, from outside like those (into ``extras``):

    - ``param_bytes_after_forward``: the parameter bytes a rank holds just after the run's last
      forward, from hooks on the model (``recipes.core.memory.measure_last_forward``);
    - ``skipped_steps_per_rank`` where ``cfg.precision`` is fp16: the steps at which a rank's
      optimizer did not advance its step count, i.e. its loss scaler skipped the update.
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.count_skips = cfg.precision == "fp16"
        self.skipped_steps: list[int] = []
        self._steps_taken = 0
        self._handles: list[Any] = []

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        self._handles = measure_last_forward(model, steps=self.steps, extras=self.extras)

    def measure(self, step: int) -> None:
        if self.count_skips:
            taken = max(
                (int(state["step"]) for state in self._optimizer.state.values() if "step" in state),
                default=0,
            )
            if taken == self._steps_taken:  # no update: the scaler found an inf or a nan
                self.skipped_steps.append(step)
            self._steps_taken = taken
        if step == self.steps - 1 and self.count_skips:  # a collective: every rank's list
            self.extras["skipped_steps_per_rank"] = all_ranks(self.skipped_steps)
        super().measure(step)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        super().close()


class AccumulationObserver(Observer):
    """recipes/sharded_accumulation.py: what each step sends and what a rank holds between its
    micro-batches, measured from outside (into ``extras``):

    - ``collectives_per_step``: each step's c10d collectives, counted by a ``CollectiveCounter``
      (recipes/core/counting.py) entered at ``model_ready`` and taken at each ``step_end``: from
      the end of the step before to the end of this one, so the step's loss line's all-reduce is
      counted too; what the observer measures itself is not;
    - ``grad_bytes_between_micro_batches``: the most gradient bytes a rank held before a
      micro-batch's forward other than a step's first, i.e. after the earlier ones' backward
      (from a forward pre-hook on the model, before fully_shard's own, which unshards the root);
    - ``fsdp_groups`` (fully_shard modules), ``grad_bytes_unsharded`` (the whole model's
      gradient, fp32) and ``mesh`` (the data-parallel mesh's shape).
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.micro_batches = cfg.micro_batches
        self.per_step: list[dict[str, dict[str, int]]] = []
        self.held: list[int] = []
        self._forwards = 0
        self._counter: Any = None
        self._pre_hook: Any = None

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        params = list(model.parameters())
        mesh = next(p.device_mesh for p in params if isinstance(p, DTensor))
        self.extras.update(
            fsdp_groups=sum(1 for m in model.modules() if isinstance(m, FSDPModule)),
            grad_bytes_unsharded=sum(p.numel() * p.element_size() for p in params),
            mesh=list(mesh.shape),
        )
        self._pre_hook = model.register_forward_pre_hook(self._record_held, prepend=True)
        self._start_counting()

    def _record_held(self, module: nn.Module, args: Any) -> None:
        if self._forwards % self.micro_batches:  # not a step's first micro-batch
            self.held.append(model_state_bytes(module)["grad_bytes"])
        self._forwards += 1

    def _start_counting(self) -> None:
        self._counter = CollectiveCounter()
        self._counter.__enter__()

    def _stop_counting(self) -> dict[str, dict[str, int]] | None:
        if self._counter is None:
            return None
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        return counter.summary()

    def step_end(self, step: int, loss: float) -> None:
        self.per_step.append(self._stop_counting())
        super().step_end(step, loss)  # measures, outside the count
        if step < self.steps - 1:
            self._start_counting()

    def measure(self, step: int) -> None:
        if step == self.steps - 1:
            self.extras.update(
                collectives_per_step=list(self.per_step),
                grad_bytes_between_micro_batches=max(self.held, default=0),
            )
        super().measure(step)

    def close(self) -> None:
        self._stop_counting()
        if self._pre_hook is not None:
            self._pre_hook.remove()
            self._pre_hook = None
        super().close()


class ClassicFSDPObserver(ShardedObserver):
    """recipes/fsdp.py (classic ``FullyShardedDataParallel``): ``ShardedObserver``'s figures, with
    one difference the wrapper makes. Its parameters are not DTensors (``use_orig_params`` views
    into flat shards): the checksum and the final state come from the full state gathered whole to
    rank 0 (every rank, a collective)."""

    def gather_final_state(self) -> None:
        state, self.param_checksum = full_state_on_rank0(self._model)
        if self.keep_final_state and self.rank == 0:
            self.final_state = state
