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
fault passes its own subclass to ``prove``: the recipe has no option for it. A recipe that starts
its own processes (ddp_spawn: ``mp.spawn``) hands the observer to them; ``SpawnedObserver`` sends
rank 0's measurements back to the caller's copy.

A recipe that trains without a process group (single_gpu, amp, data_parallel: one process) is
measured as a world of 1 with backend ``none``. A recipe whose idea needs more than its losses
returns a small dataclass with a ``losses`` field (amp: the loss scale of each step, the skipped
steps): its other fields go into ``extras`` as they are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Shard

from recipes.core.memory import SavedTensorBytes, measure_last_forward, model_state_bytes
from recipes.core.result import RecipeResult, param_checksum, peak_memory_bytes
from recipes.core.state import all_ranks, full_state_on_cpu, full_state_on_rank0
from recipes.core.throughput import Workload
from recipes.core.workload import MODEL_PRESETS, Block, TransformerLM
from recipes.core.world import _keep_groups_past_teardown

__all__ = [
    "EXTRAS",
    "Observer",
    "ShardedObserver",
    "TensorParallelObserver",
    "HybridObserver",
    "ContextParallelObserver",
    "SpawnedObserver",
    "CheckpointingObserver",
    "MetaInitObserver",
    "CheckpointObserver",
    "HangObserver",
    "OBSERVERS",
    "prove",
]

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


