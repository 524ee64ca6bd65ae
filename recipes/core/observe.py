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
exists, the parameters' checksum and (if asked) the full state on CPU. ``prove`` runs the recipe's
function with one and returns the same ``RecipeResult`` as the harness-built recipes: losses,
checksum, seconds per step, peak memory, tokens/s and MFU (``Workload``), ``memory_per_rank``.
Parameters that are DTensors (tensor parallel, fully_shard) are all-gathered for the checksum and
the final state: every rank calls ``step_end``, so every rank joins.

What one recipe adds to the result comes from an ``Observer`` subclass registered under its name
in ``OBSERVERS``: it measures from the same two calls (and hooks it registers at ``model_ready``)
and returns its figures from ``extras()``, which ``prove`` puts beside ``memory_per_rank``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from recipes.core.memory import model_state_bytes
from recipes.core.result import RecipeResult, param_checksum, peak_memory_bytes
from recipes.core.state import all_ranks
from recipes.core.throughput import Workload
from recipes.core.workload import MODEL_PRESETS, Block
from recipes.core.world import _keep_groups_past_teardown

__all__ = ["Observer", "TensorParallelObserver", "OBSERVERS", "prove"]

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
        else:  # a recipe without torch.distributed (single_gpu): one process
            self.rank, self.world_size, self.backend = 0, 1, "none"
        self._hook = model.register_forward_hook(self._record_dtype)
        self._restart_clock()

    def step_end(self, step: int, loss: float) -> None:
        self._sync()
        self.durations.append(time.perf_counter() - self._last)
        if step == 0:  # after optimizer.step(), before the next zero_grad: gradients present
            # the baseline of the sharding recipes' "1/N": every rank holds all of it
            held = model_state_bytes(self._model, self._optimizer)
            self.memory_per_rank = all_ranks(held) if dist.is_initialized() else [held]
        if step == self.steps - 1:  # the last step: the recipe's group still exists
            self.param_checksum = param_checksum(map(_whole, self._model.parameters()))
            if self.keep_final_state:
                model = getattr(self._model, "module", self._model)  # DDP's .module unwrapped
                # gathered where it lives, then copied: NCCL cannot gather a DTensor moved to CPU
                self.final_state = {name: _whole(p.detach()).cpu().clone()
                                    for name, p in model.named_parameters()}
            self._hook.remove()
            self._model = self._optimizer = None  # the recipe's teardown frees them
        self._restart_clock()  # the measuring above is not the next step's time

    def extras(self) -> dict[str, Any]:
        """The figures this recipe adds to ``RecipeResult.extras`` (a subclass's)."""
        return {}

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


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (an all-gather: every rank calls it), a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class TensorParallelObserver(Observer):
    """recipes/tensor_parallel.py: the split, measured on the model it trains.

    ``tp_size``: the ranks its parameters are split over; ``sequence_parallel``: the final norm
    runs on sequence shards (its input is a Shard(1) DTensor), and ``residual_seq_len_per_rank``
    is the sequence length of the residual stream the first block receives (1/N of it with
    sequence parallel); ``loss_parallel``: the logits come out as a DTensor split over the
    vocabulary; ``compiled``: the blocks run torch.compile'd code; ``param_bytes_per_rank``,
    ``param_bytes_unsplit`` (the whole model's), their fraction and ``optimizer_bytes_per_rank``:
    this rank's, after the first step.
    """

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        params = list(model.parameters())
        blocks = [m for m in model.modules() if isinstance(m, Block)]
        meshes = {p.device_mesh.size() for p in params if isinstance(p, DTensor)}
        self.figures: dict[str, Any] = {
            "tp_size": meshes.pop() if len(meshes) == 1 else None,
            "param_bytes_unsplit": sum(p.numel() * p.element_size() for p in params),  # global
            "compiled": all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in blocks),
        }
        # Registered after apply_tp's own hooks: these see the inputs as the split made them.
        self._tp_hooks = [blocks[0].register_forward_pre_hook(self._record_residual),
                          model.norm.register_forward_pre_hook(self._record_norm_input),
                          model.register_forward_hook(self._record_logits)]

    def step_end(self, step: int, loss: float) -> None:
        if step == 0:
            for hook in self._tp_hooks:  # the first forward showed all there is to see
                hook.remove()
        super().step_end(step, loss)

    def extras(self) -> dict[str, Any]:
        mine, unsplit = self.memory_per_rank[self.rank], self.figures["param_bytes_unsplit"]
        return {**self.figures, "param_bytes_per_rank": mine["param_bytes"],
                "param_fraction_per_rank": mine["param_bytes"] / unsplit,
                "optimizer_bytes_per_rank": mine["optimizer_bytes"]}

    def _record_residual(self, module: nn.Module, args: Any) -> None:
        residual = args[0].to_local() if isinstance(args[0], DTensor) else args[0]
        self.figures["residual_seq_len_per_rank"] = residual.shape[1]

    def _record_norm_input(self, module: nn.Module, args: Any) -> None:
        self.figures["sequence_parallel"] = (isinstance(args[0], DTensor)
                                             and args[0].placements == (Shard(1),))

    def _record_logits(self, module: nn.Module, args: Any, output: Any) -> None:
        self.figures["loss_parallel"] = isinstance(output, DTensor) and any(
            isinstance(p, Shard) and p.dim in (-1, output.ndim - 1) for p in output.placements)


# The recipes whose result carries figures of their own: name -> the Observer that measures them.
OBSERVERS: dict[str, type[Observer]] = {"tensor_parallel": TensorParallelObserver}


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


def prove(train_fn: Callable[..., list[float]], cfg: Any, *, name: str,
          keep_final_state: bool = False) -> RecipeResult:
    """``train_fn(cfg, observer=...)`` measured from outside; the result every rank returns.

    ``cfg`` needs ``steps``, ``model`` (a MODEL_PRESETS key) and ``global_batch_size`` (or
    ``batch_size``, for one process).
    ``keep_final_state``: the final parameters on CPU in ``final_state`` (tests compare them).
    """
    observer = OBSERVERS.get(name, Observer)(cfg.steps, keep_final_state=keep_final_state)
    with _in_the_callers_world():
        losses = train_fn(cfg, observer=observer)
    if observer.param_checksum is None:
        raise RuntimeError(f"{name}: the recipe never called observer.step_end for its last step "
                           f"({cfg.steps - 1}); it ran {len(observer.durations)} step(s)")
    devices = observer.world_size if observer.device.type == "cuda" else 1
    batch = getattr(cfg, "global_batch_size", None) or cfg.batch_size  # single_gpu: batch_size
    workload = Workload(MODEL_PRESETS[cfg.model], batch, observer.precision)
    return RecipeResult(
        recipe=name,
        world_size=observer.world_size,
        backend=observer.backend,
        device=str(observer.device),
        losses=list(losses),
        param_checksum=observer.param_checksum,
        seconds_per_step=observer.seconds_per_step,
        peak_memory_bytes=peak_memory_bytes(observer.device),
        extras={"memory_per_rank": observer.memory_per_rank, **observer.extras()},
        final_state=observer.final_state,
        **workload.measure(observer.seconds_per_step, observer.device, devices),
    )
