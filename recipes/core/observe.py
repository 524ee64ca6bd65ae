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
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Shard

from recipes.core.memory import SavedTensorBytes, measure_last_forward, model_state_bytes
from recipes.core.result import RecipeResult, param_checksum, peak_memory_bytes
from recipes.core.state import all_ranks, full_state_on_cpu, full_state_on_rank0
from recipes.core.throughput import Workload
from recipes.core.workload import MODEL_PRESETS, Block, TransformerLM
from recipes.core.world import _keep_groups_past_teardown

__all__ = ["EXTRAS", "Observer", "ShardedObserver", "TensorParallelObserver", "HybridObserver",
           "ContextParallelObserver", "SpawnedObserver", "CheckpointingObserver",
           "MetaInitObserver", "CheckpointObserver", "OBSERVERS", "prove"]

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


def prove(train_fn: Callable[..., Any], cfg: Any, *, name: str,
          keep_final_state: bool = False, observer: Observer | None = None) -> RecipeResult:
    """``train_fn(cfg, observer=...)`` measured from outside; the result every rank returns.

    ``cfg`` needs ``steps`` (unless its observer knows them: meta_init), ``model`` (a
    MODEL_PRESETS key) and ``global_batch_size`` (or ``batch_size``, for one process; neither:
    no tokens, for a recipe that trains nothing).
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
                           f"({observer.steps - 1}); it ran {len(observer.durations)} step(s)")
    # the devices that computed: the ranks, or the GPUs one DataParallel process drives
    devices = (observer.extras.get("gpus") or observer.world_size
               if observer.device.type == "cuda" else 1)
    # single_gpu: batch_size; meta_init trains nothing: no tokens per step (tokens/s and MFU 0)
    batch = getattr(cfg, "global_batch_size", None) or getattr(cfg, "batch_size", 0)
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
        self.extras.update({"sequence_parallel": False, "param_bytes_unsplit": sum(
            p.numel() * p.element_size() for p in whole.parameters())})
        self._norm_hooks: list[Any] = []

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        # Registered after TP's own input hooks: these see the inputs as the split made them.
        self._norm_hooks = [m.register_forward_pre_hook(self._record_norm_input)
                            for m in model.modules() if isinstance(m, nn.LayerNorm)]

    def _record_norm_input(self, module: nn.Module, args: Any) -> None:
        if isinstance(args[0], DTensor) and any(isinstance(p, Shard) and p.dim == 1
                                                for p in args[0].placements):
            self.extras["sequence_parallel"] = True

    def measure(self, step: int) -> None:
        if step == 0:
            self.close_norm_hooks()  # the first step's forwards showed all there is to see
        super().measure(step)
        if step == 0:  # memory_per_rank: measured by the step above
            held = self.memory_per_rank[self.rank]["param_bytes"]
            self.extras.update({
                "param_bytes_per_rank": held,
                "param_fraction_per_rank": held / self.extras["param_bytes_unsplit"]})

    def gather_final_state(self) -> None:
        if not self.pipelined:
            return super().gather_final_state()
        # Each stage's full state (TP x FSDP all-gathered inside it), then every rank's: a
        # collective of the world. Not cpu_offload: rank 0 does not hold every stage.
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        local = {name: t.detach().cpu().clone()
                 for name, t in get_model_state_dict(self._model, options=options).items()}
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
                cp_size=self.world_size, positions_per_rank=len(self._positions),
                score_entries_per_rank=[
                    sum(int((queries[:, None] >= keys[None, :]).sum()) for keys in layout)
                    for queries in layout])
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


_TRAVELS = ("durations", "memory_per_rank", "param_checksum", "output_dtype", "extras", "rank",
            "world_size", "backend", "device")


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
            self.extras.update(saved_bytes=None, checkpoint_input_bytes=None,
                               checkpointed_blocks=None)
            return
        self._saved = SavedTensorBytes(model)
        self._ac_hooks = [model.register_forward_pre_hook(self._start)]
        for index, block in enumerate(blocks):
            self._ac_hooks.append(block.register_forward_pre_hook(
                lambda _module, args, index=index: self._saved.note_input(index, args[0])))
            for sub in block.modules():  # a checkpointed block's replay skips its own hooks
                self._ac_hooks.append(sub.register_forward_pre_hook(
                    lambda *_, index=index: self._note_recompute(index)))

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
            starts = sorted({index for k, index in enumerate(replayed)
                             if k == 0 or replayed[k - 1] != index - 1})
            inputs = self._saved.input_bytes
            self.extras.update(saved_bytes=self._saved.total, checkpointed_blocks=starts,
                               checkpoint_input_bytes=sum(inputs.get(i, 0) for i in starts))
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
            param_bytes_per_rank=[m["param_bytes"] for m in self.memory_per_rank])
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
    "fsdp2": ShardedObserver, "tensor_parallel": TensorParallelObserver,
    "hybrid_parallel": HybridObserver, "ddp_spawn": SpawnedObserver,
    "context_parallel": ContextParallelObserver,
    "activation_checkpointing": CheckpointingObserver, "meta_init": MetaInitObserver,
    "sharded_checkpoint": CheckpointObserver}


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