def prove(
    train_fn: Callable[..., Any],
    cfg: Any,
    *,
    name: str,
    keep_final_state: bool = False,
    observer: Observer | None = None,
) -> RecipeResult:
    """``train_fn(cfg, observer=...)`` measured from outside; the result every rank returns.

    ``cfg`` needs ``steps`` (unless its observer knows them: meta_init), ``model`` (a
    MODEL_PRESETS key) and ``global_batch_size`` (or ``batch_size``, for one process; neither:
    no tokens, for a recipe that trains nothing).
    ``keep_final_state``: the final parameters on CPU in ``final_state`` (tests compare them).
    ``observer``: a test's own (fault injection; it carries its own ``keep_final_state``);
    by default the one ``OBSERVERS`` registers for ``name``, else ``Observer``.
    """
    if name in PROBES:  # a recipe that trains nothing: no model, no steps to observe
        with _in_the_callers_world():
            return PROBES[name](train_fn, cfg)
    if observer is None:
        observer = (
            OBSERVERS[name](cfg, keep_final_state=keep_final_state)
            if name in OBSERVERS
            else Observer(cfg.steps, keep_final_state=keep_final_state)
        )
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
        raise RuntimeError(
            f"{name}: the recipe never called observer.step_end for its last step "
            f"({observer.steps - 1}); it ran {len(observer.durations)} step(s)"
        )
    # the devices that computed: the ranks, or the GPUs one DataParallel process drives
    devices = (
        observer.extras.get("gpus") or observer.world_size if observer.device.type == "cuda" else 1
    )
    # single_gpu: batch_size; meta_init trains nothing: no tokens per step (tokens/s and MFU 0)
    batch = getattr(cfg, "global_batch_size", None) or getattr(cfg, "batch_size", 0)
    # an observer's model_config: the FLOPs a token costs where the preset's are not them (MoE),
    # or the shapes of a model that is not a cookbook preset (a Hugging Face model)
    workload = Workload(
        getattr(observer, "model_config", None) or MODEL_PRESETS[cfg.model],
        batch,
        observer.precision,
    )
    speed = workload.measure(observer.seconds_per_step, observer.device, devices)
    if not getattr(observer, "counts_model_flops", True):  # the FLOPs formula does not fit it
        speed.update(model_tflops=0.0, mfu=None)
    return RecipeResult(
        recipe=name,
        world_size=observer.world_size,
        backend=observer.backend,
        device=str(observer.device),
        losses=list(losses),
        param_checksum=observer.param_checksum,
        seconds_per_step=observer.seconds_per_step,
        peak_memory_bytes=peak_memory_bytes(observer.device),
        extras={"memory_per_rank": observer.memory_per_rank, **observer.extras, **returned_extras},
        final_state=observer.final_state,
        **{
            **speed,
            # where the forward's dtype is not the whole story (float8: bf16 outputs, bf16 peak)
            **({"precision": observer.precision_label} if observer.precision_label else {}),
        },
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
        self._handles = measure_last_forward(
            model, steps=self.steps, micro_batches=self.micro_batches, extras=self.extras
        )
        self._clip = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = self._record_clip  # what the recipe calls, by that name

    def _record_clip(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        norm = self._clip(*args, **kwargs)
        self.grad_norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        return norm

    def measure(self, step: int) -> None:
        if self.count_skips:
            taken = max(
                (int(state["step"]) for state in self._optimizer.state.values() if "step" in state),
                default=0,
            )
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
        self.extras.update(
            {
                "tp_size": meshes.pop() if len(meshes) == 1 else None,
                "param_bytes_unsplit": sum(p.numel() * p.element_size() for p in params),  # global
                "compiled": all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in blocks),
            }
        )
        # Registered after apply_tp's own hooks: these see the inputs as the split made them.
        self._tp_hooks = [
            blocks[0].register_forward_pre_hook(self._record_residual),
            model.norm.register_forward_pre_hook(self._record_norm_input),
            model.register_forward_hook(self._record_logits),
        ]

    def measure(self, step: int) -> None:
        if step == 0:
            self.close_tp_hooks()  # the first forward showed all there is to see
        super().measure(step)
        if step == 0:  # memory_per_rank: measured by the step above
            mine = self.memory_per_rank[self.rank]
            self.extras.update(
                {
                    "param_bytes_per_rank": mine["param_bytes"],
                    "param_fraction_per_rank": mine["param_bytes"]
                    / self.extras["param_bytes_unsplit"],
                    "optimizer_bytes_per_rank": mine["optimizer_bytes"],
                }
            )

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
        self.extras["sequence_parallel"] = isinstance(args[0], DTensor) and args[0].placements == (
            Shard(1),
        )

    def _record_logits(self, module: nn.Module, args: Any, output: Any) -> None:
        self.extras["loss_parallel"] = isinstance(output, DTensor) and any(
            isinstance(p, Shard) and p.dim in (-1, output.ndim - 1) for p in output.placements
        )


class HybridObserver(Observer):
    """recipes/hybrid_parallel.py: the split, measured on the model (or pipeline stage) it trains
    (into ``extras``).

    ``param_bytes_per_rank`` (this rank's, after the first step), ``param_bytes_unsplit`` (the
    whole model's) and their fraction; ``sequence_parallel``: a LayerNorm ran on sequence shards
    (its input a Shard(1) DTensor). With a pipeline (``cfg.pp`` > 1) each rank holds one stage:
    the final state is every stage's, gathered from the ranks that hold them, in model order
    (pp is the outermost mesh dim, so rank order is stage order).
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.pipelined = cfg.pp > 1
        with torch.device("meta"):  # the sizes only
            whole = TransformerLM(MODEL_PRESETS[cfg.model])
        self.extras.update(
            {
                "sequence_parallel": False,
                "param_bytes_unsplit": sum(
                    p.numel() * p.element_size() for p in whole.parameters()
                ),
            }
        )
        self._norm_hooks: list[Any] = []

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        # Registered after TP's own input hooks: these see the inputs as the split made them.
        self._norm_hooks = [
            m.register_forward_pre_hook(self._record_norm_input)
            for m in model.modules()
            if isinstance(m, nn.LayerNorm)
        ]

    def _record_norm_input(self, module: nn.Module, args: Any) -> None:
        if isinstance(args[0], DTensor) and any(
            isinstance(p, Shard) and p.dim == 1 for p in args[0].placements
        ):
            self.extras["sequence_parallel"] = True

    def measure(self, step: int) -> None:
        if step == 0:
            self.close_norm_hooks()  # the first step's forwards showed all there is to see
        super().measure(step)
        if step == 0:  # memory_per_rank: measured by the step above
            held = self.memory_per_rank[self.rank]["param_bytes"]
            self.extras.update(
                {
                    "param_bytes_per_rank": held,
                    "param_fraction_per_rank": held / self.extras["param_bytes_unsplit"],
                }
            )

    def gather_final_state(self) -> None:
        if not self.pipelined:
            return super().gather_final_state()
        # Each stage's full state (TP x FSDP all-gathered inside it), then every rank's: a
        # collective of the world. Not cpu_offload: rank 0 does not hold every stage.
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        local = {
            name: t.detach().cpu().clone()
            for name, t in get_model_state_dict(self._model, options=options).items()
        }
        state: dict[str, torch.Tensor] = {}
        for piece in all_ranks(local):  # a stage's dp x tp ranks hold the same state
            for name, tensor in piece.items():
                state.setdefault(name, tensor)
        self.param_checksum = param_checksum(state.values())
        if self.keep_final_state and self.rank == 0:
            self.final_state = state

    def close_norm_hooks(self) -> None:
        for hook in self._norm_hooks:
            hook.remove()
        self._norm_hooks = []

    def close(self) -> None:
        self.close_norm_hooks()
        super().close()


class ContextParallelObserver(Observer):
    """recipes/context_parallel.py: the split, measured on the model's input (into ``extras``).

    ``positions_per_rank``: how many positions of each sequence this rank's model received;
    ``score_entries_per_rank``: the query-key scores each rank computes per head under a causal
    mask, from the positions every rank's model received (its work: equal under load balancing);
    ``cp_size``: the ranks the sequence is split over (the world); ``impl`` and ``load_balance``:
    as configured.
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.extras.update(impl=cfg.impl, load_balance=cfg.load_balance)
        self._positions: torch.Tensor | None = None
        self._pre_hook: Any = None

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        self._pre_hook = model.register_forward_pre_hook(self._record_positions, with_kwargs=True)

    def _record_positions(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        positions = kwargs.get("positions")
        if positions is None:  # the model's default: 0..seq-1 of what it received
            positions = torch.arange(args[0].shape[1])
        self._positions = positions.reshape(-1, positions.shape[-1])[0].detach().cpu()

    def measure(self, step: int) -> None:
        if step == self.steps - 1:  # a collective: every rank's positions, in rank order
            layout = all_ranks(self._positions)
            self.extras.update(
                cp_size=self.world_size,
                positions_per_rank=len(self._positions),
                score_entries_per_rank=[
                    sum(int((queries[:, None] >= keys[None, :]).sum()) for keys in layout)
                    for queries in layout
                ],
            )
        super().measure(step)

    def close(self) -> None:
        if self._pre_hook is not None:
            self._pre_hook.remove()
            self._pre_hook = None
        super().close()


class SpawnedObserver(Observer):
    """An Observer that can travel into the processes a recipe starts itself (ddp_spawn hands it
    to ``mp.spawn``, which pickles a copy into every child).

    Rank 0's copy sends what it measured at the last step back through a queue made here (from
    the "spawn" context: it travels with the copy), and the caller's own copy takes it in
    ``close``, which ``prove`` calls once the recipe's function has returned. Where the recipe's
    per-rank function runs in the caller's world instead (tests), it is a plain Observer. The
    final state does not travel: the parent reads the queue only after the children exit, and a
    message larger than the pipe's buffer would block rank 0 forever.
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self._queue = multiprocessing.get_context("spawn").SimpleQueue()
        self._in_child = False

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_in_child": True}  # only ever pickled to go to a child

    def measure(self, step: int) -> None:
        super().measure(step)
        if self._in_child and step == self.steps - 1 and self.rank == 0:
            self._queue.put({key: getattr(self, key) for key in _TRAVELS})

    def close(self) -> None:
        super().close()
        if not self._in_child and not self._queue.empty():
            self.__dict__.update(self._queue.get())


_TRAVELS = (
    "durations",
    "memory_per_rank",
    "param_checksum",
    "output_dtype",
    "extras",
    "rank",
    "world_size",
    "backend",
    "device",
)


class CheckpointingObserver(Observer):
    """recipes/activation_checkpointing.py: what its first step keeps for backward, measured from
    outside (into ``extras``):

    - ``saved_bytes``: the bytes the first forward and its loss leave alive when backward starts,
      whoever keeps them (``recipes.core.memory.SavedTensorBytes``, entered by a forward pre-hook
      on the model and left at the end of the step);
    - ``checkpointed_blocks``: the first block of each region that backward ran again. Forward
      pre-hooks on each block's submodules see a block's forward run inside backward (a graph task
      is running): it was recomputed. A replay runs its region's blocks in order, and backward
      reaches the regions from the last: a recomputed block that follows the block just before it
      belongs to that block's region (checkpoint_sequential's segment of blocks 0-1 is one region,
      per_block's blocks 1 and 0 are two);
    - ``checkpoint_input_bytes``: of ``saved_bytes``, those regions' inputs (what checkpoint
      itself keeps), from a pre-hook on each block;
    - ``compiled``: the blocks run torch.compile'd code. The graph then decides what it saves, out
      of a dispatch mode's sight, and hooks inside it would change the graph: the three figures
      above are None (the peak memory tells instead);
    - ``mode``: the recipe's ``cfg.mode``, to label the figures.
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.extras["mode"] = cfg.mode
        self._saved: SavedTensorBytes | None = None
        self._entered = False
        self._recomputed: list[int] = []  # block indices, in the order backward re-ran them
        self._ac_hooks: list[Any] = []

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        blocks = [m for m in model.modules() if isinstance(m, Block)]
        compiled = all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in blocks)
        self.extras["compiled"] = compiled
        if compiled:
            self.extras.update(
                saved_bytes=None, checkpoint_input_bytes=None, checkpointed_blocks=None
            )
            return
        self._saved = SavedTensorBytes(model)
        self._ac_hooks = [model.register_forward_pre_hook(self._start)]
        for index, block in enumerate(blocks):
            self._ac_hooks.append(
                block.register_forward_pre_hook(
                    lambda _module, args, index=index: self._saved.note_input(index, args[0])
                )
            )
            for sub in block.modules():  # a checkpointed block's replay skips its own hooks
                self._ac_hooks.append(
                    sub.register_forward_pre_hook(
                        lambda *_, index=index: self._note_recompute(index)
                    )
                )

    def _start(self, module: nn.Module, args: Any) -> None:
        if not self._entered:  # the first forward: step 0's
            self._entered = True
            self._saved.__enter__()

    def _note_recompute(self, index: int) -> None:
        running_backward = torch._C._current_graph_task_id() != -1
        if running_backward and (not self._recomputed or self._recomputed[-1] != index):
            self._recomputed.append(index)

    def measure(self, step: int) -> None:
        if step == 0 and self._saved is not None:
            self._stop()
            replayed = self._recomputed
            starts = sorted(
                {
                    index
                    for k, index in enumerate(replayed)
                    if k == 0 or replayed[k - 1] != index - 1
                }
            )
            inputs = self._saved.input_bytes
            self.extras.update(
                saved_bytes=self._saved.total,
                checkpointed_blocks=starts,
                checkpoint_input_bytes=sum(inputs.get(i, 0) for i in starts),
            )
        super().measure(step)

    def _stop(self) -> None:
        for hook in self._ac_hooks:
            hook.remove()
        self._ac_hooks = []
        if self._entered:
            self._entered = False
            self._saved.__exit__(None, None, None)

    def close(self) -> None:
        self._stop()
        super().close()


