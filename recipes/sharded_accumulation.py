r"""Gradient accumulation under fully_shard, three ways, each with its communication counted.

    torchrun --standalone --nproc_per_node=2 -m recipes.sharded_accumulation --mode sync_last
    torchrun --standalone --nproc_per_node=2 -m recipes.sharded_accumulation \
        --mode reduce_scatter_every
    torchrun --standalone --nproc_per_node=4 -m recipes.sharded_accumulation \
        --mode hsdp_all_reduce_last --mesh 2 2 --global-batch-size 8
    torchrun --standalone --nproc_per_node=2 -m recipes.sharded_accumulation --pad-fraction 0.5 \
        --loss-normalisation batches        # the pitfall: the mean of micro-batch means

k micro-batches per optimizer step; what each mode sends per step (G = fully_shard groups):

- ``reduce_scatter_every``: every backward reduce-scatters (k x G); the gradients stay sharded
  between micro-batches (1/N of the gradient bytes held);
- ``sync_last``: ``model.set_requires_gradient_sync(False)`` until the last micro-batch: G
  reduce-scatters a step, but each rank holds the *unsharded* gradients meanwhile (N x the bytes);
- ``hsdp_all_reduce_last`` (mesh replicate x shard): ``set_requires_all_reduce(False)`` until the
  last one: the shard group reduce-scatters every time (k x G, sharded memory), the replica group
  all-reduces once (G);
- ``ddp_no_sync_helper``: the pitfall (NVIDIA/cosmos-framework#161). A helper written for DDP,
  ``model.no_sync() if hasattr(model, "no_sync") else nullcontext()``, is silently a no-op under
  fully_shard (which has no ``no_sync``): the traffic of ``reduce_scatter_every``, not of
  ``sync_last``.

A ``TorchDispatchMode`` sees every c10d collective the step runs (``CollectiveCounter``): the counts
and bytes are measured, and tests/test_sharded_accumulation.py asserts them exactly.

Loss normalisation: with ragged samples (``--pad-fraction``: right padding whose targets are
``ignore_index``), the loss a single process computes on the whole batch is the mean over its real
tokens. The naive accumulated loss, each micro-batch's mean divided by k and averaged over ranks, is
a mean of means: a token in a short sample weighs more (transformers PR #35207, torchtune#1275).
``--loss-normalisation tokens`` counts the real tokens of the whole step, over every micro-batch and
every data-parallel rank (one all-reduce of one number per step), and divides each micro-batch's
*summed* loss by that count: equal to the single process, asserted.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from typing import Callable, ClassVar, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import Dataset

from recipes.core.cli import run_cli
from recipes.core.config import RecipeError, TrainConfig, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.memory import model_state_bytes
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.speed import make_adamw, mixed_precision_policy, setup_precision
from recipes.core.state import full_state_on_rank0, mean_over_ranks
from recipes.core.throughput import Workload
from recipes.core.workload import (
    MODEL_PRESETS,
    Block,
    build_model,
    distributed_loader,
    iterate_steps,
    lm_loss,
    make_dataset,
)
from recipes.core.world import join_world
from recipes.parallelize import apply_fully_shard, checked_mesh

log = get_logger(__name__)

MODES = ("reduce_scatter_every", "sync_last", "hsdp_all_reduce_last", "ddp_no_sync_helper")
IGNORE_INDEX = -100  # F.cross_entropy's default: such targets add nothing to the loss or gradient


@dataclass
class ShardedAccumulationConfig(TrainConfig):
    micro_batches: int = opt(2, "forward/backward passes per optimizer step on each rank", ge=1)
    mode: Literal[MODES] = opt("sync_last", "how the micro-batches communicate (see the docstring)")
    mesh: list[int] = opt([], "data-parallel mesh: [shard] or [replicate, shard] (HSDP); product = "
                              "world size; empty = [world size]")
    pad_fraction: float = opt(0.25, "ragged samples: right-pad up to this fraction of each "
                                    "sequence (targets = ignore_index)", ge=0, lt=1)
    loss_normalisation: Literal["tokens", "batches"] = opt(
        "tokens", "tokens = the global per-token mean (one process's loss); batches = the mean of "
                  "micro-batch means (the pitfall)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.mesh) > 2:
            raise RecipeError(f"mesh={self.mesh} has {len(self.mesh)} dims; use [shard] or "
                              "[replicate, shard]")
        if self.mode == "hsdp_all_reduce_last" and len(self.mesh) != 2:
            raise RecipeError("mode hsdp_all_reduce_last needs a replicate x shard mesh, "
                              "e.g. --mesh 2 2 on 4 ranks")


# --8<-- [start:counter]
class CollectiveCounter(TorchDispatchMode):
    """Counts the c10d collectives run under it: ``calls[(kind, group_size)]`` and ``bytes[...]``.

    Every eager collective (``dist.all_reduce``, fully_shard's reduce-scatters and all-gathers)
    reaches the dispatcher as a ``c10d`` op, so this sees exactly what is sent. The bytes are the
    full buffer each rank contributes: a reduce-scatter's input, an all-gather's output.
    """

    KINDS: ClassVar[dict[str, str]] = {
        "allreduce_": "all_reduce", "_reduce_scatter_base_": "reduce_scatter",
        "reduce_scatter_": "reduce_scatter", "_allgather_base_": "all_gather",
        "allgather_": "all_gather"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = self.KINDS.get(func._opname) if func.namespace == "c10d" else None
        if kind is not None:
            if isinstance(args[0], list):  # allreduce_, allgather_: lists of tensors
                tensors = args[0]
            else:  # the base ops: (output, input); count an all-gather's output, else the input
                tensors = [args[0 if kind == "all_gather" else 1]]
            tensors = [t for item in tensors for t in (item if isinstance(item, list) else [item])]
            groups = [a for a in args if type(a).__name__ == "ScriptObject"]
            unbox = getattr(dist.ProcessGroup, "unbox", None)  # the ScriptObject -> ProcessGroup
            size = unbox(groups[0]).size() if groups and unbox else None
            self.calls[(kind, size)] += 1
            self.bytes[(kind, size)] += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, dict[str, int]]:
        """{"reduce_scatter over 2": {"calls": 6, "bytes": ...}, ...}, JSON-ready."""
        return {f"{kind} over {size}": {"calls": self.calls[(kind, size)],
                                        "bytes": self.bytes[(kind, size)]}
                for kind, size in sorted(self.calls, key=str)}
# --8<-- [end:counter]


class RaggedTokens(Dataset):
    """A dataset's samples with a real length each: targets past it are ``IGNORE_INDEX``.

    The length of sample ``i`` depends only on ``seed`` and ``i``, so every world size sees the same
    tokens. Causal attention keeps the padding from changing the real positions' logits.
    """

    def __init__(self, base: Dataset, pad_fraction: float, seq_len: int, seed: int):
        generator = torch.Generator().manual_seed(seed + 1)
        shortest = max(1, round(seq_len * (1 - pad_fraction)))
        self.base = base
        self.lengths = torch.randint(shortest, seq_len + 1, (len(base),), generator=generator)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.base[index]
        targets = targets.clone()
        targets[int(self.lengths[index]):] = IGNORE_INDEX
        return inputs, targets


def make_ragged_dataset(model: str, global_batch_size: int, *, pad_fraction: float, seed: int):
    """The shared synthetic dataset, ragged when ``pad_fraction`` > 0 (tests train on it too)."""
    dataset = make_dataset(model, global_batch_size, seed=seed)
    if pad_fraction == 0:
        return dataset
    return RaggedTokens(dataset, pad_fraction, MODEL_PRESETS[model].seq_len, seed)


def ddp_style_no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """The pitfall, as found in training code written for DDP: under fully_shard it does nothing."""
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if no_sync is not None else contextlib.nullcontext()


# --8<-- [start:accumulate]
def accumulate_gradients(
    model: nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    mode: str,
    normalise_by_tokens: bool,
    dp_group: dist.ProcessGroup | None = None,
    after_backward: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Forward and backward over one optimizer step's micro-batches; returns this rank's share of
    the step's loss (the sum over ranks is the global loss)."""
    dp_size = dist.get_world_size(dp_group)
    if normalise_by_tokens:
        # The real tokens of the whole step: every micro-batch, every data-parallel rank. One
        # all-reduce of one number, before the first backward, since each loss needs the total.
        tokens = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches).float()
        dist.all_reduce(tokens, group=dp_group)
    step_loss = torch.zeros((), device=micro_batches[0][0].device)
    for index, (x, y) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        if mode == "sync_last":  # no reduce-scatter: each rank keeps UNSHARDED gradients meanwhile
            model.set_requires_gradient_sync(last)
        elif mode == "hsdp_all_reduce_last":  # reduce-scatter in the shard group, all-reduce once
            model.set_requires_all_reduce(last)
        # Pitfall: fully_shard has no no_sync(); a DDP helper falls back to doing nothing.
        skip = ddp_style_no_sync(model) if mode == "ddp_no_sync_helper" and not last else None
        with skip or contextlib.nullcontext():
            logits = model(x)
            if normalise_by_tokens:
                summed = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(0, 1),
                                         ignore_index=IGNORE_INDEX, reduction="sum")
                # fully_shard averages gradients over the dp ranks (divides by dp_size): scale
                # back up, so the gradient is d(sum over all tokens) / tokens.
                loss = summed * dp_size / tokens
            else:  # the naive mean of means: each micro-batch's token mean weighs 1/k
                loss = lm_loss(logits, y) / len(micro_batches)
            loss.backward()
        if after_backward is not None:
            after_backward(index)
        step_loss += loss.detach() / dp_size
    return step_loss
