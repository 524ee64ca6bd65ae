"""Measure a copyable recipe from outside: an observer it calls, and ``prove`` that fills a
``RecipeResult`` from it.

A copyable recipe (recipes/ddp_torchrun.py) imports nothing from here. Its function takes an
``observer`` and calls it at two named points, one line each:

- ``observer.model_ready(model, optimizer)``: the model is wrapped and the optimizer built;
- ``observer.step_end(step, loss)``: an optimizer step ended; ``loss`` is the global batch's loss.

From these, and from a forward hook it registers itself, ``Observer`` measures the time of each
step (synchronising CUDA, so queued kernels count in their own step), the model-state bytes every
rank holds after the first step (``model_state_bytes``: parameters, gradients, optimizer state),
the precision the forward ran in, and at the last step, while the recipe's process group still
exists, the parameters' checksum, the recipe's own ``EXTRAS`` (below) and (if asked) the full
state on CPU. ``prove`` runs the recipe's function with one and returns the same ``RecipeResult``
as the harness-built recipes: losses, checksum, seconds per step, peak memory, tokens/s and MFU
(``Workload``), ``memory_per_rank``.

A recipe that trains without a process group (amp, data_parallel: one process) is measured as a
world of 1 with backend ``none``. A recipe whose idea needs more than its losses returns a small
dataclass with a ``losses`` field (amp: the loss scale of each step, the skipped steps): its other
fields go into ``extras`` as they are. A test that injects a fault passes its own ``Observer``
subclass to ``prove`` (``observer=``): the recipe has no option for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from recipes.core.memory import model_state_bytes
from recipes.core.result import RecipeResult, param_checksum, peak_memory_bytes
from recipes.core.state import all_ranks, full_state_on_cpu
from recipes.core.throughput import Workload
from recipes.core.workload import MODEL_PRESETS
from recipes.core.world import _keep_groups_past_teardown

__all__ = ["EXTRAS", "Observer", "prove"]

_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _zero_extras(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """ZeRO-1's split: the parameter elements whose optimizer state each rank keeps (a
    ZeroRedundancyOptimizer holds its partition's AdamW in ``.optim``; plain AdamW holds all)."""
    local = getattr(optimizer, "optim", optimizer)
    owned = sum(p.numel() for group in local.param_groups for p in group["params"])
    return {"optimizer_numel_per_rank": all_ranks(owned)}