class MetaInitObserver(Observer):
    """recipes/meta_init.py: the model it built, read when it is ready (``model_ready``), before
    its one forward: fully_shard's root keeps its parameters unsharded after a forward, so every
    figure is read before it. Into ``extras``: ``param_bytes_per_rank`` (each rank's shards) and
    ``full_model_bytes`` (the whole model, unsharded); the checksum and (if asked) the full state
    gathered to rank 0 are the initial weights. One "step": the initial model's forward, with no
    optimizer (``model_ready(model, None)``).
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(1, keep_final_state=keep_final_state)

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        super().model_ready(model, optimizer)
        held = model_state_bytes(model, optimizer)
        self.memory_per_rank = all_ranks(held)
        self.extras.update(
            full_model_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
            param_bytes_per_rank=[m["param_bytes"] for m in self.memory_per_rank],
        )
        state, self.param_checksum = full_state_on_rank0(model)  # a collective: every rank
        if self.keep_final_state and self.rank == 0:
            self.final_state = state
        self._restart_clock()  # the step's time is the forward's, not this reading's

    def measure(self, step: int) -> None:
        self.close()  # all of it was read before the forward
        self._model = self._optimizer = None


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
        self.gather_final_state()

    def gather_final_state(self) -> None:
        state, self.param_checksum = full_state_on_rank0(self._model)  # every rank: a collective
        if self.keep_final_state and self.rank == 0:
            self.final_state = state


# The recipes whose proof measures more than Observer does: name -> its observer's class, made
# as ``cls(cfg, keep_final_state=...)``.
OBSERVERS: dict[str, Callable[..., Observer]] = {
    "fsdp2": ShardedObserver,
    "tensor_parallel": TensorParallelObserver,
    "hybrid_parallel": HybridObserver,
    "ddp_spawn": SpawnedObserver,
    "context_parallel": ContextParallelObserver,
    "activation_checkpointing": CheckpointingObserver,
    "meta_init": MetaInitObserver,
    "sharded_checkpoint": CheckpointObserver,
}


def _probe_collectives(run_fn: Callable[..., Any], cfg: Any) -> RecipeResult:
    """recipes/collectives.py trains nothing: measured by wrapping, for the run, each op of its
    ``OPS`` table and its ``Ctx.check`` (the recipe has no observer line).

    ``extras["ops"]``: what ``run`` returned (op -> "ok", "fallback: why" or "skipped: why");
    ``extras["op_ms"]``: each op's wall time on this rank (CUDA synchronised);
    ``param_checksum``: the sum of every tensor this rank received and checked (the portable
    fallbacks must give the native ops' sum); ``seconds_per_step``: the whole pass.
    """
    module = sys.modules[run_fn.__module__]
    ops, check = dict(module.OPS), module.Ctx.check
    received: list[torch.Tensor] = []
    op_ms: dict[str, float] = {}
    seen: dict[str, Any] = {}

    def timed(name: str, op: Callable[[Any], str]) -> Callable[[Any], str]:
        def run_op(ctx: Any) -> str:
            seen.update(world_size=ctx.world_size, backend=ctx.backend, device=ctx.device)
            sync = torch.cuda.synchronize if ctx.device.type == "cuda" else lambda *_: None
            sync(ctx.device)
            start = time.perf_counter()
            note = op(ctx)
            sync(ctx.device)
            op_ms[name] = round((time.perf_counter() - start) * 1e3, 3)
            return note

        return run_op

    def recording_check(ctx: Any, actual: Any, expected: Any) -> None:
        if isinstance(expected, torch.Tensor):
            received.append(actual)
        check(ctx, actual, expected)

    module.OPS.update({name: timed(name, op) for name, op in ops.items()})
    module.Ctx.check = recording_check
    try:
        report = run_fn(cfg)
    finally:
        module.OPS.update(ops)
        module.Ctx.check = check
    device = seen["device"]
    return RecipeResult(
        recipe="collectives",
        world_size=seen["world_size"],
        backend=seen["backend"],
        device=str(device),
        losses=[],
        param_checksum=param_checksum(received),
        seconds_per_step=sum(op_ms.values()) / 1e3,
        peak_memory_bytes=peak_memory_bytes(device),
        extras={"ops": report, "op_ms": op_ms},
    )


# The recipes that train nothing: name -> fn(recipe's function, cfg) -> RecipeResult, which
# ``prove`` calls instead of observing steps.
PROBES: dict[str, Callable[[Callable[..., Any], Any], RecipeResult]] = {
    "collectives": _probe_collectives
}


class HangObserver(Observer):
    """recipes/hang_diagnosis.py: ``mode`` and ``trace_dir`` in ``extras``. A run that hangs on
    purpose stops before its last step: its checksum is then read where it stopped (in ``close``,
    once the recipe returned), so that the world that hung still gives a result."""

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.extras.update(mode=cfg.mode, trace_dir=cfg.trace_dir)

    def close(self) -> None:
        if self.param_checksum is None and self._model is not None:  # the hang ended the loop
            self.param_checksum = param_checksum(self._model.parameters())
            self._model = self._optimizer = None
        super().close()


OBSERVERS["hang_diagnosis"] = HangObserver


class ClippingObserver(Observer):
    """recipes/grad_clipping.py: the total norm each rank clipped with, recorded from outside
    (into ``extras``) by wrapping what the recipe calls, by those names, from ``model_ready`` to
    ``close``: ``torch.nn.utils.clip_grads_with_norm_`` (``clip_grad_norm_across`` passes it the
    total, once per mesh) and ``torch.nn.utils.clip_grad_norm_`` (the pitfalls: the norm it
    returns, a DTensor one made whole).

    ``grad_norms``: this rank's norm at each step; ``grad_norms_per_rank``: each step's norms of
    every rank, in rank order (one total: the same on every rank); ``layout`` and ``mesh`` as the
    recipe resolved them. The final state is every rank's parameters made whole and merged (a
    pipeline stage holds only its own), its checksum over the merged state.
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.layout, self.mesh = cfg.layout, list(cfg.mesh)
        self.grad_norms: list[float] = []
        self._norm: float | None = None
        self._wrapped: dict[str, Callable[..., Any]] = {}

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        from recipes.grad_clipping import LAYOUTS, default_mesh

        if not self.mesh and LAYOUTS[self.layout]:
            self.mesh = default_mesh(self.layout, self.world_size)
        self.extras.update(layout=self.layout, mesh=self.mesh)
        for name in ("clip_grads_with_norm_", "clip_grad_norm_"):
            self._wrapped[name] = getattr(torch.nn.utils, name)
        torch.nn.utils.clip_grads_with_norm_ = self._record_total
        torch.nn.utils.clip_grad_norm_ = self._record_returned

    def _record_total(
        self, parameters: Any, max_norm: float, total_norm: torch.Tensor, *args: Any, **kwargs: Any
    ) -> None:
        self._norm = float(total_norm)
        return self._wrapped["clip_grads_with_norm_"](
            parameters, max_norm, total_norm, *args, **kwargs
        )

    def _record_returned(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        norm = self._wrapped["clip_grad_norm_"](*args, **kwargs)
        self._norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        return norm

    def measure(self, step: int) -> None:
        self.grad_norms.append(self._norm)
        if step == self.steps - 1:  # a collective: every rank's norms, in rank order
            self.extras.update(
                grad_norms=list(self.grad_norms),
                grad_norms_per_rank=[
                    list(per_step) for per_step in zip(*all_ranks(self.grad_norms))
                ],
            )
        super().measure(step)

    def gather_final_state(self) -> None:
        module = getattr(self._model, "module", self._model)  # DDP's model, unwrapped
        local = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in module.named_parameters()
        }
        state: dict[str, torch.Tensor] = {}
        for piece in all_ranks(local):  # a collective: the stages hold different parameters
            state.update(piece)
        self.param_checksum = param_checksum(state.values())
        if self.keep_final_state and self.rank == 0:
            self.final_state = state

    def close(self) -> None:
        for name, function in self._wrapped.items():
            setattr(torch.nn.utils, name, function)
        self._wrapped = {}
        super().close()


