"""The observer a recipe calls at two named points, and what it measures for every recipe.

A copyable recipe imports nothing of the harness. Its function takes an ``observer`` and calls it
at two points, one line each:

- ``observer.model_ready(model, optimizer)``: the model is wrapped and the optimizer built;
- ``observer.step_end(step, loss)``: an optimizer step ended; ``loss`` is the global batch's loss.

From these, and from a forward hook it registers itself, ``Observer`` measures the time of each
step (synchronising CUDA, so queued kernels count in their own step), the model-state bytes every
rank holds after the first step (``model_state_bytes``: parameters, gradients, optimizer state),
the precision the forward ran in, and at the last step, while the recipe's process group still
exists, the parameters' checksum and (if asked) the full state on CPU (gathered whole to rank 0
where the parameters are sharded DTensors). A recipe that trains without a process group
(single_gpu, amp, data_parallel) is measured as a world of 1 with backend ``none``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from recipes.core.memory import model_state_bytes
from recipes.core.result import param_checksum
from recipes.core.state import all_ranks, full_state_on_cpu, full_state_on_rank0

__all__ = ["Observer"]

_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class Observer:
    """What a recipe's ``model_ready`` / ``step_end`` calls tell the harness (see the module)."""

    def __init__(self, steps: int, *, keep_final_state: bool = False):
        self.steps = steps
        self.keep_final_state = keep_final_state
        self.durations: list[float] = []
        self.memory_per_rank: list[dict[str, int]] | None = None
        self.param_checksum: float | None = None
        self.final_state: dict[str, torch.Tensor] | None = None
        self.output_dtype: torch.dtype | None = None
        self.precision_label: str | None = None  # the result's precision, if not the forward's
        self.extras: dict[str, Any] = {}
        # the recipe's EXTRAS function, if it has one (prove sets it); what it returns, like what
        # a subclass measures, is added to the result's extras
        self.extras_fn: Callable[[nn.Module, torch.optim.Optimizer], dict[str, Any]] | None = None
        self.rank, self.world_size, self.backend = 0, 1, "gloo"
        self.device = torch.device("cpu")
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._hook: Any = None
        self._last = 0.0

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._model, self._optimizer = model, optimizer
        self.device = next(model.parameters()).device
        if dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.backend = dist.get_backend()
        else:  # one process, no group (single_gpu, amp, data_parallel)
            self.rank, self.world_size, self.backend = 0, 1, "none"
        self._hook = model.register_forward_hook(self._record_dtype)
        self._restart_clock()

    def step_end(self, step: int, loss: float) -> None:
        self._sync()
        self.durations.append(time.perf_counter() - self._last)
        self.measure(step)
        self._restart_clock()  # the measuring is not the next step's time

    def measure(self, step: int) -> None:
        """What is read after ``step``, outside its time. A subclass measures first, then calls
        this: after the last step it lets the model go. Collectives are safe here: every rank
        ends every step."""
        if step == 0:  # after optimizer.step(), before the next zero_grad: gradients present
            # the baseline of the sharding recipes' "1/N": every rank holds all of it
            held = model_state_bytes(self._model, self._optimizer)
            self.memory_per_rank = all_ranks(held) if dist.is_initialized() else [held]
        if step == self.steps - 1:  # the last step: the recipe's group still exists
            self.gather_final_state()
            if self.extras_fn is not None:
                self.extras.update(self.extras_fn(self._model, self._optimizer))
            self.close()
            self._model = self._optimizer = None  # the recipe's teardown frees them

    def gather_final_state(self) -> None:
        """The parameters' checksum and (if asked) the full state, at the last step."""
        if any(isinstance(p, DTensor) for p in self._model.parameters()):
            # sharded: gathered whole to rank 0 (a collective), its checksum sent to all
            state, self.param_checksum = full_state_on_rank0(self._model)
            if self.keep_final_state and self.rank == 0:
                self.final_state = state
        else:
            self.param_checksum = param_checksum(self._model.parameters())
            if self.keep_final_state:
                self.final_state = full_state_on_cpu(self._model)  # DDP's .module unwrapped

    def close(self) -> None:
        """Take off what the observer put on (``prove`` calls it however the run ends)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @property
    def precision(self) -> str:
        """What the forward computed in: bf16/fp16 under autocast, else fp32 (tf32 where CUDA
        matmuls were allowed TF32)."""
        if self.output_dtype in _PRECISION:
            return _PRECISION[self.output_dtype]
        tf32 = self.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
        return "tf32" if tf32 else "fp32"

    @property
    def seconds_per_step(self) -> float:
        steady = self.durations[1:] or self.durations  # the first step includes warm-up
        return statistics.median(steady) if steady else 0.0

    def _record_dtype(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.output_dtype is None and isinstance(output, torch.Tensor):
            self.output_dtype = output.dtype

    def _restart_clock(self) -> None:
        self._sync()
        self._last = time.perf_counter()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