def _data_parallel_extras(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """How many GPUs nn.DataParallel splits each batch over (0: none, a pass-through on CPU)."""
    return {"gpus": len(getattr(model, "device_ids", None) or [])}


# What a recipe reports beyond the common figures, read from its model and optimizer at the last
# step (while its process group exists; a collective where it gathers from every rank).
EXTRAS: dict[str, Callable[[nn.Module, torch.optim.Optimizer], dict[str, Any]]] = {
    "zero": _zero_extras,
    "data_parallel": _data_parallel_extras,
}


class Observer:
    """What a recipe's ``model_ready`` / ``step_end`` calls tell the harness (see the module)."""

    def __init__(self, steps: int, *, keep_final_state: bool = False):
        self.steps = steps
        self.keep_final_state = keep_final_state
        self.extras_fn: Callable[[nn.Module, torch.optim.Optimizer], dict[str, Any]] | None = None
        self.extras: dict[str, Any] = {}  # what extras_fn (the recipe's EXTRAS) returned
        self.durations: list[float] = []
        self.memory_per_rank: list[dict[str, int]] | None = None
        self.param_checksum: float | None = None
        self.final_state: dict[str, torch.Tensor] | None = None
        self.output_dtype: torch.dtype | None = None
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
        else:  # one process, no group (amp, data_parallel)
            self.rank, self.world_size, self.backend = 0, 1, "none"
        self._hook = model.register_forward_hook(self._record_dtype)
        self._restart_clock()

    def step_end(self, step: int, loss: float) -> None:
        self._sync()
        self.durations.append(time.perf_counter() - self._last)
        if step == 0:  # after optimizer.step(), before the next zero_grad: gradients present
            # the baseline of the sharding recipes' "1/N": every rank holds all of it
            self.memory_per_rank = all_ranks(model_state_bytes(self._model, self._optimizer))
        if step == self.steps - 1:  # the last step: the recipe's group still exists
            self.param_checksum = param_checksum(self._model.parameters())
            if self.extras_fn is not None:
                self.extras = self.extras_fn(self._model, self._optimizer)
            if self.keep_final_state:
                self.final_state = full_state_on_cpu(self._model)  # DDP's .module unwrapped
            self._hook.remove()
            self._model = self._optimizer = None  # the recipe's teardown frees them
        self._restart_clock()  # the measuring above is not the next step's time

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


@contextlib.contextmanager
def _in_the_callers_world() -> Iterator[None]:
    """The recipe's own ``init_process_group`` / ``destroy_process_group``, adapted to the harness.

    Where the caller joined a world already (a test running several recipes in one world), both do
    nothing for this call: the recipe trains in the caller's world, which the caller destroys.
    Elsewhere the recipe joins and leaves as written, except that its groups are held past
    ``destroy_process_group`` until ``release_ended_groups``, as ``join_world`` holds its own: a
    gloo group freed by DDP's reducer (with the GIL held) can hang the process (see
    ``recipes.core.world._keep_groups_past_teardown``).
    """
    saved = dist.init_process_group, dist.destroy_process_group
    if dist.is_initialized():
        dist.init_process_group = lambda *args, **kwargs: None
        dist.destroy_process_group = lambda *args, **kwargs: None
    else:
        def destroy(*args: Any, **kwargs: Any) -> None:
            _keep_groups_past_teardown()
            saved[1](*args, **kwargs)

        dist.destroy_process_group = destroy
    try:
        yield
    finally:
        dist.init_process_group, dist.destroy_process_group = saved


def prove(train_fn: Callable[..., Any], cfg: Any, *, name: str,
          keep_final_state: bool = False, observer: Observer | None = None) -> RecipeResult:
    """``train_fn(cfg, observer=...)`` measured from outside; the result every rank returns.

    ``cfg`` needs ``steps``, ``model`` (a MODEL_PRESETS key) and ``global_batch_size``.
    ``keep_final_state``: the final parameters on CPU in ``final_state`` (tests compare them).
    ``observer``: a test's own (an ``Observer`` subclass that injects a fault); it is given the
    recipe's ``EXTRAS`` and ``keep_final_state`` here.
    """
    if observer is None:
        observer = Observer(cfg.steps)
    observer.keep_final_state = keep_final_state
    observer.extras_fn = EXTRAS.get(name)
    with _in_the_callers_world():
        returned = train_fn(cfg, observer=observer)
    extras: dict[str, Any] = {}
    if dataclasses.is_dataclass(returned):  # the losses and what the recipe's idea adds
        extras = {k: v for k, v in dataclasses.asdict(returned).items() if k != "losses"}
        losses = returned.losses
    else:
        losses = returned
    if observer.param_checksum is None:
        raise RuntimeError(f"{name}: the recipe never called observer.step_end for its last step "
                           f"({cfg.steps - 1}); it ran {len(observer.durations)} step(s)")
    extras = {"memory_per_rank": observer.memory_per_rank, **observer.extras, **extras}
    # the devices that computed: the ranks, or the GPUs one DataParallel process drives
    devices = (observer.extras.get("gpus") or observer.world_size
               if observer.device.type == "cuda" else 1)
    workload = Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, observer.precision)
    return RecipeResult(
        recipe=name,
        world_size=observer.world_size,
        backend=observer.backend,
        device=str(observer.device),
        losses=list(losses),
        param_checksum=observer.param_checksum,
        seconds_per_step=observer.seconds_per_step,
        peak_memory_bytes=peak_memory_bytes(observer.device),
        extras=extras,
        final_state=observer.final_state,
        **workload.measure(observer.seconds_per_step, observer.device, devices),
    )