OBSERVERS["grad_clipping"] = ClippingObserver


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
        from torch.distributed.fsdp import FSDPModule

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
        from recipes.core.counting import CollectiveCounter

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


OBSERVERS["sharded_accumulation"] = AccumulationObserver


class ClassicFSDPObserver(ShardedObserver):
    """recipes/fsdp.py (classic ``FullyShardedDataParallel``): ``ShardedObserver``'s figures, with
    two differences the wrapper makes. Its parameters are not DTensors (``use_orig_params`` views
    into flat shards): the checksum and the final state come from the full state gathered whole to
    rank 0 (every rank, a collective). It clips with its own ``model.clip_grad_norm_`` (the whole
    model's norm), not torch's function: the observer wraps that method on the model from
    ``model_ready`` to ``close`` to record each norm in ``grad_norms``."""

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg, keep_final_state=keep_final_state)
        self._clipped: nn.Module | None = None

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        # not torch's function: FSDP's method calls it itself where every unit is NO_SHARD
        torch.nn.utils.clip_grad_norm_, self._clip = self._clip, None
        clip = model.clip_grad_norm_

        def record(*args: Any, **kwargs: Any) -> torch.Tensor:
            norm = clip(*args, **kwargs)
            self.grad_norms.append(float(norm))
            return norm

        model.clip_grad_norm_ = record  # an instance attribute: it shadows the method
        self._clipped = model

    def gather_final_state(self) -> None:
        state, self.param_checksum = full_state_on_rank0(self._model)
        if self.keep_final_state and self.rank == 0:
            self.final_state = state

    def close(self) -> None:
        if self._clipped is not None:
            self._clipped.__dict__.pop("clip_grad_norm_", None)
            self._clipped = None
        super().close()


