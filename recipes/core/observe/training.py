"""Observers of the recipes that add one idea to the DDP (or one-device) training loop:
grad_accumulation, grad_clipping, activation_checkpointing, float8, performance, local_sgd, and
data_parallel's GPU count."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.tensor import DTensor

from recipes.core.memory import SavedTensorBytes
from recipes.core.observe.base import Observer
from recipes.core.result import param_checksum
from recipes.core.state import all_ranks
from recipes.core.throughput import Workload
from recipes.grad_clipping import LAYOUTS, default_mesh
from recipes.toy import MODEL_PRESETS, Block

__all__ = [
    "CheckpointingObserver",
    "ClippingObserver",
    "Float8Observer",
    "GradAccumulationObserver",
    "LocalSGDObserver",
    "PerformanceObserver",
    "data_parallel_extras",
]


def data_parallel_extras(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """How many GPUs nn.DataParallel splits each batch over (0: none, a pass-through on CPU)."""
    return {"gpus": len(getattr(model, "device_ids", None) or [])}


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


class LocalSGDObserver(Observer):
    """recipes/local_sgd.py reports its steps in bursts, at each synchronisation (a step's loss is
    known only once the replicas meet): the first step of a window carries the whole window's
    time, the others none. The time per step is the windows' time over their steps, the first
    window (warm-up) left out."""

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.sync_every, self.outer = cfg.sync_every, cfg.outer

    @property
    def seconds_per_step(self) -> float:
        window = self.sync_every
        steady = self.durations[window:] if len(self.durations) > window else self.durations
        return sum(steady) / len(steady) if steady else 0.0

    def measure(self, step: int) -> None:
        if step == self.steps - 1:
            self.extras.update(sync_every=self.sync_every, outer=self.outer)
        super().measure(step)