# --8<-- [end:accumulate]


def data_parallel_mesh(world, sizes: list[int]) -> DeviceMesh:
    sizes = sizes or [world.world_size]
    names = ("shard",) if len(sizes) == 1 else ("replicate", "shard")
    return checked_mesh(world, sizes, names)


# --8<-- [start:train]
def train(cfg: ShardedAccumulationConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        mesh = data_parallel_mesh(world, cfg.mesh)
        micro = per_rank_batch_size(cfg.global_batch_size, world.world_size, cfg.micro_batches)
        model = build_model(cfg.model, seed=cfg.seed, device="cpu")  # fully_shard moves shards
        full_grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        precision = setup_precision(cfg.precision, world.device)  # bf16 on a GPU by default
        if precision == "fp16":  # fp16 gradients need a loss scaler, which is not this lesson
            raise RecipeError("--precision fp16 needs a GradScaler (see recipes/fsdp2.py); "
                              "use bf16 or fp32")
        # bf16: fully_shard computes in bf16 and reduces gradients in fp32
        model = apply_fully_shard(model, mesh, block_types=(Block,),
                                  mp_policy=mixed_precision_policy(precision))
        optimizer = make_adamw(model.parameters(), lr=cfg.lr, device=world.device)
        dataset = make_ragged_dataset(cfg.model, cfg.global_batch_size,
                                      pad_fraction=cfg.pad_fraction, seed=cfg.seed)
        loader, sampler = distributed_loader(dataset, rank=world.rank, world_size=world.world_size,
                                             per_rank_batch_size=micro * cfg.micro_batches,
                                             seed=cfg.seed)
        held: list[int] = []  # gradient bytes held after each micro-batch but the last

        def measure(index: int) -> None:
            if index < cfg.micro_batches - 1:
                held.append(model_state_bytes(model)["grad_bytes"])

        losses, per_step, timer = [], [], StepTimer(world.device)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
            with timer:
                optimizer.zero_grad(set_to_none=True)
                parts = list(zip(inputs.to(world.device).split(micro),
                                 targets.to(world.device).split(micro)))
                with CollectiveCounter() as counter:  # the step's collectives, nothing else
                    step_loss = accumulate_gradients(
                        model, parts, mode=cfg.mode, after_backward=measure,
                        normalise_by_tokens=cfg.loss_normalisation == "tokens")
                optimizer.step()
            per_step.append(counter.summary())
            losses.append(mean_over_ranks(step_loss) * world.world_size)
            log.info("step %d loss %.4f collectives %s time %.1f ms", step, losses[-1],
                     per_step[-1], timer.durations[-1] * 1e3)

        full_state, checksum = full_state_on_rank0(model)  # a collective: every rank calls it
        return make_result(
            "sharded_accumulation", world, losses, checksum, timer,
            keep_final_state=full_state if cfg.keep_final_state and world.is_main else None,
            workload=Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision),
            collectives_per_step=per_step, fsdp_groups=sum(1 for _ in _fsdp_modules(model)),
            grad_bytes_between_micro_batches=max(held, default=0),
            grad_bytes_unsharded=full_grad_bytes, mesh=list(mesh.shape),
        )
# --8<-- [end:train]


def _fsdp_modules(model: nn.Module):
    from torch.distributed.fsdp import FSDPModule

    return (module for module in model.modules() if isinstance(module, FSDPModule))


if __name__ == "__main__":
    run_cli(train, ShardedAccumulationConfig, __doc__)