OBSERVERS["fsdp"] = ClassicFSDPObserver


class Float8Observer(Observer):
    """recipes/float8.py trains twice in one world, bf16 then float8, each run calling
    ``model_ready`` and ``step_end`` for its own steps. The common figures are the float8 run's;
    the bf16 run's seconds per step, measured the same way, become ``bf16_tokens_per_second`` and
    ``speedup_vs_bf16`` (bf16's time over float8's) in ``extras``. Both runs' MFU is against the
    bf16 peak (their forwards output bf16): float8 changes how fast the same model FLOPs run. The
    result's precision reads ``float8``."""

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.model_name, self.global_batch_size = cfg.model, cfg.global_batch_size
        self.runs = 0
        self.bf16_seconds_per_step = 0.0

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.runs == 1:  # the bf16 run has ended: its times are the baseline
            self.bf16_seconds_per_step, self.durations = self.seconds_per_step, []
        self.runs += 1
        super().model_ready(model, optimizer)

    def measure(self, step: int) -> None:
        super().measure(step)
        if step == self.steps - 1 and self.runs == 2:
            bf16 = Workload(
                MODEL_PRESETS[self.model_name], self.global_batch_size, self.precision
            ).measure(self.bf16_seconds_per_step, self.device, self.world_size)
            self.extras.update(
                bf16_tokens_per_second=bf16["tokens_per_second"],
                speedup_vs_bf16=self.bf16_seconds_per_step / self.seconds_per_step,
            )
            self.precision_label = "float8"


OBSERVERS["float8"] = Float8Observer


class PerformanceObserver(Observer):
    """recipes/performance.py (one device, no process group): what each switch was set to, from
    its config, and the ``torch.backends`` flags a speed number depends on (TF32, the SDPA
    backends, bf16 reductions), read at the last step: process-wide switches the recipe set, seen
    from outside (into ``extras``). The attention kernel that ran is the recipe's own figure
    (``PerformanceRun.sdpa_backend_ran``)."""

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.extras.update(
            optimizer=cfg.optimizer,
            compiled=cfg.compile,
            zero_grad=cfg.zero_grad,
            compile_scope=cfg.compile_scope if cfg.compile else None,
            compile_mode=cfg.compile_mode if cfg.compile else None,
            sdpa_backend_allowed=cfg.sdpa_backend,
            pin_memory=cfg.pin_memory,
        )

    def measure(self, step: int) -> None:
        if step == self.steps - 1:
            self.extras["backends"] = {
                "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                "cuda.matmul.allow_bf16_reduced_precision_reduction": (
                    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
                ),
                "float32_matmul_precision": torch.get_float32_matmul_precision(),
                "sdp: flash / mem_efficient / cudnn / math": [
                    torch.backends.cuda.flash_sdp_enabled(),
                    torch.backends.cuda.mem_efficient_sdp_enabled(),
                    torch.backends.cuda.cudnn_sdp_enabled(),
                    torch.backends.cuda.math_sdp_enabled(),
                ],
            }
        super().measure(step)


OBSERVERS["performance"] = PerformanceObserver


