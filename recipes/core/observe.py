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
exists, the parameters' checksum and (if asked) the full state on CPU (gathered whole to rank 0
where the parameters are sharded DTensors). ``prove`` runs the recipe's function with one and
returns the same ``RecipeResult`` as the harness-built recipes: losses, checksum, seconds per step,
peak memory, tokens/s and MFU (``Workload``), ``memory_per_rank``.

What one recipe needs beyond that is measured by an ``Observer`` subclass registered under its
name in ``OBSERVERS`` (fsdp2: ``ShardedObserver``), or, where it is read off the model and the
optimizer at the last step, by a function in ``EXTRAS`` (zero: each rank's optimizer partition);
what they measure lands in ``extras``, which ``prove`` adds to the result's. A test that injects a
fault passes its own subclass to ``prove``: the recipe has no option for it.

A recipe that trains without a process group (single_gpu, amp, data_parallel: one process) is
measured as a world of 1 with backend ``none``. A recipe whose idea needs more than its losses
returns a small dataclass with a ``losses`` field (amp: the loss scale of each step, the skipped
steps): its other fields go into ``extras`` as they are.
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
from torch.distributed.tensor import DTensor, Shard

from recipes.core.memory import measure_last_forward, model_state_bytes
from recipes.core.result import RecipeResult, param_checksum, peak_memory_bytes
from recipes.core.state import all_ranks, full_state_on_cpu, full_state_on_rank0
from recipes.core.throughput import Workload
from recipes.core.workload import MODEL_PRESETS, Block
from recipes.core.world import _keep_groups_past_teardown

__all__ = ["EXTRAS", "Observer", "ShardedObserver", "TensorParallelObserver",
           "CheckpointObserver", "OBSERVERS", "prove"]

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
        self.durations: list[float] = []
        self.memory_per_rank: list[dict[str, int]] | None = None
        self.param_checksum: float | None = None
        self.final_state: dict[str, torch.Tensor] | None = None
        self.output_dtype: torch.dtype | None = None
        self.extras: dict[str, Any] = {}
        # the recipe's EXTRAS function, if it has one (prove sets it)
        self.extras_fn: Callable[[nn.Module, torch.optim.Optimizer], dict[str, Any]] | None = None  # what a subclass measures: added to the result's extras
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
            self.measure_final_state()
            if self.extras_fn is not None:
                self.extras.update(self.extras_fn(self._model, self._optimizer))
            self.close()
            self._model = self._optimizer = None  # the recipe's teardown frees them

    def measure_final_state(self) -> None:
        """The parameters' checksum and, if asked, the final state (a collective where sharded)."""
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

    ``cfg`` needs ``steps``, ``model`` (a MODEL_PRESETS key) and ``global_batch_size`` (or
    ``batch_size``, for one process).
    ``keep_final_state``: the final parameters on CPU in ``final_state`` (tests compare them).
    ``observer``: a test's own (fault injection; it carries its own ``keep_final_state``);
    by default the one ``OBSERVERS`` registers for ``name``, else ``Observer``.
    """
    if observer is None:
        observer = (OBSERVERS[name](cfg, keep_final_state=keep_final_state) if name in OBSERVERS
                    else Observer(cfg.steps, keep_final_state=keep_final_state))
    observer.keep_final_state = observer.keep_final_state or keep_final_state
    observer.extras_fn = EXTRAS.get(name)
    try:
        with _in_the_callers_world():
            returned = train_fn(cfg, observer=observer)
    finally:
        observer.close()
    returned_extras: dict[str, Any] = {}
    if dataclasses.is_dataclass(returned):  # the losses and what the recipe's idea adds
        returned_extras = {k: v for k, v in dataclasses.asdict(returned).items() if k != "losses"}
        losses = returned.losses
    else:
        losses = returned
    if observer.param_checksum is None:
        raise RuntimeError(f"{name}: the recipe never called observer.step_end for its last step "
                           f"({cfg.steps - 1}); it ran {len(observer.durations)} step(s)")
    # the devices that computed: the ranks, or the GPUs one DataParallel process drives
    devices = (observer.extras.get("gpus") or observer.world_size
               if observer.device.type == "cuda" else 1)
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
        extras={"memory_per_rank": observer.memory_per_rank, **observer.extras,
                **returned_extras},
        final_state=observer.final_state,
        **workload.measure(observer.seconds_per_step, observer.device, devices),
    )


class ShardedObserver(Observer):
    """fsdp2's measurements beyond the common ones, from outside like those (into ``extras``):

    - ``param_bytes_after_forward``, and with two micro-batches or more ``grad_bytes_accumulated``:
      what a rank holds around the run's last forward, from hooks on the model
      (``recipes.core.memory.measure_last_forward``: ``cfg.micro_batches`` forwards a step);
    - ``grad_norms``: the total norm each ``torch.nn.utils.clip_grad_norm_`` call returned, as a
      float (the observer wraps torch's function from ``model_ready`` to ``close``);
    - ``skipped_steps_per_rank`` where ``cfg.precision`` is fp16: the steps at which a rank's
      optimizer did not advance its step count, i.e. its loss scaler skipped the update.
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.micro_batches = cfg.micro_batches
        self.count_skips = cfg.precision == "fp16"
        self.grad_norms: list[float] = []
        self.skipped_steps: list[int] = []
        self._steps_taken = 0
        self._handles: list[Any] = []
        self._clip: Callable[..., torch.Tensor] | None = None

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        self._handles = measure_last_forward(model, steps=self.steps,
                                             micro_batches=self.micro_batches, extras=self.extras)
        self._clip = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = self._record_clip  # what the recipe calls, by that name

    def _record_clip(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        norm = self._clip(*args, **kwargs)
        self.grad_norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        return norm

    def measure(self, step: int) -> None:
        if self.count_skips:
            taken = max((int(state["step"]) for state in self._optimizer.state.values()
                         if "step" in state), default=0)
            if taken == self._steps_taken:  # no update: the scaler found an inf or a nan
                self.skipped_steps.append(step)
            self._steps_taken = taken
        if step == self.steps - 1:
            if self.grad_norms:
                self.extras["grad_norms"] = list(self.grad_norms)
            if self.count_skips:  # a collective: every rank's list, in rank order
                self.extras["skipped_steps_per_rank"] = all_ranks(self.skipped_steps)
        super().measure(step)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._clip is not None:
            torch.nn.utils.clip_grad_norm_, self._clip = self._clip, None
        super().close()


class TensorParallelObserver(Observer):
    """recipes/tensor_parallel.py: the split, measured on the model it trains (into ``extras``).

    ``tp_size``: the ranks its parameters are split over; ``sequence_parallel``: the final norm
    runs on sequence shards (its input is a Shard(1) DTensor), and ``residual_seq_len_per_rank``
    is the sequence length of the residual stream the first block receives (1/N of it with
    sequence parallel); ``loss_parallel``: the logits come out as a DTensor split over the
    vocabulary; ``compiled``: the blocks run torch.compile'd code; ``param_bytes_per_rank``,
    ``param_bytes_unsplit`` (the whole model's), their fraction and ``optimizer_bytes_per_rank``:
    this rank's, after the first step.
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self._tp_hooks: list[Any] = []

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        params = list(model.parameters())
        blocks = [m for m in model.modules() if isinstance(m, Block)]
        meshes = {p.device_mesh.size() for p in params if isinstance(p, DTensor)}
        self.extras.update({
            "tp_size": meshes.pop() if len(meshes) == 1 else None,
            "param_bytes_unsplit": sum(p.numel() * p.element_size() for p in params),  # global
            "compiled": all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in blocks),
        })
        # Registered after apply_tp's own hooks: these see the inputs as the split made them.
        self._tp_hooks = [blocks[0].register_forward_pre_hook(self._record_residual),
                          model.norm.register_forward_pre_hook(self._record_norm_input),
                          model.register_forward_hook(self._record_logits)]

    def measure(self, step: int) -> None:
        if step == 0:
            self.close_tp_hooks()  # the first forward showed all there is to see
        super().measure(step)
        if step == 0:  # memory_per_rank: measured by the step above
            mine = self.memory_per_rank[self.rank]
            self.extras.update({
                "param_bytes_per_rank": mine["param_bytes"],
                "param_fraction_per_rank": mine["param_bytes"] / self.extras["param_bytes_unsplit"],
                "optimizer_bytes_per_rank": mine["optimizer_bytes"]})

    def close_tp_hooks(self) -> None:
        for hook in self._tp_hooks:
            hook.remove()
        self._tp_hooks = []

    def close(self) -> None:
        self.close_tp_hooks()
        super().close()

    def _record_residual(self, module: nn.Module, args: Any) -> None:
        residual = args[0].to_local() if isinstance(args[0], DTensor) else args[0]
        self.extras["residual_seq_len_per_rank"] = residual.shape[1]

    def _record_norm_input(self, module: nn.Module, args: Any) -> None:
        self.extras["sequence_parallel"] = (isinstance(args[0], DTensor)
                                            and args[0].placements == (Shard(1),))

    def _record_logits(self, module: nn.Module, args: Any, output: Any) -> None:
        self.extras["loss_parallel"] = isinstance(output, DTensor) and any(
            isinstance(p, Shard) and p.dim in (-1, output.ndim - 1) for p in output.placements)


class CheckpointObserver(Observer):
    """recipes/sharded_checkpoint.py: the final state gathered whole to rank 0 for each of its
    strategies (classic FSDP's flat parameters too, which ``Observer`` would read as they are), its
    checksum over that state, and ``strategy`` in ``extras``. The recipe calls ``model_ready`` after
    it loaded a checkpoint, so the loaded state is measured there too: a resumed run with no step
    left to train (the same command again) has it as its final state; a last step replaces it."""

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.extras["strategy"] = cfg.strategy

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        self.measure_final_state()

    def measure_final_state(self) -> None:
        state, self.param_checksum = full_state_on_rank0(self._model)  # every rank: a collective
        if self.keep_final_state and self.rank == 0:
            self.final_state = state


# The recipes whose proof measures more than Observer does: name -> its observer's class, made
# as ``cls(cfg, keep_final_state=...)``.
OBSERVERS: dict[str, Callable[..., Observer]] = {"fsdp2": ShardedObserver,
                                                 "tensor_parallel": TensorParallelObserver,
                                                 "sharded_checkpoint": CheckpointObserver}