class ExpertParallelObserver(Observer):
    """recipes/expert_parallel.py: the placement, read off the model's MoE layers (into
    ``extras``), and the full state with every rank's experts gathered.

    ``ep_size`` (the ranks the experts are spread over), ``experts_per_rank``, ``top_k`` and
    ``capacity_factor`` (None: no capacity, nothing dropped). The final state and its checksum
    hold every expert: each rank's slices of ``w_in``/``w_out`` all-gathered over the EP group
    (a collective), the replicated parameters as they are. ``model_config``: the FLOPs a token
    costs, for tokens/s and MFU: top_k expert MLPs the size of the dense one (router left out).
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        dense = MODEL_PRESETS[cfg.model]
        self.model_config = dataclasses.replace(dense, mlp_ratio=dense.mlp_ratio * cfg.top_k)
        self._moes: list[nn.Module] = []

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        self._moes = [
            m for m in model.modules() if hasattr(m, "ep_group") and hasattr(m, "num_experts")
        ]
        moe = self._moes[0]
        self.extras.update(
            ep_size=dist.get_world_size(moe.ep_group) if moe.ep_group is not None else 1,
            experts_per_rank=moe.w_in.shape[0],
            top_k=moe.top_k,
            capacity_factor=moe.capacity_factor if moe.capacity_factor < float("inf") else None,
        )

    def gather_final_state(self) -> None:
        sliced = {id(p): moe.ep_group for moe in self._moes for p in (moe.w_in, moe.w_out)}
        state = {}
        for name, p in self._model.named_parameters():
            group = sliced.get(id(p))
            if group is not None:  # this rank's experts: every rank's, in rank order
                parts = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, p.detach().contiguous(), group=group)
                p = torch.cat(parts)
            state[name] = p.detach().cpu().clone()
        self.param_checksum = param_checksum(state.values())
        if self.keep_final_state:
            self.final_state = state

    def close(self) -> None:
        self._moes = []
        super().close()


class PipelineObserver(Observer):
    """recipes/pipeline_parallel.py: each rank's timeline and idle time, the layout, and the whole
    model's final state gathered from the stages (into ``extras``).

    From ``model_ready`` to the end of each run it wraps torch's pipelining classes (every schedule
    calls them): each stage's ``forward_one_chunk`` (F), ``backward_one_chunk`` (B, or I when the
    schedule splits the backward) and ``backward_weight_one_chunk`` (W), timed within the window of
    the schedule's ``step``; the waits for a neighbour happen outside them: the gaps are the idle
    time. Per run (the recipe's ``--schedule``, then with ``--compare`` each other schedule in
    turn, told apart by the schedule's class): ``idle_fraction_measured_per_rank`` (1 - busy /
    window, the mean over the steps after the first), the last step's ``timeline_per_rank``
    ([kind, stage, micro-batch, start ms, end ms]) and ``step_window_ms_per_rank``; the first
    run's also as the result's own figures, with ``stage_ids_per_rank``, ``num_stages``,
    ``split_points`` and the theoretical bubble; with ``compare``, ``schedule_table``: a row per
    schedule, measured, or refused with the recipe's reason. The model the recipe hands over is
    its stages' modules (an ``nn.ModuleList``); the final state is every stage's, from the ranks
    that hold them, in stage order (a collective).
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        from recipes import pipeline_parallel

        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.cfg, self._recipe = cfg, pipeline_parallel
        self.model_config = pipeline_parallel.model_config(cfg.model, cfg.n_layers)
        self._names = {cls: name for name, cls in pipeline_parallel.SCHEDULES.items()}
        self.rows: dict[str, dict[str, Any]] = {}
        self._runs = 0
        self._saved: list[tuple[type, str, Any]] = []
        self._index_of: dict[int, int] = {}  # id(stage module) -> stage index
        self._stage_ids: set[int] = set()
        self._num_stages = 0
        self._schedule: str | None = None
        self._actions: list[tuple[str, int, int, float, float]] = []
        self._began = self._window = 0.0
        self._depth = 0
        self._idle: list[float] = []
        self._run_durations: list[float] = []
        self._run_last = 0.0

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._runs += 1
        self._stage_ids, self._idle, self._run_durations = set(), [], []
        self._patch()
        if self._runs == 1:  # the recipe's own schedule: measured in full
            super().model_ready(model, optimizer)
            self._hook.remove()  # a ModuleList runs no forward: its first stage's output tells
            self._hook = model[0].register_forward_hook(self._record_dtype)
        self._model_of_run = model
        self._run_last = time.perf_counter()

    def _patch(self) -> None:
        from torch.distributed.pipelining import schedules, stage

        if self._saved:
            return
        for cls, name in [
            (stage._PipelineStageBase, m)
            for m in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
        ] + [(schedules.PipelineScheduleSingle, "step"), (schedules.PipelineScheduleMulti, "step")]:
            original = cls.__dict__[name]
            self._saved.append((cls, name, original))
            wrap = self._timed_step if name == "step" else self._timed_action
            setattr(cls, name, wrap(original, name))

    def _unpatch(self) -> None:
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)
        self._saved = []

    def _timed_step(self, original: Callable[..., Any], _: str) -> Callable[..., Any]:
        observer = self

        def step(schedule: Any, *args: Any, **kwargs: Any) -> Any:
            observer._depth += 1
            if observer._depth == 1:  # the outermost step: a new window
                observer._schedule = observer._names.get(type(schedule).__name__)
                observer._actions, observer._began = [], time.perf_counter()
            try:
                return original(schedule, *args, **kwargs)
            finally:
                observer._depth -= 1
                if observer._depth == 0:
                    observer._window = time.perf_counter() - observer._began
                    busy = sum(end - start for *_, start, end in observer._actions)
                    observer._idle.append(1.0 - busy / observer._window)

        return step

    def _timed_action(self, original: Callable[..., Any], name: str) -> Callable[..., Any]:
        observer = self

        def timed(stage: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
            observer._index_of[id(stage.submod)] = stage.stage_index
            observer._stage_ids.add(stage.stage_index)
            observer._num_stages = stage.num_stages
            start = time.perf_counter()
            try:
                return original(stage, chunk, *args, **kwargs)
            finally:
                kind = {"forward_one_chunk": "F", "backward_weight_one_chunk": "W"}.get(name)
                if kind is None:  # backward_one_chunk(chunk, loss, full_backward, ...)
                    full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
                    kind = "B" if full else "I"
                observer._actions.append(
                    (
                        kind,
                        stage.stage_index,
                        chunk,
                        start - observer._began,
                        time.perf_counter() - observer._began,
                    )
                )

        return timed

    def step_end(self, step: int, loss: float) -> None:
        now = time.perf_counter()
        self._run_durations.append(now - self._run_last)
        if step == self.steps - 1:
            self._end_run()
        if self._runs == 1:
            super().step_end(step, loss)
        elif step == self.steps - 1:
            self._unpatch()
        self._run_last = time.perf_counter()

    def _end_run(self) -> None:
        """The run's figures, from every rank (collectives: every rank ends every run)."""
        steady = self._idle[1:] or self._idle  # after the first (warm-up) step
        actions = [
            [kind, s, mb, round(a * 1e3, 3), round(b * 1e3, 3)]
            for kind, s, mb, a, b in self._actions
        ]
        stages = sorted(self._stage_ids)
        pp_size = dist.get_world_size()
        timings = statistics.median(self._run_durations[1:] or self._run_durations)
        # one collective for every per-rank figure: (idle, actions, stage ids, window) per rank
        idle, timeline, stage_ids, windows = map(
            list,
            zip(
                *all_ranks(
                    (sum(steady) / len(steady), actions, stages, round(self._window * 1e3, 3))
                )
            ),
        )
        row = {
            "schedule": self._schedule,
            "stages_per_rank": len(stages),
            "bubble_fraction_theory": _bubble(pp_size, self.cfg.microbatches, len(stages)),
            "idle_fraction_measured_per_rank": idle,
            "timeline_per_rank": timeline,
            "seconds_per_step": timings,
        }
        self.rows[self._schedule] = row
        if self._runs == 1:
            split_points = self._recipe.even_split(
                _meta_model(self.model_config), self._recipe.TRANSFORMER_LM, self._num_stages
            )
            self.extras.update(
                schedule=self._schedule,
                split=self.cfg.split,
                pp_size=pp_size,
                num_stages=self._num_stages,
                stages_per_rank=len(stages),
                microbatches=self.cfg.microbatches,
                n_layers=self.model_config.n_layers,
                split_points=split_points,
                stage_ids_per_rank=stage_ids,
                bubble_fraction_theory=row["bubble_fraction_theory"],
                idle_fraction_measured_per_rank=idle,
                step_window_ms_per_rank=windows,
                timeline_per_rank=timeline,
            )
        if self.cfg.compare:
            self.extras["schedule_table"] = [
                self.rows.get(name) or self._refused(name, pp_size)
                for name in self._recipe.SCHEDULES
            ]
            self.extras["schedule_table"] = [r for r in self.extras["schedule_table"] if r]

    def _refused(self, name: str, pp_size: int) -> dict[str, Any] | None:
        """The recipe's reason for not running ``name`` here (None: it runs, later)."""
        try:
            self._recipe.check_schedule_runs_here(name, dist.get_backend())
            self._recipe.check_config_fits(dataclasses.replace(self.cfg, schedule=name), pp_size)
        except ValueError as refused:
            return {"schedule": name, "refused": str(refused)}
        return None

    def gather_final_state(self) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)  # not every stage on 0
        local = {
            self._index_of[id(m)]: {
                n: t.detach().cpu().clone()
                for n, t in get_model_state_dict(m, options=options).items()
            }
            for m in self._model
        }
        pieces = {index: state for piece in all_ranks(local) for index, state in piece.items()}
        state = {n: t for index in sorted(pieces) for n, t in pieces[index].items()}
        self.param_checksum = param_checksum(state.values())
        if self.keep_final_state:
            self.final_state = state

    def close(self) -> None:
        self._unpatch()
        super().close()


def _bubble(pp_size: int, microbatches: int, stages_per_rank: int) -> float:
    return (pp_size - 1) / (stages_per_rank * microbatches + pp_size - 1)


def _meta_model(model_config: Any) -> nn.Module:
    with torch.device("meta"):  # the module names only
        return TransformerLM(model_config)


OBSERVERS.update({"expert_parallel": ExpertParallelObserver, "pipeline_parallel": PipelineObserver})


def _counting_allreduce_hook(observer, bucket):
    # Unannotated: DDP checks a hook's annotations at run time, and this module's are strings.
    observer.bucket_allreduces += 1
    return default_hooks.allreduce_hook(None, bucket)  # DDP's own behaviour: average over the world


class GradAccumulationObserver(Observer):
    """recipes/grad_accumulation.py: the gradient all-reduces DDP launched, counted by a DDP
    communication hook the observer registers on the recipe's DDP model in ``model_ready`` (before
    the first backward, as DDP requires). Into ``extras``:

    - ``allreduce_rounds_per_step``: the backward passes of each step that all-reduced (a forward
      pre-hook on the DDP model starts each micro-batch): 1 with ``no_sync``, k without;
    - ``bucket_allreduces``: the bucket all-reduces of the whole run;
    - ``micro_batch_size``: the sequences of each forward on a rank.
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.bucket_allreduces = 0
        self.rounds_per_step: list[int] = []
        self._rounds = 0
        self._buckets_at_forward = 0
        self._pre_hook: Any = None

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        model.register_comm_hook(self, _counting_allreduce_hook)
        self._pre_hook = model.register_forward_pre_hook(self._micro_batch_starts)

    def _micro_batch_starts(self, module: nn.Module, args: Any) -> None:
        self.extras.setdefault("micro_batch_size", len(args[0]))
        self._backward_ended()

    def _backward_ended(self) -> None:
        self._rounds += self.bucket_allreduces > self._buckets_at_forward
        self._buckets_at_forward = self.bucket_allreduces

    def measure(self, step: int) -> None:
        self._backward_ended()  # the step's last backward
        self.rounds_per_step.append(self._rounds)
        self._rounds = 0
        self.extras.update(
            allreduce_rounds_per_step=list(self.rounds_per_step),
            bucket_allreduces=self.bucket_allreduces,
        )
        super().measure(step)

    def close(self) -> None:
        if self._pre_hook is not None:
            self._pre_hook.remove()
            self._pre_hook = None
        super().close()


OBSERVERS["grad_accumulation"] = GradAccumulationObserver


class HFCheckpointObserver(Observer):
    """recipes/hf_checkpoint.py: a fully_shard run of a Hugging Face model. Into ``extras``:
    ``param_bytes_per_rank`` (each rank's shards, read when the model is ready, before any
    forward). The checksum sums ``model.parameters()`` (GPT-2's tied embedding once) shard by
    shard; a run of 0 steps (a load, then the export) has the loaded weights as its final state.
    tokens/s counts the recipe's sequences; the FLOPs formula is the cookbook model's: left out.
    """

    counts_model_flops = False

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        from recipes.core.workload import ModelConfig

        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.model_config = ModelConfig(
            vocab_size=128, seq_len=16, dim=64, n_layers=2, n_heads=4
        )  # only seq_len counts: tokens per sequence

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        self.extras["param_bytes_per_rank"] = all_ranks(
            sum(p.to_local().nbytes for p in model.parameters())
        )
        if self.steps == 0:
            self.gather_final_state()
        self._restart_clock()

    def gather_final_state(self) -> None:
        local = sum(p.to_local().double().sum().item() for p in self._model.parameters())
        checksum = torch.tensor([local], dtype=torch.float64, device=self.device)
        dist.all_reduce(checksum)  # every rank: the sum over all shards
        self.param_checksum = float(checksum.item())
        if self.keep_final_state:
            state, _ = full_state_on_rank0(self._model)
            if self.rank == 0:
                self.final_state = state


OBSERVERS["hf_checkpoint"] = HFCheckpointObserver


class FinetuneObserver(Observer):
    """recipes/finetune.py: what freezing saves, measured on the model it trains (into ``extras``).

    When the model is ready: ``trainable_params``, ``total_params`` (tied weights once),
    ``trainable_fraction``, ``trainable_names``, and, unless the mode is full, full fine-tuning's
    bytes of the same model and strategy (``full_finetune_memory_per_rank``): built with the
    recipe's own ``adapt``/``wrap``, one step, read, freed. Under DDP a comm hook counts the
    gradient bytes all-reduced (``reduced_bytes_per_step``). After the last step, before the
    recipe's next ``zero_grad``: ``memory_per_rank`` (this run's), ``bytes_saved_per_rank``,
    ``frozen_grads_none_per_rank``, the optimizer's tensors and state tensors. The final state
    holds the model's parameter names (GPT-2's tied ``lm_head.weight`` once), its checksum the
    recipe's earlier one. No FLOPs count: 6 x parameters counts weight gradients that frozen
    weights never compute.
    """

    counts_model_flops = False

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        from recipes import finetune

        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.cfg = cfg
        self.model_config = MODEL_PRESETS[cfg.model] if cfg.arch == "cookbook" else finetune.HF_DATA
        self.extras.update(mode=cfg.mode, strategy=cfg.strategy, arch=cfg.arch)
        self._full_bytes: dict[str, int] | None = None
        self._reduced: dict[str, int] | None = None

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        base = getattr(model, "module", model)  # DDP's wrapped module
        params = list(base.parameters())
        trainable = sum(p.numel() for p in params if p.requires_grad)
        total = sum(p.numel() for p in params)
        self.extras.update(
            trainable_params=trainable,
            total_params=total,
            trainable_fraction=trainable / total,
            trainable_names=[n for n, p in base.named_parameters() if p.requires_grad],
        )
        if self.cfg.mode != "full":  # before the clock starts: not the run's time
            self._full_bytes = self._full_finetune_bytes(base)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self._reduced = {"bytes": 0}
            model.register_comm_hook(None, self._count_and_allreduce)
        super().model_ready(model, optimizer)

    def _count_and_allreduce(self, state, bucket):  # DDP checks the annotations: none
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._reduced["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(None, bucket)  # what DDP does without a hook: the average

    def _full_finetune_bytes(self, trained: nn.Module) -> dict[str, int]:
        """Every parameter trainable, the same wrapper and precision: the bytes after one step."""
        import gc

        from recipes import finetune

        cfg = dataclasses.replace(self.cfg, mode="full")
        first = next(trained.parameters())
        device = first.device
        precision = finetune.resolve_precision(cfg.precision, device)
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        model, _ = finetune.adapt(cfg, "full")
        wrapped = finetune.wrap(
            model,
            cfg.strategy,
            mesh=getattr(first, "device_mesh", None),
            device=device,
            low=low,
            block_types=finetune.ready_made_targets(cfg.arch).block_types,
        )
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if device.type == "cuda" else None
        )
        per_rank = cfg.global_batch_size // (dist.get_world_size() if dist.is_initialized() else 1)
        tokens = (
            finetune.make_dataset(self.model_config, cfg.global_batch_size, seed=cfg.seed)
            .tokens[:per_rank]
            .to(device)
        )
        autocast = low is not None and cfg.strategy == "ddp"
        with torch.autocast(device.type, dtype=low or torch.float32, enabled=autocast):
            loss = finetune.lm_loss(finetune.logits_of(wrapped(tokens[:, :-1])), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        held = model_state_bytes(model, optimizer)
        del model, wrapped, optimizer, loss
        gc.collect()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        return held

    def measure(self, step: int) -> None:
        if step == self.steps - 1:  # after the optimizer step, before the next zero_grad
            base = getattr(self._model, "module", self._model)
            own = model_state_bytes(self._model, self._optimizer)
            full = self._full_bytes or own
            self.extras.update(
                full_finetune_memory_per_rank=all_ranks(full),
                bytes_saved_per_rank=all_ranks(sum(full.values()) - sum(own.values())),
                frozen_grads_none_per_rank=all_ranks(
                    all(p.grad is None for p in base.parameters() if not p.requires_grad)
                ),
                optimizer_tensors=sum(len(g["params"]) for g in self._optimizer.param_groups),
                optimizer_state_tensors=len(self._optimizer.state),
                reduced_bytes_per_step=(
                    self._reduced["bytes"] / self.steps if self._reduced else None
                ),
            )
            super().measure(step)
            self.memory_per_rank = all_ranks(own)  # after the last step, as full's was read
        else:
            super().measure(step)

    def gather_final_state(self) -> None:
        names = [n for n, _ in getattr(self._model, "module", self._model).named_parameters()]
        state, _ = full_state_on_rank0(self._model)  # every rank: a collective; rank 0 has it
        state = {name: state[name] for name in names} if state else {}
        self.param_checksum = param_checksum(state.values())
        if self.keep_final_state and self.rank == 0:
            self.final_state = state


OBSERVERS["finetune"] = FinetuneObserver


class ResumableObserver(Observer):
    """recipes/lightning_fabric.py: ``start_step`` in ``extras``, the first step the run trained
    (past 0 where it resumed from a checkpoint; the recipe returns the losses of the steps it
    trained)."""

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)

    def step_end(self, step: int, loss: float) -> None:
        self.extras.setdefault("start_step", step)
        super().step_end(step, loss)


OBSERVERS["lightning_fabric"] = ResumableObserver


def _lightning_observer(cfg: Any, *, keep_final_state: bool = False) -> Observer:
    """recipes/lightning_trainer.py's: a Lightning Callback (recipes.core.lightning), imported
    only when asked for: Lightning takes seconds to import."""
    from recipes.core.lightning import LightningObserver

    return LightningObserver(cfg, keep_final_state=keep_final_state)


OBSERVERS["lightning_trainer"] = _lightning_observer
